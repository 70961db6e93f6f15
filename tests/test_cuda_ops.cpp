// The CUDA kernels beyond the elementwise ones: matmul (cuBLASLt / cuBLAS),
// reductions, softmax and cross-entropy, indexing, layer norm, RMS norm, the
// rotary embedding, convolution (cuDNN), batch norm and pooling. Each op runs
// forward and backward on CUDA copies of CPU inputs and must match the CPU
// result within the dtype's tolerance (tests/cuda_testing.h), on odd shapes
// and strided inputs. f32 matmul and convolution may use TF32 tensor cores
// (10-bit mantissa), so their f32 tolerance is that of a few TF32 roundings
// over the sum.
#include "core/cuda/host_rows.h"
#include "core/ops_conv.h"
#include "core/ops_transformer.h"
#include "tests/cuda_testing.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// Tolerance of ops whose f32 path runs on TF32 tensor cores.
Tolerance tf32_tolerance(DType t) { return t == DType::f32 ? Tolerance{1e-2, 1e-2} : tolerance(t); }

// Tolerance of sums over many elements: accumulation order differs.
Tolerance sum_tolerance(DType t) {
  Tolerance tol = tolerance(t);
  return t == DType::f32 ? Tolerance{1e-4, 1e-4} : tol;
}

Tensor index_tensor(const std::vector<int64_t>& v, DType t) { return from_vector(v).to(t); }

// Element offset of row-major index i of shape with strides.
int64_t offset_of(const Shape& shape, const Shape& strides, int64_t i) {
  int64_t off = 0;
  for (int d = int(shape.size()) - 1; d >= 0; --d) {
    off += (i % shape[size_t(d)]) * strides[size_t(d)];
    i /= shape[size_t(d)];
  }
  return off;
}

}  // namespace

// ---- host side (no GPU needed) ----

TEST_CASE("cuda row launches address every element of every row", "[cuda-host]") {
  // x [4, 5, 6, 3] as a permuted (non-contiguous) view; rows over any dims.
  Tensor base = arange(360, DType::f32).reshape({5, 3, 4, 6});
  Tensor x = base.permute({2, 0, 3, 1});
  const Shape& s = x.shape();
  for (uint64_t mask : {uint64_t(0b0010), uint64_t(0b1010), uint64_t(0b1111), uint64_t(0b0001),
                        uint64_t(0b0110), uint64_t(0)}) {
    INFO("mask " << mask);
    Shape kept = s, red = s;
    for (size_t d = 0; d < s.size(); ++d) ((mask >> d) & 1 ? kept : red)[d] = 1;
    Tensor out = empty(kept);
    cuda::Rows<2> r =
        cuda::rows_of<2>(s, mask, {cuda::strided_per_row(out, mask), cuda::strided(x)});
    REQUIRE(r.outer.numel == shape_numel(kept));
    REQUIRE(r.inner.numel == shape_numel(red));
    int mismatches = 0;
    for (int64_t row = 0; row < r.outer.numel; ++row) {
      int64_t o[2];
      cuda::element_offsets(r.outer, row, o);
      mismatches += o[0] != row;  // keepdim output: row-major slots
      for (int64_t e = 0; e < r.inner.numel; ++e) {
        int64_t i[2];
        cuda::element_offsets(r.inner, e, i);
        // The multi-index of (row, e): row over kept dims, e over reduced dims.
        int64_t rk = row, re = e, expected = 0;
        for (int d = int(s.size()) - 1; d >= 0; --d) {
          int64_t idx;
          if ((mask >> d) & 1) {
            idx = re % s[size_t(d)];
            re /= s[size_t(d)];
          } else {
            idx = rk % s[size_t(d)];
            rk /= s[size_t(d)];
          }
          expected += idx * x.stride(d);
        }
        mismatches += o[1] + i[1] != expected;
      }
    }
    REQUIRE(mismatches == 0);
  }
  // A plain launch over a broadcast operand merges what it can and stays exact.
  Tensor a = empty({3, 4, 5}), b = empty({4, 1}).expand({3, 4, 5});
  cuda::Launch<2> g = cuda::plan_launch<2>(a.shape(), {cuda::strided(a), cuda::strided(b)});
  for (int64_t i = 0; i < g.numel; ++i) {
    int64_t off[2];
    cuda::element_offsets(g, i, off);
    REQUIRE(off[0] == i);
    REQUIRE(off[1] == offset_of(b.shape(), b.strides(), i));
  }
}

