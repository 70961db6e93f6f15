// The data-parallel equivalence checks of one rank, written once for both
// ways the tests run ranks: processes of `trainer launch` (tests/dp_worker.cpp)
// and threads of one process (tests/thread_world.h, test_parallel_ddp.cpp).
// Each counts its checks and failures in tests/worker_checks.h's per-thread
// record, prints every mismatch with its rank, and returns 0 when all pass.
//
//   run_equiv: every rank builds an MLP from a different seed (the start-up
//     broadcast must make them equal) and trains it with DataParallel at
//     per-rank batch b, accum micro-steps per step (NoSync on all but the
//     last); each rank also trains a reference copy alone on the whole
//     global batch. After every step the two must agree. Also checks the
//     bucket layout, that overlap starts buckets during backward (or none
//     without it), and that only the final micro-step communicates. path:
//     "default" as DataParallel chooses, "in-place" buckets in a shared
//     region reduced where they lie, "pipelined" ordinary buckets through
//     the staging areas.
//   run_reducer: the ring allreduce with a caller's comm::Reducer gives the
//     plain ring's bits for every dtype, op and size, and DataParallel
//     through parallel::direct_reduce averages gradients as the default does.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "models/small.h"

namespace trainer::testing {

// The checks' model and data: an MLP of kIn inputs and kClasses classes,
// per-rank batches of kBatch.
constexpr int64_t kIn = 20, kClasses = 5, kBatch = 3;
std::shared_ptr<MLP> make_mlp(uint64_t seed);
// The global batch of a step: inputs [n, kIn] and labels [n].
std::pair<Tensor, Tensor> global_batch(int64_t step, int64_t n);

int run_equiv(const std::shared_ptr<comm::Communicator>& world, bool overlap, int64_t accum,
              size_t bucket_bytes, const std::string& path);
int run_reducer(const std::shared_ptr<comm::Communicator>& world);

}  // namespace trainer::testing
