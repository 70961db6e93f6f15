#include "layers/linear.h"

#include <cmath>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/backend.h"
#include "core/ops.h"
#include "layers/init.h"

namespace trainer {

Linear::Linear(int64_t in_features, int64_t out_features, Generator& gen, bool with_bias) {
  CHECK(in_features >= 1 && out_features >= 1)
      << "Linear: features " << in_features << " -> " << out_features;
  weight = register_parameter("weight", empty({out_features, in_features}));
  kaiming_uniform_(weight, std::sqrt(5.0), gen);
  if (with_bias) {
    bias = register_parameter("bias", empty({out_features}));
    double bound = 1.0 / std::sqrt(double(in_features));
    uniform_(bias, -bound, bound, gen);
  }
}

Linear::Linear(Tensor w, Tensor b) {
  CHECK(w.dim() == 2 && (!b.defined() || b.shape() == Shape{w.size(0)}))
      << "Linear over weight " << w.shape_str() << " and bias "
      << (b.defined() ? b.shape_str() : "none");
  weight = register_parameter("weight", std::move(w));
  if (b.defined()) bias = register_parameter("bias", std::move(b));
}

namespace {

// y = x W^T + b over rows x [N, in], W [out, in], b [out] (may be undefined):
// one GEMM on W's transposed view, then b added in place. Backward:
// grad_x = g W, grad_W = g^T x ([out, in] directly, no transposed copy),
// grad_b = sum_N g.
struct LinearFn {
  struct Saved {
    Tensor x, weight;
    bool has_bias = false;
  };
  static constexpr const char* name = "linear";
  static Tensor forward(Saved& s, const Tensor& x, const Tensor& weight, const Tensor& bias) {
    Backend& be = backend(x.device());
    Tensor y = empty({x.size(0), weight.size(0)}, x.dtype(), x.device());
    be.matmul(x, weight.t(), y);
    if (bias.defined()) be.binary(BinaryOp::add, y, bias.expand(y.shape()), y);
    s = Saved{x, weight, bias.defined()};
    return y;
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask& needs) {
    Backend& be = backend(s.x.device());
    Tensor gx, gw, gb;
    if (needs[0]) {
      gx = empty(s.x.shape(), s.x.dtype(), s.x.device());
      be.matmul(g[0], s.weight, gx);
    }
    if (needs[1]) {
      gw = autograd::grad_buffer(1, s.weight.shape(), s.weight.dtype(), s.weight.device());
      be.matmul(g[0].t(), s.x, gw);
    }
    if (s.has_bias && needs[2]) gb = sum(g[0], {0});
    return {gx, gw, gb};
  }
};

}  // namespace

// The rows of x go through as one [N, in] matrix: one GEMM, and the weight's
// gradient is one g^T x rather than a product per batch index summed after.
Tensor linear(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in) {
  CHECK(x_in.defined() && weight_in.defined()) << "linear: undefined input or weight";
  Tensor x = autocast_lower(x_in), weight = autocast_lower(weight_in),
         bias = autocast_lower(bias_in);
  CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1))
      << "linear: x " << x.shape_str() << " does not match weight " << weight.shape_str();
  CHECK(is_floating(x.dtype()) && weight.dtype() == x.dtype() &&
        (!bias.defined() || bias.dtype() == x.dtype()))
      << "linear: x, weight and bias must share a floating dtype";
  CHECK(weight.device() == x.device() && (!bias.defined() || bias.device() == x.device()))
      << "linear: x, weight and bias must be on one device";
  CHECK(!bias.defined() || bias.shape() == Shape{weight.size(0)})
      << "linear: bias " << bias.shape_str() << " for weight " << weight.shape_str();
  Tensor rows = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
  Tensor y = autograd::apply<LinearFn>(rows, weight, bias);
  if (x.dim() == 2) return y;
  Shape shape = x.shape();
  shape.back() = weight.size(0);
  return y.reshape(shape);
}

