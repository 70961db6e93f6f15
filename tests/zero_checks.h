// The ZeRO-1 and SyncBatchNorm checks of one rank, written once for ranks as
// processes (tests/zero_worker.cpp) and as threads of one process
// (tests/thread_world.h): scenarios as tests/zero_checks.cpp lists them
// (zero, zero_ddp, syncbn and their staged forms). Returns the rank's exit
// code; the checks are in tests/worker_checks.h's per-thread record.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"

namespace trainer::testing {

int run_zero_checks(comm::Communicator& world, const std::vector<std::string>& scenarios);

}  // namespace trainer::testing
