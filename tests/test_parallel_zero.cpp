// ZeRO-1 and SyncBatchNorm over several processes: `trainer launch` starts
// tests/zero_worker.cpp as the ranks, each of which compares its results with
// the single-process answer and prints its mismatches (rank, what, index,
// expected, actual); the output is shown when a case fails.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "tests/testing.h"

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

void check_ranks(int nproc, const std::string& scenarios) {
  Outcome o = launch(nproc, scenarios, 120);
  trainer::testing::require_ranks_passed(o.code, o.output, nproc);
}

}  // namespace

TEST_CASE("zero: ZeRO-1 matches the plain optimizer on the averaged gradient, 2 and 3 ranks",
          "[parallel][zero][mp]") {
  for (int n : {2, 3}) {
    INFO("world size " << n);
    check_ranks(n, "zero zero_ddp");
  }
}

TEST_CASE("zero: SyncBatchNorm matches BatchNorm2d on the concatenated batch, 2 and 3 ranks",
          "[parallel][syncbn][mp]") {
  for (int n : {2, 3}) {
    INFO("world size " << n);
    check_ranks(n, "syncbn");
  }
}

TEST_CASE("zero: ZeRO-1 and SyncBatchNorm through the GPU's host staging match, 2 ranks",
          "[parallel][zero][syncbn][staging][mp]") {
  // CPU tensors taking the data flow of GPU ones: ZeRO-1's buffers staged
  // through host copies and the optimizer on the "device" block; SyncBatchNorm
  // by tensor ops with its statistics allreduced through host copies.
  check_ranks(2, "zero_staged zero_ddp_staged syncbn_ops");
}
