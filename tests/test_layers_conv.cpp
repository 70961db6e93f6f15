// Convolution, pooling and batch-norm ops: finite-difference gradients (f64,
// reference kernels), oneDNN against the reference on odd random shapes in
// channels-last layout, and a few closed forms.
#include "tests/testing.h"

#include <optional>
#include <random>

#include "core/backend.h"
#include "core/cpu/conv_direct_avx2.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "core/ops_conv.h"
#include "layers/linear.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// tests/testing.h's rule for a convolution of x [N, C, H, W] with w [O, C/g,
// kH, kW], operands in [-1, 1]: the longest sum is the weight gradient's (at
// most N H W pixels) or the forward's and data gradient's (C/g kH kW, O kH kW).
Reduction conv_reduction(const Tensor& x, const Tensor& w) {
  const int64_t n = std::max({x.size(0) * x.size(2) * x.size(3), w.size(1) * w.size(2) * w.size(3),
                              w.size(0) * w.size(2) * w.size(3)});
  return {.length = n, .scale = 1.5 * std::sqrt(double(n))};
}

// Batch norm over x [N, C, H, W]: sums of N H W values per channel (x of size ~3).
Reduction bn_reduction(const Shape& x) {
  const int64_t n = x[0] * x[2] * x[3];
  return {.length = n, .scale = 4 * std::sqrt(double(n))};
}

}  // namespace

namespace {

Tensor image_f64(const Shape& s, Generator& gen) { return rand_f64(s, gen); }

// f32 image in channels-last layout (what the layers pass), values in [-1, 1).
Tensor image_cl(const Shape& s, Generator& gen) {
  autograd::NoGradGuard no_grad;
  return to_channels_last(rand_tensor(s, gen));
}

}  // namespace

TEST_CASE("conv2d: layout helpers", "[layers][conv]") {
  Tensor x = empty_channels_last({2, 3, 4, 5});
  REQUIRE(x.strides() == Shape{60, 1, 15, 3});
  REQUIRE(is_channels_last(x));
  REQUIRE(!is_channels_last(zeros({2, 3, 4, 5})));
  REQUIRE(is_channels_last(zeros({2, 1, 4, 5})));  // one channel: both layouts agree
  Generator gen(1);
  Tensor a = rand_tensor({2, 3, 4, 5}, gen);
  Tensor b = to_channels_last(a);
  REQUIRE(is_channels_last(b));
  require_close(b, a, 0, 0, "to_channels_last keeps values");
  REQUIRE(is_channels_last(relu_channels_last(b)));
  REQUIRE(is_channels_last(add_channels_last(b, b)));
  require_close(add_channels_last(b, b), a * 2.0, 0, 0, "add_channels_last");
}

TEST_CASE("conv2d: closed form of a 1x1 convolution and of a 3x3 box filter", "[layers][conv]") {
  Generator gen(2);
  Tensor x = rand_tensor({2, 3, 4, 5}, gen);
  Tensor w = rand_tensor({4, 3, 1, 1}, gen);
  Tensor b = rand_tensor({4}, gen);
  // A 1x1 conv is a matmul over channels.
  Tensor expected =
      (matmul(x.permute({0, 2, 3, 1}), w.reshape({4, 3}).t()) + b).permute({0, 3, 1, 2});
  Tensor y = conv2d(x, w, b);
  REQUIRE(is_channels_last(y));
  require_close(y, expected, 1e-5, 1e-5, "1x1 conv");
  // All-ones 3x3 kernel with padding 1 on all-ones input: 9 inside, 6 on edges, 4 at corners.
  Tensor ones_x = ones({1, 1, 4, 4});
  Tensor box = conv2d(ones_x, ones({1, 1, 3, 3}), {}, {.padding = {1, 1}});
  std::vector<float> v = box.contiguous().to_vector<float>();
  REQUIRE(v == std::vector<float>{4, 6, 6, 4, 6, 9, 9, 6, 6, 9, 9, 6, 4, 6, 6, 4});
}

TEST_CASE("conv2d: gradients match finite differences", "[layers][conv]") {
  Generator gen(3);
  struct Case {
    Shape x, w;
    Conv2dAttrs a;
    bool bias, relu;
  };
  std::vector<Case> cases = {
      {{2, 3, 7, 6}, {4, 3, 3, 3}, {.stride = {2, 2}, .padding = {1, 1}}, true, false},
      {{1, 2, 8, 7}, {3, 2, 3, 2}, {.padding = {2, 1}, .dilation = {2, 2}}, false, false},
      {{2, 4, 5, 5}, {6, 2, 3, 3}, {.stride = {1, 2}, .padding = {1, 0}, .groups = 2}, true, false},
      {{1, 3, 5, 6}, {2, 3, 2, 3}, {.padding = {1, 1}}, true, true},
  };
  for (const Case& c : cases) {
    INFO("x " << shape_str(c.x) << " w " << shape_str(c.w) << " groups " << c.a.groups);
    TensorList in = {image_f64(c.x, gen), rand_f64(c.w, gen)};
    if (c.bias) in.push_back(rand_f64({c.w[0]}, gen));
    gradcheck(
        [&](const TensorList& t) {
          return conv2d(t[0], t[1], c.bias ? t[2] : Tensor(), c.a, c.relu);
        },
        in);
  }
}

