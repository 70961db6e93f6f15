// MoEMonitor (trainer/moe_monitor.h).
#include "trainer/moe_monitor.h"

#include <algorithm>
#include <numeric>
#include <set>

#include "comm/collectives.h"

namespace trainer {

MoEMonitor::MoEMonitor(const Model& model, const Module& trained, const Distributed& dist)
    : layers_(model.moe_layers()), world_(dist.world()), tp_(dist.layout.size(parallel::Dim::tp)) {
  std::set<const TensorImpl*> mine;
  for (const Tensor& p : trained.parameters()) mine.insert(p.impl());
  for (const std::shared_ptr<MoEFeedForward>& l : layers_) {
    here_.push_back(mine.count(l->router->weight.impl()) > 0);
    l->take_stats();  // a pipeline probe's forward
  }
}

void MoEMonitor::step_done() {
  if (layers_.empty()) return;
  // Per layer: E loads, dropped, tokens, aux, z, forwards.
  std::vector<double> v;
  for (const std::shared_ptr<MoEFeedForward>& l : layers_) {
    const MoEStats s = l->take_stats();
    for (int64_t n : s.load) v.push_back(double(n));
    v.insert(v.end(),
             {double(s.dropped), double(s.tokens), s.aux_loss, s.z_loss, double(s.forwards)});
  }
  if (world_ && world_->size() > 1)
    comm::allreduce(*world_, v.data(), v.size(), DType::f64, {.op = comm::ReduceOp::sum});
  last_.clear();
  size_t at = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    MoEFeedForward* l = layers_[i].get();
    MoEStats s;
    for (int64_t e = 0; e < l->options().experts; ++e) s.load.push_back(int64_t(v[at++] / tp_));
    s.dropped = int64_t(v[at++] / tp_), s.tokens = int64_t(v[at++] / tp_);
    s.aux_loss = v[at++], s.z_loss = v[at++], s.forwards = int64_t(v[at++]);
    if (here_[i]) l->update_bias(s.load);
    last_.push_back(std::move(s));
  }
}

Scalars MoEMonitor::scalars() const {
  Scalars sc;
  if (last_.empty()) return sc;
  double aux = 0, z = 0;
  int64_t forwards = 0;
  for (const MoEStats& s : last_) aux += s.aux_loss, z += s.z_loss, forwards += s.forwards;
  sc.push_back({"moe_aux_loss", forwards > 0 ? aux / double(forwards) : 0});
  sc.push_back({"moe_z_loss", forwards > 0 ? z / double(forwards) : 0});
  for (size_t i = 0; i < last_.size(); ++i) {
    const MoEStats& s = last_[i];
    const double assigned = double(std::accumulate(s.load.begin(), s.load.end(), int64_t(0)));
    const double mean = assigned / double(s.load.size());
    const double top = double(*std::max_element(s.load.begin(), s.load.end()));
    sc.push_back({cat("moe_imbalance.", i), mean > 0 ? top / mean - 1 : 0});
    sc.push_back({cat("moe_dropped.", i), assigned > 0 ? double(s.dropped) / assigned : 0});
    for (size_t e = 0; e < s.load.size(); ++e)
      sc.push_back({cat("moe_load.", i, ".", e), assigned > 0 ? double(s.load[e]) / assigned : 0});
  }
  return sc;
}

std::string MoEMonitor::progress() const {
  if (last_.empty()) return "";
  const Scalars sc = scalars();
  double worst = 0;
  for (const auto& [name, value] : sc)
    if (name.starts_with("moe_imbalance.")) worst = std::max(worst, value);
  char buf[96];
  std::snprintf(buf, sizeof buf, " | aux %.4g | imbalance %.2f", sc[0].second + sc[1].second,
                worst);
  return buf;
}

}  // namespace trainer
