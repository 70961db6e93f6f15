#include "trainer/step_executor.h"

#include <cmath>

#include "core/autocast.h"
#include "core/ops.h"
#include "parallel/trace.h"

namespace trainer {

using parallel::Action;
using parallel::ActionKind;

parallel::Schedule training_schedule(const Recipe& recipe, const RankLayout& layout) {
  // parallel_layout() refuses pp > 1 until pipeline stages exist.
  CHECK_EQ(layout.job.mesh.pp, 1) << "a pipeline schedule before pipeline stages exist";
  return parallel::one_stage_schedule(int(recipe.training.grad_accum));
}

StepExecutor::StepExecutor(Session& session, DistributedRun& run, Precision& precision,
                           parallel::Schedule schedule)
    : session_(session),
      run_(run),
      precision_(precision),
      schedule_(std::move(schedule)),
      actions_(schedule_.stages.at(0)) {
  parallel::check_schedule(schedule_);
  CHECK_EQ(schedule_.stages.size(), size_t(1)) << "pipeline stages are not built yet";
  for (size_t i = 0; i < actions_.size(); ++i) {
    const ActionKind kind = actions_[i].kind;
    CHECK(kind == ActionKind::forward || kind == ActionKind::backward ||
          kind == ActionKind::grad_sync || kind == ActionKind::optimizer_step)
        << "action " << parallel::to_string(actions_[i]) << " needs pipeline stages";
    if (kind == ActionKind::backward) last_backward_ = i;
  }
}

StepResult StepExecutor::run(int64_t step, bool stop_requested) {
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
}

void StepExecutor::grad_sync(InFlight& in_flight) {
  if (in_flight.finite || run_.dist().active()) run_.finish_gradients();
}

void StepExecutor::optimizer_step(bool stop_requested, InFlight& in_flight) {
  StepResult& result = in_flight.result;
  const StepVerdict verdict = run_.agree(in_flight.loss_sum / double(schedule_.micro_batches),
                                         in_flight.finite, stop_requested);
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
    precision_.step(session_.model().parameters(), [&] {
      // Sharded: the gradients are averaged into each rank's shard only, so
      // the optimizer computes the norm.
      if (recipe.optimizer.clip_grad_norm > 0)
        result.grad_norm = optimizer.clip_grad_norm(recipe.optimizer.clip_grad_norm);
      optimizer.set_lr(result.lr);
      optimizer.step();
    });
    precision_.update();
  }
  run_.zero_grad(optimizer);
}

}  // namespace trainer
