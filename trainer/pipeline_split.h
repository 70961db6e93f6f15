// Where a pipeline's stages are cut (parallel.stages): by block count
// ("even"), by each block's measured forward + backward time ("auto",
// within parallel.stage_memory_mb per stage), or at the recipe's list of
// block indices; and the per-stage table `trainer train --dry-run` prints.
//
//   BlockProfile profile = profile_blocks(session, DType::f32);   // changes no training state
//   StageSplit split = choose_split(session, &profile);
//   std::printf("%s", describe_stages(session, split, &profile).c_str());
#pragma once

#include <string>
#include <vector>

#include "parallel/pipeline.h"
#include "trainer/session.h"

namespace trainer {

// Per block of the model, at the session's micro-batch.
struct BlockProfile {
  std::vector<double> forward_ms, backward_ms;
  std::vector<double> activation_bytes;  // the allocator's growth over the block's forward
  // With recompute (BlockList::recompute): the growth over the block's forward
  // recording its whole graph, held while its backward recomputes it; else 0.
  std::vector<double> recompute_bytes;
  std::vector<double> parameter_bytes;
};
// Times each block's forward and backward on a micro-batch of zeros under
// autocast (best of `repeats`); restores the buffers it changed (BatchNorm).
BlockProfile profile_blocks(Session& session, DType autocast, int repeats = 3);

// The recipe's split for the session's layout (profile: needed for "auto").
parallel::StageSplit choose_split(const Session& session, const BlockProfile* profile);

// One line per stage: its blocks, parameters, and with a profile its
// predicted forward + backward time per micro-batch and activation memory.
std::string describe_stages(const Session& session, const parallel::StageSplit& split,
                            const BlockProfile* profile);

}  // namespace trainer
