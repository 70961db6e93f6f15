#include "trainer/step_executor.h"

#include <cmath>

#include "core/autocast.h"
#include "core/ops.h"
#include "parallel/pipeline_runtime.h"
#include "parallel/trace.h"

namespace trainer {

using parallel::Action;
using parallel::ActionKind;

parallel::Schedule training_schedule(const Recipe& recipe, const RankLayout& layout) {
  if (layout.job.mesh[parallel::Dim::pp] == 1)
    return parallel::one_stage_schedule(int(recipe.training.grad_accum));
  // The LSTM LM's wavefront: the time chunks are the micro-batches.
  const int64_t micro_batches =
      recipe.parallel.time_chunks > 1 ? recipe.parallel.time_chunks : recipe.parallel.micro_batches;
  try {
    return parallel::make_schedule(recipe.parallel.schedule, layout.job.mesh[parallel::Dim::pp],
                                   int(micro_batches), int(recipe.parallel.virtual_stages));
  } catch (const Error& e) {
    throw Error(cat(recipe.source, ": ", e.what()));
  }
}

StepExecutor::StepExecutor(Session& session, DistributedRun& run, Precision& precision,
                           parallel::Schedule schedule)
    : session_(session),
      run_(run),
      precision_(precision),
      schedule_(std::move(schedule)),
      actions_(schedule_.stages.at(run.pipeline() ? size_t(run.pipeline()->stage()) : 0)),
      time_chunks_(run.pipeline() ? int(session.recipe().parallel.time_chunks) : 1) {
  parallel::check_schedule(schedule_);
  parallel::PipelineRuntime* pipeline = run_.pipeline();
  if (!pipeline)
    CHECK_EQ(schedule_.stages.size(), size_t(1)) << "a pipeline schedule without stages";
  for (size_t i = 0; i < actions_.size(); ++i) {
    const ActionKind kind = actions_[i].kind;
    if (!pipeline)
      CHECK(kind == ActionKind::forward || kind == ActionKind::backward ||
            kind == ActionKind::grad_sync || kind == ActionKind::optimizer_step)
          << "action " << parallel::to_string(actions_[i]) << " needs pipeline stages";
    if (kind == ActionKind::backward || kind == ActionKind::backward_weight) last_backward_ = i;
  }
  if (pipeline) {
    CHECK_EQ(int(schedule_.stages.size()), pipeline->plan().split().stages);
    CHECK_EQ(schedule_.chunks, pipeline->plan().split().chunks);
    // The probe's forward must not move BatchNorm's running statistics.
    std::vector<NamedTensor> buffers = session_.trained().named_buffers();
    std::vector<Tensor> kept;
    for (const NamedTensor& b : buffers) kept.push_back(b.tensor.clone());
    pipeline->set_carry_state(time_chunks_ > 1);
    BatchSource& source = session_.data();
    pipeline->probe(source.model_inputs(
                        time_chunk(source.probe_batch(session_.micro_batch()), 0, time_chunks_)),
                    precision_.autocast_dtype());
    autograd::NoGradGuard no_grad;
    for (size_t k = 0; k < buffers.size(); ++k) buffers[k].tensor.copy_(kept[k]);
    // From here on the stage holds only its own blocks' tensors.
    session_.release_other_stages();
  }
  moe_ = MoEMonitor(*session_.model_ptr(), session_.trained(),
                    run_.dist());  // after the probe's forward
}

StepResult StepExecutor::run(int64_t step, bool stop_requested) {
  step_begun_ = false;
  // The auxiliary losses of mixture-of-experts layers weigh as the loss does.
  set_auxiliary_loss_scale((precision_.scales_loss() ? precision_.scale() : 1.0) /
                           double(schedule_.micro_batches));
  if (run_.pipeline()) return run_pipeline(step, stop_requested);
  InFlight in_flight;
  in_flight.step = step;
  in_flight.losses.resize(size_t(schedule_.micro_batches));
  for (size_t i = 0; i < actions_.size(); ++i) {
    const Action& a = actions_[i];
    switch (a.kind) {
      case ActionKind::forward:
        if (!forward(a.micro_batch, in_flight)) {
          in_flight.result.ran_out = true;
          return in_flight.result;
        }
        break;
      case ActionKind::backward:
        backward(a.micro_batch, i == last_backward_, in_flight);
        break;
      case ActionKind::grad_sync:
        grad_sync(in_flight);
        break;
      case ActionKind::optimizer_step:
        optimizer_step(stop_requested, in_flight);
        break;
      default:
        CHECK(false) << "unreachable: checked by the constructor";
    }
  }
  return in_flight.result;
}

bool StepExecutor::forward(int m, InFlight& in_flight) {
  StepBatch batch;
  if (!session_.next_batch(batch)) return false;
  step_begun_ = true;
  session_.rekey_dropout(in_flight.step * schedule_.micro_batches + m);
  Tensor loss;
  {
    parallel::TraceScope span(run_.timeline(), "forward");
    AutocastGuard autocast(precision_.autocast_dtype());
    loss = session_.loss(batch);
  }
  const double v = loss.item<double>();
  in_flight.finite = in_flight.finite && std::isfinite(v);
  in_flight.loss_sum += v;
  in_flight.losses[size_t(m)] = loss;
  in_flight.result.position = batch.position;
  in_flight.result.items += batch.items;
  return true;
}

void StepExecutor::backward(int m, bool last, InFlight& in_flight) {
  Tensor loss = std::move(in_flight.losses[size_t(m)]);
  in_flight.losses[size_t(m)] = Tensor();
  // Data-parallel ranks always run backward: its collectives must match.
  if (!in_flight.finite && !run_.dist().active()) return;
  auto no_sync = run_.no_sync(!last);
  parallel::TraceScope span(run_.timeline(), "backward");
  const int M = schedule_.micro_batches;
  precision_.scale_loss(M == 1 ? loss : loss * (1.0 / double(M))).backward();
  run_.end_backward();
}

void StepExecutor::grad_sync(InFlight& in_flight) {
  if (in_flight.finite || run_.dist().active()) run_.finish_gradients();
}

StepResult StepExecutor::run_pipeline(int64_t step, bool stop_requested) {
  parallel::PipelineRuntime& rt = *run_.pipeline();
  InFlight in_flight;
  in_flight.step = step;
  in_flight.batches.resize(size_t(schedule_.micro_batches));
  rt.begin_step(actions_);
  for (size_t i = 0; i < actions_.size(); ++i) {
    const Action& a = actions_[i];
    switch (a.kind) {
      case ActionKind::forward:
        if (!pipeline_forward(a.micro_batch, a.chunk, in_flight)) {
          in_flight.result.ran_out = true;
          return in_flight.result;
        }
        break;
      case ActionKind::grad_sync: {
        rt.finish_step();
        parallel::TraceScope span(run_.timeline(), "grad sync", parallel::Track::comm);
        run_.finish_gradients();
        break;
      }
      case ActionKind::optimizer_step:
        optimizer_step(stop_requested, in_flight);
        break;
      default: {
        // Data parallelism communicates in the step's last B or W only (the
        // other actions compute no weight gradient).
        auto no_sync = run_.no_sync(i != last_backward_);
        rt.run(a);
        // Sharded gradients: each micro-batch's weight gradients are
        // reduce-scattered into the shard as they complete.
        if (a.kind == ActionKind::backward || a.kind == ActionKind::backward_weight)
          run_.end_backward();
      }
    }
  }
  return in_flight.result;
}

bool StepExecutor::pipeline_forward(int m, int chunk, InFlight& in_flight) {
  parallel::PipelineRuntime& rt = *run_.pipeline();
  // Time chunks are pieces of one batch, read once per step.
  std::optional<StepBatch>& batch = in_flight.batches[time_chunks_ > 1 ? 0 : size_t(m)];
  if (!batch) {
    StepBatch b;
    if (!session_.next_batch(b)) return false;
    in_flight.result.position = b.position;
    in_flight.result.items += b.items;
    batch = std::move(b);
  }
  session_.rekey_dropout(in_flight.step * schedule_.micro_batches + m);
  AutocastGuard autocast(precision_.autocast_dtype());
  BatchSource& source = session_.data();
  const StepBatch piece = time_chunk(*batch, time_chunks_ > 1 ? m : 0, time_chunks_);
  // A middle stage's batches are positions only: its pieces read no model input.
  TensorList outputs = rt.forward(
      m, chunk, source.batches_have_tensors() ? source.model_inputs(piece) : TensorList{});
  source.keep_outputs(outputs);
  if (!rt.is_last_piece(chunk)) return true;
  Tensor loss = source.loss_from(piece, outputs);
  const double v = loss.item<double>();
  in_flight.finite = in_flight.finite && std::isfinite(v);
  in_flight.loss_sum += v;
  const int M = schedule_.micro_batches;
  rt.set_loss(m, precision_.scale_loss(M == 1 ? loss : loss * (1.0 / double(M))));
  return true;
}

void StepExecutor::optimizer_step(bool stop_requested, InFlight& in_flight) {
  if (before_update_) before_update_();
  StepResult& result = in_flight.result;
  parallel::PipelineRuntime* pipeline = run_.pipeline();
  const bool has_loss = !pipeline || pipeline->is_last_piece(schedule_.chunks - 1);
  const StepVerdict verdict = run_.agree(in_flight.loss_sum / double(schedule_.micro_batches),
                                         in_flight.finite, stop_requested, has_loss);
  result.loss = verdict.loss;
  result.finite = verdict.finite;
  result.stop = verdict.stop;
  result.lr = session_.schedule().lr(in_flight.step);
  optim::Optimizer& optimizer = session_.optimizer();
  if (verdict.finite) {
    const Recipe& recipe = session_.recipe();
    parallel::TraceScope span(run_.timeline(), "optimizer");
    // fp16: the gradients are unscaled first, and the step is skipped when
    // one holds an inf/nan (the same on every rank: they are averaged).
    precision_.step(session_.trained().parameters(), [&] {
      // Sharded: the gradients are averaged into each rank's shard only, so
      // the optimizer computes the norm. Pipeline stages and tensor-parallel
      // ranks sum theirs.
      if (recipe.optimizer.clip_grad_norm > 0)
        // ZeRO-1 sums its shards' norms over the dp and pipeline ranks itself.
        result.grad_norm = run_.splits_model() && !session_.shards_optimizer()
                               ? run_.clip_gradients(recipe.optimizer.clip_grad_norm)
                               : optimizer.clip_grad_norm(recipe.optimizer.clip_grad_norm);
      optimizer.set_lr(result.lr);
      optimizer.step();
    });
    precision_.update();
  }
  run_.zero_grad(optimizer);
  moe_.step_done();
}

}  // namespace trainer
