// Tensor metadata, views, copies, dtype conversion, the allocator and autograd mechanics.
#include <limits>

#include "core/cpu/cpu_backend.h"
#include "core/ops_conv.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;

TEST_CASE("tensor: factories, shape and strides", "[tensor]") {
  Tensor t = zeros({2, 3, 4});
  REQUIRE(t.dim() == 3);
  REQUIRE(t.numel() == 24);
  REQUIRE(t.strides() == Shape{12, 4, 1});
  REQUIRE(t.is_contiguous());
  REQUIRE(t.size(-1) == 4);
  Tensor s = scalar_tensor(2.5);
  REQUIRE(s.dim() == 0);
  REQUIRE(s.item<double>() == 2.5);
  Tensor a = arange(5);
  REQUIRE(a.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3, 4});
}

TEST_CASE("tensor: views share storage and index correctly", "[tensor]") {
  Tensor x = arange(24, DType::f32).reshape({2, 3, 4});
  Tensor t = x.transpose(0, 2);  // [4, 3, 2]
  REQUIRE(t.shape() == Shape{4, 3, 2});
  REQUIRE(!t.is_contiguous());
  REQUIRE(t.storage() == x.storage());
  // t[i][j][k] == x[k][j][i] == 12k + 4j + i
  std::vector<float> v = t.contiguous().to_vector<float>();
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 2; ++k) REQUIRE(v[i * 6 + j * 2 + k] == float(12 * k + 4 * j + i));

  Tensor sl = x.slice(2, 1, 4, 2);  // elements 1 and 3 of the last dim
  REQUIRE(sl.shape() == Shape{2, 3, 2});
  REQUIRE(sl.contiguous().to_vector<float>()[0] == 1.0f);
  REQUIRE(sl.contiguous().to_vector<float>()[1] == 3.0f);
  REQUIRE(x.select(1, 2).shape() == Shape{2, 4});
  REQUIRE(x.select(1, 2).contiguous().to_vector<float>()[0] == 8.0f);

  Tensor e = from_vector<float>({1, 2, 3}).reshape({3, 1}).expand({3, 4});
  REQUIRE(e.strides()[1] == 0);
  REQUIRE(e.contiguous().to_vector<float>()[5] == 2.0f);
  REQUIRE(x.unsqueeze(0).shape() == Shape{1, 2, 3, 4});
  REQUIRE(x.flatten(1).shape() == Shape{2, 12});
  REQUIRE(x.reshape({-1, 4}).shape() == Shape{6, 4});
  // A non-viewable reshape copies.
  Tensor r = t.reshape({24});
  REQUIRE(r.storage() != x.storage());
  REQUIRE(r.to_vector<float>()[1] == 12.0f);
}

TEST_CASE("tensor: copy_ broadcasts and converts dtypes", "[tensor]") {
  Tensor dst = zeros({2, 3});
  dst.copy_(from_vector<float>({1, 2, 3}));
  REQUIRE(dst.to_vector<float>() == std::vector<float>{1, 2, 3, 1, 2, 3});
  Tensor d = from_vector<double>({1.5, -2.25, 3e5});
  REQUIRE(d.to(DType::f32).to_vector<float>() == std::vector<float>{1.5f, -2.25f, 3e5f});
  REQUIRE(d.to(DType::i64).to_vector<int64_t>() == std::vector<int64_t>{1, -2, 300000});
  REQUIRE(d.to(DType::bf16).to_vector<float>() == std::vector<float>{1.5f, -2.25f, 299008.0f});
  REQUIRE(d.to(DType::f16).to_vector<float>()[1] == -2.25f);
  REQUIRE(std::isinf(d.to(DType::f16).to_vector<float>()[2]));  // above f16's 65504
  Tensor b = from_vector<float>({0.0f, 2.0f}).to(DType::boolean);
  REQUIRE(b.to_vector<int32_t>() == std::vector<int32_t>{0, 1});
}

