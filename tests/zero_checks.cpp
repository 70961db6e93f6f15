// The ZeRO-1 and SyncBatchNorm checks of one rank (tests/zero_checks.h), run
// by tests/zero_worker.cpp as processes of `trainer launch` and by
// tests/test_parallel_zero.cpp as threads of one process. Every rank
// recomputes the single-process answer (the plain optimizer on the averaged
// gradient; BatchNorm2d on the concatenated batch) and compares its own
// result with it, printing mismatches with rank, what, index, expected and
// actual; the last line is "rank R: N checks, F failed", the exit code 0
// only without failures.
//
//   zero_worker zero      ZeRO-1 (SGD with momentum, AdamW): parameters and state
//                         over several steps, gradient clipping, state round trip,
//                         errors on another rank's, another layout's or plain state
//   zero_worker zero_ddp  ZeRO-1 on DataParallel's buckets (reduce-scatter in backward)
//                         against DataParallel's allreduce with the plain optimizer
//   zero_worker syncbn    SyncBatchNorm (uneven per-rank batches) against BatchNorm2d
//   zero_worker zero_staged zero_ddp_staged syncbn_ops
//                         the same through the GPU's data flow on CPU tensors: ZeRO-1
//                         with ZeroOptions::stage_through_host, SyncBatchNorm by
//                         sync_batch_norm_ops (statistics staged through host copies)
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "core/autograd.h"
#include "layers/conv.h"
#include "layers/linear.h"
#include "optim/clip.h"
#include "parallel/sync_batchnorm.h"
#include "parallel/zero.h"
#include "tests/worker_checks.h"
#include "tests/zero_checks.h"

using namespace trainer;
using namespace trainer::testing;
using namespace trainer::parallel;

namespace {

// |actual - expected| <= atol + rtol |expected| elementwise; reports the first failure.
void expect_close(const std::string& what, const Tensor& actual, const Tensor& expected,
                  double rtol, double atol) {
  ++g_checks;
  if (actual.shape() != expected.shape()) {
    std::printf("rank %d: %s: shape %s, expected %s\n", g_rank, what.c_str(),
                actual.shape_str().c_str(), expected.shape_str().c_str());
    ++g_failures;
    return;
  }
  std::vector<double> a = actual.to_vector<double>(), e = expected.to_vector<double>();
  for (size_t i = 0; i < a.size(); ++i)
    if (!(std::fabs(a[i] - e[i]) <= atol + rtol * std::fabs(e[i]))) {
      std::printf("rank %d: %s: mismatch at index %zu: expected %.9g, actual %.9g\n", g_rank,
                  what.c_str(), i, e[i], a[i]);
      ++g_failures;
      return;
    }
}

void expect_true(const std::string& what, bool ok) { expect(ok, what); }

// fn must throw an Error whose message contains needle.
void expect_error(const std::string& what, const std::function<void()>& fn,
                  const std::string& needle) {
  ++g_checks;
  try {
    fn();
  } catch (const Error& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) return;
    std::printf("rank %d: %s: error \"%s\" lacks \"%s\"\n", g_rank, what.c_str(), e.what(),
                needle.c_str());
    ++g_failures;
    return;
  }
  std::printf("rank %d: %s: no error\n", g_rank, what.c_str());
  ++g_failures;
}

// ---- ZeRO-1 ----

// Parameter sizes not divisible by 2 or 3, a parameter no rank has a gradient
// for ("unused"), one only rank 0 has ("partial"), and two groups: weight
// decay on the first; none and half the lr on the second.
struct ParamSpec {
  const char* name;
  Shape shape;
  int group;
};
const std::vector<ParamSpec> kParams = {{"a.weight", {5, 3}, 0}, {"a.bias", {5}, 1},
                                        {"b.weight", {7, 2}, 0}, {"unused", {4}, 0},
                                        {"b.bias", {1}, 1},      {"c.weight", {2, 2, 3}, 0},
                                        {"partial", {3}, 1}};

struct Replica {
  std::vector<optim::ParamGroup> groups;
  std::map<std::string, Tensor> by_name;
};

