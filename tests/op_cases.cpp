// The op table (tests/op_cases.h): every case every backend runs against the
// reference kernels, one line per case, grouped by op family (the families'
// inputs, dtypes and tolerances: tests/op_families.h). Shapes are small and
// odd (vector tails, ragged tiles) with sums of tens to thousands of terms;
// a last group is large enough for the fast kernels' threaded and blocked
// paths. The whole table runs in a few seconds on two cores.
#include "tests/op_cases.h"

#include "layers/linear.h"
#include "tests/op_families.h"

namespace trainer::testing {
namespace {

std::vector<OpCase> build_table() {
  using namespace op_table;
  using R = CrossEntropyOptions::Reduction;
  std::vector<OpCase> cases;
  auto add = [&](OpCase c) { cases.push_back(std::move(c)); };

  // ---- elementwise: unary, on plain, strided, transposed and stride-0 inputs ----
  for (const UnaryRange& u : kUnaryRanges) {
    add(unary_case(u, {7, 33}));
    add(unary_case(u, strided({5, 17})));
    add(unary_case(u, transposed({9, 13})));
    add(unary_case(u, broadcast({5, 33})));
  }

  // ---- elementwise: binary, with broadcasting ----
  for (BinaryOp op : kBinaryOps) {
    add(binary_case(op, {7, 33}, {7, 33}));
    add(binary_case(op, {7, 33}, {1, 33}));   // b's gradient sums 7 rows
    add(binary_case(op, {7, 1}, {1, 33}));    // both broadcast
    add(binary_case(op, {3, 1, 9}, {5, 9}));  // a missing dim
    add(binary_case(op, {}, {7, 33}));        // a 0-d tensor
    add(binary_case(op, strided({7, 33}), transposed({7, 33})));
    add(binary_case(op, {5, 9}, broadcast({5, 9})));  // stride 0
    add(binary_scalar_case(op, false, {7, 33}));
    add(binary_scalar_case(op, true, strided({7, 33})));
  }

  // ---- elementwise: selection and dropout ----
  auto where_ab = [](const TensorList& t) { return where(gt(t[2], t[1]), t[0], t[1]); };
  add(pointwise("where", {{7, 33}, {7, 33}, {7, 33}}, where_ab, {7, 33}));
  add(pointwise("where", {strided({7, 33}), {1, 33}, {7, 1}}, where_ab, {7, 33}));
  auto clamp_x = [](const TensorList& t) { return clamp(t[0], -0.5, 0.75); };
  add(pointwise("clamp", {range({7, 33}, -2, 2)}, clamp_x, {7, 33}, "to [-0.5, 0.75]"));
  add(pointwise("clamp", {range(strided({7, 33}), -2, 2)}, clamp_x, {7, 33}, "to [-0.5, 0.75]"));
  auto fill_where_less = [](const TensorList& t) { return masked_fill(t[0], gt(t[1], t[0]), 2.0); };
  add(pointwise("masked_fill", {{7, 33}, {1, 33}}, fill_where_less, {7, 33}, "with 2"));
  auto dropout_x = [](const TensorList& t) {
    Generator gen(5, kStreamDropout);
    return dropout(t[0], 0.3, /*training=*/true, gen);
  };
  add(pointwise("dropout", {{7, 33}}, dropout_x, {7, 33}, "p 0.3, fixed key"));
  add(pointwise("dropout", {strided({7, 33})}, dropout_x, {7, 33}, "p 0.3, fixed key"));

  // ---- reductions: sum, mean, var, max over axes ----
  add(reduce_case(Reduce::sum, {129, 67}, {0}));
  add(reduce_case(Reduce::sum, strided({129, 67}), {1}, /*keepdim=*/true));
  add(reduce_case(Reduce::sum, transposed({7, 33, 9}), {0, 2}));
  add(reduce_case(Reduce::sum, {61, 67}, {}));
  add(reduce_case(Reduce::mean, {129, 67}, {1}));
  add(reduce_case(Reduce::mean, transposed({33, 129}), {0}, /*keepdim=*/true));
  add(reduce_case(Reduce::mean, broadcast({65, 33}), {}));
  add(reduce_case(Reduce::var, {129, 67}, {0}));
  add(reduce_case(Reduce::var, strided({61, 67}), {}));
  add(reduce_case(Reduce::max, {129, 67}, {-1}));
  add(reduce_case(Reduce::max, transposed({33, 129}), {0}, /*keepdim=*/true));
  add(reduce_case(Reduce::max, {61, 67}, {}));

  // ---- matmul, bmm, linear (K, M, N and any batch a broadcast gradient sums) ----
  add(matmul_case({7, 33}, {33, 9}, 33));
  add(matmul_case(transposed({7, 33}), transposed({33, 9}), 33));
  add(matmul_case(strided({7, 33}), {33, 9}, 33));
  add(matmul_case({2, 1, 7, 33}, {5, 33, 9}, 45));  // a's gradient: 5 batches x 9 columns
  add(matmul_case({3, 7, 17}, {17}, 21));           // b's gradient: 3 x 7 rows
  add(matmul_case({33}, {33, 9}, 33));
  auto bmm = [](const TensorList& t) { return matmul(t[0], t[1]); };
  add(gemm_case("bmm", {{3, 7, 17}, {3, 17, 5}}, bmm, 17));
  add(gemm_case("bmm", {transposed({3, 7, 17}), strided({3, 17, 5})}, bmm, 17));
  auto linear_xwb = [](const TensorList& t) { return linear(t[0], t[1], t[2]); };
  auto linear_xw = [](const TensorList& t) { return linear(t[0], t[1], Tensor()); };
  add(gemm_case("linear", {{3, 7, 33}, {17, 33}, {17}}, linear_xwb, 33));
  add(gemm_case("linear", {strided({21, 33}), {17, 33}}, linear_xw, 33, "no bias"));

  // ---- softmax, log_softmax, cross-entropy ----
  for (bool log : {false, true}) {
    add(softmax_case(log, {7, 33}, 1));
    add(softmax_case(log, {129, 7}, 0));
    add(softmax_case(log, {3, 33, 5}, 1));
    add(softmax_case(log, strided({7, 33}), 1));
    add(softmax_case(log, transposed({7, 33}), 1));
    add(softmax_case(log, {2, 1000}, 1));
  }
  add(cross_entropy_case({37, 33}, 0.0, R::none));
  add(cross_entropy_case({37, 33}, 0.1, R::none));
  add(cross_entropy_case(transposed({37, 33}), 0.0, R::mean));
  add(cross_entropy_case({129, 7}, 0.1, R::mean));

  // ---- normalisation ----
  add(layer_norm_case({7, 33}));
  add(layer_norm_case({2, 3, 65}));
  add(layer_norm_case(strided({7, 33})));
  add(layer_norm_case({64, 129}));
  add(rms_norm_case({7, 33}));
  add(rms_norm_case(strided({2, 3, 65})));
  add(batch_norm_case(image({3, 5, 7, 3}), false));
  add(batch_norm_case(image({3, 5, 7, 3}), true));
  add(batch_norm_case(image({1, 7, 9, 11}), false));
  add(batch_norm_case({5, 3, 4, 4}, false));  // row-major NCHW

  // ---- convolution and pooling (channels-last images unless said) ----
  add(conv2d_case(image({2, 3, 7, 6}), {4, 3, 3, 3}, {.stride = {2, 2}, .padding = {1, 1}}, true));
  add(conv2d_case(image({1, 2, 8, 7}), {3, 2, 3, 2}, {.padding = {2, 1}, .dilation = {2, 2}},
                  false));
  add(conv2d_case(image({2, 4, 5, 5}), {6, 2, 3, 3},
                  {.stride = {1, 2}, .padding = {1, 0}, .groups = 2}, true));
  add(conv2d_case(image({1, 3, 5, 6}), {2, 3, 2, 3}, {.padding = {1, 1}}, true, /*relu=*/true));
  add(conv2d_case(image({2, 8, 5, 6}), {4, 8, 1, 1}, {}, false));  // 1x1: one GEMM
  add(conv2d_case(image({2, 16, 6, 5}), {8, 16, 3, 3}, {.padding = {1, 1}}, false));
  add(conv2d_case(strided({2, 5, 9, 7}), {3, 5, 3, 3}, {}, true));  // not channels-last
  add(pool_case(true, image({2, 3, 7, 6}),
                {.kernel = {3, 2}, .stride = {2, 1}, .padding = {1, 1}}));
  add(pool_case(true, image({2, 5, 8, 8}), {}));
  add(pool_case(false, image({2, 2, 7, 8}),
                {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}));
  add(pool_case(
      false, image({2, 2, 7, 8}),
      {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}, .count_include_pad = false}));
  add(adaptive_pool_case(image({2, 3, 4, 5}), 1, 1));
  add(adaptive_pool_case(image({1, 2, 7, 5}), 3, 2));

