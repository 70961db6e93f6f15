// softmax, log_softmax, cross_entropy and dropout: forward and backward side by side.
#include "core/autocast.h"
#include "core/ops.h"

namespace trainer {

using autograd::GradMask;

namespace {

void check_floating(const char* op, const Tensor& x) {
  CHECK(x.defined()) << op << ": undefined tensor";
  CHECK(is_floating(x.dtype())) << op << " needs a floating tensor, got " << x.dtype();
}

// y = softmax(x) along dim (log: y = log_softmax(x)).
// Backward, from y: softmax gx = y (g - sum_dim g y); log_softmax gx = g - exp(y) sum_dim g.
struct SoftmaxFn {
  struct Saved {
    Tensor y;
    int dim;
    bool log;
  };
  static constexpr const char* name = "softmax";
  static Tensor forward(Saved& s, const Tensor& x, int dim, bool log) {
    check_floating(log ? "log_softmax" : "softmax", x);
    int d = x.wrap_dim(dim);
    Tensor out = empty(x.shape(), x.dtype(), x.device());
    if (out.numel() > 0) backend(x.device()).softmax(x, d, log, out);
    s = Saved{out, d, log};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad_x = empty(s.y.shape(), s.y.dtype(), s.y.device());
    if (grad_x.numel() > 0) backend(s.y.device()).softmax_backward(g[0], s.y, s.dim, s.log, grad_x);
    return {grad_x};
  }
};

Tensor softmax_op(const Tensor& x_in, int dim, bool log) {
  CHECK(x_in.defined()) << (log ? "log_softmax" : "softmax") << ": undefined tensor";
  Tensor x = autocast_fp32(x_in);
  // A 0-d tensor is one row of one element, as in PyTorch.
  if (x.dim() == 0) return autograd::apply<SoftmaxFn>(x.reshape({1}), dim, log).reshape({});
  return autograd::apply<SoftmaxFn>(x, dim, log);
}

// loss[n] = -sum_c q_c log_softmax(logits[n])_c with q = (1 - eps) onehot(target[n]) + eps / C,
// 0 where target[n] == ignore_index. Backward: grad_logits[n, c] = g[n] (softmax_c - q_c),
// 0 for ignored rows; target gets none.
struct CrossEntropyFn {
  struct Saved {
    Tensor logp, target;
    double eps;
    int64_t ignore_index;
  };
  static constexpr const char* name = "cross_entropy";
  static Tensor forward(Saved& s, const Tensor& logits, const Tensor& target, double eps,
                        int64_t ignore_index) {
    Tensor loss = empty({logits.size(0)}, logits.dtype(), logits.device());
    Tensor logp = empty(logits.shape(), logits.dtype(), logits.device());
    if (logits.numel() > 0)
      backend(logits.device()).cross_entropy(logits, target, eps, ignore_index, loss, logp);
    s = Saved{logp, target, eps, ignore_index};
    return loss;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad_logits = empty(s.logp.shape(), s.logp.dtype(), s.logp.device());
    if (grad_logits.numel() > 0)
      backend(s.logp.device())
          .cross_entropy_backward(g[0], s.logp, s.target, s.eps, s.ignore_index, grad_logits);
    return {grad_logits, Tensor()};
  }
};

// y = x * mask, where mask = bernoulli(1 - p) / (1 - p) is drawn by dropout()
// (all zeros when p == 1). Backward: gx = g * mask.
struct DropoutFn {
  struct Saved {
    Tensor mask;
  };
  static constexpr const char* name = "dropout";
  static Tensor forward(Saved& s, const Tensor& x, const Tensor& mask) {
    Tensor out = empty(x.shape(), x.dtype(), x.device());
    backend(x.device()).binary(BinaryOp::mul, x, mask, out);
    s = Saved{mask};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    return {g[0] * s.mask, Tensor()};
  }
};

}  // namespace

Tensor softmax(const Tensor& x, int dim) { return softmax_op(x, dim, /*log=*/false); }
Tensor log_softmax(const Tensor& x, int dim) { return softmax_op(x, dim, /*log=*/true); }

// The mean over non-ignored rows divides by max(count, 1): when every row is
// ignored the loss is 0 with a zero gradient (PyTorch returns NaN), so a
// micro-batch made only of padding leaves the training loss finite.
Tensor cross_entropy(const Tensor& logits_in, const Tensor& target,
                     const CrossEntropyOptions& options) {
  check_floating("cross_entropy", logits_in);
  Tensor logits = autocast_fp32(logits_in);
  CHECK(target.defined()) << "cross_entropy: undefined target";
  CHECK(logits.dim() == 2) << "cross_entropy expects logits [N, C], got " << logits.shape_str();
  CHECK(target.dim() == 1 && target.size(0) == logits.size(0))
      << "cross_entropy: target " << target.shape_str() << " does not match logits "
      << logits.shape_str();
  CHECK(target.dtype() == DType::i64)
      << "cross_entropy: target must be i64, got " << target.dtype();
  CHECK(target.device() == logits.device())
      << "cross_entropy: logits on " << logits.device() << ", target on " << target.device();
  double eps = options.label_smoothing;
  CHECK(eps >= 0.0 && eps <= 1.0) << "cross_entropy: label_smoothing " << eps << " outside [0, 1]";
  Tensor loss = autograd::apply<CrossEntropyFn>(logits, target, eps, options.ignore_index);
  using Reduction = CrossEntropyOptions::Reduction;
  switch (options.reduction) {
    case Reduction::none:
      return loss;
    case Reduction::sum:
      return sum(loss);
    case Reduction::mean: {
      Tensor ignored =
          eq(target, full({}, double(options.ignore_index), DType::i64, target.device()));
      Tensor count = sum(1.0 - ignored.to(logits.dtype()));
      return sum(loss) / clamp(count, 1.0, double(std::max<int64_t>(logits.size(0), 1)));
    }
  }
  return loss;
}

// No randomness is drawn (gen does not advance) when dropout is the identity
// or p == 1.
Tensor dropout(const Tensor& x, double p, bool training, Generator& gen) {
  check_floating("dropout", x);
  CHECK(p >= 0.0 && p <= 1.0) << "dropout: p " << p << " outside [0, 1]";
  if (!training || p == 0.0) return x;
  Tensor mask;
  if (p < 1.0) {
    mask = bernoulli(x.shape(), 1.0 - p, gen, x.dtype(), x.device());
    mul_(mask, 1.0 / (1.0 - p));
  } else {
    mask = zeros(x.shape(), x.dtype(), x.device());
  }
  return autograd::apply<DropoutFn>(x, mask);
}

}  // namespace trainer