TEST_CASE("tensor: bf16 and f16 round to nearest even", "[tensor]") {
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even (1).
  REQUIRE(to_float(to_bf16(1.0f + 1.0f / 256)) == 1.0f);
  REQUIRE(to_float(to_bf16(1.0f + 3.0f / 256)) == 1.0f + 4.0f / 256);
  REQUIRE(to_float(to_f16(65504.0f)) == 65504.0f);
  REQUIRE(to_float(to_f16(1.0f + 1.0f / 2048)) == 1.0f);          // halfway, ties to even
  REQUIRE(to_float(to_f16(5.96046448e-08f)) == 5.96046448e-08f);  // smallest subnormal
  REQUIRE(to_float(to_f16(-0.0f)) == 0.0f);
  for (float v : {0.1f, -3.75f, 1000.5f, 1e-3f})
    REQUIRE(std::fabs(to_float(to_f16(v)) - v) <= std::fabs(v) * 1e-3f);
}

TEST_CASE("tensor: dense conversions match element by element", "[tensor]") {
  // Contiguous and channels-last copies convert as one flat vectorised run;
  // each element must equal the scalar conversion (ties to even, NaN stays
  // NaN, infinities, subnormals), on sizes that leave vector tails.
  Generator gen(5);
  std::vector<float> special = {1.0f + 1.0f / 256,
                                1.0f + 3.0f / 256,
                                -0.0f,
                                1e-40f,
                                std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::quiet_NaN(),
                                3.4e38f,
                                -65520.0f};
  for (const Shape& shape : {Shape{3, 5, 7, 9}, Shape{2, 17, 1, 33}, Shape{1000, 37}}) {
    Tensor x = normal(shape, 0.0, 100.0, gen);
    std::vector<float> values = x.to_vector<float>();
    for (size_t i = 0; i < special.size(); ++i) values[i * 7 % values.size()] = special[i];
    x = from_vector<float>(values, shape);
    for (bool channels_last : {false, true}) {
      if (channels_last && shape.size() != 4) continue;
      Tensor src = channels_last ? empty_channels_last(shape, DType::f32) : empty(shape);
      src.copy_(x);
      for (DType to : {DType::bf16, DType::f16, DType::f64}) {
        Tensor low = channels_last ? empty_channels_last(shape, to) : empty(shape, to);
        low.copy_(src);
        Tensor back = channels_last ? empty_channels_last(shape, DType::f32) : empty(shape);
        back.copy_(low);
        const std::vector<float> got = back.to_vector<float>();
        for (size_t i = 0; i < values.size(); ++i) {
          const float v = values[i];
          const float want = to == DType::bf16  ? to_float(to_bf16(v))
                             : to == DType::f16 ? to_float(to_f16(v))
                                                : v;
          INFO("element " << i << " of " << shape_str(shape) << " value " << v);
          if (std::isnan(want))
            REQUIRE(std::isnan(got[i]));
          else
            REQUIRE(got[i] == want);
        }
      }
    }
  }
}

TEST_CASE("allocator: caches blocks, aligns them and tracks peak", "[tensor]") {
  Allocator& a = allocator(Device{});
  a.reset_peak();
  AllocatorStats before = a.stats();
  {
    Tensor t = empty({1000, 1000});
    REQUIRE(reinterpret_cast<uintptr_t>(t.data_ptr()) % kCpuAlignment == 0);
    REQUIRE(a.stats().current_bytes >= before.current_bytes + 4000000);
  }
  AllocatorStats mid = a.stats();
  REQUIRE(mid.current_bytes == before.current_bytes);
  REQUIRE(mid.peak_bytes >= before.current_bytes + 4000000);
  Tensor again = empty({1000, 1000});
  REQUIRE(a.stats().cache_hits > mid.cache_hits);
}

