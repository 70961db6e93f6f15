// Optimizers, LR schedules, gradient clipping and loss scaling (optim/):
// update rules against closed forms and PyTorch golden runs, schedules against
// hand-computed values, state round trips, and the loss scaler's counters.
#include "tests/testing.h"

#include <numbers>

#include "core/backend.h"
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

using namespace trainer;
using namespace trainer::optim;
using namespace trainer::testing;

namespace {

// A fresh leaf parameter holding values.
Tensor param_f64(const std::vector<double>& values) {
  return from_vector<double>(values).requires_grad_();
}

void set_grad(const Tensor& p, const std::vector<double>& g) {
  p.set_grad(from_vector<double>(g).to(p.dtype()));
}

// Runs `steps` updates of opt on p with a constant gradient g.
void run_constant_grad(Optimizer& opt, const Tensor& p, const std::vector<double>& g, int steps) {
  for (int k = 0; k < steps; ++k) {
    set_grad(p, g);
    opt.step();
  }
}

void require_values(const Tensor& t, const std::vector<double>& expected, double tol,
                    const std::string& what) {
  require_close(t, from_vector<double>(expected), 0.0, tol, what);
}

// Runs body and requires it to throw Error whose message contains every fragment.
template <class Body>
void require_error(Body&& body, std::initializer_list<std::string> fragments) {
  try {
    body();
  } catch (const Error& e) {
    std::string msg = e.what();
    INFO("message: " << msg);
    for (const std::string& f : fragments) CHECK(msg.find(f) != std::string::npos);
    return;
  }
  FAIL("expected trainer::Error");
}

std::vector<ParamGroup> one_group(const std::string& name, const Tensor& p) {
  return {ParamGroup{{{name, p}}}};
}

}  // namespace

// ---- SGD: constant gradient g from p0, closed forms of the k-th iterate ----

TEST_CASE("sgd: plain, momentum, dampening, nesterov and weight decay match closed forms",
          "[optim]") {
  const double p0 = 0.75, g = -0.4, lr = 0.1;
  const int k = 6;
  auto final_value = [&](const SGDOptions& o) {
    Tensor p = param_f64({p0});
    SGD opt(one_group("w", p), o);
    run_constant_grad(opt, p, {g}, k);
    return p.item<double>();
  };
  SECTION("plain: p_k = p0 - k lr g") {
    CHECK(final_value({.lr = lr}) == Approx(p0 - k * lr * g).epsilon(1e-14));
  }
  SECTION("momentum m, dampening d: buf_1 = g, buf_j -> b* = (1-d) g / (1-m)") {
    for (double d : {0.0, 0.3}) {
      const double m = 0.9, bstar = (1 - d) * g / (1 - m);
      // buf_j = b* + (g - b*) m^(j-1); p_k = p0 - lr sum_j buf_j.
      double expected = p0 - lr * (k * bstar + (g - bstar) * (1 - std::pow(m, k)) / (1 - m));
      CHECK(final_value({.lr = lr, .momentum = m, .dampening = d}) ==
            Approx(expected).epsilon(1e-13));
    }
  }
  SECTION("nesterov: step_j = g + m buf_j, buf_j = g (1 - m^j) / (1 - m)") {
    const double m = 0.9;
    double sum_buf = g / (1 - m) * (k - m * (1 - std::pow(m, k)) / (1 - m));
    double expected = p0 - lr * (k * g + m * sum_buf);
    CHECK(final_value({.lr = lr, .momentum = m, .nesterov = true}) ==
          Approx(expected).epsilon(1e-13));
  }
  SECTION("coupled weight decay: p_k = a^k p0 - lr g (1 - a^k) / (1 - a), a = 1 - lr wd") {
    const double wd = 0.5, a = 1 - lr * wd;
    double expected = std::pow(a, k) * p0 - lr * g * (1 - std::pow(a, k)) / (1 - a);
    CHECK(final_value({.lr = lr, .weight_decay = wd}) == Approx(expected).epsilon(1e-13));
  }
}