TEST_CASE("conv2d: oneDNN matches the reference on odd shapes", "[layers][conv]") {
  Generator gen(4);
  std::mt19937 pick(4);
  auto r = [&](int lo, int hi) {
    return int64_t(std::uniform_int_distribution<int>(lo, hi)(pick));
  };
  for (int iter = 0; iter < 12; ++iter) {
    int64_t groups = iter % 3 == 2 ? r(2, 3) : 1;
    int64_t I = groups * r(1, 4), O = groups * r(1, 5), k = r(1, 3) * 2 - 1 + (iter % 4 == 3);
    Conv2dAttrs a{.stride = {r(1, 2), r(1, 2)},
                  .padding = {r(0, 2), r(0, 1)},
                  .dilation = {iter % 5 == 4 ? 2 : 1, 1},
                  .groups = groups};
    Shape xs = {r(1, 3), I, r(7, 13), r(6, 11)};
    bool bias = iter % 2 == 0, relu = iter % 4 == 1;
    INFO("iter " << iter << " x " << shape_str(xs) << " O " << O << " k " << k);
    TensorList in = {image_cl(xs, gen), rand_tensor({O, I / groups, k, k}, gen)};
    if (bias) in.push_back(rand_tensor({O}, gen));
    check_fast_vs_reference(
        [&](const TensorList& t) {
          Tensor y = conv2d(t[0], t[1], bias ? t[2] : Tensor(), a, relu);
          REQUIRE(is_channels_last(y));
          return y;
        },
        in, conv_reduction(in[0], in[1]));
  }
  // A row-major input and a non-contiguous one go through the same path.
  Tensor x = non_contiguous(rand_tensor({2, 5, 9, 7}, gen));
  Tensor w = rand_tensor({3, 5, 3, 3}, gen);
  check_fast_vs_reference([](const TensorList& t) { return conv2d(t[0], t[1], t[2]); },
                          {x, w, rand_tensor({3}, gen)}, conv_reduction(x, w));
}

TEST_CASE("conv2d: stride-1 and 1x1 fast backward paths match the reference", "[layers][conv]") {
  // Stride 1 without groups runs the data gradient as a forward convolution
  // of flipped weights (padding up to dilation * (k - 1)); 1x1 stride-1
  // unpadded convs without bias take the weight gradient from one sgemm.
  struct Case {
    int64_t k, pad, dilation;
    bool bias;
  };
  const Case cases[] = {{1, 0, 1, false}, {1, 0, 1, true},  {3, 1, 1, false}, {3, 0, 1, false},
                        {3, 2, 1, false}, {3, 2, 2, false}, {3, 3, 2, true},  {5, 2, 1, false},
                        {1, 1, 1, false}, {3, 3, 1, false}};
  Generator gen(9);
  int iter = 0;
  for (const Case& c : cases) {
    int64_t I = 3 + iter % 4, O = 2 + (iter * 3) % 5;
    Shape xs = {1 + iter % 2, I, 7 + iter % 3, 9 - iter % 2};
    Conv2dAttrs a{.padding = {c.pad, c.pad}, .dilation = {c.dilation, c.dilation}};
    INFO("k " << c.k << " pad " << c.pad << " dilation " << c.dilation << " bias " << c.bias);
    TensorList in = {image_cl(xs, gen), rand_tensor({O, I, c.k, c.k}, gen)};
    if (c.bias) in.push_back(rand_tensor({O}, gen));
    check_fast_vs_reference(
        [&](const TensorList& t) { return conv2d(t[0], t[1], c.bias ? t[2] : Tensor(), a); }, in,
        conv_reduction(in[0], in[1]));
    ++iter;
  }
  // ResNet-like channel counts, where oneDNN's forward kernel takes w' in
  // blocked layouts (Acdb32a, Acdb64a) rather than the small cases' ones.
  const int64_t channels[][2] = {{64, 64}, {32, 48}, {128, 96}, {48, 40}};
  for (const auto& [I, O] : channels) {
    INFO("I " << I << " O " << O);
    Conv2dAttrs a{.padding = {1, 1}};
    TensorList in = {image_cl({2, I, 5, 6}, gen), rand_tensor({O, I, 3, 3}, gen)};
    check_fast_vs_reference([&](const TensorList& t) { return conv2d(t[0], t[1], Tensor(), a); },
                            in, conv_reduction(in[0], in[1]));
  }
}

