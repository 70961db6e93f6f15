// The fused multi-tensor optimizer kernels (core/cuda/optim.cu) against the
// CPU loops running the same core/optim_math.h: SGD and AdamW steps over
// parameter groups with different lr, weight decay and step counts, tensors
// larger than a chunk and of odd sizes; the global gradient norm and
// clipping; the loss scaler's unscale and inf/nan check. [cuda-host] cases
// (chunk planning) run without a GPU.
#include <cmath>

#include "core/cuda/kernels.h"
#include "core/ops.h"
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "tests/cuda_testing.h"

using namespace trainer;
using namespace trainer::optim;
using namespace trainer::testing;

namespace {

// Sizes around the chunk boundary, odd, a scalar-like one and an empty one.
const Shape kShapes[] = {{3, 5}, {cuda::kMultiTensorChunk + 7}, {1}, {0}, {257, 129}};

// The same parameters (values from seed) as two groups on device: the
// second with its own weight decay and lr scale.
std::vector<ParamGroup> make_groups(Device device, DType dtype, uint64_t seed) {
  Generator gen(seed);
  std::vector<ParamGroup> groups(2);
  groups[1].weight_decay = 0.0;
  groups[1].lr_scale = 0.5;
  int k = 0;
  for (const Shape& s : kShapes) {
    Tensor p = rand_tensor(s, gen, -1, 1, dtype).to(device).requires_grad_();
    groups[size_t(k % 2)].params.push_back({cat("p", k), p});
    ++k;
  }
  return groups;
}

// Gradients of step `step` (the same on every device); the parameter p0 gets
// none on step 1, so its step count lags the others'.
void set_grads(const std::vector<ParamGroup>& groups, int step) {
  Generator gen(100 + uint64_t(step));
  for (const ParamGroup& g : groups)
    for (const NamedTensor& p : g.params) {
      Tensor grad = rand_tensor(p.tensor.shape(), gen, -2, 2, p.tensor.dtype());
      p.tensor.set_grad(p.name == "p0" && step == 1 ? Tensor() : grad.to(p.tensor.device()));
    }
}

// Runs `steps` steps of the optimizer make_opt builds on the CPU and on the
// GPU; parameters and state must agree.
template <class MakeOpt>
void check_optimizer_on_gpu(MakeOpt make_opt, DType dtype, double tol, const std::string& what) {
  std::vector<ParamGroup> cpu_groups = make_groups(kHost, dtype, 7);
  std::vector<ParamGroup> gpu_groups = make_groups(gpu(), dtype, 7);
  std::unique_ptr<Optimizer> cpu_opt = make_opt(cpu_groups);
  std::unique_ptr<Optimizer> gpu_opt = make_opt(gpu_groups);
  for (int step = 1; step <= 3; ++step) {
    set_grads(cpu_groups, step);
    set_grads(gpu_groups, step);
    cpu_opt->set_lr(0.1 / step);
    gpu_opt->set_lr(0.1 / step);
    cpu_opt->step();
    gpu_opt->step();
  }
  std::vector<NamedTensor> expected = cpu_opt->state();
  std::vector<NamedTensor> actual = gpu_opt->state();
  REQUIRE(actual.size() == expected.size());
  for (size_t k = 0; k < actual.size(); ++k) {
    REQUIRE(actual[k].name == expected[k].name);
    require_close(actual[k].tensor.to(kHost), expected[k].tensor, tol, tol,
                  what + " state " + actual[k].name);
  }
  TensorList cpu_params = parameters(cpu_groups), gpu_params = parameters(gpu_groups);
  for (size_t k = 0; k < cpu_params.size(); ++k) {
    REQUIRE(gpu_params[k].device() == gpu());
    require_close(gpu_params[k].to(kHost), cpu_params[k], tol, tol, cat(what, " param ", k));
  }
}

}  // namespace

TEST_CASE("cuda multi-tensor chunks: every element of every tensor once, in order", "[cuda-host]") {
  const int64_t C = cuda::kMultiTensorChunk;
  std::vector<int64_t> numels = {0, 1, C, C + 1, 3, 2 * C};
  std::vector<cuda::ChunkRef> chunks = cuda::plan_chunks(numels);
  std::vector<std::pair<int, int>> expected = {{1, 0}, {2, 0}, {3, 0}, {3, 1},
                                               {4, 0}, {5, 0}, {5, 1}};
  REQUIRE(chunks.size() == expected.size());
  for (size_t b = 0; b < chunks.size(); ++b) {
    CHECK(chunks[b].tensor == expected[b].first);
    CHECK(chunks[b].chunk == expected[b].second);
  }
  CHECK(cuda::plan_chunks({}).empty());
}

