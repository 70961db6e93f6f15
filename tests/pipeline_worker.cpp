// The rank program of the pipeline runtime tests: the checks of
// tests/pipeline_checks.h (modes equiv, mismatch, kill, kill-evaluation)
// over a world of `trainer launch`'s ranks, one pipeline stage each.
//
//   pipeline_worker equiv SCHEDULE... | mismatch | kill VICTIM | kill-evaluation VICTIM
#include <cstdio>
#include <string>
#include <vector>

#include "comm/bootstrap.h"
#include "comm/communicator.h"
#include "tests/pipeline_checks.h"
#include "tests/worker_checks.h"

using namespace trainer;
using namespace trainer::testing;

int main(int argc, char** argv) {
  try {
    comm::Bootstrap boot = comm::detect_bootstrap();
    g_rank = boot.rank;
    // A dead peer is detected within milliseconds; the timeout only bounds a hang.
    auto world = comm::init_world(
        boot, {.timeout = comm::Millis(30000), .connect_timeout = comm::Millis(30000)});
    return run_pipeline_checks(world, std::vector<std::string>(argv + 1, argv + argc));
  } catch (const Error& e) {
    std::printf("rank %d: error: %s\n", g_rank, e.what());
    return 2;
  }
}