// ---- AdamW: with a constant gradient the bias-corrected moments are exactly
// g and g^2, so each step moves by lr g / (|g| + eps) after decaying p by (1 - lr wd).

TEST_CASE("adamw: bias correction, eps after the sqrt and decoupled decay (closed form)",
          "[optim]") {
  const double lr = 0.01, wd = 0.2, eps = 1e-3, a = 1 - lr * wd;
  const std::vector<double> p0 = {1.5, -0.5, 0.25}, g = {2e-3, -5e-4, 0.3};
  const int k = 7;
  for (bool amsgrad : {false, true}) {
    Tensor p = param_f64(p0);
    AdamW opt(one_group("w", p),
              {.lr = lr, .betas = {0.9, 0.99}, .eps = eps, .weight_decay = wd, .amsgrad = amsgrad});
    run_constant_grad(opt, p, g, k);
    std::vector<double> expected;
    for (size_t i = 0; i < p0.size(); ++i) {
      double s = g[i] / (std::fabs(g[i]) + eps);
      expected.push_back(std::pow(a, k) * p0[i] - lr * s * (1 - std::pow(a, k)) / (1 - a));
    }
    require_values(p, expected, 1e-13, amsgrad ? "amsgrad" : "adamw");
  }
}

// ---- Golden runs from PyTorch 2.15 (float64): p0 = {0.5, -1.25, 2, 0, -0.3},
// 5 steps, gradient of element i at step k = sin(1.3 i + 0.7 k) * 3 / (k + 1),
// lr halved before step 3 (param_groups[0]['lr'] *= 0.5). Produced once with
//   torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.05)
//   torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05)
//   torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1[, amsgrad=True])
// and p.detach().tolist() after the last step.

namespace {
std::vector<double> golden_run(const std::function<std::unique_ptr<Optimizer>(Tensor)>& make) {
  Tensor p = param_f64({0.5, -1.25, 2.0, 0.0, -0.3});
  std::unique_ptr<Optimizer> opt = make(p);
  for (int k = 0; k < 5; ++k) {
    if (k == 3) opt->set_lr(opt->lr() * 0.5);
    std::vector<double> g;
    for (int i = 0; i < 5; ++i) g.push_back(std::sin(1.3 * i + 0.7 * k) * (3.0 / (k + 1)));
    set_grad(p, g);
    opt->step();
  }
  return p.to_vector<double>();
}
}  // namespace

TEST_CASE("sgd and adamw match PyTorch golden runs with varying gradients and lr", "[optim]") {
  auto sgd = [](SGDOptions o) {
    return [o](Tensor p) { return std::make_unique<SGD>(one_group("p", p), o); };
  };
  auto adamw = [](bool amsgrad) {
    return [amsgrad](Tensor p) {
      return std::make_unique<AdamW>(one_group("p", p), AdamWOptions{.lr = 0.01,
                                                                     .betas = {0.8, 0.95},
                                                                     .eps = 1e-3,
                                                                     .weight_decay = 0.1,
                                                                     .amsgrad = amsgrad});
    };
  };
  struct Case {
    const char* name;
    std::function<std::unique_ptr<Optimizer>(Tensor)> make;
    std::vector<double> golden;
  };
  std::vector<Case> cases = {
      {"sgd momentum dampening wd",
       sgd({.lr = 0.1, .momentum = 0.9, .dampening = 0.2, .weight_decay = 0.05}),
       {0.07191423892626622, -2.489135890843857, 1.6365071781052516, 1.1388545135542343,
        0.603761260050168}},
      {"sgd nesterov wd",
       sgd({.lr = 0.1, .momentum = 0.9, .nesterov = true, .weight_decay = 0.05}),
       {-0.22104822966842635, -2.813039714125402, 1.6908305241110038, 1.5396681214464123,
        0.7288119400563047}},
      {"adamw",
       adamw(false),
       {0.4728304740873162, -1.2759386308907361, 1.9799078706983513, 0.03501616743606054,
        -0.27498598061102053}},
      {"adamw amsgrad",
       adamw(true),
       {0.47289399307922475, -1.2756337960351698, 1.979975705330698, 0.03482331307467564,
        -0.27512542723211064}},
  };
  for (const Case& c : cases) {
    std::vector<double> got = golden_run(c.make);
    for (size_t i = 0; i < got.size(); ++i) {
      INFO(c.name << " element " << i);
      CHECK(got[i] == Approx(c.golden[i]).epsilon(1e-12).margin(1e-14));
    }
  }
}