Replica make_replica() {
  Replica r;
  r.groups = {optim::ParamGroup{}, optim::ParamGroup{{}, 0.0, 0.5}};
  Generator gen(7, 1);
  for (const ParamSpec& p : kParams) {
    Tensor t = uniform(p.shape, -1, 1, gen);
    r.groups[size_t(p.group)].params.push_back({p.name, t});
    r.by_name[p.name] = t;
  }
  return r;
}

Replica clone_replica(const Replica& from) {
  Replica r = make_replica();
  for (auto& [name, t] : r.by_name) t.copy_(from.by_name.at(name));
  return r;
}

// Rank r's gradient of a parameter at a step; none for "unused", and for "partial" off rank 0.
Tensor local_grad(const ParamSpec& p, int rank, int64_t step) {
  if (std::string(p.name) == "unused" || (std::string(p.name) == "partial" && rank != 0))
    return Tensor();
  Generator gen(uint64_t(100 + step), uint64_t(rank * 16 + (&p - kParams.data())));
  return uniform(p.shape, -1, 1, gen);
}

void set_local_grads(Replica& r, int rank, int64_t step) {
  for (const ParamSpec& p : kParams) r.by_name[p.name].set_grad(local_grad(p, rank, step));
}

// The average over the ranks (missing gradients count as zero; none when no rank has one).
void set_average_grads(Replica& r, int world, int64_t step) {
  for (const ParamSpec& p : kParams) {
    Tensor sum;
    for (int q = 0; q < world; ++q) {
      Tensor g = local_grad(p, q, step);
      if (g.defined()) sum = sum.defined() ? sum + g : g.clone();
    }
    r.by_name[p.name].set_grad(sum.defined() ? sum * (1.0 / world) : Tensor());
  }
}

using Factory = OptimizerFactory;

Factory sgd_factory() {
  return [](std::vector<optim::ParamGroup> g) -> std::unique_ptr<optim::Optimizer> {
    return std::make_unique<optim::SGD>(
        std::move(g),
        optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .nesterov = true, .weight_decay = 1e-2});
  };
}

Factory adamw_factory() {
  return [](std::vector<optim::ParamGroup> g) -> std::unique_ptr<optim::Optimizer> {
    return std::make_unique<optim::AdamW>(std::move(g),
                                          optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.05});
  };
}

// Every piece of the ZeRO state against the same elements of the plain optimizer's state.
void compare_state(const std::string& what, const ZeroOptimizer& zero, const optim::Optimizer& ref,
                   comm::Communicator& comm, double total) {
  std::map<std::string, Tensor> full;
  for (const NamedTensor& e : ref.state()) full[e.name] = e.tensor;
  double elements = 0;
  for (const NamedTensor& e : zero.state()) {
    if (e.name.rfind("zero1.", 0) == 0) continue;
    size_t open = e.name.rfind('[');
    long long b = 0, end = 0;
    std::sscanf(e.name.c_str() + open, "[%lld:%lld]", &b, &end);
    std::string base = e.name.substr(0, open);
    auto it = full.find(base);
    expect_true(cat(what, ": ", e.name, " names a plain state entry"), it != full.end());
    if (it == full.end()) continue;
    if (it->second.dim() == 0) {
      expect_close(cat(what, ": ", e.name), e.tensor, it->second, 0, 0);
    } else {
      expect_close(cat(what, ": ", e.name), e.tensor, it->second.reshape({-1}).slice(0, b, end),
                   1e-5, 1e-6);
      if (base.size() > 7 && base.compare(base.size() - 7, 7, "exp_avg") == 0)
        elements += double(end - b);
      if (base.find("momentum_buffer") != std::string::npos) elements += double(end - b);
    }
  }
  comm::allreduce(comm, &elements, 1, DType::f64);
  expect_true(cat(what, ": the shards cover every element once (", elements, " of ", total, ")"),
              elements == total);
}

// The scenarios' variant: the GPU's data flow (staged through host copies).
thread_local bool g_staged = false;