// ---- matmul ----

TEST_CASE("cuda matmul matches the CPU: batched, broadcast, transposed, strided", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(21);
  auto mm = [](const TensorList& in) { return matmul(in[0], in[1]); };
  auto mm_at = [](const TensorList& in) { return matmul(in[0].transpose(-1, -2), in[1]); };
  auto mm_bt = [](const TensorList& in) { return matmul(in[0], in[1].transpose(-1, -2)); };
  for (DType t : kFloating) {
    Tolerance tol = tf32_tolerance(t);
    auto r = [&](const Shape& s) { return rand_tensor(s, gen, -1.0, 1.0, t); };
    for (bool strided : {false, true}) {
      std::string what = cat(t, strided ? " strided" : "");
      check_cuda_vs_cpu(mm, {r({7, 13}), r({13, 9})}, tol.rtol, tol.atol, strided, true,
                        "matmul 2-d " + what);
      check_cuda_vs_cpu(mm, {r({3, 5, 17}), r({3, 17, 6})}, tol.rtol, tol.atol, strided, true,
                        "matmul batched " + what);
      // b broadcast over the batch (a Linear layer): folded into one GEMM.
      check_cuda_vs_cpu(mm, {r({2, 3, 5, 4}), r({4, 6})}, tol.rtol, tol.atol, strided, true,
                        "matmul broadcast b " + what);
      // Broadcast in two batch dims: strided batch with stride 0, host loop.
      check_cuda_vs_cpu(mm, {r({5, 1, 4, 8}), r({3, 8, 2})}, tol.rtol, tol.atol, strided, true,
                        "matmul broadcast both " + what);
    }
    // Transposed views reach cuBLAS as op T.
    check_cuda_vs_cpu(mm_at, {r({13, 7}), r({13, 9})}, tol.rtol, tol.atol, false, true,
                      cat("matmul a^T ", t));
    check_cuda_vs_cpu(mm_bt, {r({2, 7, 13}), r({2, 9, 13})}, tol.rtol, tol.atol, false, true,
                      cat("matmul b^T ", t));
    // Vectors and single rows or columns.
    check_cuda_vs_cpu(mm, {r({1, 11}), r({11, 1})}, tol.rtol, tol.atol, false, true,
                      cat("matmul row by column ", t));
    check_cuda_vs_cpu(mm, {r({6, 1}), r({1, 5})}, tol.rtol, tol.atol, false, true,
                      cat("matmul outer product ", t));
    // K = 0: zeros.
    Tensor z = matmul(zeros({3, 0}, t, gpu()), zeros({0, 4}, t, gpu()));
    REQUIRE(z.to(kHost).to_vector<double>() == std::vector<double>(12, 0.0));
  }
}

// ---- reductions ----