TEST_CASE("optimizer: f32 updates of a large tensor track the f64 ones", "[optim]") {
  Generator gen(7, 1);
  const int64_t n = 100003;  // odd, large enough for the threaded loop
  Tensor p64 = rand_f64({n}, gen);
  Tensor p32 = p64.to(DType::f32).requires_grad_();
  p64.requires_grad_();
  AdamW a64(one_group("w", p64), {.lr = 0.01});
  AdamW a32(one_group("w", p32), {.lr = 0.01});
  SGD s64(one_group("w", p64), {.lr = 0.05, .momentum = 0.9, .nesterov = true});
  SGD s32(one_group("w", p32), {.lr = 0.05, .momentum = 0.9, .nesterov = true});
  for (int k = 0; k < 3; ++k) {
    Tensor g = rand_f64({n}, gen);
    p64.set_grad(g);
    p32.set_grad(g.to(DType::f32));
    a64.step();
    a32.step();
    s64.step();
    s32.step();
  }
  require_close(p32, p64, 1e-5, 1e-6, "f32 vs f64");
}

TEST_CASE("optimizer: the CPU kernels match the reference backend's (f32 and f64)", "[optim]") {
  // The optimizer dispatches through backend(device) like any op, so
  // ReferenceKernelsGuard runs the same steps on core/ref/ref_optim.cpp.
  Generator gen(11, 3);
  const int64_t n = 70001;  // several threaded chunks
  for (DType dtype : {DType::f32, DType::f64}) {
    for (int kind = 0; kind < 4; ++kind) {
      INFO(dtype << " optimizer " << kind);
      Tensor init = rand_f64({n}, gen).to(dtype);
      Tensor fast = init.clone().requires_grad_(), ref = init.clone().requires_grad_();
      auto make = [&](const Tensor& p) -> std::unique_ptr<Optimizer> {
        if (kind == 0) return std::make_unique<SGD>(one_group("w", p), SGDOptions{.lr = 0.05});
        if (kind == 1)
          return std::make_unique<SGD>(
              one_group("w", p),
              SGDOptions{.lr = 0.05, .momentum = 0.9, .nesterov = true, .weight_decay = 0.01});
        return std::make_unique<AdamW>(one_group("w", p),
                                       AdamWOptions{.lr = 0.01, .amsgrad = kind == 3});
      };
      std::unique_ptr<Optimizer> on_fast = make(fast), on_ref = make(ref);
      for (int k = 0; k < 3; ++k) {
        Tensor g = rand_f64({n}, gen).to(dtype);
        fast.set_grad(g);
        ref.set_grad(g.clone());
        on_fast->step();
        ReferenceKernelsGuard reference;
        on_ref->step();
      }
      const double tol = dtype == DType::f32 ? 1e-6 : 1e-13;
      require_close(fast, ref, tol, tol, "parameters");
      std::vector<NamedTensor> fast_state = on_fast->state(), ref_state = on_ref->state();
      for (size_t k = 0; k < fast_state.size(); ++k)
        require_close(fast_state[k].tensor, ref_state[k].tensor, tol, tol, fast_state[k].name);
    }
  }
}