namespace {

// Runs the own AVX2 convolution (core/cpu/conv_direct_avx2.h) wherever it
// can, whatever this machine's automatic choice, for the guard's lifetime.
// Largest |a - b| of two f32 tensors of one shape.
double max_abs_diff(const Tensor& a, const Tensor& b) {
  Tensor ca = a.contiguous(), cb = b.contiguous();
  double m = 0;
  for (int64_t i = 0; i < ca.numel(); ++i)
    m = std::max(m, double(std::abs(ca.data<float>()[i] - cb.data<float>()[i])));
  return m;
}

struct DirectConvGuard {
  explicit DirectConvGuard(cpu::DirectConvUse use) : before(cpu::direct_conv_use()) {
    cpu::set_direct_conv_use(use);
  }
  ~DirectConvGuard() { cpu::set_direct_conv_use(before); }
  cpu::DirectConvUse before;
};

// A convolution against the reference kernels: forward, both gradients.
struct ConvCase {
  int64_t N, C, H, W, O, kh, kw, stride, pad, dilation;
  bool bias, relu;
};

void check_conv_cases(const std::vector<ConvCase>& cases, Generator& gen) {
  for (const ConvCase& c : cases) {
    Conv2dAttrs a{.stride = {c.stride, c.stride},
                  .padding = {c.kh == c.kw ? c.pad : 0, c.pad},
                  .dilation = {c.dilation, c.dilation}};
    INFO("N " << c.N << " C " << c.C << " " << c.H << "x" << c.W << " O " << c.O << " k " << c.kh
              << "x" << c.kw << " stride " << c.stride << " pad " << c.pad << " dilation "
              << c.dilation);
    TensorList in = {image_cl({c.N, c.C, c.H, c.W}, gen), rand_tensor({c.O, c.C, c.kh, c.kw}, gen)};
    if (c.bias) in.push_back(rand_tensor({c.O}, gen));
    check_fast_vs_reference(
        [&](const TensorList& t) {
          return conv2d(t[0], t[1], c.bias ? t[2] : Tensor(), a, c.relu);
        },
        in, conv_reduction(in[0], in[1]));
  }
}

}  // namespace

TEST_CASE("conv2d: the own AVX2 kernel matches the reference", "[layers][conv]") {
  // Forward (with bias, fused relu), weight gradient and, at stride 1, the
  // data gradient (the flipped weights packed straight from w). Batches
  // 1..13 give tiles of 1 to 6 pairs and pairs of several pixels and images;
  // O not a multiple of 16 gives a partial panel; padding beyond the kernel
  // gives skipped taps.
  const std::vector<ConvCase> cases = {
      {1, 16, 6, 7, 16, 3, 3, 1, 1, 1, false, false},
      {2, 5, 9, 8, 20, 3, 3, 1, 1, 1, true, false},
      {3, 17, 7, 7, 33, 3, 3, 2, 1, 1, false, true},
      {4, 8, 5, 9, 7, 1, 1, 1, 0, 1, true, false},
      {7, 24, 6, 5, 16, 5, 5, 1, 2, 1, false, false},
      {6, 3, 8, 8, 40, 3, 3, 1, 2, 2, true, true},
      {13, 16, 4, 4, 48, 3, 3, 1, 1, 1, false, false},
      {5, 9, 10, 7, 12, 1, 3, 1, 0, 1, true, false},
      {2, 32, 9, 9, 17, 3, 3, 3, 3, 1, false, false},
      {8, 12, 7, 6, 64, 2, 2, 1, 1, 1, true, false},
      // Weight-gradient tiles of 6 + 1 and 2 channels; from 256 channels the
      // weight gradient packs its input channels (260: tiles of 5 and 6).
      {3, 7, 6, 6, 10, 3, 3, 1, 1, 1, true, false},
      {2, 2, 5, 7, 16, 3, 3, 2, 0, 1, false, false},
      {2, 260, 5, 4, 20, 3, 3, 1, 1, 1, false, false},
  };
  DirectConvGuard always(cpu::DirectConvUse::always);
  Generator gen(21);
  check_conv_cases(cases, gen);
}

TEST_CASE("conv2d: the own AVX2 kernel's results do not depend on the batch", "[layers][conv]") {
  // Every output is one FMA chain in a fixed order, however the pairs are
  // tiled: each image of a batch of 11 equals that image alone, bit for bit,
  // forward and data gradient.
  DirectConvGuard always(cpu::DirectConvUse::always);
  Generator gen(22);
  Conv2dAttrs a{.padding = {1, 1}};
  Tensor x = image_cl({11, 24, 6, 5}, gen), w = rand_tensor({40, 24, 3, 3}, gen);
  Tensor b = rand_tensor({40}, gen), gy = image_cl({11, 40, 6, 5}, gen);
  autograd::NoGradGuard no_grad;
  Backend& cpu_backend = backend(Device{});
  Tensor y = empty_channels_last({11, 40, 6, 5}), gx = empty_channels_last({11, 24, 6, 5});
  cpu_backend.conv2d(x, w, b, a, false, y);
  cpu_backend.conv2d_backward_data(gy, w, a, gx);
  for (int64_t n = 0; n < 11; ++n) {
    INFO("image " << n);
    Tensor y1 = empty_channels_last({1, 40, 6, 5}), gx1 = empty_channels_last({1, 24, 6, 5});
    cpu_backend.conv2d(x.slice(0, n, n + 1), w, b, a, false, y1);
    cpu_backend.conv2d_backward_data(gy.slice(0, n, n + 1), w, a, gx1);
    CHECK(max_abs_diff(y.slice(0, n, n + 1), y1) == 0.0);
    CHECK(max_abs_diff(gx.slice(0, n, n + 1), gx1) == 0.0);
  }
}

