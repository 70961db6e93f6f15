// The step executor: runs one optimizer
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
// accumulation, bit for bit the loop it replaces.
//
// On a pipeline (pp > 1, M = parallel.micro_batches) the rank runs its
// stage's list of the recipe's schedule (gpipe, 1f1b, interleaved, zbh1)
// through its PipelineRuntime (parallel/pipeline_runtime.h):
//   recvA/sendA, recvG/sendG   activations and gradients between stages
//   F m (chunk c)  micro-batch m is read on every stage (the first piece
//                  takes its inputs, the last its targets); dropout re-keyed
//                  as above; the last piece computes the loss
//   B m, I m, W m  backward, or its input and weight halves (zbh1)
//   sync           every send completed; the data-parallel reduction; the
//                  gradient of a weight tied across stages summed
//   step           as above, the gradient norm summed over the stages
// Gradients accumulate in micro-batch order on every stage, so a pipeline
// trains bit for bit as pp = 1 with training.grad_accum = M (a weight tied
// across stages aside: its two halves add in another order).
//
// The LSTM LM's wavefront (parallel.time_chunks = K, schedule wavefront):
// each step reads one batch and its K time chunks are the micro-batches;
// every stage carries its layers' state from chunk to chunk
// (PipelineRuntime::set_carry_state) and runs the backwards in reverse
// order, so the step computes the gradient of the whole sequence, as one
// process does, with the loss of chunk m scaled by 1/K.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "parallel/schedule.h"
#include "trainer/distributed.h"
#include "trainer/moe_monitor.h"
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
  // Called before each optimizer step changes the parameters and the
  // optimizer state (a checkpoint's background copy waits to be done).
  void set_before_update(std::function<void()> f) { before_update_ = std::move(f); }
  // True when run() left by an exception after a micro-batch's forward had
  // run: the model's buffers (batch-norm statistics) are then part-way
  // through the step, and not a state to checkpoint.
  bool step_begun() const { return step_begun_; }
  // The mixture-of-experts layers' load and auxiliary losses of the last step.
  const MoEMonitor& moe() const { return moe_; }

 private:
  // The step in progress.
  struct InFlight {
    int64_t step = 0;
    std::vector<Tensor> losses;                     // per micro-batch, from its F to its B
    std::vector<std::optional<StepBatch>> batches;  // pipeline: per micro-batch, once read
    double loss_sum = 0;
    bool finite = true;  // every loss so far
    StepResult result;
  };
  bool forward(int micro_batch, InFlight& in_flight);
  void backward(int micro_batch, bool last, InFlight& in_flight);
  // A pipeline stage's actions.
  StepResult run_pipeline(int64_t step, bool stop_requested);
  bool pipeline_forward(int micro_batch, int chunk, InFlight& in_flight);
  void grad_sync(InFlight& in_flight);
  void optimizer_step(bool stop_requested, InFlight& in_flight);

  Session& session_;
  DistributedRun& run_;
  Precision& precision_;
  std::function<void()> before_update_;
  parallel::Schedule schedule_;
  const std::vector<parallel::Action>& actions_;  // this rank's stage
  bool step_begun_ = false;
  size_t last_backward_ = 0;  // index of the step's last action computing weight gradients
  // parallel.time_chunks: the micro-batches are time chunks of one batch
  // (the LSTM LM's wavefront); 1 otherwise.
  int time_chunks_ = 1;
  MoEMonitor moe_;
};

}  // namespace trainer
