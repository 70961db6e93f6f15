// The pipeline runtime checks of one rank, written once for ranks as
// processes (tests/pipeline_worker.cpp) and, for equiv, as threads of one
// process (tests/thread_world.h): args are a mode and its arguments
// (tests/pipeline_checks.cpp says what each does). Returns the rank's exit
// code; the checks and compared parts are in tests/worker_checks.h's
// per-thread record.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace trainer::testing {

int run_pipeline_checks(const std::shared_ptr<comm::Communicator>& world,
                        const std::vector<std::string>& args);

}  // namespace trainer::testing