ZeroOptions zero_options(const std::vector<Bucket>* buckets = nullptr) {
  return ZeroOptions{.buckets = buckets, .stage_through_host = g_staged};
}

void check_zero_equivalence(comm::Communicator& world, std::shared_ptr<comm::Communicator> comm,
                            const std::string& kind, const Factory& factory) {
  const int n = comm->size(), r = comm->rank();
  Replica mine = make_replica(), ref = make_replica();
  ZeroOptimizer zero(comm, mine.groups, factory, zero_options());
  // One host: unstaged segments share a region and reduce in place; staged ones use the ring.
  ++g_checks;
  if (zero.shared_buffers() != (!g_staged && n > 1)) {
    std::printf("rank %d: %s: shared buffers %d with %d ranks, staged %d\n", g_rank, kind.c_str(),
                int(zero.shared_buffers()), n, int(g_staged));
    ++g_failures;
  }
  std::unique_ptr<optim::Optimizer> plain = factory(ref.groups);
  const int steps = 4;
  for (int64_t t = 0; t < steps; ++t) {
    std::string what = cat(kind, " step ", t, " (", n, " ranks)");
    set_local_grads(mine, r, t);
    set_average_grads(ref, n, t);
    double lr = (kind == "sgd" ? 0.1 : 1e-2) * (1.0 - 0.1 * double(t));
    zero.set_lr(lr);
    plain->set_lr(lr);
    if (t == 2) {  // clipping by the norm of the averaged gradient
      double z = zero.clip_grad_norm(0.5);
      double p = optim::clip_grad_norm(optim::parameters(ref.groups), 0.5);
      expect_close(what + ": clip_grad_norm", scalar_tensor(z, DType::f64),
                   scalar_tensor(p, DType::f64), 1e-6, 0);
    }
    zero.step();
    plain->step();
    zero.zero_grad();
    plain->zero_grad();
    for (const ParamSpec& p : kParams)
      expect_close(cat(what, ": ", p.name), mine.by_name[p.name], ref.by_name[p.name], 1e-5, 1e-6);
  }
  double total = 0;
  for (const ParamSpec& p : kParams) total += double(shape_numel(p.shape));
  compare_state(cat(kind, " state (", n, " ranks)"), zero, *plain, *comm, total);

  // Round trip: a fresh optimizer loads the saved state and continues identically.
  std::vector<NamedTensor> saved;
  for (const NamedTensor& e : zero.state()) saved.push_back({e.name, e.tensor.clone()});
  Replica restored = clone_replica(mine);
  ZeroOptimizer resumed(comm, restored.groups, factory, zero_options());
  resumed.load_state(saved);
  resumed.set_lr(zero.lr());  // the lr is the schedule's (trainer state), not optimizer state
  for (int64_t t = steps; t < steps + 2; ++t) {
    set_local_grads(mine, r, t);
    set_local_grads(restored, r, t);
    zero.step();
    resumed.step();
    zero.zero_grad();
    resumed.zero_grad();
  }
  for (const ParamSpec& p : kParams)
    expect_close(cat(kind, " resumed (", n, " ranks): ", p.name), restored.by_name[p.name],
                 mine.by_name[p.name], 0, 0);

  // Layout errors; a refused state changes nothing.
  std::vector<NamedTensor> before;
  for (const NamedTensor& e : resumed.state()) before.push_back({e.name, e.tensor.clone()});
  auto unchanged = [&](const std::string& what) {
    std::vector<NamedTensor> after = resumed.state();
    for (size_t i = 0; i < after.size(); ++i)
      expect_close(cat(what, ": unchanged ", after[i].name), after[i].tensor, before[i].tensor, 0,
                   0);
  };
  std::vector<NamedTensor> plain_state = plain->state();
  expect_error(
      cat(kind, ": plain state"), [&] { resumed.load_state(plain_state); }, "not saved by ZeRO-1");
  unchanged(kind + " plain state");
  // Another rank's shard, passed round the ring as names only: rebuild it here.
  if (n > 1) {
    std::vector<NamedTensor> other = saved;
    other[0].name = cat("zero1.rank", (r + 1) % n, ".layout");
    expect_error(
        cat(kind, ": another rank's shard"), [&] { resumed.load_state(other); }, "another rank");
    unchanged(kind + " another rank");
  }
  // A state saved over a smaller group (ranks 0..n-2, or each rank alone at 2 ranks).
  int color = n > 2 ? (world.rank() < n - 1 ? 0 : -1) : world.rank();
  std::shared_ptr<comm::Communicator> sub = world.split(color, world.rank());
  if (sub) {
    Replica other = make_replica();
    ZeroOptimizer smaller(sub, other.groups, factory, zero_options());
    std::vector<NamedTensor> small_state = smaller.state();
    bool same_rank = sub->rank() == r;
    expect_error(
        cat(kind, ": a state of world size ", sub->size()),
        [&] { resumed.load_state(small_state); },
        same_rank ? "saved on a different layout: world size" : "another rank");
    unchanged(kind + " other layout");
  }
}

