// Expert parallelism in the trainer (parallel.ep): the recipe's checks, the
// pass that divides the mixture-of-experts layers' experts over the ep
// ranks, and their gradients' reduction over the ranks holding the same
// experts (trainer/distributed.h).
#include "comm/collectives.h"
#include "parallel/expert_parallel.h"
#include "trainer/distributed.h"
#include "trainer/session.h"

namespace trainer {

// Expert parallelism: a GPT with mixture-of-experts layers whose experts
// divide over the ranks, with plain or sharded data parallelism (ZeRO-1,
// -2, -3 without replica groups), tensor and context parallelism,
// pipelines or none, on CPU tensors.
void check_expert_keys(const Recipe& r) {
  const ParallelRecipe& p = r.parallel;
  if (p.ep == 1) return;
  const std::string what = cat(r.source, ": parallel.ep = ", p.ep);
  const int64_t experts = r.model.moe.experts;
  if (experts == 0)
    throw Error(cat(what, ": expert parallelism divides the experts of mixture-of-experts layers, ",
                    "and this model has none; set model.moe.experts (a multiple of ", p.ep,
                    ") or parallel.ep=1"));
  if (experts % p.ep != 0)
    throw Error(cat(what, ": model.moe.experts = ", experts, " does not divide over ", p.ep,
                    " ranks; use a parallel.ep dividing ", experts));
  auto refuse = [&](bool bad, const std::string& with, const std::string& fix) {
    if (bad) throw Error(cat(what, " with ", with, ": not supported together yet; set ", fix));
  };
  refuse(r.device != "cpu", cat("device ", r.device), "device=cpu");
  refuse(p.mode != "allreduce", cat("parallel.mode = ", p.mode), "parallel.mode=allreduce");
  refuse(zero_stage(p) > 0 && p.dp_replicate > 1, "hybrid sharding (parallel.dp_replicate)",
         "parallel.dp_replicate=1");
  refuse(r.data.sampling != "random", cat("data.sampling = ", r.data.sampling),
         "data.sampling=random");
}

void DistributedRun::apply_expert_parallel(Session& session) {
  const std::shared_ptr<comm::Communicator> ep = dist_.mesh.comm(parallel::Dim::ep);
  const std::shared_ptr<ExpertParallelGroup> g = make_expert_group(ep);
  int64_t first = 0, local = 0, experts = 0;
  for (const std::shared_ptr<MoEFeedForward>& l : session.model_ptr()->moe_layers()) {
    l->set_expert_parallel(g);
    first = l->first_expert(), local = l->local_experts(), experts = l->options().experts;
    for (int64_t e = first; e < first + local; ++e)
      for (const Tensor& p : l->expert_list[size_t(e)]->parameters()) expert_params_.push_back(p);
  }
  // The ranks holding the same experts: the dp ranks and the cp ranks
  // (other tokens of the same windows), those whose evaluation sums add up.
  expert_comm_ = eval_comm();
  session.record_pass("expert", cat("ep=", ep->size(), ", experts ", first, "-", first + local - 1,
                                    " of ", experts, " per layer"));
}

void DistributedRun::reduce_expert_gradients() {
  // Each expert's gradient already sums every ep rank's tokens (their rows
  // came back through the all-to-all): averaged over the dp ranks and
  // divided by ep, it is the gradient of the mean loss over the batch, as
  // the dense parameters' average over dp x ep is.
  if (expert_params_.empty()) return;
  const double scale = 1.0 / double(dist_.layout.size(parallel::Dim::ep));
  TensorList grads;
  for (const Tensor& p : expert_params_) {
    if (!p.grad().defined()) p.set_grad(zeros_like(p));
    grads.push_back(p.grad().reshape({-1}));
  }
  Tensor flat = concat(grads, 0) * scale;
  if (expert_comm_->size() > 1) comm::allreduce(*expert_comm_, flat, {.op = comm::ReduceOp::avg});
  int64_t at = 0;
  for (const Tensor& p : expert_params_) {
    Tensor g = p.grad();
    g.copy_(flat.narrow(0, at, p.numel()).reshape(p.shape()));
    at += p.numel();
  }
}

}  // namespace trainer
