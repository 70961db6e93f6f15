// The rank program of the data-parallel tests (tests/test_parallel_ddp.cpp),
// started by `trainer launch` or forked by the test with torchrun-style
// variables. Prints "rank R: N checks, F failed" (and every mismatch with
// rank, step, parameter, index, expected and actual); exit 0 when all pass.
//
//   dp_worker equiv OVERLAP ACCUM BUCKET_BYTES [PATH]
//   dp_worker reducer
//       The checks of tests/dp_checks.h (run_equiv, run_reducer) as the
//       ranks of a launched job; the default tests run them as threads.
//   dp_worker kill VICTIM
//       DataParallel training in which VICTIM SIGKILLs itself in the third
//       backward; the others must get an Error naming it and exit 3.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "comm/collectives.h"
#include "core/ops.h"
#include "models/small.h"
#include "optim/optimizer.h"
#include "parallel/ddp.h"
#include "parallel/device_staging.h"
#include "tests/dp_checks.h"
#include "tests/worker_checks.h"

using namespace trainer;
using namespace trainer::testing;
using namespace trainer::parallel;

namespace {

int run_kill(const std::shared_ptr<comm::Communicator>& world, int victim) {
  auto model = make_mlp(1);
  DataParallel dp(model, world, {.bucket_bytes = 4096, .first_bucket_bytes = 4096});
  try {
    for (int64_t step = 0; step < 1000; ++step) {
      auto [x, y] = global_batch(step, kBatch);
      Tensor loss = cross_entropy(dp(x), y);
      if (step == 2 && world->rank() == victim) ::raise(SIGKILL);
      loss.backward();
      dp.finish();
      dp.zero_grad();
    }
  } catch (const Error& e) {
    std::printf("rank %d: error: %s\n", world->rank(), e.what());
    return 3;
  }
  std::printf("rank %d: finished without noticing the dead peer\n", world->rank());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  try {
    auto world = comm::init_world(comm::detect_bootstrap(), {.timeout = comm::Millis(20000)});
    g_rank = world->rank();
    if (mode == "equiv" && (argc == 5 || argc == 6))
      return run_equiv(world, std::atoi(argv[2]) != 0, std::atoll(argv[3]),
                       size_t(std::atoll(argv[4])), argc == 6 ? argv[5] : "default");
    if (mode == "kill" && argc == 3) return run_kill(world, std::atoi(argv[2]));
    if (mode == "reducer" && argc == 2) return run_reducer(world);
  } catch (const Error& e) {
    std::printf("rank %d: error: %s\n", g_rank, e.what());
    return 2;
  }
  std::fprintf(
      stderr, "usage: dp_worker equiv OVERLAP ACCUM BUCKET_BYTES [PATH] | kill VICTIM | reducer\n");
  return 64;
}