TEST_CASE("conv2d: images of at most 4 pixels as one product match the reference",
          "[layers][conv]") {
  // Forward (bias, fused relu), data and weight gradient through the dense
  // matrix of core/cpu/conv_small_image.h: 2 x 2 with every pixel pair a
  // tap, 1 x 1 (the centre tap alone), 2 x 1, a stride and a dilation that
  // leave pairs without a tap, 5x5 kernels, padding beyond the kernel.
  const std::vector<ConvCase> cases = {
      {3, 16, 2, 2, 24, 3, 3, 1, 1, 1, true, false}, {5, 8, 1, 1, 12, 3, 3, 1, 1, 1, false, true},
      {2, 7, 2, 1, 9, 3, 3, 1, 1, 1, true, true},    {4, 12, 2, 2, 20, 3, 3, 2, 1, 1, false, false},
      {2, 6, 2, 2, 10, 3, 3, 1, 2, 2, true, false},  {1, 20, 2, 2, 17, 5, 5, 1, 2, 1, false, false},
      {3, 5, 2, 2, 33, 3, 3, 1, 3, 1, true, false},
  };
  Generator gen(25);
  check_conv_cases(cases, gen);
}

TEST_CASE("conv2d: the one-channel kernels match the reference", "[layers][conv]") {
  // Forward (bias, fused relu) and weight gradient of one-channel images
  // (core/cpu/conv_single_channel.h), in both ISA instances. O around the
  // 32-output blocks (1, 16, 33, 70) gives partial blocks; 5x5 has three
  // groups of tap sums; padding beyond the kernel and a stride that skips
  // the last column read the zero border; 30 rows of 10 pixels make two
  // bands of rows per image.
  struct Case {
    int64_t N, H, W, O, kh, kw, stride, pad, dilation;
    bool bias, relu;
  };
  const Case cases[] = {
      {3, 9, 8, 32, 3, 3, 1, 1, 1, true, false},   {2, 7, 7, 1, 3, 3, 1, 1, 1, false, true},
      {4, 6, 9, 16, 3, 3, 2, 1, 1, true, true},    {1, 11, 10, 33, 5, 5, 1, 2, 1, true, false},
      {5, 8, 8, 70, 3, 3, 1, 2, 2, false, false},  {2, 9, 6, 24, 1, 3, 1, 0, 1, true, false},
      {2, 30, 10, 48, 3, 3, 1, 1, 1, true, false}, {3, 10, 12, 20, 7, 7, 3, 3, 1, false, true},
  };
  // always: the forward's AVX2 instance too (automatic leaves AVX2 forwards to oneDNN).
  DirectConvGuard always(cpu::DirectConvUse::always);
  const cpu::Isa before = cpu::active_isa();
  Generator gen(23);
  for (cpu::Isa isa : {cpu::Isa::avx512, cpu::Isa::avx2}) {
    cpu::set_max_isa(isa);
    for (const Case& c : cases) {
      Conv2dAttrs a{.stride = {c.stride, c.stride},
                    .padding = {c.kh == c.kw ? c.pad : 0, c.pad},
                    .dilation = {c.dilation, c.dilation}};
      INFO(cpu::isa_name(isa) << ": N " << c.N << " " << c.H << "x" << c.W << " O " << c.O << " k "
                              << c.kh << "x" << c.kw << " stride " << c.stride << " pad " << c.pad
                              << " dilation " << c.dilation);
      TensorList in = {image_cl({c.N, 1, c.H, c.W}, gen), rand_tensor({c.O, 1, c.kh, c.kw}, gen)};
      if (c.bias) in.push_back(rand_tensor({c.O}, gen));
      check_fast_vs_reference(
          [&](const TensorList& t) {
            return conv2d(t[0], t[1], c.bias ? t[2] : Tensor(), a, c.relu);
          },
          in, conv_reduction(in[0], in[1]));
    }
  }
  cpu::set_max_isa(before);
}