TEST_CASE("cuda sum, mean, var and max match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(23);
  for (DType t : kFloating) {
    Tolerance tol = sum_tolerance(t);
    Tensor x = rand_tensor({6, 37, 5}, gen, -1.0, 1.0, t);
    for (bool strided : {false, true}) {
      std::string what = cat(t, strided ? " strided" : "");
      for (std::vector<int> dims : {std::vector<int>{1}, {0, 2}, {}, {2}, {0}}) {
        for (bool keep : {false, true}) {
          std::string w = cat(what, " dims ", dims.size(), keep ? " keepdim" : "");
          check_cuda_vs_cpu([&](const TensorList& in) { return sum(in[0], dims, keep); }, {x},
                            tol.rtol, tol.atol, strided, true, "sum " + w);
          check_cuda_vs_cpu([&](const TensorList& in) { return mean(in[0], dims, keep); }, {x},
                            tol.rtol, tol.atol, strided, true, "mean " + w);
        }
        for (int64_t correction : {0, 1})
          check_cuda_vs_cpu(
              [&](const TensorList& in) { return var(in[0], dims, correction, false); }, {x},
              tol.rtol, tol.atol, strided, true, cat("var ", what, " correction ", correction));
      }
      for (int dim : {0, 1, 2}) {
        check_cuda_vs_cpu([dim](const TensorList& in) { return max(in[0], dim, false); }, {x},
                          tol.rtol, tol.atol, strided, true, cat("max ", what, " dim ", dim));
        check_cuda_vs_cpu([dim](const TensorList& in) { return argmax(in[0], dim, true); }, {x}, 0,
                          0, strided, false, cat("argmax ", what, " dim ", dim));
      }
    }
    // Rows adjacent in memory (reducing the outer dim): the column kernel.
    Tensor tall = rand_tensor({300, 70}, gen, -1.0, 1.0, t);
    for (bool strided : {false, true}) {
      check_cuda_vs_cpu([](const TensorList& in) { return sum(in[0], {0}); }, {tall}, tol.rtol,
                        tol.atol, strided, true, cat("sum of columns ", t));
      check_cuda_vs_cpu([](const TensorList& in) { return var(in[0], {0}, 1, true); }, {tall},
                        tol.rtol, tol.atol, strided, true, cat("var of columns ", t));
    }
    // Few long rows: the two-stage (split) path, with a center for var.
    Tensor wide = rand_tensor({3, 40000}, gen, -1.0, 1.0, t);
    Tolerance big = t == DType::f32 ? Tolerance{1e-4, 2e-3} : tol;
    check_cuda_vs_cpu([](const TensorList& in) { return sum(in[0], {1}); }, {wide}, big.rtol,
                      big.atol, false, true, cat("sum of long rows ", t));
    check_cuda_vs_cpu([](const TensorList& in) { return mean(in[0]); }, {wide}, big.rtol, big.atol,
                      true, true, cat("mean of everything ", t));
    check_cuda_vs_cpu([](const TensorList& in) { return var(in[0], {1}, 1, false); }, {wide},
                      big.rtol, big.atol, false, true, cat("var of long rows ", t));
    check_cuda_vs_cpu([](const TensorList& in) { return max(in[0]); }, {wide}, 0, 0, false, false,
                      cat("max of everything ", t));
  }
  // Ties pick the first index, NaN wins; argmax takes integers too.
  Tensor ties = from_vector<double>({1, 3, 3, 0, 2, NAN, 5, NAN, 4, 4, 4, 4}, {3, 4});
  check_cuda_vs_cpu([](const TensorList& in) { return argmax(in[0], 1); }, {ties}, 0, 0, false,
                    false, "argmax ties and NaN");
  check_cuda_vs_cpu([](const TensorList& in) { return max(in[0], 1); }, {ties}, 0, 0, false, false,
                    "max ties and NaN");
  Tensor ints = from_vector<int64_t>({4, -2, 9, 9, 0, 7}, {2, 3});
  check_cuda_vs_cpu([](const TensorList& in) { return argmax(in[0], 1); }, {ints}, 0, 0, false,
                    false, "argmax i64");
  // var with correction >= count is NaN on both.
  check_cuda_vs_cpu([](const TensorList& in) { return var(in[0], {1}, 3, false); },
                    {rand_tensor({2, 3}, gen)}, 0, 0, false, false, "var without dof");
}

// ---- softmax and cross-entropy ----

