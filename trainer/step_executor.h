// The step executor (DESIGN.md "The step executor"): runs one optimizer
// step as its schedule's list of actions (parallel/schedule.h) over the
// micro-batches of the step, and hands back what the loop logs.
//
//   StepExecutor executor(session, run, precision, training_schedule(recipe, layout));
//   StepResult r = executor.run(state.step, stop_signal_received);
//   if (r.ran_out) ...;   // the epoch's data ended first
//
// The actions, on this rank's stage list:
//   F m     micro-batch m: read it, re-key dropout for micro-step
//           step * M + m, forward and loss under the precision's autocast
//   B m     backward of loss_m / M (scaled for fp16); DataParallel
//           communicates only in the last backward of the step (no_sync
//           before); skipped once a loss was not finite on a single process
//   sync    waits for the averaged gradients
//   step    the ranks agree on the mean loss, whether every loss was finite
//           and whether to stop; then clipping, the LR of this step, the
//           update (fp16: skipped on an overflow); the gradients are zeroed
//           whether or not the step was taken
// With one stage and M = training.grad_accum this is gradient
// accumulation, bit for bit the loop it replaces. Pipeline stages (pp > 1)
// will add the send/recv and split-backward actions here; until then
// a table holding them is refused.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/schedule.h"
#include "trainer/distributed.h"
#include "trainer/precision.h"
#include "trainer/session.h"

namespace trainer {

// What one step did.
struct StepResult {
  bool ran_out = false;  // the epoch's data ended before the step's micro-batches did
  double loss = 0;       // the mean over micro-batches and ranks; nan when not finite
  bool finite = true;    // every rank's losses were finite: the update ran (fp16 may still skip it)
  bool stop = false;     // some rank received SIGTERM/SIGINT: checkpoint and exit
  double lr = 0;         // of this step
  double grad_norm = 0;  // before clipping (optimizer.clip_grad_norm > 0 and finite)
  int64_t items = 0;     // samples or tokens this rank read
  int64_t position = 0;  // this rank's position in the epoch after the step
};

// The schedule of the recipe's training step on this layout: with one
// pipeline stage, gradient accumulation over training.grad_accum micro-batches.
parallel::Schedule training_schedule(const Recipe& recipe, const RankLayout& layout);

class StepExecutor {
 public:
  // Checks the schedule (CHECK: generators are code) and that this runtime
  // runs its actions.
  StepExecutor(Session& session, DistributedRun& run, Precision& precision,
               parallel::Schedule schedule);

  // Runs optimizer step number `step` (counted from 0 over the run);
  // stop_requested: this rank received a stop signal.
  StepResult run(int64_t step, bool stop_requested);

  const parallel::Schedule& schedule() const { return schedule_; }

 private:
  // The step in progress.
  struct InFlight {
    int64_t step = 0;
    std::vector<Tensor> losses;  // per micro-batch, from its F to its B
    double loss_sum = 0;
    bool finite = true;  // every loss so far
    StepResult result;
  };
  bool forward(int micro_batch, InFlight& in_flight);
  void backward(int micro_batch, bool last, InFlight& in_flight);
  void grad_sync(InFlight& in_flight);
  void optimizer_step(bool stop_requested, InFlight& in_flight);

  Session& session_;
  DistributedRun& run_;
  Precision& precision_;
  parallel::Schedule schedule_;
  const std::vector<parallel::Action>& actions_;  // this rank's stage
  size_t last_backward_ = 0;                      // index of the step's last backward
};

}  // namespace trainer