TEST_CASE("conv2d: the one-channel weight gradient does not depend on the threads",
          "[layers][conv]") {
  // Each band of rows sums alone and the bands add in order: one thread and
  // two give the same bits; and the forward of each image alone equals its
  // part of the batch's.
  Generator gen(24);
  Conv2dAttrs a{.padding = {1, 1}};
  Tensor x = image_cl({6, 1, 40, 20}, gen), w = rand_tensor({32, 1, 3, 3}, gen);
  Tensor b = rand_tensor({32}, gen), gy = image_cl({6, 32, 40, 20}, gen);
  autograd::NoGradGuard no_grad;
  Backend& cpu_backend = backend(Device{});
  const int threads = num_threads();
  auto weight_grads = [&](int n_threads) {
    set_num_threads(n_threads);
    Tensor gw = empty({32, 1, 3, 3}), gb = empty({32});
    cpu_backend.conv2d_backward_weights(gy, x, a, gw, gb);
    return std::pair{gw, gb};
  };
  auto [gw1, gb1] = weight_grads(1);
  auto [gw2, gb2] = weight_grads(2);
  set_num_threads(threads);
  CHECK(max_abs_diff(gw1, gw2) == 0.0);
  CHECK(max_abs_diff(gb1, gb2) == 0.0);
  Tensor y = empty_channels_last({6, 32, 40, 20});
  cpu_backend.conv2d(x, w, b, a, false, y);
  for (int64_t n = 0; n < 6; ++n) {
    INFO("image " << n);
    Tensor y1 = empty_channels_last({1, 32, 40, 20});
    cpu_backend.conv2d(x.slice(0, n, n + 1), w, b, a, false, y1);
    CHECK(max_abs_diff(y.slice(0, n, n + 1), y1) == 0.0);
  }
}

TEST_CASE("conv2d: strided 1x1 sgemm backward paths match the reference", "[layers][conv]") {
  // Unpadded 1x1 convs read the pixels (oy * sy, ox * sx): the data gradient
  // scatters one sgemm's rows there (zeros elsewhere, including the rows and
  // columns floor mode never reads), the weight gradient gathers them.
  const Pair strides[] = {{2, 2}, {2, 1}, {3, 2}, {1, 3}, {2, 2}};
  Generator gen(12);
  int iter = 0;
  for (const Pair& stride : strides) {
    int64_t I = 3 + iter % 4, O = 2 + (iter * 3) % 5;
    Shape xs = {1 + iter % 3, I, 7 + iter % 3, 9 - iter % 2};
    bool bias = iter == 4;
    Conv2dAttrs a{.stride = stride};
    INFO("stride " << stride[0] << "x" << stride[1] << " x " << shape_str(xs) << " bias " << bias);
    TensorList in = {image_cl(xs, gen), rand_tensor({O, I, 1, 1}, gen)};
    if (bias) in.push_back(rand_tensor({O}, gen));
    check_fast_vs_reference(
        [&](const TensorList& t) { return conv2d(t[0], t[1], bias ? t[2] : Tensor(), a); }, in,
        conv_reduction(in[0], in[1]));
    ++iter;
  }
}

TEST_CASE("add of channels-last images stays channels-last", "[layers][conv]") {
  Generator gen(10);
  for (Shape xs : {Shape{2, 5, 3, 4}, Shape{1, 7, 5, 3}, Shape{3, 17, 2, 9}, Shape{2, 3, 1, 1}}) {
    INFO("x " << shape_str(xs));
    Tensor a = image_cl(xs, gen), b = image_cl(xs, gen);
    Tensor s = add(a, b);
    REQUIRE(is_channels_last(s));
    require_close(s, add(a.contiguous(), b.contiguous()), 0, 0, "sum");
    require_close(a * b, a.contiguous() * b.contiguous(), 0, 0, "product");
    check_fast_vs_reference([](const TensorList& t) { return relu_channels_last(t[0] + t[1]); },
                            {a, b});
    // A tensor read twice: autograd sums its two channels-last gradients.
    check_fast_vs_reference(
        [](const TensorList& t) {
          Tensor y = relu_channels_last(t[0] * t[1]);
          return add_channels_last(y, t[0] * 2.0);
        },
        {a, b});
  }
}

TEST_CASE("pooling: closed forms", "[layers][pool]") {
  Tensor x = arange(16, DType::f32).reshape({1, 1, 4, 4});
  REQUIRE(max_pool2d(x, {}).contiguous().to_vector<float>() == std::vector<float>{5, 7, 13, 15});
  REQUIRE(avg_pool2d(x, {}).contiguous().to_vector<float>() ==
          std::vector<float>{2.5, 4.5, 10.5, 12.5});
  // Padding 1, kernel 3, stride 2 on a 4x4 of ones: corners see 4 of 9 (include_pad) or 4 of 4.
  Pool2dAttrs a{.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
  Tensor o = ones({1, 1, 4, 4});
  REQUIRE(std::fabs(avg_pool2d(o, a).contiguous().to_vector<float>()[0] - 4.0f / 9.0f) < 1e-6f);
  a.count_include_pad = false;
  REQUIRE(avg_pool2d(o, a).contiguous().to_vector<float>()[0] == 1.0f);
  // Adaptive 5 -> 3: windows [0,2), [1,4), [3,5).
  Tensor row = arange(5, DType::f32).reshape({1, 1, 1, 5});
  std::vector<float> ad = adaptive_avg_pool2d(row, 1, 3).contiguous().to_vector<float>();
  REQUIRE(ad == std::vector<float>{0.5f, 2.0f, 3.5f});
  REQUIRE(adaptive_avg_pool2d(x, 1, 1).contiguous().to_vector<float>()[0] == 7.5f);
}

TEST_CASE("pooling: gradients match finite differences", "[layers][pool]") {
  Generator gen(5);
  Pool2dAttrs max_a{.kernel = {3, 2}, .stride = {2, 1}, .padding = {1, 1}};
  gradcheck([&](const TensorList& t) { return max_pool2d(t[0], max_a); },
            {image_f64({2, 3, 7, 6}, gen)});
  for (bool include : {true, false}) {
    Pool2dAttrs a{
        .kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}, .count_include_pad = include};
    gradcheck([&](const TensorList& t) { return avg_pool2d(t[0], a); },
              {image_f64({2, 2, 7, 8}, gen)});
  }
  gradcheck([](const TensorList& t) { return adaptive_avg_pool2d(t[0], 3, 2); },
            {image_f64({1, 2, 7, 5}, gen)});
  gradcheck([](const TensorList& t) { return adaptive_avg_pool2d(t[0], 1, 1); },
            {image_f64({2, 3, 4, 5}, gen)});
}