TEST_CASE("optimizer: groups, lr_scale, skipped parameters and zero_grad", "[optim]") {
  Tensor a = param_f64({1.0}), b = param_f64({1.0}), c = param_f64({1.0});
  std::vector<ParamGroup> groups = {ParamGroup{{{"a", a}}},
                                    ParamGroup{{{"b", b}, {"c", c}}, 0.0, 0.5}};
  SGD opt(groups, {.lr = 0.1, .weight_decay = 1.0});
  set_grad(a, {1.0});
  set_grad(b, {1.0});  // c has no gradient: skipped, as in PyTorch
  opt.step();
  CHECK(a.item<double>() == Approx(1.0 - 0.1 * (1.0 + 1.0)));  // optimizer's weight decay
  CHECK(b.item<double>() == Approx(1.0 - 0.05 * 1.0));         // group: no decay, half the lr
  CHECK(c.item<double>() == 1.0);
  for (const NamedTensor& e : opt.state())
    if (e.name == "c.step") CHECK(e.tensor.item<int64_t>() == 0);
  opt.zero_grad(false);
  CHECK(a.grad().item<double>() == 0.0);
  opt.zero_grad();
  CHECK(!a.grad().defined());
  CHECK(!b.grad().defined());
  CHECK(parameters(opt.param_groups()).size() == 3);
}

TEST_CASE("optimizer: options and parameters are validated with named errors", "[optim]") {
  Tensor p = param_f64({1.0});
  require_error([&] { SGD(one_group("w", p), {.momentum = -0.5}); }, {"momentum", "-0.5"});
  require_error([&] { SGD(one_group("w", p), {.lr = -1}); }, {"lr", "-1"});
  require_error(
      [&] { SGD(one_group("w", p), {.momentum = 0.9, .dampening = 0.1, .nesterov = true}); },
      {"nesterov", "dampening"});
  require_error([&] { AdamW(one_group("w", p), {.betas = {0.9, 1.0}}); }, {"betas[1]", "1"});
  require_error([&] { AdamW(one_group("w", p), {.eps = -1e-8}); }, {"eps"});
  require_error([&] { AdamW(one_group("w", p), {.weight_decay = -0.1}); }, {"weight_decay"});
  require_error([&] { SGD({ParamGroup{{{"w", p}, {"w", p}}}}, {}); }, {"'w'", "twice"});
  require_error([&] { SGD(one_group("h", p.to(DType::f16)), {}); }, {"'h'", "f16"});
  Tensor wide = zeros({4, 6}, DType::f64).slice(1, 0, 6, 2);
  require_error([&] { SGD(one_group("nc", wide), {}); }, {"'nc'", "contiguous"});
  SGD opt(one_group("w", p), {});
  require_error([&] { opt.set_lr(std::nan("")); }, {"lr"});
  p.set_grad(zeros({2}, DType::f64));
  require_error([&] { opt.step(); }, {"gradient of 'w'", "[2]"});
}

