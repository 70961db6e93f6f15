// The `train` and `eval` commands: the training loop around a Session.
//
// One optimizer step = grad_accum micro-batches, each forward + backward of
// loss / grad_accum; then gradient clipping, the LR of this step from the
// schedule, the update. A non-finite loss skips the step (counted); more than
// training.max_nonfinite in a row aborts. SIGTERM/SIGINT finish the current
// step, write a checkpoint and exit 0 (cluster preemption).
#pragma once

#include <string>
#include <vector>

namespace trainer {

struct TrainArgs {
  std::string recipe;
  std::vector<std::string> overrides;  // key=value
  std::string resume;                  // "", "auto" or a checkpoint directory
  std::string init_from;               // a safetensors file of weights
  bool init_strict = true;
  bool dry_run = false;
};

struct EvalArgs {
  std::string recipe;
  std::vector<std::string> overrides;
  std::string checkpoint;  // a checkpoint directory, or a run's checkpoints/ (its latest)
};

// Return the process exit code; user errors are thrown as trainer::Error.
int train_command(const TrainArgs& args);
int eval_command(const EvalArgs& args);

}  // namespace trainer
