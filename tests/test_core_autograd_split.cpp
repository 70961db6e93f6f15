// The split backward (run_backward_input, then DeferredWeightGrads::run) of
// zero-bubble pipeline schedules: bit-identical to run_backward on small
// networks, micro-batches accumulated as I1, I2, W1, W2; I defers the weight
// work (masks, memory); grad destinations and hooks in W; its CHECKs.
#include <cstring>
#include <functional>
#include <iomanip>
#include <memory>

#include "core/allocator.h"
#include "core/autograd.h"
#include "core/ops.h"
#include "layers/conv.h"
#include "layers/linear.h"
#include "layers/transformer.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;
using autograd::DeferredWeightGrads;
using autograd::SplitBackward;

namespace {

// Where actual and expected differ in a bit (shape, dtype, or the first
// element that differs, with both values); empty when they are the same.
std::string bit_mismatch(const Tensor& actual, const Tensor& expected) {
  if (!actual.defined() || !expected.defined())
    return actual.defined() == expected.defined() ? "" : "one of them is undefined";
  if (actual.shape() != expected.shape())
    return "shape " + actual.shape_str() + " vs " + expected.shape_str();
  if (actual.dtype() != expected.dtype()) return "dtypes differ";
  Tensor a = actual.contiguous(), e = expected.contiguous();
  const size_t size = dtype_size(a.dtype());
  const auto* pa = static_cast<const unsigned char*>(a.data_ptr());
  const auto* pe = static_cast<const unsigned char*>(e.data_ptr());
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (std::memcmp(pa + i * size, pe + i * size, size) == 0) continue;
    Tensor a64 = a.to(DType::f64), e64 = e.to(DType::f64);
    std::ostringstream out;
    out << std::setprecision(17) << "element " << i << ": " << a64.data<double>()[i]
        << " vs expected " << e64.data<double>()[i] << " (of " << a.numel() << ")";
    return out.str();
  }
  return "";
}

void require_same_bits(const Tensor& actual, const Tensor& expected, const std::string& what) {
  REQUIRE(expected.defined());
  const std::string why = bit_mismatch(actual, expected);
  if (!why.empty()) FAIL(what + ": " + why);
}

// A stage: its roots from its input, its parameters, and per micro-batch
// the input and the gradients sent back to the roots.
struct Stage {
  std::function<TensorList(const Tensor& x)> forward;
  TensorList params;
  TensorList micro_batches;
  std::vector<TensorList> root_grads;
};

struct Grads {
  TensorList params;  // each parameter's .grad() at the end
  TensorList inputs;  // each micro-batch input's gradient
};

void set_grads(const TensorList& params, const TensorList& initial) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i].set_grad(initial.empty() ? Tensor() : initial[i].clone());
}

TensorList grads_of(const TensorList& params) {
  TensorList out;
  for (const Tensor& p : params) out.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
  return out;
}

// F1 B1 F2 B2 ... with run_backward, starting from .grad() = initial.
Grads run_plain(const Stage& stage, const TensorList& initial) {
  set_grads(stage.params, initial);
  Grads out;
  for (size_t m = 0; m < stage.micro_batches.size(); ++m) {
    Tensor x = stage.micro_batches[m].clone().requires_grad_();
    autograd::run_backward(stage.forward(x), stage.root_grads[m], false);
    out.inputs.push_back(x.grad());
  }
  out.params = grads_of(stage.params);
  return out;
}

