// The tensor-parallel op checks of one rank (modes regions, loss, linear,
// block, gpt, llama, cuda; tests/tp_checks.cpp says what each compares), written
// once for ranks as processes (tests/tp_worker.cpp) and as threads of one
// process (tests/thread_world.h). Returns 0 when every check passed; the
// checks and compared parts are in tests/worker_checks.h's per-thread record.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace trainer::testing {

int run_tp_checks(const std::shared_ptr<comm::Communicator>& world, const std::string& mode);

}  // namespace trainer::testing