TEST_CASE("pooling: oneDNN matches the reference on odd shapes", "[layers][pool]") {
  Generator gen(6);
  std::mt19937 pick(6);
  auto r = [&](int lo, int hi) {
    return int64_t(std::uniform_int_distribution<int>(lo, hi)(pick));
  };
  for (int iter = 0; iter < 10; ++iter) {
    Pool2dAttrs a{.kernel = {r(1, 3), r(2, 3)}, .stride = {r(1, 3), r(1, 2)}};
    a.padding = {r(0, a.kernel[0] / 2), r(0, a.kernel[1] / 2)};
    a.count_include_pad = iter % 2 == 0;
    Shape xs = {r(1, 3), r(1, 9), r(5, 12), r(5, 11)};
    INFO("iter " << iter << " x " << shape_str(xs) << " kernel " << a.kernel[0] << "x"
                 << a.kernel[1] << " stride " << a.stride[0] << "x" << a.stride[1] << " pad "
                 << a.padding[0] << "x" << a.padding[1]);
    Tensor x = image_cl(xs, gen);
    check_fast_vs_reference([&](const TensorList& t) { return max_pool2d(t[0], a); }, {x});
    check_fast_vs_reference([&](const TensorList& t) { return avg_pool2d(t[0], a); }, {x},
                            {.length = a.kernel[0] * a.kernel[1], .scale = 3});
    check_fast_vs_reference([&](const TensorList& t) { return adaptive_avg_pool2d(t[0], 1, 1); },
                            {x}, {.length = xs[2] * xs[3], .scale = 12});
  }
}

TEST_CASE("max pooling: the own loops match the reference", "[layers][pool]") {
  // Ties (values from a small set: the first max of a window wins), NaN
  // (propagates; the gradient goes to the last NaN), channel counts with
  // vector tails, overlapping windows, and a window of 256 positions
  // (oneDNN's kernel, past the record's limit).
  Generator gen(8);
  struct Case {
    Shape x;
    Pool2dAttrs a;
  };
  const std::vector<Case> cases = {
      {{3, 17, 9, 8}, {}},
      {{2, 64, 11, 10}, {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}},
      {{2, 37, 7, 9}, {.kernel = {3, 2}, .stride = {1, 1}, .padding = {1, 0}}},
      {{1, 1, 6, 7}, {.kernel = {2, 3}, .stride = {2, 3}}},
      {{2, 5, 17, 16}, {.kernel = {16, 16}, .stride = {1, 1}}}};
  for (const Case& c : cases) {
    INFO("x " << shape_str(c.x) << " kernel " << c.a.kernel[0] << "x" << c.a.kernel[1]);
    std::vector<float> v = uniform(c.x, 0.0, 4.0, gen).to_vector<float>();
    for (float& e : v) e = std::floor(e);
    // oneDNN's kernel (the 256-position window) does not propagate NaN.
    const bool own = c.a.kernel[0] * c.a.kernel[1] <= 255;
    for (size_t i = 5; own && i < v.size(); i += 97) v[i] = std::numeric_limits<float>::quiet_NaN();
    const Tensor x = to_channels_last(from_vector<float>(v, c.x));
    const Tensor probe = uniform(max_pool2d(x, c.a).shape(), -1.0, 1.0, gen);
    auto run = [&](std::vector<float>& grad) {
      Tensor in = x.detach().requires_grad_();
      Tensor out = max_pool2d(in, c.a);
      out.backward(probe);
      grad = in.grad().contiguous().to_vector<float>();
      return out.contiguous().to_vector<float>();
    };
    std::vector<float> fast_grad, ref_grad, ref;
    const std::vector<float> fast = run(fast_grad);
    {
      ReferenceKernelsGuard guard;
      ref = run(ref_grad);
    }
    REQUIRE(fast.size() == ref.size());
    for (size_t i = 0; i < fast.size(); ++i) {
      INFO("output " << i);
      REQUIRE((std::isnan(fast[i]) ? std::isnan(ref[i]) : fast[i] == ref[i]));
    }
    // Overlapping windows add several outputs' gradients into one input:
    // in f32 here, in f64 rounded once by the reference.
    const bool overlap = c.a.stride[0] < c.a.kernel[0] || c.a.stride[1] < c.a.kernel[1];
    if (!overlap) REQUIRE(fast_grad == ref_grad);
    for (size_t i = 0; i < fast_grad.size(); ++i) {
      INFO("gradient " << i);
      REQUIRE(std::fabs(fast_grad[i] - ref_grad[i]) <= 1e-6f * (1.0f + std::fabs(ref_grad[i])));
    }
  }
}

