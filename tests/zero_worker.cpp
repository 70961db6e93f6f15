// The rank program of the ZeRO-1 and SyncBatchNorm tests: the checks of
// tests/zero_checks.h over a world of `trainer launch`'s ranks. The last
// line is "rank R: N checks, F failed", the exit code 0 only without
// failures.
//
//   zero_worker [zero] [zero_ddp] [syncbn] [zero_staged] [zero_ddp_staged] [syncbn_ops]
#include <cstdio>
#include <string>
#include <vector>

#include "comm/bootstrap.h"
#include "comm/communicator.h"
#include "tests/worker_checks.h"
#include "tests/zero_checks.h"

using namespace trainer;
using namespace trainer::testing;

int main(int argc, char** argv) {
  try {
    comm::Bootstrap boot = comm::detect_bootstrap();
    g_rank = boot.rank;
    auto world = comm::init_world(
        boot, {.timeout = comm::Millis(60000), .connect_timeout = comm::Millis(30000)});
    return run_zero_checks(*world, std::vector<std::string>(argv + 1, argv + argc));
  } catch (const Error& e) {
    std::printf("rank %d: error: %s\n", g_rank, e.what());
    return 4;
  }
}