TEST_CASE("optimizer: state round trip continues bit for bit, bad states are rejected", "[optim]") {
  Generator gen(11, 2);
  Tensor w0 = rand_f64({3, 5}, gen), b0 = rand_f64({5}, gen);
  std::vector<Tensor> grads;
  for (int k = 0; k < 6; ++k) grads.push_back(rand_f64({3, 5}, gen).to(DType::f32));
  auto make = [&](bool adamw, Tensor& w, Tensor& b) -> std::unique_ptr<Optimizer> {
    w = w0.to(DType::f32).requires_grad_();
    b = b0.to(DType::f32).requires_grad_();
    std::vector<ParamGroup> groups = {ParamGroup{{{"fc.weight", w}}},
                                      ParamGroup{{{"fc.bias", b}}, 0.0}};
    if (adamw) return std::make_unique<AdamW>(groups, AdamWOptions{.lr = 0.01, .amsgrad = true});
    return std::make_unique<SGD>(groups,
                                 SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-2});
  };
  auto steps = [&](Optimizer& opt, Tensor& w, Tensor& b, int from, int to) {
    for (int k = from; k < to; ++k) {
      w.set_grad(grads[k].clone());
      b.set_grad(grads[k].select(0, 0).clone());
      opt.step();
    }
  };
  for (bool adamw : {false, true}) {
    INFO((adamw ? "AdamW" : "SGD"));
    Tensor w1, b1, w2, b2;
    std::unique_ptr<Optimizer> first = make(adamw, w1, b1);
    steps(*first, w1, b1, 0, 3);
    std::vector<NamedTensor> saved;
    for (const NamedTensor& e : first->state()) saved.push_back({e.name, e.tensor.clone()});
    Tensor w_saved = w1.detach().clone(), b_saved = b1.detach().clone();
    steps(*first, w1, b1, 3, 6);

    std::unique_ptr<Optimizer> second = make(adamw, w2, b2);
    w2.detach().copy_(w_saved);
    b2.detach().copy_(b_saved);
    second->load_state(saved);
    steps(*second, w2, b2, 3, 6);
    CHECK(w2.to_vector<float>() == w1.to_vector<float>());
    CHECK(b2.to_vector<float>() == b1.to_vector<float>());
    std::vector<NamedTensor> s1 = first->state(), s2 = second->state();
    REQUIRE(s1.size() == s2.size());
    for (size_t i = 0; i < s1.size(); ++i) {
      CHECK(s1[i].name == s2[i].name);
      CHECK(s1[i].tensor.to_vector<double>() == s2[i].tensor.to_vector<double>());
    }
    CHECK(s1[0].name == "fc.weight.step");
    CHECK(s1[0].tensor.item<int64_t>() == 6);

    std::string slot = adamw ? "fc.weight.exp_avg" : "fc.weight.momentum_buffer";
    auto with = [&](const std::string& name, const Tensor& t) {
      std::vector<NamedTensor> s = saved;
      for (NamedTensor& e : s)
        if (e.name == name) e.tensor = t;
      return s;
    };
    require_error([&] { second->load_state(with(slot, zeros({5, 3}))); }, {slot, "[5, 3]"});
    require_error(
        [&] {
          second->load_state(with(slot, zeros({3, 5}, DType::f64)));
        },
        {slot, "f64"});
    require_error([&] { second->load_state(with("fc.bias.step", full({}, -1, DType::i64))); },
                  {"fc.bias.step", "negative"});
    std::vector<NamedTensor> renamed = saved;
    renamed.back().name = "fc.bias.bogus";
    require_error([&] { second->load_state(renamed); }, {"unexpected", "fc.bias.bogus"});
    std::vector<NamedTensor> missing(saved.begin(), saved.end() - 1);
    require_error([&] { second->load_state(missing); }, {"missing", saved.back().name});
    // A rejected load changes nothing.
    CHECK(second->state()[0].tensor.item<int64_t>() == 6);
  }
}

// ---- clip_grad_norm ----

TEST_CASE("clip_grad_norm: total norm and scaling as torch.nn.utils.clip_grad_norm_", "[optim]") {
  Tensor a = param_f64({0, 0}), b = param_f64({0}), none = param_f64({5});
  auto reset = [&] {
    set_grad(a, {3, -4});
    set_grad(b, {12});
  };
  TensorList params = {a, b, none};  // `none` has no gradient: ignored
  reset();
  CHECK(grad_norm(params, 1.0) == Approx(19.0));
  CHECK(grad_norm(params, INFINITY) == 12.0);
  CHECK(grad_norm(params, 3.0) == Approx(std::cbrt(27.0 + 64.0 + 1728.0)));
  CHECK(clip_grad_norm(params, 100.0) == Approx(13.0));  // below max_norm: untouched
  CHECK(b.grad().item<double>() == 12.0);
  CHECK(clip_grad_norm(params, 6.5) == Approx(13.0));
  const double coef = 6.5 / (13.0 + 1e-6);
  require_values(a.grad(), {3 * coef, -4 * coef}, 1e-15, "a clipped");
  require_values(b.grad(), {12 * coef}, 1e-15, "b clipped");
  CHECK(grad_norm(params) == Approx(6.5).epsilon(1e-6));

  reset();
  set_grad(b, {INFINITY});
  require_error([&] { clip_grad_norm(params, 1.0, 2.0, true); }, {"non-finite"});
  require_error([&] { clip_grad_norm(params, 1.0, -2.0); }, {"norm_type", "-2"});

  // A large f32 gradient takes the blocked, threaded path.
  Tensor big = zeros({200001}).requires_grad_();
  big.set_grad(full({200001}, 0.5));
  double norm = clip_grad_norm({big}, 1.0);
  CHECK(norm == Approx(0.5 * std::sqrt(200001.0)).epsilon(1e-12));
  CHECK(grad_norm({big}) == Approx(1.0).epsilon(1e-5));
}