// F1 I1 F2 I2 ... then W1 W2 ..., starting from .grad() = initial; requires
// that no I touches a parameter's gradient.
Grads run_split(const Stage& stage, const TensorList& initial) {
  set_grads(stage.params, initial);
  Grads out;
  std::vector<DeferredWeightGrads> deferred;
  for (size_t m = 0; m < stage.micro_batches.size(); ++m) {
    Tensor x = stage.micro_batches[m].clone().requires_grad_();
    SplitBackward split = autograd::run_backward_input(stage.forward(x), stage.root_grads[m], {x});
    REQUIRE(split.input_grads.size() == 1);
    REQUIRE_FALSE(x.grad().defined());  // returned, not accumulated
    out.inputs.push_back(split.input_grads[0]);
    REQUIRE_FALSE(split.weight_grads.empty());
    deferred.push_back(std::move(split.weight_grads));
  }
  const TensorList after_i = grads_of(stage.params);
  for (size_t i = 0; i < stage.params.size(); ++i) {
    INFO("parameter " << i << " after the I passes");
    if (initial.empty())
      REQUIRE_FALSE(after_i[i].defined());
    else
      REQUIRE(bit_mismatch(after_i[i], initial[i]).empty());
  }
  for (DeferredWeightGrads& w : deferred) w.run();
  out.params = grads_of(stage.params);
  return out;
}

void require_split_matches_plain(const Stage& stage, const TensorList& initial) {
  const Grads plain = run_plain(stage, initial);
  const Grads split = run_split(stage, initial);
  for (size_t i = 0; i < stage.params.size(); ++i) {
    REQUIRE(plain.params[i].defined());
    require_same_bits(split.params[i], plain.params[i], cat("gradient of parameter ", i));
  }
  for (size_t m = 0; m < plain.inputs.size(); ++m)
    require_same_bits(split.inputs[m], plain.inputs[m], cat("gradient of input ", m));
}

// Each micro-batch count and starting gradient (none, then earlier
// micro-batches' gradients) the tests run a stage with.
void require_split_matches_plain_all(Stage stage, Generator& gen) {
  const TensorList all_batches = stage.micro_batches;
  const std::vector<TensorList> all_grads = stage.root_grads;
  TensorList initial;
  for (const Tensor& p : stage.params) initial.push_back(rand_tensor(p.shape(), gen));
  for (size_t count : {size_t(1), all_batches.size()}) {
    stage.micro_batches.assign(all_batches.begin(), all_batches.begin() + long(count));
    stage.root_grads.assign(all_grads.begin(), all_grads.begin() + long(count));
    INFO(count << " micro-batches, no gradient yet");
    require_split_matches_plain(stage, {});
    INFO(count << " micro-batches, accumulating onto a gradient");
    require_split_matches_plain(stage, initial);
  }
}

// Micro-batches of the given input shape and output gradients of the
// shapes the stage's roots have.
Stage make_stage(std::function<TensorList(const Tensor&)> forward, TensorList params,
                 const Shape& input_shape, Generator& gen, int micro_batches = 3) {
  Stage stage{std::move(forward), std::move(params), {}, {}};
  for (int m = 0; m < micro_batches; ++m) {
    stage.micro_batches.push_back(rand_tensor(input_shape, gen));
    TensorList roots;
    {
      autograd::NoGradGuard no_grad;
      roots = stage.forward(stage.micro_batches.back());
    }
    TensorList grads;
    for (const Tensor& r : roots) grads.push_back(rand_tensor(r.shape(), gen));
    stage.root_grads.push_back(grads);
  }
  return stage;
}

}  // namespace

TEST_CASE("split backward: the bit comparison sees one ulp", "[autograd-split]") {
  Tensor a = from_vector<float>({1.0f, 2.0f, 3.0f});
  Tensor b = a.clone();
  REQUIRE(bit_mismatch(a, b).empty());
  b.data<float>()[2] = std::nextafter(3.0f, 4.0f);
  REQUIRE(bit_mismatch(a, b).find("element 2") != std::string::npos);
}

TEST_CASE("split backward: Linear-GELU-Linear matches run_backward bit for bit",
          "[autograd-split]") {
  Generator gen(11);
  auto fc1 = std::make_shared<Linear>(8, 16, gen);
  auto fc2 = std::make_shared<Linear>(16, 4, gen);
  Stage stage =
      make_stage([=](const Tensor& x) { return TensorList{fc2->forward(gelu(fc1->forward(x)))}; },
                 {fc1->weight, fc1->bias, fc2->weight, fc2->bias}, {5, 8}, gen);
  require_split_matches_plain_all(stage, gen);
}