TEST_CASE("batch_norm: training forward and gradients", "[layers][bn]") {
  Generator gen(7);
  Tensor x = image_f64({3, 4, 5, 3}, gen);
  Tensor gamma = rand_f64({4}, gen, 0.5, 1.5), beta = rand_f64({4}, gen);
  BatchNormResult r = batch_norm_train(x, gamma, beta, 1e-5);
  // Closed form: batch mean and biased variance over N, H, W.
  Tensor mean = sum(x, {0, 2, 3}) / 45.0;
  Tensor centered = x - mean.reshape({1, 4, 1, 1});
  Tensor var = sum(centered * centered, {0, 2, 3}) / 45.0;
  require_close(r.mean, mean, 1e-12, 1e-12, "mean");
  require_close(r.var, var, 1e-12, 1e-12, "var");
  Tensor expected =
      centered * rsqrt(var + 1e-5).reshape({1, 4, 1, 1}) * gamma.reshape({1, 4, 1, 1}) +
      beta.reshape({1, 4, 1, 1});
  require_close(r.out, expected, 1e-10, 1e-10, "out");
  REQUIRE(is_channels_last(r.out));
  gradcheck([](const TensorList& t) { return batch_norm_train(t[0], t[1], t[2], 1e-5).out; },
            {x, gamma, beta});
  gradcheck([](const TensorList& t) { return batch_norm_train(t[0], t[1], t[2], 1e-5, true).out; },
            {x, gamma, beta});
  require_close(batch_norm_train(x, gamma, beta, 1e-5, true).out, relu(expected), 1e-10, 1e-10,
                "fused relu");
  Tensor rm = rand_f64({4}, gen), rv = rand_f64({4}, gen, 0.5, 2.0);
  gradcheck([&](const TensorList& t) { return batch_norm_eval(t[0], t[1], t[2], rm, rv, 1e-5); },
            {x, gamma, beta});
}

TEST_CASE("batch_norm: oneDNN matches the reference on odd shapes", "[layers][bn]") {
  Generator gen(8);
  for (Shape xs : {Shape{3, 5, 7, 3}, Shape{1, 7, 9, 11}, Shape{5, 3, 1, 1}}) {
    INFO("x " << shape_str(xs));
    Tensor x = image_cl(xs, gen) * 3.0 + 0.5;
    Tensor gamma = rand_tensor({xs[1]}, gen, 0.5, 1.5), beta = rand_tensor({xs[1]}, gen);
    check_fast_vs_reference(
        [](const TensorList& t) { return batch_norm_train(t[0], t[1], t[2], 1e-5).out; },
        {x, gamma, beta}, bn_reduction(xs));
    check_fast_vs_reference(
        [](const TensorList& t) { return batch_norm_train(t[0], t[1], t[2], 1e-5, true).out; },
        {x, gamma, beta}, bn_reduction(xs));
    Tensor rm = rand_tensor({xs[1]}, gen), rv = rand_tensor({xs[1]}, gen, 0.5, 2.0);
    check_fast_vs_reference(
        [&](const TensorList& t) { return batch_norm_eval(t[0], t[1], t[2], rm, rv, 1e-5); },
        {x, gamma, beta}, bn_reduction(xs));
    BatchNormResult fast = batch_norm_train(x, gamma, beta, 1e-5);
    ReferenceKernelsGuard guard;
    BatchNormResult ref = batch_norm_train(x, gamma, beta, 1e-5);
    require_close(fast.mean, ref.mean, 1e-5, 1e-5, "mean");
    require_close(fast.var, ref.var, 1e-4, 1e-5, "var");
  }
}

TEST_CASE("batch_norm: fast statistics of a large image with a large mean", "[layers][bn]") {
  // Many pixels (several f32 blocks and threads' shares) with a mean 1000
  // times the spread: the one-pass statistics still match the f64 reference.
  Generator gen(13);
  Tensor x = image_cl({5, 19, 33, 31}, gen) * 0.1 + 100.0;
  Tensor gamma = rand_tensor({19}, gen, 0.5, 1.5), beta = rand_tensor({19}, gen);
  BatchNormResult fast = batch_norm_train(x, gamma, beta, 1e-5, true);
  ReferenceKernelsGuard guard;
  BatchNormResult ref = batch_norm_train(x, gamma, beta, 1e-5, true);
  require_close(fast.mean, ref.mean, 1e-6, 1e-6, "mean");
  require_close(fast.var, ref.var, 1e-4, 1e-7, "var");
  require_close(fast.out, ref.out, 1e-3, 1e-3, "out");
}

