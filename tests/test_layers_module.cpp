// Module bookkeeping (names, modes, parameter groups), layer initialisation,
// BatchNorm2d train/eval semantics, Linear and Dropout.
#include "tests/testing.h"

#include "layers/conv.h"
#include "layers/init.h"
#include "layers/linear.h"
#include "layers/pooling.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

class Net : public Module {
 public:
  explicit Net(Generator& gen) {
    conv = register_module(
        "conv",
        std::make_shared<Conv2d>(
            Conv2dOptions{
                .in_channels = 2, .out_channels = 4, .attrs = {.padding = {1, 1}}, .bias = false},
            gen));
    bn = register_module("bn", std::make_shared<BatchNorm2d>(4));
    head = register_module(
        "head", std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
                    std::make_shared<Flatten>(), std::make_shared<Linear>(4 * 5 * 5, 3, gen)}));
  }
  Tensor forward(const Tensor& x) override { return (*head)(conv_bn(*conv, *bn, x, true)); }
  std::shared_ptr<Conv2d> conv;
  std::shared_ptr<BatchNorm2d> bn;
  std::shared_ptr<Sequential> head;
};

std::vector<std::string> names(const std::vector<NamedTensor>& ts) {
  std::vector<std::string> out;
  for (const NamedTensor& t : ts) out.push_back(t.name);
  return out;
}

}  // namespace

TEST_CASE("module: hierarchical names, modes and parameter groups", "[layers][module]") {
  Generator gen(1);
  Net net(gen);
  REQUIRE(names(net.named_parameters()) == std::vector<std::string>{"conv.weight", "bn.weight",
                                                                    "bn.bias", "head.1.weight",
                                                                    "head.1.bias"});
  REQUIRE(names(net.named_buffers()) ==
          std::vector<std::string>{"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"});
  REQUIRE(names(net.state()) == std::vector<std::string>{"conv.weight", "bn.weight", "bn.bias",
                                                         "bn.running_mean", "bn.running_var",
                                                         "bn.num_batches_tracked", "head.1.weight",
                                                         "head.1.bias"});
  REQUIRE(net.num_parameters() == 4 * 2 * 9 + 4 + 4 + 3 * 100 + 3);
  for (const Tensor& p : net.parameters()) REQUIRE(p.requires_grad());
  for (const NamedTensor& b : net.named_buffers()) REQUIRE(!b.tensor.requires_grad());

  REQUIRE(net.bn->is_training());
  net.eval();
  REQUIRE(!net.bn->is_training());
  REQUIRE(!net.head->children()[1].second->is_training());
  net.train();
  REQUIRE(net.bn->is_training());

  WeightDecaySplit split = split_weight_decay(net);
  REQUIRE(names(split.decay) == std::vector<std::string>{"conv.weight", "head.1.weight"});
  REQUIRE(names(split.no_decay) == std::vector<std::string>{"bn.weight", "bn.bias", "head.1.bias"});

  Tensor x = rand_tensor({2, 2, 5, 5}, gen);
  sum(net(x)).backward();
  for (const Tensor& p : net.parameters()) REQUIRE(p.grad().defined());
  net.zero_grad();
  for (const Tensor& p : net.parameters()) REQUIRE(!p.grad().defined());
}

TEST_CASE("init: PyTorch's default and Kaiming initialisations", "[layers][init]") {
  Generator gen(2);
  Conv2d conv({.in_channels = 64, .out_channels = 128, .kernel = {3, 3}}, gen);
  double bound = 1.0 / std::sqrt(64.0 * 9.0);
  auto stats = [](const Tensor& t) {
    std::vector<double> v = t.to_vector<double>();
    double m = 0, sq = 0, mx = 0;
    for (double x : v) m += x, sq += x * x, mx = std::max(mx, std::fabs(x));
    m /= double(v.size());
    return std::array<double, 3>{m, std::sqrt(sq / double(v.size()) - m * m), mx};
  };
  auto w = stats(conv.weight);
  REQUIRE(w[2] <= bound);
  REQUIRE(std::fabs(w[1] - bound / std::sqrt(3.0)) < 0.02 * bound);
  REQUIRE(stats(conv.bias)[2] <= bound);
  kaiming_normal_(conv.weight, FanMode::fan_out, gen);
  REQUIRE(std::fabs(stats(conv.weight)[1] - std::sqrt(2.0 / (128 * 9))) <
          0.02 * std::sqrt(2.0 / (128 * 9)));
  Linear fc(300, 50, gen);
  REQUIRE(stats(fc.weight)[2] <= 1.0 / std::sqrt(300.0));
  REQUIRE(std::fabs(stats(fc.weight)[1] - 1.0 / std::sqrt(900.0)) < 0.03 / std::sqrt(900.0));
  // Same seed, same parameters.
  Generator g1(7), g2(7);
  require_close(Linear(10, 4, g1).weight, Linear(10, 4, g2).weight, 0, 0, "deterministic init");
}