TEST_CASE("split backward: conv + batchnorm + relu matches run_backward bit for bit",
          "[autograd-split]") {
  Generator gen(12);
  Conv2dOptions options{.in_channels = 3, .out_channels = 4};
  options.attrs.padding = {1, 1};
  auto conv = std::make_shared<Conv2d>(options, gen);
  auto bn = std::make_shared<BatchNorm2d>(4);
  auto bn_fused = std::make_shared<BatchNorm2d>(4);
  auto conv2 = std::make_shared<Conv2d>(Conv2dOptions{.in_channels = 4, .out_channels = 4}, gen);
  // batch_norm's backward ignores its mask: W recomputes its input gradient.
  Stage stage = make_stage(
      [=](const Tensor& x) {
        Tensor h = relu_channels_last(bn->forward(conv->forward(x)));
        return TensorList{bn_fused->forward(conv2->forward(h), /*relu=*/true)};
      },
      {conv->weight, conv->bias, bn->weight, bn->bias, conv2->weight, conv2->bias, bn_fused->weight,
       bn_fused->bias},
      {2, 3, 6, 6}, gen);
  require_split_matches_plain_all(stage, gen);
}

TEST_CASE("split backward: a Transformer block matches run_backward bit for bit",
          "[autograd-split]") {
  Generator gen(13);
  TransformerOptions options{.d_model = 16, .num_heads = 2, .dropout = 0.0};
  auto block = std::make_shared<Block>(options, gen, 0);
  Stage stage = make_stage([=](const Tensor& x) { return TensorList{block->forward(x)}; },
                           block->parameters(), {2, 5, 16}, gen);
  REQUIRE(stage.params.size() >= 8);
  require_split_matches_plain_all(stage, gen);
}

TEST_CASE("split backward: skip connections and a tensor with two consumers", "[autograd-split]") {
  Generator gen(14);
  auto fc1 = std::make_shared<Linear>(8, 8, gen);
  auto fc2 = std::make_shared<Linear>(8, 8, gen);
  auto fc3 = std::make_shared<Linear>(8, 8, gen);
  // h feeds fc2 and fc3; x feeds fc1 and the residual add.
  Stage stage = make_stage(
      [=](const Tensor& x) {
        Tensor h = gelu(fc1->forward(x));
        return TensorList{fc2->forward(h) * fc3->forward(h) + x};
      },
      {fc1->weight, fc1->bias, fc2->weight, fc2->bias, fc3->weight, fc3->bias}, {4, 8}, gen);
  require_split_matches_plain_all(stage, gen);
}

TEST_CASE("split backward: parameters used several times, and a root without the input",
          "[autograd-split]") {
  Generator gen(15);
  Tensor w = rand_tensor({8, 8}, gen).requires_grad_();
  Tensor scale = rand_tensor({8}, gen).requires_grad_();
  // w reaches its accumulator through both linears (input-path nodes, run
  // again in W) and twice through w * w of the second root (off the input
  // path, W only); scale through a mul and an add: four and two
  // contributions whose order of summation shows in the bits.
  Stage stage = make_stage(
      [=](const Tensor& x) {
        Tensor h = linear(gelu(linear(x, w, Tensor())), w, Tensor());
        Tensor penalty = sum(w * w) * 0.01;
        return TensorList{h * scale + scale, penalty};
      },
      {w, scale}, {3, 8}, gen);
  require_split_matches_plain_all(stage, gen);
}