int run_zero(comm::Communicator& world) {
  std::shared_ptr<comm::Communicator> comm = world.split(0, world.rank());
  check_zero_equivalence(world, comm, "sgd", sgd_factory());
  check_zero_equivalence(world, comm, "adamw", adamw_factory());
  return 0;
}

// ---- ZeRO-1 under DataParallel ----

class Mlp : public Module {
 public:
  Mlp() {
    Generator gen(13, 4);
    fc1 = register_module("fc1", std::make_shared<Linear>(5, 7, gen));
    fc2 = register_module("fc2", std::make_shared<Linear>(7, 3, gen));
  }
  Tensor forward(const Tensor& x) override { return (*fc2)(tanh((*fc1)(x))); }
  std::shared_ptr<Linear> fc1, fc2;
};

std::vector<optim::ParamGroup> split_groups(const Module& m) {
  WeightDecaySplit split = split_weight_decay(m);
  return {optim::ParamGroup{split.decay}, optim::ParamGroup{split.no_decay, 0.0, 0.5}};
}

int run_zero_ddp(comm::Communicator& world) {
  std::shared_ptr<comm::Communicator> comm = world.split(0, world.rank());
  const int n = comm->size(), r = comm->rank();
  // Small buckets: several segments, parameters split across ranks inside each.
  DataParallelOptions dpo;
  dpo.bucket_bytes = 64;
  dpo.first_bucket_bytes = 32;
  auto ref_model = std::make_shared<Mlp>(), zero_model = std::make_shared<Mlp>();
  DataParallel ref_dp(ref_model, comm, dpo);
  std::shared_ptr<ZeroOptimizer> zero;
  DataParallelOptions zero_dpo = dpo;
  zero_dpo.reduce = zero_bucket_reduce(&zero);
  DataParallel zero_dp(zero_model, comm, zero_dpo);
  Factory factory = adamw_factory();
  zero = std::make_shared<ZeroOptimizer>(comm, split_groups(*zero_model), factory,
                                         zero_options(&zero_dp.buckets()));
  std::unique_ptr<optim::Optimizer> plain = factory(split_groups(*ref_model));
  expect_true(cat("zero_ddp: ", zero_dp.buckets().size(), " buckets"),
              zero_dp.buckets().size() >= 2);
  for (int64_t t = 0; t < 4; ++t) {
    Generator gen(uint64_t(700 + t), uint64_t(r));
    Tensor x = uniform({4, 5}, -1, 1, gen), probe = uniform({4, 3}, -1, 1, gen);
    sum((*ref_model)(x)*probe).backward();
    sum((*zero_model)(x)*probe).backward();
    ref_dp.finish();
    zero_dp.finish();
    if (t != 1) {  // step 1 is skipped (as for a non-finite loss) after its reduction
      plain->step();
      zero->step();
    }
    zero->zero_grad();
    ref_dp.zero_grad();
    zero_dp.zero_grad();
    std::vector<NamedTensor> a = zero_model->named_parameters(), e = ref_model->named_parameters();
    for (size_t i = 0; i < a.size(); ++i)
      expect_close(cat("zero_ddp step ", t, " (", n, " ranks): ", a[i].name), a[i].tensor,
                   e[i].tensor, 1e-5, 1e-6);
  }
  compare_state(cat("zero_ddp state (", n, " ranks)"), *zero, *plain, *comm,
                double(zero_model->num_parameters()));
  return 0;
}