TEST_CASE("cuda softmax, log_softmax and cross-entropy match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(29);
  for (DType t : kFloating) {
    Tolerance tol = tolerance(t);
    for (bool strided : {false, true}) {
      std::string what = cat(t, strided ? " strided" : "");
      Tensor x = rand_tensor({4, 7, 3}, gen, -4.0, 4.0, t);
      for (int dim : {0, 1, 2}) {
        check_cuda_vs_cpu([dim](const TensorList& in) { return softmax(in[0], dim); }, {x},
                          tol.rtol, tol.atol, strided, true, cat("softmax ", what, " dim ", dim));
        check_cuda_vs_cpu([dim](const TensorList& in) { return log_softmax(in[0], dim); }, {x},
                          tol.rtol, tol.atol, strided, true,
                          cat("log_softmax ", what, " dim ", dim));
      }
      // Rows longer than a block.
      Tensor wide = rand_tensor({5, 700}, gen, -8.0, 8.0, t);
      check_cuda_vs_cpu([](const TensorList& in) { return log_softmax(in[0], 1); }, {wide},
                        tol.rtol, tol.atol, strided, true, "log_softmax wide " + what);
    }
    Tensor logits = rand_tensor({6, 11}, gen, -3.0, 3.0, t);
    Tensor target = from_vector<int64_t>({3, 0, -100, 10, 7, 3});
    using Reduction = CrossEntropyOptions::Reduction;
    for (double eps : {0.0, 0.1}) {
      for (Reduction red : {Reduction::mean, Reduction::none}) {
        CrossEntropyOptions o;
        o.label_smoothing = eps;
        o.reduction = red;
        for (bool strided : {false, true})
          check_cuda_vs_cpu(
              [o](const TensorList& in) { return cross_entropy(in[0], in[1], o); },
              {logits, target}, tol.rtol, tol.atol, strided, true,
              cat("cross_entropy ", t, " eps ", eps, red == Reduction::none ? " none" : " mean",
                  strided ? " strided" : ""));
      }
    }
  }
}

// ---- indexing ----

TEST_CASE("cuda index_select, gather, their gradients and concat match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(31);
  for (DType t : kFloating) {
    Tolerance tol = tolerance(t);
    Tensor x = rand_tensor({5, 6, 4}, gen, -1.0, 1.0, t);
    for (DType it : {DType::i64, DType::i32}) {
      // Repeated indices: the backward adds them up (atomics).
      Tensor idx = index_tensor({4, 0, 4, 2, 4}, it);
      for (int dim : {0, 1, 2}) {
        Tensor in_range = index_tensor({1, 0, 3, 3, 1}, it);
        const Tensor& i = dim == 2 ? in_range : idx;
        check_cuda_vs_cpu([dim](const TensorList& in) { return index_select(in[0], dim, in[1]); },
                          {x, i}, tol.rtol, tol.atol, true, true,
                          cat("index_select ", t, " ", it, " dim ", dim));
      }
      Tensor gidx =
          index_tensor({0, 5, 5, 1, 2, 2, 3, 0, 5, 4, 4, 4, 1, 1, 0}, it).reshape({5, 3, 1});
      check_cuda_vs_cpu([](const TensorList& in) { return gather(in[0], 1, in[1]); }, {x, gidx},
                        tol.rtol, tol.atol, false, true, cat("gather ", t, " ", it));
    }
    Tensor table = rand_tensor({9, 5}, gen, -1.0, 1.0, t);
    check_cuda_vs_cpu([](const TensorList& in) { return embedding(in[0], in[1]); },
                      {table, from_vector<int64_t>({3, 8, 3, 0, 3, 1}, {2, 3})}, tol.rtol, tol.atol,
                      false, true, cat("embedding ", t));
    Tensor a = rand_tensor({3, 2, 4}, gen, -1, 1, t), b = rand_tensor({3, 5, 4}, gen, -1, 1, t);
    Tensor c = rand_tensor({3, 1, 4}, gen, -1, 1, t);
    check_cuda_vs_cpu([](const TensorList& in) { return concat(in, 1); }, {a, b, c}, 0, 0, true,
                      true, cat("concat ", t));
  }
  Tensor ints = from_vector<int64_t>({1, 2, 3, 4, 5, 6}, {3, 2});
  check_cuda_vs_cpu(
      [](const TensorList& in) {
        return index_select(in[0], 0, from_vector<int64_t>({2, 2, 0}).to(in[0].device()));
      },
      {ints}, 0, 0, false, false, "index_select i64 values");
}

// ---- layer norm ----

TEST_CASE("cuda layer norm and its gradients match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(37);
  for (DType t : kFloating) {
    Tolerance tol = sum_tolerance(t);
    auto f = [](const TensorList& in) { return layer_norm(in[0], in[1], in[2], 1e-5); };
    for (const Shape& s : {Shape{9, 70}, Shape{3, 4, 33}, Shape{300, 20}}) {
      Tensor x = rand_tensor(s, gen, -2.0, 2.0, t);
      Tensor w = rand_tensor({s.back()}, gen, 0.5, 1.5, t);
      Tensor b = rand_tensor({s.back()}, gen, -0.5, 0.5, t);
      check_cuda_vs_cpu(f, {x, w, b}, tol.rtol, tol.atol, true, true,
                        cat("layer_norm ", t, " ", shape_str(s)));
    }
  }
}