// ---- LR schedules ----

TEST_CASE("schedule: constant, step and multistep at their boundaries", "[optim]") {
  LrSchedule constant({.base_lr = 0.1, .global_batch = 1024});  // linear scaling: 0.1 * 4
  CHECK(constant.peak_lr() == Approx(0.4));
  CHECK(constant.lr(0) == Approx(0.4));
  CHECK(constant.lr(123456) == Approx(0.4));
  CHECK(linear_scaled_lr(0.1, 512) == Approx(0.2));

  LrSchedule step({.kind = ScheduleKind::step, .base_lr = 0.1, .step_size = 30, .gamma = 0.1});
  CHECK(step.lr(0) == Approx(0.1));
  CHECK(step.lr(29) == Approx(0.1));
  CHECK(step.lr(30) == Approx(0.01));
  CHECK(step.lr(59) == Approx(0.01));
  CHECK(step.lr(60) == Approx(0.001));

  // Milestones in epochs, 10 steps per epoch: boundaries at steps 300, 600, 800.
  LrSchedule multistep({.kind = ScheduleKind::multistep,
                        .base_lr = 0.1,
                        .unit = ScheduleUnit::epochs,
                        .steps_per_epoch = 10,
                        .milestones = {30, 60, 80}});
  CHECK(multistep.resolved().milestones == std::vector<int64_t>{300, 600, 800});
  CHECK(multistep.lr(299) == Approx(0.1));
  CHECK(multistep.lr(300) == Approx(0.01));
  CHECK(multistep.lr(599) == Approx(0.01));
  CHECK(multistep.lr(600) == Approx(0.001));
  CHECK(multistep.lr(800) == Approx(1e-4));
  CHECK(multistep.lr(5000) == Approx(1e-4));
}

TEST_CASE("schedule: cosine midpoint, end and floor", "[optim]") {
  LrSchedule cosine({.kind = ScheduleKind::cosine, .base_lr = 1.0, .t_max = 100, .min_lr = 0.1});
  CHECK(cosine.lr(0) == Approx(1.0));
  CHECK(cosine.lr(25) == Approx(0.1 + 0.9 * (1 + std::sqrt(0.5)) / 2));
  CHECK(cosine.lr(50) == Approx(0.55));
  CHECK(cosine.lr(100) == Approx(0.1));
  CHECK(cosine.lr(250) == Approx(0.1));  // stays at the floor
  LrSchedule to_zero({.kind = ScheduleKind::cosine, .base_lr = 0.5, .t_max = 4});
  CHECK(to_zero.lr(2) == Approx(0.25));
  CHECK(to_zero.lr(4) == 0.0);
}