  // ---- embedding and index ops (repeated indices) ----
  add(embedding_case({37, 33}, indices({5, 7}, 37)));
  add(embedding_case({37, 65}, indices({9, 41}, 37, DType::i32)));
  add(index_select_case({7, 33}, 1, indices({9}, 33)));
  add(index_select_case(strided({13, 7}), 0, indices({9}, 13, DType::i32)));
  add(gather_case({37, 7}, 1, indices({37, 1}, 7)));
  add(gather_case(strided({5, 33}), 0, indices({4, 33}, 5, DType::i32)));
  add(concat_case({7, 5}, strided({7, 3}), 1));

  // ---- fused causal attention ----
  add(attention_case(2, 37, 15, 3, 0.0));
  add(attention_case(1, 70, 8, 2, 0.0));  // three query tiles, the last ragged
  add(attention_case(2, 5, 12, 3, 0.25));
  add(attention_case(2, 33, 12, 3, 0.2, /*fused_qkv=*/true));
  add(attention_case(2, 37, 24, 6, 0.0, false, /*kv_heads=*/2));  // grouped-query
  add(attention_case(1, 33, 16, 4, 0.25, false, /*kv_heads=*/1));
  add(attention_block_case(2, 45, 12, 3, 3, /*q0=*/20, /*Tq=*/25, /*split=*/30, 0.0));
  add(attention_block_case(1, 70, 16, 4, 2, /*q0=*/35, /*Tq=*/35, /*split=*/40, 0.25));