TEST_CASE("cuda RMS norm and its gradients match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(38);
  for (DType t : kFloating) {
    Tolerance tol = sum_tolerance(t);
    auto f = [](const TensorList& in) { return rms_norm(in[0], in[1], 1e-6); };
    for (const Shape& s : {Shape{9, 70}, Shape{3, 4, 33}, Shape{300, 20}, Shape{2, 4099}}) {
      Tensor x = rand_tensor(s, gen, -2.0, 2.0, t);
      Tensor w = rand_tensor({s.back()}, gen, 0.5, 1.5, t);
      check_cuda_vs_cpu(f, {x, w}, tol.rtol, tol.atol, true, true,
                        cat("rms_norm ", t, " ", shape_str(s)));
    }
  }
}

// ---- rotary embedding ----

TEST_CASE("cuda rotary embedding and its gradient match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(39);
  // Positions unsorted and not from 0; x a view of a fused [B, T, 3W] projection.
  const RopeOptions llama3{.theta = 500000.0, .scaling = "llama3", .factor = 8.0};
  struct Case {
    int64_t B, T, NH, HD;
  };
  for (DType t : kFloating)
    for (const Case& c : {Case{2, 5, 3, 2}, Case{1, 9, 2, 64}, Case{2, 7, 2, 128}})
      for (const RopeOptions& o : {RopeOptions{}, llama3}) {
        std::vector<int64_t> p;
        for (int64_t i = 0; i < c.T; ++i) p.push_back((i * 7919 + 13) % 9001);
        const Tensor pos = from_vector(p);
        const int64_t W = c.NH * c.HD;
        auto f = [&](const TensorList& in) {
          return rotary_embedding(in[0].narrow(2, W, W), c.NH, pos.to(in[0].device()), o);
        };
        Tolerance tol = tolerance(t);
        check_cuda_vs_cpu(f, {rand_tensor({c.B, c.T, 3 * W}, gen, -2.0, 2.0, t)}, tol.rtol,
                          tol.atol, false, true,
                          cat("rotary_embedding ", t, " HD ", c.HD, " ", o.scaling));
      }
}

// ---- convolution, batch norm, pooling ----

TEST_CASE("cuda conv2d (cuDNN) and its gradients match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(41);
  struct Case {
    int64_t n, c, h, w, o, k;
    Conv2dAttrs attrs;
    bool bias, relu;
  };
  const Case cases[] = {
      {2, 3, 9, 8, 4, 3, {{1, 1}, {1, 1}, {1, 1}, 1}, true, false},
      {2, 3, 11, 10, 5, 3, {{2, 2}, {0, 1}, {2, 1}, 1}, false, true},
      {1, 4, 7, 7, 6, 3, {{1, 2}, {1, 1}, {1, 1}, 2}, true, true},
      {3, 8, 5, 6, 8, 1, {{1, 1}, {0, 0}, {1, 1}, 8}, true, false},  // depthwise 1x1
      {2, 16, 6, 5, 8, 1, {}, false, false},
  };
  for (DType t : kFloating) {
    Tolerance tol = tf32_tolerance(t);
    for (const Case& k : cases) {
      Tensor x = rand_tensor({k.n, k.c, k.h, k.w}, gen, -1.0, 1.0, t);
      Tensor w = rand_tensor({k.o, k.c / k.attrs.groups, k.k, k.k}, gen, -0.5, 0.5, t);
      TensorList in = {x, w};
      if (k.bias) in.push_back(rand_tensor({k.o}, gen, -0.5, 0.5, t));
      auto f = [k](const TensorList& v) {
        return conv2d(v[0], v[1], v.size() > 2 ? v[2] : Tensor(), k.attrs, k.relu);
      };
      std::string what = cat("conv2d ", t, " c", k.c, " o", k.o, " k", k.k, " groups ",
                             k.attrs.groups, k.bias ? " bias" : "", k.relu ? " relu" : "");
      check_cuda_vs_cpu(f, in, tol.rtol, tol.atol, false, true, what);
      // Channels-last input, as the layers pass it.
      check_cuda_vs_cpu(
          [f](const TensorList& v) {
            TensorList u = v;
            u[0] = to_channels_last(v[0]);
            return f(u);
          },
          in, tol.rtol, tol.atol, false, true, what + " channels-last");
    }
  }
}

