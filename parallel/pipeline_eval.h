// Evaluation over a pipeline's stages: each stage runs the evaluation
// batches through its own pieces (PipelineRuntime::evaluate, forward only,
// batch after batch) and the stage with the model's last piece adds up the
// sums, which it then broadcasts to the other stages of the pipeline. The
// batches come through callbacks (the trainer's batch source behind them),
// so this file knows nothing of how they are read or scored.
//
//   PipelineEvalBatches batches{.start = ..., .next = ..., .inputs = ...,
//                               .outputs = ..., .sums = ...};
//   PipelineEvalSums s = evaluate_pipeline(runtime, model, pp_comm, time_chunks, batches);
#pragma once

#include <array>
#include <functional>

#include "comm/communicator.h"
#include "core/tensor.h"
#include "layers/module.h"

namespace trainer::parallel {

class PipelineRuntime;

// The sums of an evaluation as doubles: loss, top-1, top-5, samples.
using PipelineEvalSums = std::array<double, 4>;

// What evaluate_pipeline reads the evaluation batches through. A batch is
// cut into time chunks (the LSTM LM's wavefront; one chunk otherwise), each
// a micro-batch of the pipeline.
struct PipelineEvalBatches {
  // Goes back to the first evaluation batch of this dp rank's share.
  std::function<void()> start;
  // Moves to the next batch; false after the last.
  std::function<bool()> next;
  // The model inputs (boundary(0) order) of time chunk k of K of the batch.
  std::function<TensorList(int k, int K)> inputs;
  // The model outputs this stage kept for the chunk inputs gave last;
  // last_stage: this stage holds the last piece and adds the chunk's sums.
  std::function<void(const TensorList& outputs, bool last_stage)> outputs;
  // The sums added so far (read once, after the last batch).
  std::function<PipelineEvalSums()> sums;
};

// Runs the evaluation batches through this stage in eval mode without
// gradients (model is the stage's module tree, back in training mode after),
// the micro-batches numbered m * time_chunks + k, and returns the last
// stage's sums on every stage (collective over pp, the pipeline's
// communicator, in which a stage's rank is its index).
PipelineEvalSums evaluate_pipeline(PipelineRuntime& runtime, Module& model, comm::Communicator& pp,
                                   int time_chunks, const PipelineEvalBatches& batches);

}  // namespace trainer::parallel