TEST_CASE("split backward: an intermediate tensor as the input", "[autograd-split]") {
  Generator gen(16);
  auto fc1 = std::make_shared<Linear>(6, 8, gen);
  auto fc2 = std::make_shared<Linear>(8, 3, gen);
  Tensor x = rand_tensor({4, 6}, gen);
  Tensor g = rand_tensor({4, 3}, gen);
  TensorList params{fc1->weight, fc1->bias, fc2->weight, fc2->bias};

  // Reference: h's gradient through a leaf copy of it, parameters' whole.
  Tensor h_leaf = fc1->forward(x).detach().requires_grad_();
  autograd::run_backward({fc2->forward(h_leaf)}, {g}, false);
  const Tensor expected_h = h_leaf.grad();
  set_grads(params, {});
  autograd::run_backward({fc2->forward(fc1->forward(x))}, {g}, false);
  const TensorList expected = grads_of(params);

  // h's node (fc1's linear) is an input target whose edges are all weight
  // edges: W runs it on the gradient that reached h in I.
  set_grads(params, {});
  Tensor h = fc1->forward(x);
  SplitBackward split = autograd::run_backward_input({fc2->forward(h)}, {g}, {h});
  require_same_bits(split.input_grads[0], expected_h, "gradient of h");
  REQUIRE_FALSE(fc1->weight.grad().defined());
  split.weight_grads.run();
  for (size_t i = 0; i < params.size(); ++i)
    require_same_bits(params[i].grad(), expected[i], cat("gradient of parameter ", i));
}

namespace {
// y = x * w (elementwise); backward computes only what its mask asks for,
// in grad_buffer's buffers, and records each mask it gets and each buffer.
struct RecordMaskOp {
  struct Saved {
    Tensor x, w;
  };
  static constexpr const char* name = "record_mask";
  static inline std::vector<std::vector<bool>> masks;
  static inline std::vector<const void*> buffers;
  static Tensor forward(Saved& s, const Tensor& x, const Tensor& w) {
    s = Saved{x, w};
    return x * w;
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask& needs) {
    masks.push_back({needs[0], needs[1]});
    auto grad = [&](size_t input, const Tensor& self, const Tensor& other) {
      Tensor buffer = autograd::grad_buffer(input, self.shape(), self.dtype(), self.device());
      buffer.copy_(g[0] * other);
      buffers.push_back(buffer.data_ptr());
      return buffer;
    };
    return {needs[0] ? grad(0, s.x, s.w) : Tensor(), needs[1] ? grad(1, s.w, s.x) : Tensor()};
  }
};

// y = x; its backward sends no gradient.
struct NoGradientOp {
  struct Saved {};
  static constexpr const char* name = "no_gradient";
  static Tensor forward(Saved&, const Tensor& x) { return x.clone(); }
  static TensorList backward(Saved&, const TensorList&, const autograd::GradMask&) {
    return {Tensor()};
  }
};
}  // namespace

TEST_CASE("split backward: I asks ops for input gradients only, W for the weights'",
          "[autograd-split]") {
  Tensor w = from_vector<double>({2.0, 3.0}).requires_grad_();
  auto forward = [&](const Tensor& x) { return sum(autograd::apply<RecordMaskOp>(x, w)); };

  RecordMaskOp::masks.clear();
  Tensor x0 = from_vector<double>({5.0, 7.0}).requires_grad_();
  forward(x0).backward();
  REQUIRE(RecordMaskOp::masks == std::vector<std::vector<bool>>{{true, true}});
  w.set_grad(Tensor());

  RecordMaskOp::masks.clear();
  Tensor x = from_vector<double>({5.0, 7.0}).requires_grad_();
  Tensor loss = forward(x);
  SplitBackward split = autograd::run_backward_input({loss}, {ones_like(loss)}, {x});
  REQUIRE(RecordMaskOp::masks == std::vector<std::vector<bool>>{{true, false}});
  REQUIRE(split.input_grads[0].to_vector<double>() == std::vector<double>{2.0, 3.0});
  REQUIRE_FALSE(w.grad().defined());
  REQUIRE_FALSE(x.grad().defined());

  split.weight_grads.run();
  REQUIRE(RecordMaskOp::masks == std::vector<std::vector<bool>>{{true, false}, {false, true}});
  REQUIRE(w.grad().to_vector<double>() == std::vector<double>{5.0, 7.0});
  REQUIRE_FALSE(x.grad().defined());
}