// ---- SyncBatchNorm ----

// conv -> batch norm -> relu, the batch norm first of the model's modules.
class ConvBn : public Module {
 public:
  explicit ConvBn(Generator& gen) {
    conv = register_module("conv", std::make_shared<Conv2d>(Conv2dOptions{3, 4, {3, 3}}, gen));
    bn = register_module("bn", std::make_shared<BatchNorm2d>(4));
  }
  Tensor forward(const Tensor& x) override { return conv_bn(*conv, *bn, x, /*relu=*/true); }
  std::shared_ptr<Conv2d> conv;
  std::shared_ptr<BatchNorm2d> bn;
};

std::shared_ptr<ConvBn> make_conv_bn() {
  Generator gen(11, 2);
  auto m = std::make_shared<ConvBn>(gen);
  m->bn->weight.copy_(uniform({4}, 0.5, 1.5, gen));
  m->bn->bias.copy_(uniform({4}, -0.5, 0.5, gen));
  return m;
}

// convert_sync_batchnorm, with sync_batch_norm_ops when g_staged.
int convert_bn(Module& model, std::shared_ptr<comm::Communicator> comm) {
  return convert_sync_batchnorm(model, std::move(comm), /*by_ops=*/g_staged);
}

int run_syncbn(comm::Communicator& world) {
  std::shared_ptr<comm::Communicator> comm = world.split(0, world.rank());
  const int n = comm->size(), r = comm->rank();
  // Rank q's batch is 2 + q images: the global batch concatenates them.
  auto batch_of = [](int q) { return int64_t(2 + q); };
  int64_t first = 0, global = 0;
  for (int q = 0; q < n; ++q) {
    if (q < r) first += batch_of(q);
    global += batch_of(q);
  }
  auto ref = make_conv_bn(), mine = make_conv_bn();
  std::vector<std::string> names_before;
  for (const NamedTensor& p : mine->state()) names_before.push_back(p.name);
  expect_true("convert_sync_batchnorm converts the one BatchNorm2d", convert_bn(*mine, comm) == 1);
  std::vector<std::string> names_after;
  for (const NamedTensor& p : mine->state()) names_after.push_back(p.name);
  expect_true("conversion keeps the state names", names_before == names_after);

  for (int64_t step = 0; step < 3; ++step) {
    std::string what = cat("syncbn step ", step, " (", n, " ranks)");
    Generator gen(uint64_t(500 + step), 3);
    Tensor x_all = to_channels_last(uniform({global, 3, 6, 5}, -2, 3, gen));
    Tensor probe = uniform({global, 4, 4, 3}, -1, 1, gen);
    Tensor x_ref = x_all.clone().requires_grad_();
    Tensor x_mine = x_all.slice(0, first, first + batch_of(r)).contiguous();
    x_mine = to_channels_last(x_mine).detach().requires_grad_();
    // Summed losses, so each image's gradient is the same in both runs.
    Tensor out_ref = (*ref)(x_ref);
    sum(out_ref * probe).backward();
    Tensor out_mine = (*mine)(x_mine);
    sum(out_mine * probe.slice(0, first, first + batch_of(r))).backward();
    expect_close(what + ": output", out_mine, out_ref.slice(0, first, first + batch_of(r)), 1e-4,
                 1e-5);
    expect_close(what + ": input gradient", x_mine.grad(),
                 x_ref.grad().slice(0, first, first + batch_of(r)), 1e-4, 1e-5);
    // Parameter gradients: this rank's share; their sum over the ranks is the global one.
    std::vector<NamedTensor> params_ref = ref->named_parameters(),
                             params_mine = mine->named_parameters();
    for (size_t i = 0; i < params_mine.size(); ++i) {
      Tensor g = params_mine[i].tensor.grad().contiguous();
      comm::allreduce(*comm, g);
      expect_close(cat(what, ": gradient of ", params_mine[i].name), g, params_ref[i].tensor.grad(),
                   1e-4, 1e-4);
    }
    ref->zero_grad();
    mine->zero_grad();
    for (const char* b : {"running_mean", "running_var"}) {
      Tensor a = b[8] == 'm' ? mine->bn->running_mean : mine->bn->running_var;
      Tensor e = b[8] == 'm' ? ref->bn->running_mean : ref->bn->running_var;
      expect_close(cat(what, ": ", b), a, e, 1e-5, 1e-6);
    }
    expect_close(what + ": num_batches_tracked", mine->bn->num_batches_tracked,
                 ref->bn->num_batches_tracked, 0, 0);
  }
  // Under DataParallel (bucket reductions in flight on the same communicator
  // while backward all-reduces the batch-norm terms): the averaged gradients
  // are the global ones over the number of ranks.
  {
    auto ddp_model = make_conv_bn();
    convert_bn(*ddp_model, comm);
    DataParallelOptions dpo;
    dpo.first_bucket_bytes = 16;  // a bucket per parameter: reductions start in backward
    dpo.bucket_bytes = 16;
    DataParallel dp(ddp_model, comm, dpo);
    auto ref_model = make_conv_bn();
    for (int64_t step = 0; step < 2; ++step) {
      Generator gen(uint64_t(800 + step), 3);
      Tensor x_all = uniform({global, 3, 6, 5}, -2, 3, gen);
      Tensor probe = uniform({global, 4, 4, 3}, -1, 1, gen);
      sum((*ref_model)(to_channels_last(x_all)) * probe).backward();
      Tensor x = to_channels_last(x_all.slice(0, first, first + batch_of(r)).contiguous());
      sum(dp(x) * probe.slice(0, first, first + batch_of(r))).backward();
      dp.finish();
      std::vector<NamedTensor> e = ref_model->named_parameters(), a = ddp_model->named_parameters();
      for (size_t i = 0; i < a.size(); ++i)
        expect_close(cat("syncbn under DataParallel step ", step, ": gradient of ", a[i].name),
                     a[i].tensor.grad() * double(n), e[i].tensor.grad(), 1e-4, 1e-4);
      dp.zero_grad();
      ref_model->zero_grad();
    }
  }
  // Evaluation normalises by the running statistics, without communication.
  ref->eval();
  mine->eval();
  Generator gen(900, 3);
  Tensor x = to_channels_last(uniform({batch_of(r), 3, 6, 5}, -2, 3, gen));
  autograd::NoGradGuard no_grad;
  expect_close("syncbn eval output", (*mine)(x), (*ref)(x), 1e-5, 1e-6);
  return 0;
}

}  // namespace

int trainer::testing::run_zero_checks(comm::Communicator& world,
                                      const std::vector<std::string>& scenarios) {
  for (std::string scenario : scenarios) {
    const std::string staged_suffix = "_staged";
    g_staged =
        scenario == "syncbn_ops" || (scenario.size() > staged_suffix.size() &&
                                     scenario.compare(scenario.size() - staged_suffix.size(),
                                                      staged_suffix.size(), staged_suffix) == 0);
    if (g_staged)
      scenario = scenario == "syncbn_ops"
                     ? "syncbn"
                     : scenario.substr(0, scenario.size() - staged_suffix.size());
    if (scenario == "zero") {
      run_zero(world);
    } else if (scenario == "zero_ddp") {
      run_zero_ddp(world);
    } else if (scenario == "syncbn") {
      run_syncbn(world);
    } else {
      std::fprintf(stderr,
                   "usage: zero_worker [zero] [zero_ddp] [syncbn] [zero_staged] "
                   "[zero_ddp_staged] [syncbn_ops]\n");
      return 2;
    }
  }
  comm::barrier(world);
  return report_checks();
}