TEST_CASE("schedule: linear warmup multiplies the main schedule from step 0", "[optim]") {
  // Goyal et al.: lr 0.1 * 1024 / 256 = 0.4, 5 warmup epochs from 0.1, 10 steps per epoch.
  LrSchedule s({.kind = ScheduleKind::multistep,
                .base_lr = 0.1,
                .unit = ScheduleUnit::epochs,
                .steps_per_epoch = 10,
                .milestones = {30, 60},
                .warmup = 5,
                .warmup_start_factor = 0.25,
                .global_batch = 1024});
  CHECK(s.lr(0) == Approx(0.1));
  CHECK(s.lr(25) == Approx(0.4 * (0.25 + 0.75 * 0.5)));
  CHECK(s.lr(49) == Approx(0.4 * (0.25 + 0.75 * 49 / 50.0)));
  CHECK(s.lr(50) == Approx(0.4));
  CHECK(s.lr(300) == Approx(0.04));

  // The same as PyTorch's ChainedScheduler([LinearLR(opt, start_factor=0.25,
  // total_iters=5), MultiStepLR(opt, [3, 6], gamma=0.1)]) with lr 0.4, read
  // from param_groups[0]['lr'] before each step (torch 2.15):
  const std::vector<double> torch_lrs = {0.1,
                                         0.16000000000000003,
                                         0.22000000000000003,
                                         0.028000000000000004,
                                         0.034,
                                         0.04,
                                         0.004,
                                         0.004,
                                         0.004};
  LrSchedule chained({.kind = ScheduleKind::multistep,
                      .base_lr = 0.4,
                      .milestones = {3, 6},
                      .warmup = 5,
                      .warmup_start_factor = 0.25});
  for (int t = 0; t < 9; ++t) CHECK(chained.lr(t) == Approx(torch_lrs[size_t(t)]).epsilon(1e-12));

  // Cosine keeps its clock: at the end of warmup it is already past step 0.
  LrSchedule cw({.kind = ScheduleKind::cosine,
                 .base_lr = 1.0,
                 .t_max = 100,
                 .warmup = 10,
                 .warmup_start_factor = 0.0});
  CHECK(cw.lr(0) == 0.0);
  CHECK(cw.lr(5) == Approx(0.5 * (1 + std::cos(std::numbers::pi * 5 / 100)) / 2));
  CHECK(cw.lr(10) == Approx((1 + std::cos(std::numbers::pi * 10 / 100)) / 2));
  CHECK(cw.lr(50) == Approx(0.5));
}

TEST_CASE("schedule: invalid options name the field", "[optim]") {
  require_error([] { LrSchedule({.kind = ScheduleKind::step}); }, {"step_size", "0"});
  require_error(
      [] {
        LrSchedule({.kind = ScheduleKind::multistep, .milestones = {30, 20}});
      },
      {"milestones", "30", "20"});
  require_error([] { LrSchedule({.kind = ScheduleKind::cosine}); }, {"t_max"});
  require_error(
      [] { LrSchedule({.kind = ScheduleKind::cosine, .base_lr = 0.1, .t_max = 5, .min_lr = 0.2}); },
      {"min_lr", "0.2"});
  require_error([] { LrSchedule({.unit = ScheduleUnit::epochs}); }, {"steps_per_epoch"});
  require_error([] { LrSchedule({.warmup_start_factor = 1.5}); }, {"warmup_start_factor", "1.5"});
  require_error([] { linear_scaled_lr(0.1, 0); }, {"global_batch"});
}

// ---- loss scaling ----

