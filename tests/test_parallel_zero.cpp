// ZeRO-1 and SyncBatchNorm over several ranks (tests/zero_checks.h): as
// threads of this process, and once end to end as processes that `trainer
// launch` starts (tests/zero_worker.cpp). Each rank compares its results with
// the single-process answer and prints its mismatches (rank, what, index,
// expected, actual).
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "tests/testing.h"
#include "tests/thread_checks.h"
#include "tests/zero_checks.h"

namespace {

struct Outcome {
  int code = -1;
  std::string output;
};

// `trainer launch` of nproc zero_workers running the scenarios, stopped after timeout_s.
Outcome launch(int nproc, const std::string& scenarios, int timeout_s) {
  char path[] = "/tmp/test_parallel_zero_XXXXXX";
  int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::close(fd);
  // One thread per rank: ranks waiting in a collective while the others' OpenMP
  // threads spin would oversubscribe the cores (torchrun's default too).
  std::string command =
      trainer::cat("OMP_NUM_THREADS=1 timeout -k 10 ", timeout_s, " ", TRAINER_BINARY,
                   " launch --nproc-per-node ", nproc, " --program ", ZERO_WORKER_BINARY, " -- ",
                   scenarios, " > ", path, " 2>&1");
  int status = std::system(command.c_str());
  Outcome o;
  o.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  o.output = text.str();
  ::unlink(path);
  return o;
}

// The scenarios on ranks as threads of this process (tests/thread_world.h),
// one OpenMP thread each; every rank must pass.
void check_ranks(int ranks, const std::vector<std::string>& scenarios) {
  const std::vector<trainer::testing::RankReport> reports = trainer::testing::run_checks_on_threads(
      ranks,
      [&](const auto& world) { return trainer::testing::run_zero_checks(*world, scenarios); });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r << " (mismatches are printed above)");
    CHECK(reports[size_t(r)].code == 0);
  }
}

}  // namespace

TEST_CASE("zero: ZeRO-1 matches the plain optimizer on the averaged gradient, 2 and 3 ranks",
          "[parallel][zero][threads]") {
  for (int n : {2, 3}) {
    INFO("world size " << n);
    check_ranks(n, {"zero", "zero_ddp"});
  }
}

TEST_CASE("zero: ZeRO-1 and SyncBatchNorm as processes of trainer launch, end to end",
          "[parallel][zero][mp]") {
  Outcome o = launch(2, "zero_ddp syncbn", 120);
  trainer::testing::require_ranks_passed(o.code, o.output, 2);
}

TEST_CASE("zero: SyncBatchNorm matches BatchNorm2d on the concatenated batch, 2 and 3 ranks",
          "[parallel][syncbn][threads]") {
  for (int n : {2, 3}) {
    INFO("world size " << n);
    check_ranks(n, {"syncbn"});
  }
}

TEST_CASE("zero: ZeRO-1 and SyncBatchNorm through the GPU's host staging match, 2 ranks",
          "[parallel][zero][syncbn][staging][threads]") {
  // CPU tensors taking the data flow of GPU ones: ZeRO-1's buffers staged
  // through host copies and the optimizer on the "device" block; SyncBatchNorm
  // by tensor ops with its statistics allreduced through host copies.
  check_ranks(2, {"zero_staged", "zero_ddp_staged", "syncbn_ops"});
}