TEST_CASE("split backward: a Linear's weight gradient is made in W, not in I", "[autograd-split]") {
  // With a [512, 512] weight and one row of input, grad_W (1 MiB) dwarfs
  // everything else I allocates (grad_x: 2 KiB).
  Generator gen(17);
  Linear fc(512, 512, gen, /*with_bias=*/false);
  const int64_t weight_bytes = int64_t(fc.weight.nbytes());
  Allocator& cpu = allocator(Device{kCPU});
  Tensor x = rand_tensor({1, 512}, gen).requires_grad_();
  Tensor g = rand_tensor({1, 512}, gen);
  Tensor y = fc.forward(x);

  cpu.reset_peak();
  int64_t before = cpu.stats().current_bytes;
  SplitBackward split = autograd::run_backward_input({y}, {g}, {x});
  INFO("I allocated at most " << cpu.stats().peak_bytes - before << " bytes");
  REQUIRE(cpu.stats().peak_bytes - before < weight_bytes / 4);
  REQUIRE_FALSE(fc.weight.grad().defined());

  cpu.reset_peak();
  before = cpu.stats().current_bytes;
  split.weight_grads.run();
  REQUIRE(cpu.stats().peak_bytes - before >= weight_bytes);
  REQUIRE(fc.weight.grad().defined());
}

TEST_CASE("split backward: grad destinations and hooks work in W", "[autograd-split]") {
  Generator gen(18);
  auto fc1 = std::make_shared<Linear>(6, 8, gen);
  auto fc2 = std::make_shared<Linear>(8, 3, gen);
  const TensorList params{fc1->weight, fc1->bias, fc2->weight, fc2->bias};
  Tensor x = rand_tensor({4, 6}, gen);
  Tensor g = rand_tensor({4, 3}, gen);
  auto forward = [&](const Tensor& in) { return fc2->forward(gelu(fc1->forward(in))); };

  // As data parallelism sets them up: destinations are slices of one bucket,
  // hooks record the order they fire in and what grad() is by then.
  std::vector<int> fired;
  std::vector<const void*> grad_seen;
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].register_hook([&fired, &grad_seen, i](const Tensor& leaf) {
      fired.push_back(int(i));
      grad_seen.push_back(leaf.grad().defined() ? leaf.grad().data_ptr() : nullptr);
    });
  }
  auto point_at_bucket = [&](Tensor& bucket, TensorList& dests) {
    int64_t total = 0;
    for (const Tensor& p : params) total += p.numel();
    bucket = zeros({total});
    int64_t offset = 0;
    dests.clear();
    for (const Tensor& p : params) {
      dests.push_back(bucket.slice(0, offset, offset + p.numel()).reshape(p.shape()));
      p.set_grad_destination(dests.back());
      p.set_grad(Tensor());
      offset += p.numel();
    }
  };

  Tensor plain_bucket;
  TensorList plain_dests;
  point_at_bucket(plain_bucket, plain_dests);
  autograd::run_backward({forward(x)}, {g}, false);
  const std::vector<int> plain_order = fired;
  REQUIRE(plain_order.size() == params.size());
  fired.clear();
  grad_seen.clear();

  Tensor bucket;
  TensorList dests;
  point_at_bucket(bucket, dests);
  Tensor xi = x.clone().requires_grad_();
  SplitBackward split = autograd::run_backward_input({forward(xi)}, {g}, {xi});
  REQUIRE(fired.empty());
  require_same_bits(bucket, zeros(bucket.shape()), "the bucket after I");

  split.weight_grads.run();
  REQUIRE(fired == plain_order);
  for (size_t k = 0; k < fired.size(); ++k) {
    INFO("hook " << k << " of parameter " << fired[k]);
    REQUIRE(grad_seen[k] == dests[size_t(fired[k])].data_ptr());
  }
  for (size_t i = 0; i < params.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(params[i].grad().data_ptr() == dests[i].data_ptr());
  }
  require_same_bits(bucket, plain_bucket, "the bucket after W");
  for (const Tensor& p : params) p.set_grad_destination(Tensor());
}