  // ---- rotary embedding ----
  add(rope_case({2, 7, 24}, 3, false));
  add(rope_case(strided({1, 5, 128}), 1, true));

  // ---- fused recurrent layers ----
  add(recurrent_case(true, 3, 7, 5, 9));
  add(recurrent_case(true, 5, 4, 17, 13));
  add(recurrent_case(false, 3, 7, 5, 9));

  // ---- fused multi-tensor optimizer updates ----
  add(sgd_case(33));
  add(adamw_case(33, false));
  add(adamw_case(33, true));

  // ---- random draws ----
  for (Draw draw : {Draw::uniform, Draw::normal, Draw::bernoulli}) {
    add(random_case(draw, {7, 33}));
    add(random_case(draw, strided({5, 9})));  // counters follow the logical order
  }

  // ---- large enough for the fast kernels' threaded and blocked paths ----
  // (elementwise loops split above core/cpu/loops.h's grain of 32768 elements)
  for (const UnaryRange& u : kUnaryRanges) add(unary_case(u, {131, 331}));
  for (BinaryOp op : kBinaryOps) add(binary_case(op, {131, 331}, {1, 331}));
  add(reduce_case(Reduce::sum, {3, 20011}, {1}));    // long rows split over threads
  add(reduce_case(Reduce::sum, {5001, 33}, {0}));    // columns split over threads
  add(reduce_case(Reduce::var, {3, 300, 61}, {1}));  // columns between kept dims
  add(matmul_case({33, 129}, transposed({129, 31}), 129));
  add(softmax_case(false, {64, 1031}, 1));
  add(softmax_case(true, {64, 1031}, 0));
  add(cross_entropy_case({300, 129}, 0.1, R::none));
  add(layer_norm_case({300, 129}));
  add(rms_norm_case({300, 129}));
  add(batch_norm_case(image({8, 16, 12, 12}), true));
  add(conv2d_case(image({2, 32, 8, 7}), {48, 32, 3, 3}, {.padding = {1, 1}}, true));
  add(conv2d_case(image({4, 24, 10, 9}), {32, 24, 1, 1}, {.stride = {2, 2}}, false));
  add(pool_case(true, image({4, 16, 14, 14}),
                {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}));
  add(adaptive_pool_case(image({4, 64, 7, 7}), 1, 1));
  add(embedding_case({37, 515}, indices({9, 41}, 37)));  // index_add split over columns
  add(gather_case({4001, 7}, 1, indices({4001, 1}, 7)));
  add(attention_case(1, 97, 32, 2, 0.1));
  add(rope_case({4, 65, 384}, 6, true));
  add(recurrent_case(true, 8, 5, 16, 40));
  add(sgd_case(70001));
  add(adamw_case(70001, true));
  add(random_case(Draw::normal, {100003}));
  return cases;
}

}  // namespace

const std::vector<OpCase>& op_cases() {
  static const std::vector<OpCase> cases = build_table();
  return cases;
}

}  // namespace trainer::testing
