// The traffic counters (comm/traffic.h): tests/comm_worker_traffic.cpp's
// scenario on 1, 2 and 4 processes under `trainer launch`, with the
// communicators' shared-memory channel and without it (then every ring byte
// goes through the UCX transport and is checked there too); and ranks as
// threads of one process, whose counters add up.
#include "comm/collectives.h"
#include "comm/traffic.h"
#include "tests/process.h"
#include "tests/testing.h"
#include "tests/thread_world.h"

using namespace trainer;

namespace {

void check_traffic(int nproc, bool shared_memory) {
  std::vector<std::string> argv{
      TRAINER_BINARY,     "launch", "--nproc-per-node", std::to_string(nproc), "--program",
      COMM_WORKER_BINARY, "--",     "traffic"};
  if (!shared_memory) argv.push_back("no-shm");
  const testing::ProcessResult o = testing::run_process(argv, {.timeout_s = 120});
  testing::require_ranks_passed(o.code, o.output, nproc);
}

}  // namespace

TEST_CASE("comm: the traffic counters count each collective's bus bytes on 1, 2 and 4 ranks",
          "[comm][mp]") {
  for (int n : {1, 2, 4})
    for (bool shared_memory : {true, false}) {
      INFO(n << " ranks, shared-memory channel " << (shared_memory ? "on" : "off"));
      check_traffic(n, shared_memory);
    }
}

TEST_CASE("comm: ranks as threads add their traffic to the process's counters", "[comm]") {
  for (int n : {1, 2, 3}) {
    INFO(n << " ranks");
    const comm::Traffic before = comm::traffic();
    testing::run_thread_ranks<int>(n, [](comm::Communicator& world) {
      comm::allreduce(world, full({1001}, 1.0), {.algorithm = comm::AllreduceAlgorithm::ring});
      comm::allgather(world, full({5}, 1.0));
      return 0;
    });
    const comm::Traffic d = comm::traffic() - before;
    // Per rank: 2 (n - 1) / n of 4004 bytes (rounded down), (n - 1) x 20 bytes.
    CHECK(d.allreduce == uint64_t(n) * (2 * uint64_t(n - 1) * 4004 / uint64_t(n)));
    CHECK(d.allgather == uint64_t(n) * uint64_t(n - 1) * 20);
    CHECK(d.reduce_scatter + d.broadcast + d.p2p == 0);
    CHECK(d.total() == d.allreduce + d.allgather);
    CHECK(d.network == 0);
  }
}