TEST_CASE("loss scaler: unscale, growth after the interval, backoff and skip on inf/nan",
          "[optim]") {
  Tensor w = param_f64({1.0, 2.0});
  SGD opt(one_group("w", w), {.lr = 0.5});
  LossScaler scaler({.init_scale = 8.0, .growth_interval = 3});
  CHECK(scaler.scale() == 8.0);

  // scale_loss is recorded: the gradient of (w . w) * 8 is 16 w.
  sum(scaler.scale_loss(w * w)).backward();
  require_values(w.grad(), {16.0, 32.0}, 0, "scaled gradient");
  CHECK(!scaler.unscale(opt));
  CHECK(!scaler.unscale(opt));  // a second call does nothing
  require_values(w.grad(), {2.0, 4.0}, 0, "unscaled once");
  CHECK(scaler.step(opt));
  require_values(w, {0.0, 0.0}, 0, "stepped");
  scaler.update();
  CHECK(scaler.growth_tracker() == 1);

  auto iteration = [&](double g0) {
    set_grad(w, {g0 * scaler.scale(), 1.0});
    bool stepped = scaler.step(opt);
    scaler.update();
    return stepped;
  };
  CHECK(iteration(1.0));
  CHECK(scaler.scale() == 8.0);
  CHECK(iteration(1.0));  // third good step: the scale grows
  CHECK(scaler.scale() == 16.0);
  CHECK(scaler.growth_tracker() == 0);

  Tensor before = w.detach().clone();
  CHECK(!iteration(INFINITY));
  CHECK(w.to_vector<double>() == before.to_vector<double>());  // skipped
  CHECK(scaler.scale() == 8.0);
  CHECK(!iteration(NAN));
  CHECK(scaler.scale() == 4.0);
  CHECK(scaler.skipped_steps() == 2);
  CHECK(scaler.growth_tracker() == 0);
  CHECK(iteration(1.0));
  CHECK(scaler.growth_tracker() == 1);

  // A sharded run ORs found-inf across ranks and overrides the local flag.
  set_grad(w, {1.0, 1.0});
  CHECK(!scaler.unscale(opt));
  scaler.set_found_inf(true);
  CHECK(!scaler.step(opt));
  scaler.update();
  CHECK(scaler.scale() == 2.0);
  CHECK(scaler.skipped_steps() == 3);
}

TEST_CASE("loss scaler: large and f16 gradients, disabled mode, state round trip", "[optim]") {
  Tensor big = zeros({150001}).requires_grad_();
  SGD opt(one_group("big", big), {.lr = 1.0});
  LossScaler scaler;
  CHECK(scaler.scale() == 65536.0);
  Tensor g = full({150001}, 65536.0);
  big.set_grad(g.clone());
  CHECK(!scaler.unscale(opt));
  CHECK(big.grad().to_vector<float>()[150000] == 1.0f);
  scaler.update();
  Tensor bad = g.clone();
  bad.data<float>()[140000] = NAN;  // in the last block of the threaded loop
  big.set_grad(bad);
  CHECK(scaler.unscale(opt));
  scaler.update();
  CHECK(scaler.scale() == 32768.0);

  Tensor h = from_vector<float>({32768.0f, -16384.0f}).to(DType::f16);
  Tensor hp = zeros({2}).requires_grad_();
  SGD hopt(one_group("h", hp), {});
  hp.set_grad(h);
  CHECK(!scaler.unscale(hopt));
  CHECK(hp.grad().to_vector<float>() == std::vector<float>{1.0f, -0.5f});
  scaler.update();

  LossScaler off({.enabled = false});
  Tensor loss = scalar_tensor(3.0);
  CHECK(off.scale() == 1.0);
  CHECK(off.scale_loss(loss).item<double>() == 3.0);
  big.set_grad(full({150001}, INFINITY));
  CHECK(off.step(opt));  // nothing is checked
  off.update();

  LossScaler restored({.init_scale = 1.0});
  restored.load_state(scaler.state());
  CHECK(restored.scale() == scaler.scale());
  CHECK(restored.skipped_steps() == scaler.skipped_steps());
  CHECK(restored.growth_tracker() == scaler.growth_tracker());
  std::vector<NamedTensor> s = scaler.state();
  s[0].tensor = scalar_tensor(-1.0, DType::f64);
  require_error([&] { restored.load_state(s); }, {"loss_scaler.scale", "-1"});
  s = scaler.state();
  s[1].tensor = zeros({1}, DType::i64);
  require_error([&] { restored.load_state(s); }, {"loss_scaler.growth_tracker", "0-d"});
  s = scaler.state();
  s.pop_back();
  require_error([&] { restored.load_state(s); }, {"missing", "loss_scaler.skipped_steps"});
  require_error([] { LossScaler({.growth_factor = 1.0}); }, {"growth_factor", "1"});
  require_error([] { LossScaler({.backoff_factor = 0.0}); }, {"backoff_factor"});
}