TEST_CASE("batch_norm: fused relu backward takes the record of either forward", "[layers][bn]") {
  Generator gen(11);
  Tensor x = image_cl({3, 6, 5, 7}, gen), g = image_cl({3, 6, 5, 7}, gen);
  Tensor gamma = rand_tensor({6}, gen, 0.5, 1.5), beta = rand_tensor({6}, gen);
  auto grads = [&](bool ref_forward, bool ref_backward) {
    Tensor xr = x.detach().requires_grad_(), gr = gamma.detach().requires_grad_();
    Tensor br = beta.detach().requires_grad_();
    Tensor out;
    {
      std::optional<ReferenceKernelsGuard> guard;
      if (ref_forward) guard.emplace();
      out = batch_norm_train(xr, gr, br, 1e-5, true).out;
    }
    {
      std::optional<ReferenceKernelsGuard> guard;
      if (ref_backward) guard.emplace();
      out.backward(g);
    }
    return TensorList{out, xr.grad(), gr.grad(), br.grad()};
  };
  TensorList ref = grads(true, true);
  // A record goes back to the backend that made it (the guard is per thread):
  // the fast backward also takes the reference forward's.
  for (bool ref_forward : {false, true}) {
    INFO("reference forward " << ref_forward);
    TensorList got = grads(ref_forward, false);
    const char* names[] = {"out", "grad_x", "grad_gamma", "grad_beta"};
    for (int k = 0; k < 4; ++k) require_close(got[k], ref[k], 1e-4, 1e-4, names[k]);
  }
}

TEST_CASE("conv2d_bn_eval: folded conv + bn + relu equals the unfused sequence", "[layers][bn]") {
  Generator gen(9);
  Tensor x = image_cl({2, 5, 9, 8}, gen);
  Tensor w = rand_tensor({6, 5, 3, 3}, gen), gamma = rand_tensor({6}, gen, 0.5, 1.5);
  Tensor beta = rand_tensor({6}, gen), rm = rand_tensor({6}, gen),
         rv = rand_tensor({6}, gen, 0.5, 2);
  Conv2dAttrs a{.stride = {2, 2}, .padding = {1, 1}};
  for (bool relu : {true, false}) {
    Tensor unfused = batch_norm_eval(conv2d(x, w, {}, a), gamma, beta, rm, rv, 1e-5);
    if (relu) unfused = relu_channels_last(unfused);
    Tensor fused = conv2d_bn_eval(x, w, {}, a, gamma, beta, rm, rv, 1e-5, relu);
    REQUIRE(is_channels_last(fused));
    require_close(fused, unfused, 1e-5, 1e-5, relu ? "with relu" : "without relu");
  }
  // Differentiable: gradients agree with the unfused graph (f64, reference kernels).
  Tensor x64 = image_f64({1, 2, 5, 5}, gen);
  Tensor w64 = rand_f64({3, 2, 3, 3}, gen), b64 = rand_f64({3}, gen);
  Tensor g64 = rand_f64({3}, gen, 0.5, 1.5), be64 = rand_f64({3}, gen);
  Tensor rm64 = rand_f64({3}, gen), rv64 = rand_f64({3}, gen, 0.5, 2.0);
  gradcheck(
      [&](const TensorList& t) {
        return conv2d_bn_eval(t[0], t[1], t[2], {.padding = {1, 1}}, t[3], t[4], rm64, rv64, 1e-5,
                              true);
      },
      {x64, w64, b64, g64, be64});
}

TEST_CASE("conv2d and linear write parameter gradients into their grad destinations",
          "[conv][autograd]") {
  Generator gen(11);
  Tensor x = rand_tensor({2, 3, 6, 6}, gen);
  Tensor w = rand_tensor({4, 3, 3, 3}, gen).requires_grad_();
  Tensor b = rand_tensor({4}, gen).requires_grad_();
  Tensor fw = rand_tensor({5, 4 * 4 * 4}, gen).requires_grad_();
  auto loss = [&] {
    Tensor h = relu(conv2d(x, w, b, {}));
    return sum(linear(h.reshape({2, -1}), fw, Tensor()) * 0.5);
  };
  loss().backward();
  const TensorList reference = {w.grad().clone(), b.grad().clone(), fw.grad().clone()};

  // One flat buffer, as a data-parallel bucket holds them (odd offsets).
  Tensor flat = full({1 + w.numel() + b.numel() + fw.numel()}, 99.0);
  const TensorList params = {w, b, fw};
  int64_t at = 1;
  TensorList views;
  for (const Tensor& p : params) {
    views.push_back(make_view(flat, p.shape(), contiguous_strides(p.shape()), at));
    at += p.numel();
    p.set_grad(Tensor());
    p.set_grad_destination(views.back());
  }
  loss().backward();
  for (size_t i = 0; i < params.size(); ++i) {
    REQUIRE(params[i].grad().data_ptr() == views[i].data_ptr());
    require_close(params[i].grad(), reference[i], 1e-6, 1e-6);
  }
  REQUIRE(flat.to_vector<float>()[0] == 99.0f);  // nothing written outside the views
}
