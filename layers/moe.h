// Mixture of experts: a feed-forward layer of E expert MLPs of which each
// token uses k, chosen by a learned router (Switch Transformer, GShard,
// Mixtral, DeepSeek-V3).
//
//   MoEOptions o{.d_model = 256, .hidden = 512, .experts = 8, .top_k = 2};
//   MoEFeedForward moe(o, gen);
//   Tensor y = moe(x);                     // [B, T, D] -> [B, T, D]
//
// Per token: scores = softmax(router(x)) (or sigmoid), the k experts of
// the largest scores + expert_bias chosen (the bias, DeepSeek-V3's
// auxiliary-loss-free balancing, only steers the choice), their scores the
// gates (normalised to sum 1 with normalize_top_k), and
// y = sum_j gate_j expert_j(x) (+ the shared experts' output). Tokens are
// sorted by expert and each expert runs one GEMM pair over the rows it
// received; a capacity of ceil(capacity_factor N k / E) rows per expert
// drops the assignments beyond it (first choices first, then by token),
// unless dropless. Parameter names:
//
//   router.weight [E, D]  experts.<e>.c_fc.weight [H, D]  experts.<e>.c_proj.weight [D, H]
//   shared_experts.c_fc.weight [S H, D] ...  expert_bias [E] (a buffer)
//
// The auxiliary losses (the Switch load-balancing loss, the router
// z-loss) reach the router through the output: with_auxiliary_loss passes
// y through unchanged and, in backward, gives the loss a gradient of
// auxiliary_loss_scale() (the trainer sets it to the main loss's scale:
// 1 / micro-batches, times the fp16 loss scale), so they train in every
// layout without a term added to the loss.
#pragma once

#include <memory>
#include <vector>

#include "core/ops.h"
#include "core/rng.h"
#include "layers/linear.h"
#include "layers/module.h"

namespace trainer {

struct MoEOptions {
  int64_t d_model = 384;
  int64_t hidden = 1536;  // of each expert's MLP
  int64_t experts = 8;
  int64_t top_k = 2;
  bool sigmoid = false;  // scores: softmax (false) or sigmoid
  bool normalize_top_k = false;
  double capacity_factor = 1.25;
  bool dropless = false;
  double aux_loss_coef = 0.01;
  double z_loss_coef = 0.0;
  int64_t shared_experts = 0;     // a shared MLP of shared_experts x hidden, every token
  double bias_update_rate = 0.0;  // auxiliary-loss-free balancing (0: off)
  bool bias = true;               // in the experts' Linear layers
  GeluApprox gelu = GeluApprox::none;
};

// Which expert rows each token goes to: the assignments sorted by expert
// (by token within one), those over capacity dropped.
struct MoERouting {
  std::vector<int64_t> choice;  // [N k] the expert of each token's choice j at t k + j
  std::vector<int64_t> token;   // [M] the token of each kept assignment
  std::vector<int64_t> slot;    // [M] its place in the gates: token * k + choice
  std::vector<int64_t> counts;  // [E] kept rows per expert
  std::vector<int64_t> chosen;  // [E] assignments before dropping (the load)
  int64_t dropped = 0;
};

// scores [N, E] row-major (plus bias [E], or empty) -> the top-k of each
// row (ties to the lower expert) -> assignments, at most `capacity` per
// expert (< 0: no limit). The reference of the routing.
MoERouting route_tokens(const std::vector<float>& scores, int64_t n, int64_t experts, int64_t k,
                        const std::vector<float>& bias, int64_t capacity);

// The ranks the experts of every mixture-of-experts layer are divided over
// (expert parallelism): rank r holds experts [r E/n, (r + 1) E/n). Every
// rank of a group runs the same layers in the same order, so its
// exchanges pair up.
class ExpertParallelGroup {
 public:
  virtual ~ExpertParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Rows of dim 0 (contiguous): the first send_counts[0] go to rank 0, the
  // next send_counts[1] to rank 1, ...; returns the rows received, rank 0's
  // first, and their counts in *recv_counts (when not null).
  virtual Tensor all_to_all_v(const Tensor& rows, const std::vector<int64_t>& send_counts,
                              std::vector<int64_t>* recv_counts) = 0;
  // counts [size() k]: block r goes to rank r; the result's block r came from rank r.
  virtual std::vector<int64_t> exchange(const std::vector<int64_t>& counts) = 0;
};

// An expert: x -> c_proj(gelu(c_fc(x))).
class ExpertMLP : public Module {
 public:
  ExpertMLP(int64_t d_model, int64_t hidden, Generator& gen, bool bias, GeluApprox gelu);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Linear> c_fc, c_proj;

 private:
  GeluApprox gelu_;
};

// What the layer saw over the steps since take_stats (training only).
struct MoEStats {
  std::vector<int64_t> load;  // [E] tokens that chose each expert
  int64_t dropped = 0, tokens = 0;
  double aux_loss = 0, z_loss = 0;  // summed over forwards
  int64_t forwards = 0;
};

class MoEFeedForward : public Module {
 public:
  MoEFeedForward(const MoEOptions& o, Generator& gen);
  Tensor forward(const Tensor& x) override;
  const MoEOptions& options() const { return options_; }
  // The statistics since the last call, then reset.
  MoEStats take_stats();
  // Auxiliary-loss-free balancing: expert_bias[e] += rate * sign(mean -
  // load[e]) for the load of the whole step (summed over the ranks).
  void update_bias(const std::vector<int64_t>& load);
  // Expert parallelism over g: keeps experts [r E/n, (r + 1) E/n) (E must
  // divide by n; the others leave the module) and sends each token's rows
  // to the rank of its expert and back, by two all-to-alls forward and two
  // backward. The router and the shared experts stay on every rank.
  void set_expert_parallel(std::shared_ptr<ExpertParallelGroup> g);
  // The experts this rank holds: [first_expert(), first_expert() + local_experts()).
  int64_t first_expert() const { return ep_ ? ep_->rank() * local_experts() : 0; }
  int64_t local_experts() const { return ep_ ? options_.experts / ep_->size() : options_.experts; }

  std::shared_ptr<Linear> router;
  std::shared_ptr<ModuleDict> experts;
  std::vector<std::shared_ptr<ExpertMLP>> expert_list;  // by global index; null: another rank's
  std::shared_ptr<ExpertMLP> shared;                    // null without shared experts
  Tensor expert_bias;                                   // [E] f32

 private:
  // xs [M, D], sorted by expert with counts [E] rows each -> each row
  // through its expert, in xs's order.
  Tensor run_experts(const Tensor& xs, const std::vector<int64_t>& counts);
  Tensor run_local_experts(const Tensor& xs, const std::vector<int64_t>& counts);

  MoEOptions options_;
  MoEStats stats_;
  std::shared_ptr<ExpertParallelGroup> ep_;
};

// y unchanged; backward gives `aux` (a scalar) the gradient
// auxiliary_loss_scale(), as if aux were added to the loss.
Tensor with_auxiliary_loss(const Tensor& y, const Tensor& aux);
void set_auxiliary_loss_scale(double scale);
double auxiliary_loss_scale();

}  // namespace trainer