Tensor Linear::forward(const Tensor& x) {
  switch (split_) {
    case LinearSplit::none:
      return linear(x, weight, bias);
    case LinearSplit::column: {
      TensorParallelGroup& g = *group_;
      return linear(g.sequence_parallel() ? gather_sequence(x, g) : copy_to_region(x, g), weight,
                    bias);
    }
    case LinearSplit::row: {
      TensorParallelGroup& g = *group_;
      Tensor partial = linear(x, weight, Tensor());
      Tensor y = g.sequence_parallel() ? reduce_scatter_sequence(partial, g)
                                       : reduce_from_region(partial, g);
      return bias.defined() ? y + bias : y;
    }
  }
  return Tensor();
}

void Linear::shard(std::shared_ptr<TensorParallelGroup> g, LinearSplit split, int parts) {
  CHECK(split_ == LinearSplit::none && split != LinearSplit::none && g)
      << "Linear::shard: already split, or no split";
  const int n = g->size();
  const int dim = split == LinearSplit::column ? 0 : 1;
  CHECK(weight.size(dim) % (int64_t(parts) * n) == 0)
      << "Linear::shard: " << weight.size(dim) << (dim == 0 ? " outputs" : " inputs")
      << " do not split into " << parts << " x " << n;
  const ParameterSplit s{.kind = ParameterSplit::Kind::sharded,
                         .dim = dim,
                         .parts = parts,
                         .rank = g->rank(),
                         .size = n};
  {
    autograd::NoGradGuard no_grad;
    weight = replace_parameter("weight", shard_of(weight.detach(), s), s);
    if (bias.defined()) {
      if (split == LinearSplit::column) {
        ParameterSplit b = s;
        b.dim = 0;
        bias = replace_parameter("bias", shard_of(bias.detach(), b), b);
      } else if (g->sequence_parallel()) {
        // Added to this rank's part of the sequence: its gradient is a share.
        bias = replace_parameter(
            "bias", bias,
            ParameterSplit{
                .kind = ParameterSplit::Kind::partial_gradient, .rank = g->rank(), .size = n});
      }
    }
  }
  group_ = std::move(g);
  split_ = split;
}

void Linear::mark_partial_gradient(const TensorParallelGroup& g) {
  CHECK(split_ == LinearSplit::none) << "Linear::mark_partial_gradient after shard";
  const ParameterSplit s{
      .kind = ParameterSplit::Kind::partial_gradient, .rank = g.rank(), .size = g.size()};
  weight = replace_parameter("weight", weight, s);
  if (bias.defined()) bias = replace_parameter("bias", bias, s);
}

void Linear::pad_outputs(int64_t features) {
  CHECK(split_ == LinearSplit::none) << "Linear::pad_outputs after shard";
  if (features == weight.size(0)) return;
  autograd::NoGradGuard no_grad;
  weight = replace_parameter("weight", zero_padded_rows(weight.detach(), features));
  if (bias.defined()) bias = replace_parameter("bias", zero_padded_rows(bias.detach(), features));
}

void Linear::share_sharded_weight(std::shared_ptr<TensorParallelGroup> g, Tensor w,
                                  const ParameterSplit& split) {
  CHECK(split_ == LinearSplit::none && !bias.defined() && split.dim == 0)
      << "Linear::share_sharded_weight: a bias-free layer split along its outputs";
  weight = replace_parameter("weight", std::move(w), split);
  group_ = std::move(g);
  split_ = LinearSplit::column;
}

Dropout::Dropout(double p, Generator gen) : p_(p), gen_(gen) {
  CHECK(p >= 0.0 && p < 1.0) << "Dropout: p " << p << " outside [0, 1)";
}

Tensor Dropout::forward(const Tensor& x) {
  if (!cp_ || !is_training() || p_ == 0.0) return dropout(x, p_, is_training(), gen_);
  Shape whole = x.shape();
  whole[1] *= cp_->size();
  const Tensor mask = dropout(ones(whole, x.dtype(), x.device()), p_, true, gen_);
  // Under sequence parallelism x holds a slice of the cp rank's tokens and
  // the tp rank draws its own stream: the cp ranks take distinct rows of it.
  if (stream_rank_ != 0) return x * mask.narrow(1, cp_->rank() * x.size(1), x.size(1)).contiguous();
  return x * cp_->layout(whole[1]).local(mask).contiguous();
}

}  // namespace trainer