TEST_CASE("batch_norm layer: running statistics, eval mode, num_batches_tracked", "[layers][bn]") {
  Generator gen(3);
  BatchNorm2d bn(3);
  const int64_t M = 2 * 4 * 5;
  std::vector<double> rm(3, 0.0), rv(3, 1.0);
  for (int step = 0; step < 4; ++step) {
    Tensor x = rand_tensor({2, 3, 4, 5}, gen) * double(step + 1) + double(step);
    std::vector<float> v = x.contiguous().to_vector<float>();
    for (int c = 0; c < 3; ++c) {
      double s = 0, sq = 0;
      for (int n = 0; n < 2; ++n)
        for (int k = 0; k < 20; ++k) s += v[(n * 3 + c) * 20 + k];
      double mean = s / M;
      for (int n = 0; n < 2; ++n)
        for (int k = 0; k < 20; ++k) sq += std::pow(v[(n * 3 + c) * 20 + k] - mean, 2);
      rm[c] = 0.9 * rm[c] + 0.1 * mean;
      rv[c] = 0.9 * rv[c] + 0.1 * sq / (M - 1);  // unbiased, as PyTorch
    }
    bn(x);
  }
  require_close(bn.running_mean, from_vector(rm).to(DType::f32), 1e-5, 1e-6, "running_mean");
  require_close(bn.running_var, from_vector(rv).to(DType::f32), 1e-5, 1e-6, "running_var");
  REQUIRE(bn.num_batches_tracked.item<int64_t>() == 4);

  // Eval: normalises with the running statistics and leaves them alone.
  bn.eval();
  Tensor gamma = rand_tensor({3}, gen, 0.5, 1.5), beta = rand_tensor({3}, gen);
  bn.weight.detach().copy_(gamma);
  bn.bias.detach().copy_(beta);
  Tensor x = rand_tensor({2, 3, 4, 5}, gen);
  Tensor expected = (x - bn.running_mean.reshape({1, 3, 1, 1})) *
                        rsqrt(bn.running_var + 1e-5).reshape({1, 3, 1, 1}) *
                        gamma.reshape({1, 3, 1, 1}) +
                    beta.reshape({1, 3, 1, 1});
  require_close(bn(x), expected, 1e-5, 1e-5, "eval output");
  REQUIRE(bn.num_batches_tracked.item<int64_t>() == 4);
  require_close(bn.running_mean, from_vector(rm).to(DType::f32), 1e-5, 1e-6, "unchanged in eval");

  // Without tracking: batch statistics in both modes, no buffers.
  BatchNorm2d free_bn(3, {.track_running_stats = false});
  free_bn.eval();
  REQUIRE(free_bn.named_buffers().empty());
  require_close(mean(free_bn(x), {0, 2, 3}), zeros({3}), 0, 1e-5, "batch statistics in eval");
}

TEST_CASE("linear: closed form and gradients", "[layers][linear]") {
  Generator gen(4);
  Linear fc(3, 2, gen);
  Tensor x = rand_tensor({4, 3}, gen);
  std::vector<float> xv = x.to_vector<float>(), w = fc.weight.to_vector<float>(),
                     b = fc.bias.to_vector<float>(), y = fc(x).to_vector<float>();
  for (int n = 0; n < 4; ++n)
    for (int o = 0; o < 2; ++o) {
      float e = b[o];
      for (int i = 0; i < 3; ++i) e += xv[n * 3 + i] * w[o * 3 + i];
      REQUIRE(std::fabs(y[n * 2 + o] - e) < 1e-5f);
    }
  gradcheck([](const TensorList& t) { return linear(t[0], t[1], t[2]); },
            {rand_f64({5, 4}, gen), rand_f64({3, 4}, gen), rand_f64({3}, gen)});
  gradcheck([](const TensorList& t) { return linear(t[0], t[1], Tensor()); },
            {rand_f64({2, 3, 4}, gen), rand_f64({2, 4}, gen)});
}

TEST_CASE("dropout layer: deterministic from its generator, identity in eval",
          "[layers][dropout]") {
  Tensor x = ones({64, 64});
  Dropout a(0.3, Generator(5, kStreamDropout)), b(0.3, Generator(5, kStreamDropout));
  Tensor ya = a(x), yb = b(x);
  require_close(ya, yb, 0, 0, "same seed, same mask");
  std::vector<float> v = ya.to_vector<float>();
  double zeros_frac = double(std::count(v.begin(), v.end(), 0.0f)) / double(v.size());
  REQUIRE(std::fabs(zeros_frac - 0.3) < 0.03);
  for (float f : v) REQUIRE((f == 0.0f || std::fabs(f - 1.0f / 0.7f) < 1e-6f));
  REQUIRE(a.generator().offset() > 0);
  a.eval();
  require_close(a(x), x, 0, 0, "eval identity");
}
