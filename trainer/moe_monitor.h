// The mixture-of-experts layers' statistics over a step, summed over the
// ranks: the expert load per layer (for the logs and the balancing bias)
// and the auxiliary losses (layers/moe.h).
//
//   MoEMonitor moe(model, trained, dist);   // nothing to do for a dense model
//   ... after each optimizer step:
//   moe.step_done();               // collective over the workers
//   for (auto& kv : moe.scalars()) sc.push_back(kv);
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "layers/block_list.h"
#include "trainer/distributed.h"
#include "trainer/metrics.h"

namespace trainer {

class MoEMonitor {
 public:
  MoEMonitor() = default;
  // `trained`: what this rank runs (a pipeline stage's blocks, or the model).
  MoEMonitor(const Model& model, const Module& trained, const Distributed& dist);
  bool active() const { return !layers_.empty(); }
  // Takes every layer's statistics, sums them over the ranks (tensor-
  // parallel ranks route the same tokens: counted once) and moves the
  // balancing biases. The same on every rank.
  void step_done();
  // Of the last step: moe_aux_loss, moe_z_loss (means over the layers'
  // forwards), and per layer L moe_imbalance.L (the largest expert's load
  // over the mean, minus 1), moe_dropped.L (the share of assignments
  // dropped) and moe_load.L.e (expert e's share of the assignments).
  Scalars scalars() const;
  // " | aux 0.0102" for the progress line ("" when dense).
  std::string progress() const;

 private:
  std::vector<std::shared_ptr<MoEFeedForward>> layers_;
  std::vector<bool> here_;  // the layer runs on this rank (a pipeline's other stages' do not)
  std::shared_ptr<comm::Communicator> world_;
  int tp_ = 1;
  std::vector<MoEStats> last_;
};

}  // namespace trainer