TEST_CASE("cuda fused SGD: momentum, nesterov, decay and per-group lr as on the CPU", "[cuda]") {
  require_gpu_or_skip();
  for (DType dtype : {DType::f32, DType::f64}) {
    const double tol = dtype == DType::f64 ? 1e-12 : 1e-5;
    for (bool nesterov : {false, true}) {
      auto make = [&](std::vector<ParamGroup> g) -> std::unique_ptr<Optimizer> {
        return std::make_unique<SGD>(
            std::move(g),
            SGDOptions{.lr = 0.1, .momentum = 0.9, .nesterov = nesterov, .weight_decay = 1e-2});
      };
      check_optimizer_on_gpu(make, dtype, tol, cat("sgd ", dtype, nesterov ? " nesterov" : ""));
    }
    auto plain = [&](std::vector<ParamGroup> g) -> std::unique_ptr<Optimizer> {
      return std::make_unique<SGD>(std::move(g), SGDOptions{.lr = 0.1, .weight_decay = 1e-3});
    };
    check_optimizer_on_gpu(plain, dtype, tol, cat("sgd without momentum ", dtype));
  }
}

TEST_CASE("cuda fused AdamW: bias correction per step count, amsgrad, as on the CPU", "[cuda]") {
  require_gpu_or_skip();
  for (DType dtype : {DType::f32, DType::f64}) {
    const double tol = dtype == DType::f64 ? 1e-12 : 1e-5;
    for (bool amsgrad : {false, true}) {
      auto make = [&](std::vector<ParamGroup> g) -> std::unique_ptr<Optimizer> {
        AdamWOptions o;
        o.lr = 0.1;
        o.weight_decay = 0.05;
        o.amsgrad = amsgrad;
        return std::make_unique<AdamW>(std::move(g), o);
      };
      check_optimizer_on_gpu(make, dtype, tol, cat("adamw ", dtype, amsgrad ? " amsgrad" : ""));
    }
  }
}

TEST_CASE("cuda gradient norm and clipping: the CPU's total for every norm type", "[cuda]") {
  require_gpu_or_skip();
  for (double p : {2.0, 1.0, 3.0, double(INFINITY)}) {
    std::vector<ParamGroup> cpu_groups = make_groups(kHost, DType::f32, 3);
    std::vector<ParamGroup> gpu_groups = make_groups(gpu(), DType::f32, 3);
    set_grads(cpu_groups, 2);
    set_grads(gpu_groups, 2);
    TensorList cpu_params = parameters(cpu_groups), gpu_params = parameters(gpu_groups);
    const double expected = clip_grad_norm(cpu_params, 1.0, p);
    const double actual = clip_grad_norm(gpu_params, 1.0, p);
    CHECK(actual == Approx(expected).epsilon(1e-12));
    for (size_t k = 0; k < cpu_params.size(); ++k)
      require_close(gpu_params[k].grad().to(kHost), cpu_params[k].grad(), 1e-6, 1e-7,
                    cat("clipped gradient ", k, " (p = ", p, ")"));
  }
  // A non-finite gradient gives a non-finite norm, as on the CPU.
  Tensor q = zeros({5}, DType::f32, gpu()).requires_grad_();
  q.set_grad(from_vector<float>({1, 2, INFINITY, 0, 1}).to(gpu()));
  CHECK(std::isinf(grad_norm({q})));
  q.set_grad(from_vector<float>({1, NAN, 0, 0, 1}).to(gpu()));
  CHECK(std::isnan(grad_norm({q}, INFINITY)));
}

TEST_CASE("cuda loss scaler: unscale and inf/nan check of GPU gradients", "[cuda]") {
  require_gpu_or_skip();
  for (DType dtype : kFloating) {
    Generator gen(11);
    Tensor big = rand_tensor({cuda::kMultiTensorChunk + 3}, gen, -4, 4, dtype);
    Tensor small = rand_tensor({7}, gen, -4, 4, dtype);
    Tensor p1 = zeros_like(big).to(gpu()).requires_grad_();
    Tensor p2 = zeros_like(small).to(gpu()).requires_grad_();
    p1.set_grad(big.to(gpu()));
    p2.set_grad(small.to(gpu()));
    LossScaler scaler({.init_scale = 8.0});
    CHECK_FALSE(scaler.unscale(TensorList{p1, p2}));
    const Tolerance tol = tolerance(dtype);
    require_close(p1.grad().to(kHost), big.to(DType::f64) * 0.125, tol.rtol, tol.atol,
                  cat("unscaled ", dtype));
    require_close(p2.grad().to(kHost), small.to(DType::f64) * 0.125, tol.rtol, tol.atol,
                  cat("unscaled ", dtype));
    scaler.update();

    // One inf deep in the second chunk of the large gradient is found.
    Tensor with_inf = big.clone();
    with_inf.narrow(0, cuda::kMultiTensorChunk + 1, 1).fill_(INFINITY);
    p1.set_grad(with_inf.to(gpu()));
    CHECK(scaler.unscale(TensorList{p1, p2}));
    scaler.update();
    CHECK(scaler.scale() == 4.0);
  }
}
