// The rank program of the tensor-parallel op tests: the checks of
// tests/tp_checks.h over a world of `trainer launch`'s ranks, one
// tensor-parallel group of the world's size. Prints each rank's parts
// ("rank R: <part>, n = N: compared") and "rank R: N checks, F failed";
// exit 0 only without failures.
//
//   tp_worker regions | loss | linear | block | gpt | cuda
#include <cstdio>
#include <string>

#include "comm/bootstrap.h"
#include "comm/communicator.h"
#include "tests/tp_checks.h"
#include "tests/worker_checks.h"

using namespace trainer;
using namespace trainer::testing;

int main(int argc, char** argv) {
  const std::string mode = argc == 2 ? argv[1] : "";
  try {
    comm::Bootstrap boot = comm::detect_bootstrap();
    g_rank = boot.rank;
    // The timeout only bounds a hang (a rank that skipped a collective).
    auto world = comm::init_world(
        boot, {.timeout = comm::Millis(30000), .connect_timeout = comm::Millis(30000)});
    return run_tp_checks(world, mode);
  } catch (const Error& e) {
    std::printf("rank %d: error: %s\n", g_rank, e.what());
    return 2;
  }
}