TEST_CASE("autograd: accumulation, retain_graph, hooks, detach, no_grad", "[autograd]") {
  Tensor x = from_vector<double>({1.0, 2.0, 3.0}).requires_grad_();
  Tensor y = sum(x * x);
  y.backward(Tensor(), /*retain_graph=*/true);
  REQUIRE(x.grad().to_vector<double>() == std::vector<double>{2, 4, 6});
  y.backward();  // accumulates
  REQUIRE(x.grad().to_vector<double>() == std::vector<double>{4, 8, 12});

  // A leaf used twice receives the sum, and its hook fires once per backward.
  Tensor w = from_vector<double>({3.0}).requires_grad_();
  int fired = 0;
  double seen = 0;
  w.register_hook([&](const Tensor& leaf) {
    ++fired;
    seen = leaf.grad().item<double>();
  });
  Tensor z = w * w + w * 2.0;  // dz/dw = 2w + 2 = 8
  z.backward(ones({1}, DType::f64));
  REQUIRE(fired == 1);
  REQUIRE(seen == 8.0);

  Tensor d = x.detach();
  REQUIRE(!d.requires_grad());
  REQUIRE(d.storage() == x.storage());
  {
    autograd::NoGradGuard guard;
    Tensor q = x * 2.0;
    REQUIRE(!q.requires_grad());
    REQUIRE(q.grad_fn() == nullptr);
  }
}

TEST_CASE("autograd: hooks fire in reverse order of use", "[autograd]") {
  Tensor a = from_vector<double>({1.0}).requires_grad_();
  Tensor b = from_vector<double>({2.0}).requires_grad_();
  std::vector<char> order;
  a.register_hook([&](const Tensor&) { order.push_back('a'); });
  b.register_hook([&](const Tensor&) { order.push_back('b'); });
  Tensor h = tanh(a * 3.0);  // layer 1 uses a
  Tensor out = h * b;        // layer 2 uses b
  sum(out).backward();
  REQUIRE(order == std::vector<char>{'b', 'a'});
}

TEST_CASE("autograd: backward(grad) on a non-scalar output", "[autograd]") {
  Tensor x = from_vector<double>({1.0, -2.0}).requires_grad_();
  Tensor y = x * 3.0;
  y.backward(from_vector<double>({1.0, 10.0}));
  REQUIRE(x.grad().to_vector<double>() == std::vector<double>{3.0, 30.0});
}

namespace {
// A custom op through the public API: y = x^3 with a hand-written backward.
struct CubeOp {
  struct Saved {
    Tensor x;
  };
  static constexpr const char* name = "cube";
  static Tensor forward(Saved& s, const Tensor& x) {
    s.x = x;
    return x * x * x;
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask&) {
    return {g[0] * s.x * s.x * 3.0};
  }
};
}  // namespace

TEST_CASE("autograd: custom op", "[autograd]") {
  Generator gen(3);
  gradcheck([](const TensorList& in) { return autograd::apply<CubeOp>(in[0]); },
            {rand_f64({5}, gen)});
  // The saved tensors are freed after backward.
  Tensor x = from_vector<double>({2.0}).requires_grad_();
  Tensor y = autograd::apply<CubeOp>(x);
  std::weak_ptr<TensorImpl> saved_x = x.impl_ptr();
  y.backward();
  REQUIRE(x.grad().item<double>() == 12.0);
}

TEST_CASE("autograd: views are differentiable", "[autograd]") {
  Generator gen(5);
  gradcheck([](const TensorList& in) { return in[0].transpose(0, 1).slice(0, 1, 3) * 2.0; },
            {rand_f64({3, 4}, gen)});
  gradcheck(
      [](const TensorList& in) {
        return in[0].unsqueeze(1).expand({3, 2, 4}) * in[1];
      },
      {rand_f64({3, 4}, gen), rand_f64({2, 4}, gen)});
  gradcheck(
      [](const TensorList& in) {
        return in[0].reshape({4, 3}).select(0, 2);
      },
      {rand_f64({3, 4}, gen)});
}

