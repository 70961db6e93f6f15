// The builders of the op table's cases (tests/op_cases.cpp), one per op
// family: each takes the inputs and attributes of a case and knows how the
// op is called, which dtypes it runs in and the Reduction of its tolerance
// (tests/comparison.h's rule), stated next to each below. Inputs are uniform
// in [-1, 1] unless a range is given.
//
//   add(conv2d_case(image({2, 3, 7, 6}), {4, 3, 3, 3}, {.stride = {2, 2}}, /*bias=*/true));
#pragma once

#include <string>
#include <vector>

#include "core/conv_attrs.h"
#include "tests/op_cases.h"

namespace trainer::testing::op_table {

// ---- inputs ----

Input range(Input x, double lo, double hi);
Input away_from_zero(Input x);  // magnitudes of at least 0.1
Input strided(Input x);
Input transposed(Input x);
Input broadcast(Input x);  // dim 0 a stride-0 expansion of one row
Input image(Input x);      // channels-last [N, C, H, W]
// An index tensor of shape with values in [0, bound), repeating; with
// ignore_every, every such element (from the fourth) is -100 instead
// (cross-entropy's ignore_index).
Input indices(Shape shape, int64_t bound, DType dtype = DType::i64, int ignore_every = 0);

// ---- elementwise ----
// Elementwise ops sum nothing, but a broadcast operand's gradient sums over
// the dims it was broadcast along (up to the largest dim, cotangents up to
// 1.5). In bf16 and f16 the backward reads the rounded forward output (1 - y^2
// and the like magnify its rounding up to about twice near the saturation of
// tanh and sigmoid) and rounds its own result: 4 roundings.

struct UnaryRange {
  UnaryOp op;
  double lo, hi;
  bool kink_at_zero;  // abs, relu: inputs away from it
};
// Where each op is smooth: log, sqrt and rsqrt need x > 0.
inline constexpr UnaryRange kUnaryRanges[] = {
    {UnaryOp::neg, -2, 2, false},      {UnaryOp::exp, -2, 2, false},
    {UnaryOp::log, 0.2, 3, false},     {UnaryOp::sqrt, 0.2, 3, false},
    {UnaryOp::rsqrt, 0.2, 3, false},   {UnaryOp::abs, -2, 2, true},
    {UnaryOp::tanh, -2.5, 2.5, false}, {UnaryOp::sigmoid, -4, 4, false},
    {UnaryOp::relu, -2, 2, true},      {UnaryOp::gelu_tanh, -3, 3, false},
    {UnaryOp::gelu_erf, -3, 3, false}, {UnaryOp::silu, -4, 4, false},
};
inline constexpr BinaryOp kBinaryOps[] = {BinaryOp::add,    BinaryOp::sub, BinaryOp::mul,
                                          BinaryOp::div,    BinaryOp::pow, BinaryOp::maximum,
                                          BinaryOp::minimum};

OpCase unary_case(const UnaryRange& u, Input x);
// a op b; pow takes a positive base, div a divisor away from 0.
OpCase binary_case(BinaryOp op, Input a, Input b);
// x op s, or s op x: s / x takes the divisor, s ^ x a positive base s.
OpCase binary_scalar_case(BinaryOp op, bool scalar_first, Input x);
// Any other op whose output, of shape out, is elementwise.
OpCase pointwise(std::string op, std::vector<Input> inputs, OpFn f, const Shape& out,
                 std::string attrs = "");

// ---- reductions ----
// Reduce x over dims (empty: all; var unbiased, max over at most one dim).
// The longest sum is the reduced count, of terms up to 1 with random signs.
// bf16 and f16 round the f32 sum once, and var's gradient goes through two
// rounded intermediates: 3 roundings.
enum class Reduce { sum, mean, var, max };
OpCase reduce_case(Reduce reduce, Input x, std::vector<int> dims, bool keepdim = false);

// ---- products: matmul, bmm, linear, conv2d ----
// [M, K] x [K, N] and its gradients: the longest of K, M and N (and of any
// batch a broadcast operand's gradient sums over) is n, cotangents up to 1.5.
// The operands and the gradients round to bf16/f16: 2 roundings. f32
// products may run on TF32 tensor cores (OpCase::tf32).
OpCase gemm_case(std::string op, std::vector<Input> inputs, OpFn f, int64_t n,
                 std::string attrs = "");
OpCase matmul_case(Input a, Input b, int64_t n);
// x [N, C, H, W], w [O, C/g, kH, kW]: the weight gradient sums up to N H W
// terms, the forward C/g kH kW, the data gradient O kH kW.
OpCase conv2d_case(Input x, Shape w, Conv2dAttrs a, bool bias, bool relu = false);

// ---- softmax and losses ----
// A row of n (values in [-8, 8]): the backward sums n cotangents weighted by
// probabilities, terms that cancel of size ~2. bf16 and f16: each side rounds
// its result and the backward reads the rounded forward output.
OpCase softmax_case(bool log, Input x, int dim);
// logits [N, C] in [-6, 6] (losses up to ~12), every fifth target ignored:
// log-sum-exp over a row of C; the mean sums N losses.
OpCase cross_entropy_case(Input logits, double label_smoothing,
                          CrossEntropyOptions::Reduction reduction);

// ---- normalisation ----
// Over D (x in [-2, 2]): the mean, the variance and the backward's two dot
// products sum D terms, the weight and bias gradients the rows.
OpCase layer_norm_case(Input x);
// RMS norm over D (x in [-2, 2], weight in [0.5, 1.5]): the mean square and
// the backward's dot product sum D terms, the weight gradient the rows.
OpCase rms_norm_case(Input x);
// Training mode over x [N, C, H, W] (values in [-2.5, 3.5], the mean off 0):
// sums of N H W values per channel; gamma in [0.5, 1.5].
OpCase batch_norm_case(Input x, bool relu);

// ---- pooling ----
// Overlapping windows: a pixel's gradient sums the cotangents (up to 1.5) of
// up to kH kW windows; an average sums kH kW values.
OpCase pool_case(bool max, Input x, Pool2dAttrs a);
// The mean of a window of up to H W values.
OpCase adaptive_pool_case(Input x, int64_t out_h, int64_t out_w);

// ---- indexing: copies and gathers, bit for bit ----
// Their backward adds repeated indices' gradients in index order, as the
// reference does.
OpCase embedding_case(Shape table, Input ids);
OpCase index_select_case(Input x, int dim, Input index);
OpCase gather_case(Input x, int dim, Input index);
// concat({a, b, a}, dim): a piece twice, its gradient the sum of two slices.
OpCase concat_case(Input a, Input b, int dim);

// ---- fused layers ----
// Causal attention on the thirds of one projection qkv [B, T, 3D] (in
// [-2, 2], scores up to ~8), dropout mask from a fixed key: sums over T keys
// and D / NH head dims. fused_qkv: causal_attention_qkv, else
// causal_attention on the three views. kv_heads > 0: grouped-query attention
// on views of one [B, T, D + 2 KV HD] projection, k's and v's gradients
// summing over NH / KV heads too.
OpCase attention_case(int64_t B, int64_t T, int64_t D, int64_t NH, double dropout_p,
                      bool fused_qkv = false, int64_t kv_heads = 0);
// Two blocks of ring attention (core/ops_transformer.h, "attention
// blocks") over views of one [B, T, D + 2 KV HD] projection: q's rows
// [q0, q0 + Tq) against the key rows [0, split) and [split, q0 + Tq),
// merged, each block's backward with the merged out and lse. No autograd:
// the case returns out, lse and the gradients flattened into one tensor.
// q0 < split: q's first rows see nothing of the second block.
OpCase attention_block_case(int64_t B, int64_t T, int64_t D, int64_t NH, int64_t KV, int64_t q0,
                            int64_t Tq, int64_t split, double dropout_p);
// The rotary embedding of x [B, T, NH HD] (in [-2, 2]) at unsorted
// positions up to 9000 (llama3 scaling when llama3): elementwise, pairs
// turned by angles in f32.
OpCase rope_case(Input x, int64_t NH, bool llama3);
// An LSTM (or GRU) layer over x [B, T, I] with H units: the gate GEMMs sum I
// or H terms, the weight gradients B T rows, and the recurrence carries
// rounding through T steps (counted as roundings). Inputs strided; the
// output is y, h (and c) flattened into one.
OpCase recurrent_case(bool lstm, int64_t B, int64_t T, int64_t I, int64_t H);

// ---- fused multi-tensor optimizer updates (core/optim_math.h), f32 and f64 ----
// Two tensors, [n] and [7, 5], in one call with per-tensor lr, weight decay
// and step (one starts its state); the output is every updated tensor,
// flattened. The per-element chain rounds up to 9 times in f32.
OpCase sgd_case(int64_t n);
OpCase adamw_case(int64_t n, bool amsgrad);

// ---- random draws: counter-based, the same bits on every device ----
// like gives the draw its shape, dtype and device.
enum class Draw { uniform, normal, bernoulli };
OpCase random_case(Draw draw, Input like);

}  // namespace trainer::testing::op_table