TEST_CASE("split backward: W offers grad destinations to ops, I offers none", "[autograd-split]") {
  // The op writes w's gradient straight into w's destination in W, as in
  // run_backward; x's destination is never offered: its gradient is returned.
  Tensor w = from_vector<double>({2.0, 3.0}).requires_grad_();
  Tensor w_dest = zeros({2}, DType::f64), x_dest = zeros({2}, DType::f64);
  w.set_grad_destination(w_dest);
  Tensor x = from_vector<double>({5.0, 7.0}).requires_grad_();
  x.set_grad_destination(x_dest);

  RecordMaskOp::buffers.clear();
  Tensor loss = sum(autograd::apply<RecordMaskOp>(x, w));
  SplitBackward split = autograd::run_backward_input({loss}, {ones_like(loss)}, {x});
  REQUIRE(RecordMaskOp::buffers.size() == 1);
  REQUIRE(RecordMaskOp::buffers[0] != x_dest.data_ptr());
  REQUIRE(split.input_grads[0].data_ptr() != x_dest.data_ptr());
  REQUIRE(x_dest.to_vector<double>() == std::vector<double>{0.0, 0.0});
  REQUIRE_FALSE(x.grad().defined());

  split.weight_grads.run();
  REQUIRE(RecordMaskOp::buffers.size() == 2);
  REQUIRE(RecordMaskOp::buffers[1] == w_dest.data_ptr());
  REQUIRE(w.grad().data_ptr() == w_dest.data_ptr());
  REQUIRE(w_dest.to_vector<double>() == std::vector<double>{5.0, 7.0});
  REQUIRE(x_dest.to_vector<double>() == std::vector<double>{0.0, 0.0});
}

TEST_CASE("split backward: nothing to defer, and inputs no gradient reaches", "[autograd-split]") {
  // No parameters: W is empty and runs as a no-op.
  Tensor x = from_vector<float>({1.0f, -2.0f}).requires_grad_();
  Tensor square = sum(x * x);
  SplitBackward split = autograd::run_backward_input({square}, {ones_like(square)}, {x});
  REQUIRE(split.weight_grads.empty());
  REQUIRE(split.input_grads[0].to_vector<float>() == std::vector<float>{2.0f, -4.0f});
  split.weight_grads.run();

  // Reachable, but the op sends no gradient: zeros of the input's shape.
  Tensor z = from_vector<float>({1.0f, 2.0f, 3.0f}).requires_grad_();
  Tensor blocked = sum(autograd::apply<NoGradientOp>(z));
  SplitBackward none = autograd::run_backward_input({blocked}, {ones_like(blocked)}, {z});
  REQUIRE(none.input_grads[0].to_vector<float>() == std::vector<float>{0.0f, 0.0f, 0.0f});
}

TEST_CASE("split backward: misuse fails a CHECK that says what happened", "[autograd-split]") {
  Generator gen(19);
  Linear fc(4, 4, gen);
  Tensor g = rand_tensor({2, 4}, gen);

  const std::string twice = check_failure_of([&] {
    Tensor x = rand_tensor({2, 4}, gen).requires_grad_();
    SplitBackward split = autograd::run_backward_input({fc.forward(x)}, {g}, {x});
    split.weight_grads.run();
    split.weight_grads.run();
  });
  INFO(twice);
  REQUIRE(twice.find("CHECK failed") != std::string::npos);
  REQUIRE(twice.find("run() called twice") != std::string::npos);

  const std::string unreachable = check_failure_of([&] {
    Tensor x = rand_tensor({2, 4}, gen).requires_grad_();
    Tensor unused = rand_tensor({3, 5}, gen).requires_grad_();
    autograd::run_backward_input({fc.forward(x)}, {g}, {x, unused});
  });
  INFO(unreachable);
  REQUIRE(unreachable.find("input 1 (shape [3, 5]) is not reachable from the roots") !=
          std::string::npos);

  const std::string constant = check_failure_of([&] {
    Tensor x = rand_tensor({2, 4}, gen);
    autograd::run_backward_input({fc.forward(x)}, {g}, {x});
  });
  INFO(constant);
  REQUIRE(constant.find("input 0 does not require a gradient") != std::string::npos);

  const std::string unmade = check_failure_of([] { DeferredWeightGrads().run(); });
  INFO(unmade);
  REQUIRE(unmade.find("run_backward_input did not make") != std::string::npos);
}
