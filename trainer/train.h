// The `train`, `eval` and `sample` commands: the training loop around a
// Session, evaluation of a checkpoint, and text from a language model's.
//
// The loop is a thin driver: the step executor (trainer/step_executor.h)
// runs each optimizer step (grad_accum micro-batches, each forward +
// backward of loss / grad_accum; then gradient clipping, the LR of this step
// from the schedule, the update), and the loop hands its result to logging,
// evaluation and checkpointing. A non-finite loss skips the step (counted);
// more than training.max_nonfinite in a row aborts. SIGTERM/SIGINT finish
// the current step, write a checkpoint and exit 0 (cluster preemption).
#pragma once

#include <cstdint>
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
  bool trace = false;  // write a Chrome-trace timeline (as training.trace=true)
};

struct EvalArgs {
  std::string recipe;
  std::vector<std::string> overrides;
  std::string checkpoint;  // a checkpoint directory, or a run's checkpoints/ (its latest)
};

struct SampleArgs {
  std::string recipe;
  std::vector<std::string> overrides;
  std::string checkpoint;  // as EvalArgs::checkpoint, or a run's output directory
  std::string prompt;      // "": start at a line break
  int64_t tokens = 500;
  double temperature = 0.8;  // 0: greedy
  int64_t top_k = 0;         // 0: every token
  uint64_t seed = 0;
};

// Return the process exit code; user errors are thrown as trainer::Error.
int train_command(const TrainArgs& args);
int eval_command(const EvalArgs& args);
// Prints the prompt and its continuation by a language model's checkpoint.
int sample_command(const SampleArgs& args);

}  // namespace trainer
