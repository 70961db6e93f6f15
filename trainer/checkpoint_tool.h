// The checkpoint commands: finding a checkpoint from what a user gives
// (--checkpoint, --resume, the commands below), `trainer checkpoint info`
// (what a checkpoint holds, every file verified) and `trainer export` (one
// safetensors file of whole tensors under the model's PyTorch names, from
// a checkpoint written on any layout).
//
//   trainer checkpoint info runs/gpt_kjv
//   trainer export runs/gpt_kjv/checkpoints/latest --out gpt.safetensors --dtype bf16
#pragma once

#include <string>

#include "core/dtype.h"

namespace CLI {
class App;
}

namespace trainer {

// The checkpoint directory `given` names: a checkpoint directory itself, a
// pointer file beside the checkpoints (`latest`, `best`), a checkpoints/
// folder or a run's output directory (their latest complete checkpoint).
// Error naming `option` and what was given otherwise.
std::string find_checkpoint(const std::string& given, const std::string& option);

// What a checkpoint holds, as `trainer checkpoint info` prints it: its
// format, step and layout, every file with its size and tensors, every
// logical tensor with its shape, dtype and pieces, and the totals. Every
// file is read and verified (the safetensors checks, the pieces covering
// each tensor exactly once, finite values): Error naming what is wrong.
std::string checkpoint_info(const std::string& dir);

// Writes the checkpoint's model as one safetensors file at `out`: whole
// tensors, under the names and shapes of the model the checkpoint's
// recipe builds (a vocabulary padded for tensor parallelism cut back),
// floating tensors converted to `dtype` (f32, bf16 or f16). Returns what
// it wrote, for the command's line.
std::string export_checkpoint(const std::string& dir, const std::string& out, DType dtype);

struct CheckpointArgs {
  std::string checkpoint, out, dtype = "f32";
};
// Adds `checkpoint info` and `export` to app; run_checkpoint_commands runs
// the one parsed (returns -1 when neither was).
void add_checkpoint_commands(CLI::App& app, CheckpointArgs& args);
int run_checkpoint_commands(CLI::App& app, const CheckpointArgs& args);

}  // namespace trainer