namespace {
// y = x * w (elementwise) whose backward asks for grad_buffer on both inputs
// and records which it got.
struct ProbeDestinationOp {
  struct Saved {
    Tensor x, w;
  };
  static constexpr const char* name = "probe_destination";
  static inline std::vector<const void*> handed;  // grad_buffer's result per input, last backward
  static Tensor forward(Saved& s, const Tensor& x, const Tensor& w) {
    s = Saved{x, w};
    return x * w;
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask&) {
    Tensor gx = autograd::grad_buffer(0, s.x.shape(), s.x.dtype(), s.x.device());
    Tensor gw = autograd::grad_buffer(1, s.w.shape(), s.w.dtype(), s.w.device());
    handed = {gx.data_ptr(), gw.data_ptr()};
    gx.copy_(g[0] * s.w);
    gw.copy_(g[0] * s.x);
    return {gx, gw};
  }
};
}  // namespace

TEST_CASE("autograd: grad destinations receive a leaf's gradient in place", "[autograd]") {
  Tensor x = from_vector<double>({1.0, 2.0, 3.0}).requires_grad_();
  Tensor w = from_vector<double>({4.0, 5.0, 6.0}).requires_grad_();
  Tensor dest = zeros({3}, DType::f64);
  w.set_grad_destination(dest);

  // The only producer of w's gradient is offered the destination; x has none.
  sum(autograd::apply<ProbeDestinationOp>(x, w)).backward();
  REQUIRE(ProbeDestinationOp::handed[1] == dest.data_ptr());
  REQUIRE(ProbeDestinationOp::handed[0] != dest.data_ptr());
  REQUIRE(w.grad().data_ptr() == dest.data_ptr());
  REQUIRE(dest.to_vector<double>() == std::vector<double>{1, 2, 3});
  REQUIRE(x.grad().to_vector<double>() == std::vector<double>{4, 5, 6});

  // A second pass accumulates there; nobody is offered the destination then.
  sum(autograd::apply<ProbeDestinationOp>(x, w)).backward();
  REQUIRE(ProbeDestinationOp::handed[1] != dest.data_ptr());
  REQUIRE(w.grad().data_ptr() == dest.data_ptr());
  REQUIRE(dest.to_vector<double>() == std::vector<double>{2, 4, 6});

  // Two producers: neither writes the destination; the sum is copied in.
  w.set_grad(Tensor());
  dest.fill_(-7.0);
  Tensor y = autograd::apply<ProbeDestinationOp>(x, w) + w * w;  // d/dw = x + 2w
  sum(y).backward();
  REQUIRE(ProbeDestinationOp::handed[1] != dest.data_ptr());
  REQUIRE(w.grad().data_ptr() == dest.data_ptr());
  REQUIRE(dest.to_vector<double>() == std::vector<double>{9, 12, 15});

  // An op that does not ask (here mul) has its gradient copied in.
  w.set_grad(Tensor());
  sum(w * 3.0).backward();
  REQUIRE(w.grad().data_ptr() == dest.data_ptr());
  REQUIRE(dest.to_vector<double>() == std::vector<double>{3, 3, 3});

  // Cleared: gradients are the engine's own again.
  w.set_grad_destination(Tensor());
  w.set_grad(Tensor());
  sum(autograd::apply<ProbeDestinationOp>(x, w)).backward();
  REQUIRE(w.grad().data_ptr() != dest.data_ptr());
  REQUIRE(w.grad().to_vector<double>() == std::vector<double>{1, 2, 3});

  // A destination of another shape or dtype, or strided, is a programming error.
  REQUIRE_THAT(check_failure_of([&] { w.set_grad_destination(zeros({4}, DType::f64)); }),
               Catch::Contains("set_grad_destination") && Catch::Contains("leaf's shape"));
  REQUIRE_THAT(check_failure_of([&] { w.set_grad_destination(zeros({3}, DType::f32)); }),
               Catch::Contains("dtype"));
  REQUIRE_THAT(check_failure_of([&] {
                 w.set_grad_destination(zeros({3, 2}, DType::f64).select(1, 0));
               }),
               Catch::Contains("contiguous"));
  REQUIRE_THAT(check_failure_of([&] { (x * 2.0).set_grad_destination(zeros({3}, DType::f64)); }),
               Catch::Contains("leaves"));
}
