// The builders of the op table's cases (tests/op_families.h): inputs, op,
// dtypes and Reduction of each family.
#include "tests/op_families.h"

#include <algorithm>
#include <cmath>

#include "core/ops_conv.h"
#include "core/ops_rnn.h"
#include "core/ops_transformer.h"
#include "layers/linear.h"

namespace trainer::testing::op_table {
namespace {

const std::vector<DType> kFloat32And64 = {DType::f32, DType::f64};

Input laid_out(Input x, Layout layout) {
  x.layout = layout;
  return x;
}

// "[7, 33] strided, [1, 33]": the variant's inputs (then "; " and its attributes).
std::string describe(const std::vector<Input>& inputs) {
  static const char* const suffix[] = {"", " strided", " transposed", " broadcast",
                                       " channels-last"};
  std::string s;
  for (const Input& in : inputs) {
    if (!s.empty()) s += ", ";
    s += shape_str(in.shape) + suffix[int(in.layout)];
    if (!in.index.empty()) s += in.index_dtype == DType::i32 ? " i32" : " i64";
  }
  return s;
}

std::string with_attrs(const std::vector<Input>& inputs, const std::string& attrs) {
  return attrs.empty() ? describe(inputs) : describe(inputs) + "; " + attrs;
}

Tensor flat(const TensorList& ts) {
  TensorList parts;
  for (const Tensor& t : ts) parts.push_back(t.reshape({-1}));
  return concat(parts, 0);
}

int64_t longest(std::initializer_list<int64_t> lengths) { return std::max(lengths); }

// The elementwise Reduction (op_families.h) of an output of shape out.
Reduction elementwise(const Shape& out) {
  const int64_t n = out.empty() ? 1 : *std::max_element(out.begin(), out.end());
  return {.length = n, .scale = 1.5 * std::sqrt(double(n))};
}

// n terms of size up to 1 with random signs.
Reduction sum_of(int64_t n) { return {.length = n, .scale = std::sqrt(double(n))}; }

// A sum of n products (op_families.h).
Reduction products(int64_t n) { return {.length = n, .scale = 1.5 * std::sqrt(double(n))}; }

// pow takes a positive base; div a divisor away from 0.
Input first_operand(BinaryOp op, Input a) {
  return op == BinaryOp::pow ? range(std::move(a), 0.3, 2) : range(std::move(a), -2, 2);
}

Input second_operand(BinaryOp op, Input b) {
  b = range(std::move(b), -1.5, 1.5);
  return op == BinaryOp::div ? away_from_zero(range(std::move(b), -2, 2)) : b;
}

std::string pool_attrs(const Pool2dAttrs& a) {
  return cat("kernel ", a.kernel[0], "x", a.kernel[1], " stride ", a.stride[0], "x", a.stride[1],
             " pad ", a.padding[0], "x", a.padding[1]);
}

// Copies and gathers: bit for bit; their backward adds repeated indices'
// gradients in index order, as the reference does.
OpCase index_case(std::string op, std::vector<Input> inputs, OpFn f, std::string attrs = "") {
  std::string variant = with_attrs(inputs, attrs);
  return {.op = std::move(op),
          .variant = std::move(variant),
          .inputs = std::move(inputs),
          .f = std::move(f),
          .reduction = kExact};
}

// Copies of the state tensors the update writes in place.
TensorList copies(const TensorList& t, size_t first, size_t count) {
  TensorList out;
  for (size_t k = first; k < first + count; ++k) out.push_back(t[k].detach().clone());
  return out;
}

}  // namespace

Input range(Input x, double lo, double hi) {
  x.lo = lo;
  x.hi = hi;
  return x;
}

Input away_from_zero(Input x) {
  x.away_from_zero = true;
  return x;
}

Input strided(Input x) { return laid_out(std::move(x), Layout::strided); }

Input transposed(Input x) { return laid_out(std::move(x), Layout::transposed); }

Input broadcast(Input x) { return laid_out(std::move(x), Layout::broadcast); }

Input image(Input x) { return laid_out(std::move(x), Layout::channels_last); }

Input indices(Shape shape, int64_t bound, DType dtype, int ignore_every) {
  Input x(std::move(shape));
  for (int64_t i = 0; i < shape_numel(x.shape); ++i)
    x.index.push_back(ignore_every && i % ignore_every == 3 ? -100 : (i * 31 + 5) % bound);
  x.index_dtype = dtype;
  return x;
}

OpCase unary_case(const UnaryRange& u, Input x) {
  x = range(std::move(x), u.lo, u.hi);
  if (u.kink_at_zero) x = away_from_zero(std::move(x));
  const Shape shape = x.shape;
  return {.op = unary_op_name(u.op),
          .variant = describe({x}),
          .inputs = {x},
          .f = [op = u.op](const TensorList& t) { return unary(op, t[0]); },
          .reduction = elementwise(shape),
          .lowp_roundings = 4};
}

OpCase binary_case(BinaryOp op, Input a, Input b) {
  std::vector<Input> inputs = {first_operand(op, std::move(a)), second_operand(op, std::move(b))};
  const Shape out = broadcast_shapes(inputs[0].shape, inputs[1].shape);
  return {.op = binary_op_name(op),
          .variant = describe(inputs),
          .inputs = inputs,
          .f = [op](const TensorList& t) { return binary(op, t[0], t[1]); },
          .reduction = elementwise(out),
          .lowp_roundings = 4};
}

OpCase binary_scalar_case(BinaryOp op, bool scalar_first, Input x) {
  const double s = op == BinaryOp::pow ? 1.3 : -0.7;
  x = op == BinaryOp::div ? second_operand(op, std::move(x)) : first_operand(op, std::move(x));
  const Shape shape = x.shape;
  return {.op = binary_op_name(op),
          .variant = with_attrs({x}, scalar_first ? "scalar first" : "scalar second"),
          .inputs = {x},
          .f = [=](const TensorList& t) { return binary_scalar(op, t[0], s, scalar_first); },
          .reduction = elementwise(shape),
          .lowp_roundings = 4};
}

OpCase pointwise(std::string op, std::vector<Input> inputs, OpFn f, const Shape& out,
                 std::string attrs) {
  std::string variant = with_attrs(inputs, attrs);
  return {.op = std::move(op),
          .variant = std::move(variant),
          .inputs = std::move(inputs),
          .f = std::move(f),
          .reduction = elementwise(out),
          .lowp_roundings = 4};
}

OpCase reduce_case(Reduce reduce, Input x, std::vector<int> dims, bool keepdim) {
  static const char* const names[] = {"sum", "mean", "var", "max"};
  int64_t n = 1;
  for (size_t d = 0; d < x.shape.size(); ++d)
    if (dims.empty() || std::count(dims.begin(), dims.end(), int(d) - int(x.shape.size())) ||
        std::count(dims.begin(), dims.end(), int(d)))
      n *= x.shape[d];
  std::string attrs = "all";
  if (!dims.empty()) {
    attrs = "dims";
    for (int d : dims) attrs += cat(" ", d);
  }
  if (keepdim) attrs += " keepdim";
  std::string variant = with_attrs({x}, attrs);
  return {.op = names[int(reduce)],
          .variant = std::move(variant),
          .inputs = {std::move(x)},
          .f =
              [=](const TensorList& t) {
                switch (reduce) {
                  case Reduce::sum:
                    return sum(t[0], dims, keepdim);
                  case Reduce::mean:
                    return mean(t[0], dims, keepdim);
                  case Reduce::var:
                    return var(t[0], dims, 1, keepdim);
                  case Reduce::max:
                    break;
                }
                return dims.empty() ? max(t[0]) : max(t[0], dims[0], keepdim);
              },
          .reduction = sum_of(n),
          .lowp_roundings = 3};
}

OpCase gemm_case(std::string op, std::vector<Input> inputs, OpFn f, int64_t n, std::string attrs) {
  std::string variant = with_attrs(inputs, attrs);
  return {.op = std::move(op),
          .variant = std::move(variant),
          .inputs = std::move(inputs),
          .f = std::move(f),
          .reduction = products(n),
          .lowp_roundings = 2,
          .tf32 = true};
}

OpCase matmul_case(Input a, Input b, int64_t n) {
  return gemm_case(
      "matmul", {std::move(a), std::move(b)},
      [](const TensorList& t) { return matmul(t[0], t[1]); }, n);
}

OpCase conv2d_case(Input x, Shape w, Conv2dAttrs a, bool bias, bool relu) {
  const int64_t O = w[0];
  const int64_t n =
      longest({x.shape[0] * x.shape[2] * x.shape[3], w[1] * w[2] * w[3], O * w[2] * w[3]});
  std::vector<Input> inputs = {std::move(x), Input(std::move(w))};
  if (bias) inputs.push_back({O});
  const std::string attrs =
      cat("stride ", a.stride[0], "x", a.stride[1], " pad ", a.padding[0], "x", a.padding[1],
          a.dilation[0] > 1 ? cat(" dilation ", a.dilation[0]) : "",
          a.groups > 1 ? cat(" groups ", a.groups) : "", relu ? " relu" : "");
  return gemm_case(
      "conv2d", inputs,
      [=](const TensorList& t) { return conv2d(t[0], t[1], bias ? t[2] : Tensor(), a, relu); }, n,
      attrs);
}

OpCase softmax_case(bool log, Input x, int dim) {
  x = range(std::move(x), -8, 8);
  const int64_t n = x.shape[size_t(dim)];
  return {
      .op = log ? "log_softmax" : "softmax",
      .variant = with_attrs({x}, cat("dim ", dim)),
      .inputs = {x},
      .f = [=](const TensorList& t) { return log ? log_softmax(t[0], dim) : softmax(t[0], dim); },
      .reduction = {.length = n, .scale = 2},
      .lowp_roundings = 2};
}

OpCase cross_entropy_case(Input logits, double label_smoothing,
                          CrossEntropyOptions::Reduction reduction) {
  logits = range(std::move(logits), -6, 6);
  const int64_t N = logits.shape[0], C = logits.shape[1];
  const CrossEntropyOptions options{.label_smoothing = label_smoothing, .reduction = reduction};
  const char* reduce = reduction == CrossEntropyOptions::Reduction::none ? "none" : "mean";
  std::vector<Input> inputs = {logits, indices({N}, C, DType::i64, 5)};
  return {.op = "cross_entropy",
          .variant = with_attrs(inputs, cat("smoothing ", label_smoothing, ", ", reduce)),
          .inputs = inputs,
          .f = [=](const TensorList& t) { return cross_entropy(t[0], t[1], options); },
          .reduction = {.length = std::max(N, C), .scale = 12},
          .lowp_roundings = 2};
}

OpCase layer_norm_case(Input x) {
  x = range(std::move(x), -2, 2);
  const int64_t D = x.shape.back(), n = std::max(D, shape_numel(x.shape) / D);
  return {.op = "layer_norm",
          .variant = describe({x}),
          .inputs = {x, {D}, {D}},
          .f = [](const TensorList& t) { return layer_norm(t[0], t[1], t[2]); },
          .reduction = {.length = n, .scale = 4 * std::sqrt(double(n))},
          .lowp_roundings = 2};
}

OpCase rms_norm_case(Input x) {
  x = range(std::move(x), -2, 2);
  const int64_t D = x.shape.back(), n = std::max(D, shape_numel(x.shape) / D);
  std::vector<Input> inputs = {x, range({D}, 0.5, 1.5)};
  return {.op = "rms_norm",
          .variant = describe({x}),
          .inputs = inputs,
          .f = [](const TensorList& t) { return rms_norm(t[0], t[1]); },
          .reduction = {.length = n, .scale = 4 * std::sqrt(double(n))},
          .lowp_roundings = 2};
}

OpCase batch_norm_case(Input x, bool relu) {
  x = range(std::move(x), -2.5, 3.5);
  const int64_t C = x.shape[1], n = x.shape[0] * x.shape[2] * x.shape[3];
  std::vector<Input> inputs = {x, range({C}, 0.5, 1.5), {C}};
  return {
      .op = "batch_norm",
      .variant = with_attrs(inputs, relu ? "train, fused relu" : "train"),
      .inputs = inputs,
      .f = [=](const TensorList& t) { return batch_norm_train(t[0], t[1], t[2], 1e-5, relu).out; },
      .reduction = {.length = n, .scale = 4 * std::sqrt(double(n))},
      .lowp_roundings = 2};
}

OpCase pool_case(bool max, Input x, Pool2dAttrs a) {
  const int64_t n = a.kernel[0] * a.kernel[1];
  const std::string attrs =
      pool_attrs(a) + (!max && !a.count_include_pad ? " exclude padding" : "");
  return {.op = max ? "max_pool2d" : "avg_pool2d",
          .variant = with_attrs({x}, attrs),
          .inputs = {x},
          .f = [=](const TensorList& t) { return max ? max_pool2d(t[0], a) : avg_pool2d(t[0], a); },
          .reduction = {.length = n, .scale = 3},
          .lowp_roundings = 2};
}

OpCase adaptive_pool_case(Input x, int64_t out_h, int64_t out_w) {
  const int64_t n = x.shape[2] * x.shape[3];
  return {.op = "adaptive_avg_pool2d",
          .variant = with_attrs({x}, cat("to ", out_h, "x", out_w)),
          .inputs = {x},
          .f = [=](const TensorList& t) { return adaptive_avg_pool2d(t[0], out_h, out_w); },
          .reduction = {.length = n, .scale = 12},
          .lowp_roundings = 2};
}

OpCase embedding_case(Shape table, Input ids) {
  return index_case("embedding", {std::move(table), std::move(ids)},
                    [](const TensorList& t) { return embedding(t[0], t[1]); });
}

OpCase index_select_case(Input x, int dim, Input index) {
  return index_case(
      "index_select", {std::move(x), std::move(index)},
      [dim](const TensorList& t) { return index_select(t[0], dim, t[1]); }, cat("dim ", dim));
}

OpCase gather_case(Input x, int dim, Input index) {
  return index_case(
      "gather", {std::move(x), std::move(index)},
      [dim](const TensorList& t) { return gather(t[0], dim, t[1]); }, cat("dim ", dim));
}

OpCase concat_case(Input a, Input b, int dim) {
  return index_case(
      "concat", {std::move(a), std::move(b)},
      [dim](const TensorList& t) {
        return concat({t[0], t[1], t[0]}, dim);
      },
      cat("dim ", dim, ", the first twice"));
}

OpCase attention_case(int64_t B, int64_t T, int64_t D, int64_t NH, double dropout_p, bool fused_qkv,
                      int64_t kv_heads) {
  const int64_t KV = kv_heads > 0 ? kv_heads : NH, Dkv = KV * (D / NH);
  const int64_t n = std::max(T, D / NH) * (NH / KV);
  std::vector<Input> inputs = {range({B, T, D + 2 * Dkv}, -2, 2)};
  return {.op = "attention",
          .variant =
              with_attrs(inputs, cat("heads ", NH, kv_heads > 0 ? cat(" kv heads ", KV) : "",
                                     " dropout ", dropout_p, fused_qkv ? " fused qkv" : " views")),
          .inputs = inputs,
          .f =
              [=](const TensorList& t) {
                Generator gen(3, kStreamDropout);
                if (fused_qkv) return causal_attention_qkv(t[0], NH, dropout_p, true, gen);
                return causal_attention(t[0].narrow(2, 0, D), t[0].narrow(2, D, Dkv),
                                        t[0].narrow(2, D + Dkv, Dkv), NH, dropout_p, true, gen,
                                        kv_heads);
              },
          .reduction = {.length = n, .scale = 8 * std::sqrt(double(n))},
          .lowp_roundings = 2};
}

OpCase attention_block_case(int64_t B, int64_t T, int64_t D, int64_t NH, int64_t KV, int64_t q0,
                            int64_t Tq, int64_t split, double dropout_p) {
  const int64_t Dkv = KV * (D / NH), Tk = q0 + Tq;
  const int64_t n = std::max(Tk, D / NH) * (NH / KV);
  std::vector<Input> inputs = {range({B, T, D + 2 * Dkv}, -2, 2)};
  return {.op = "attention",
          .variant = with_attrs(inputs, cat("block: q rows [", q0, ", ", Tk, ") against [0, ",
                                            split, ") and [", split, ", ", Tk, "), heads ", NH,
                                            " kv heads ", KV, " dropout ", dropout_p)),
          .inputs = inputs,
          .f =
              [=](const TensorList& t) {
                Generator gen(3, kStreamDropout);
                AttentionAttrs attrs = attention_block_attrs(B, D, NH, KV, dropout_p, true, gen, T);
                attrs.q_offset = q0;
                const Tensor q = t[0].narrow(2, 0, D).narrow(1, q0, Tq);
                const Tensor k = t[0].narrow(2, D, Dkv), v = t[0].narrow(2, D + Dkv, Dkv);
                const int64_t starts[] = {0, split}, lens[] = {split, Tk - split};
                AttentionBlockResult acc;
                for (int i = 0; i < 2; ++i) {
                  attrs.k_offset = starts[i];
                  AttentionBlockResult r = attention_block_forward(
                      q, k.narrow(1, starts[i], lens[i]), v.narrow(1, starts[i], lens[i]), attrs);
                  if (i == 0)
                    acc = r;
                  else
                    attention_merge(acc.out, acc.lse, r.out, r.lse);
                }
                const Tensor grad_out = probe_like(acc.out).to(acc.out.device());
                TensorList parts = {acc.out.flatten(), acc.lse.to(q.dtype()).flatten()};
                Tensor grad_q;
                for (int i = 0; i < 2; ++i) {
                  attrs.k_offset = starts[i];
                  TensorList g = attention_block_backward(
                      grad_out, q, k.narrow(1, starts[i], lens[i]), v.narrow(1, starts[i], lens[i]),
                      acc.out, acc.lse, attrs);
                  grad_q = i == 0 ? g[0] : grad_q + g[0];
                  parts.push_back(g[1].flatten());
                  parts.push_back(g[2].flatten());
                }
                parts.push_back(grad_q.flatten());
                return concat(parts, 0);
              },
          .reduction = {.length = n, .scale = 8 * std::sqrt(double(n))},
          .lowp_roundings = 3};
}

OpCase rope_case(Input x, int64_t NH, bool llama3) {
  x = range(std::move(x), -2, 2);
  const int64_t T = x.shape[1];
  std::vector<Input> inputs = {x, indices({T}, 9001)};
  RopeOptions options{.theta = 500000.0};
  if (llama3) options = {.theta = 500000.0, .scaling = "llama3", .factor = 8.0};
  return {.op = "rotary_embedding",
          .variant = with_attrs(inputs, cat("heads ", NH, llama3 ? " llama3" : "")),
          .inputs = inputs,
          .f = [=](const TensorList& t) { return rotary_embedding(t[0], NH, t[1], options); },
          .reduction = {.scale = 2}};
}

OpCase recurrent_case(bool lstm, int64_t B, int64_t T, int64_t I, int64_t H) {
  const int64_t G = lstm ? 4 : 3, n = longest({I, H, B * T});
  std::vector<Input> inputs = {strided({B, T, I}), strided({B, H})};
  if (lstm) inputs.push_back(strided({B, H}));
  for (const Shape& s : {Shape{G * H, I}, Shape{G * H, H}, Shape{G * H}, Shape{G * H}})
    inputs.push_back(strided(s));
  OpFn f = [](const TensorList& t) {
    LSTMOutput o = lstm_layer(t[0], t[1], t[2], t[3], t[4], t[5], t[6]);
    return flat({o.y, o.h, o.c});
  };
  if (!lstm)
    f = [](const TensorList& t) {
      GRUOutput o = gru_layer(t[0], t[1], t[2], t[3], t[4], t[5]);
      return flat({o.y, o.h});
    };
  return {.op = lstm ? "lstm" : "gru",
          .variant = cat("B ", B, " T ", T, " I ", I, " H ", H, ", inputs strided"),
          .inputs = inputs,
          .f = f,
          .reduction = {.length = n, .scale = 2 * std::sqrt(double(n)), .roundings = int(T)},
          .tf32 = true};
}

OpCase sgd_case(int64_t n) {
  const std::vector<Input> inputs = {{n}, {7, 5}, {n}, {7, 5}, {n}, {7, 5}};
  return {
      .op = "sgd_step",
      .variant = cat("[", n, "], [7, 5] momentum 0.9 dampening 0.1 nesterov, decay"),
      .inputs = inputs,
      .f =
          [](const TensorList& t) {
            MultiTensorSgd a{.params = copies(t, 0, 2),
                             .grads = {t[2].detach(), t[3].detach()},
                             .momentum_buffers = copies(t, 4, 2),
                             .lr = {0.05, 0.1},
                             .weight_decay = {0.01, 0.0},
                             .step = {1, 4},
                             .momentum = 0.9,
                             .dampening = 0.1,
                             .nesterov = true};
            backend(t[0].device()).sgd_step(a);
            return flat({a.params[0], a.params[1], a.momentum_buffers[0], a.momentum_buffers[1]});
          },
      .reduction = {.roundings = 9},
      .dtypes = kFloat32And64};
}

OpCase adamw_case(int64_t n, bool amsgrad) {
  std::vector<Input> inputs = {{n}, {7, 5}, {n}, {7, 5}, {n}, {7, 5}};
  for (int k = 0; k < (amsgrad ? 2 : 1); ++k) {
    inputs.push_back(range({n}, 0, 0.5));
    inputs.push_back(range({7, 5}, 0, 0.5));
  }
  return {.op = "adamw_step",
          .variant = cat("[", n, "], [7, 5]", amsgrad ? " amsgrad" : ""),
          .inputs = inputs,
          .f =
              [amsgrad](const TensorList& t) {
                MultiTensorAdamW a{.params = copies(t, 0, 2),
                                   .grads = {t[2].detach(), t[3].detach()},
                                   .exp_avg = copies(t, 4, 2),
                                   .exp_avg_sq = copies(t, 6, 2),
                                   .max_exp_avg_sq = amsgrad ? copies(t, 8, 2) : TensorList{},
                                   .lr = {1e-2, 3e-3},
                                   .weight_decay = {0.01, 0.1},
                                   .step = {1, 5},
                                   .amsgrad = amsgrad};
                backend(t[0].device()).adamw_step(a);
                TensorList all = {a.params[0],  a.params[1],     a.exp_avg[0],
                                  a.exp_avg[1], a.exp_avg_sq[0], a.exp_avg_sq[1]};
                for (const Tensor& m : a.max_exp_avg_sq) all.push_back(m);
                return flat(all);
              },
          .reduction = {.roundings = 9},
          .dtypes = kFloat32And64};
}

OpCase random_case(Draw draw, Input like) {
  static const char* const names[] = {"uniform", "normal", "bernoulli"};
  std::string variant = describe({like});
  return {.op = names[int(draw)],
          .variant = std::move(variant),
          .inputs = {std::move(like)},
          .f =
              [draw](const TensorList& t) {
                Generator gen(9, kStreamInit, 5);
                const Tensor& like = t[0];
                if (draw == Draw::uniform)
                  return uniform(like.shape(), -2, 3, gen, like.dtype(), like.device());
                if (draw == Draw::normal)
                  return normal(like.shape(), 0.5, 2, gen, like.dtype(), like.device());
                return bernoulli(like.shape(), 0.3, gen, like.dtype(), like.device());
              },
          .reduction = kExact};
}

}  // namespace trainer::testing::op_table