TEST_CASE("cuda batch norm (train and eval) and its gradients match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(43);
  for (DType t : kFloating) {
    Tolerance tol = sum_tolerance(t);
    Tensor x = rand_tensor({4, 5, 7, 3}, gen, -2.0, 2.0, t);
    Tensor gamma = rand_tensor({5}, gen, 0.5, 1.5, t), beta = rand_tensor({5}, gen, -0.5, 0.5, t);
    for (bool relu : {false, true}) {
      for (int stat = 0; stat < 3; ++stat) {
        check_cuda_vs_cpu(
            [relu, stat](const TensorList& in) {
              BatchNormResult r = batch_norm_train(in[0], in[1], in[2], 1e-5, relu);
              return stat == 0 ? r.out : stat == 1 ? r.mean : r.var;
            },
            {x, gamma, beta}, tol.rtol, tol.atol, true, stat == 0,
            cat("batch_norm_train ", t, relu ? " relu" : "", " output ", stat));
      }
    }
    // 40 channels: channels-last statistics take the column kernel.
    Tensor wide = rand_tensor({2, 40, 3, 5}, gen, -2.0, 2.0, t);
    check_cuda_vs_cpu(
        [](const TensorList& in) {
          return batch_norm_train(to_channels_last(in[0]), in[1], in[2], 1e-5, false).out;
        },
        {wide, rand_tensor({40}, gen, 0.5, 1.5, t), rand_tensor({40}, gen, -0.5, 0.5, t)}, tol.rtol,
        tol.atol, false, true, cat("batch_norm_train 40 channels ", t));
    Tensor rm = rand_tensor({5}, gen, -0.5, 0.5, t), rv = rand_tensor({5}, gen, 0.5, 2.0, t);
    check_cuda_vs_cpu(
        [](const TensorList& in) {
          return batch_norm_eval(in[0], in[1], in[2], in[3], in[4], 1e-5);
        },
        {x, gamma, beta, rm, rv}, tol.rtol, tol.atol, true, true, cat("batch_norm_eval ", t));
  }
}

TEST_CASE("cuda max, avg and adaptive avg pooling and their gradients match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(47);
  for (DType t : kFloating) {
    Tolerance tol = tolerance(t);
    Tensor x = rand_tensor({2, 3, 9, 8}, gen, -1.0, 1.0, t);
    Pool2dAttrs p3{{3, 3}, {2, 2}, {1, 1}, true};
    Pool2dAttrs p2{{2, 3}, {2, 1}, {0, 1}, false};
    for (bool strided : {false, true}) {
      std::string what = cat(t, strided ? " strided" : "");
      for (const Pool2dAttrs& a : {p3, p2}) {
        check_cuda_vs_cpu([a](const TensorList& in) { return max_pool2d(in[0], a); }, {x}, tol.rtol,
                          tol.atol, strided, true, "max_pool2d " + what);
        check_cuda_vs_cpu([a](const TensorList& in) { return avg_pool2d(in[0], a); }, {x}, tol.rtol,
                          tol.atol, strided, true,
                          cat("avg_pool2d ", what, a.count_include_pad ? " with pad" : ""));
      }
      for (auto [oh, ow] : {std::pair<int64_t, int64_t>{3, 2}, {1, 1}, {4, 5}})
        check_cuda_vs_cpu(
            [oh, ow](const TensorList& in) { return adaptive_avg_pool2d(in[0], oh, ow); }, {x},
            tol.rtol, tol.atol, strided, true, cat("adaptive_avg_pool2d ", what, " ", oh, "x", ow));
    }
  }
  // Ties inside a window route the gradient to the first maximum.
  Tensor flat = ones({1, 1, 4, 4});
  check_cuda_vs_cpu([](const TensorList& in) { return max_pool2d(in[0], Pool2dAttrs{}); }, {flat},
                    0, 0, false, true, "max_pool2d ties");
}
