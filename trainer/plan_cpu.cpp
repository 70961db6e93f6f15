// trainer plan --device cpu and parallel.auto: the model's blocks and the
// optimizer timed on this machine, next to companion processes that load
// the other cores as the plan's ranks would.
#include "models/registry.h"
#include "trainer/plan.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <set>

#include <sched.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include "core/cpu/threads.h"
#include "parallel/tensor_parallel.h"
#include "trainer/pipeline_split.h"
#include "trainer/plan_parts.h"
#include "trainer/precision.h"
#include "trainer/recipe.h"
#include "trainer/session.h"

namespace trainer {

void set_plain_layout(ParallelRecipe& p, int64_t dp) {
  p.dp = dp;
  p.pp = 1;
  p.tp = 1;
  p.micro_batches = 1;
  p.virtual_stages = 1;
  p.schedule = "1f1b";
  p.stages = "even";
  p.stage_starts.clear();
  p.sequence_parallel = false;
  p.zero1 = false;
  p.shard = "none";
  p.dp_replicate = 1;
}

namespace {

// Process-private memory a CPU rank needs beyond the model: the binary,
// oneDNN's scratch pads, the data loader, the allocator's slack.
constexpr double kCpuWorkspaceGib = 0.25;
// The median of this many optimizer steps, after one that allocates
// AdamW's moments.
constexpr int kOptimizerRepeats = 3;

std::vector<int> divisors_of(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

// Every micro-batch size the plans of `world` ranks at this tp can take.
std::set<int64_t> micro_batch_sizes(int64_t global_batch, int world, int tp) {
  std::set<int64_t> sizes;
  for (int pp : divisors_of(world / tp)) {
    const int dp = world / tp / pp;
    if (global_batch % dp != 0) continue;
    const int64_t per_replica = global_batch / dp;
    for (int64_t m = 1; m <= per_replica; ++m)
      if (per_replica % m == 0) sizes.insert(per_replica / m);
  }
  return sizes;
}

// The sizes to profile: the smallest, the largest and one between
// (geometrically), interpolated between for the rest.
std::vector<int64_t> sizes_to_profile(const std::set<int64_t>& needed) {
  if (needed.size() <= 3) return {needed.begin(), needed.end()};
  const int64_t lo = *needed.begin(), hi = *needed.rbegin();
  const double mid = std::sqrt(double(lo) * double(hi));
  int64_t between = lo;
  for (int64_t b : needed)
    if (std::fabs(std::log(double(b) / mid)) < std::fabs(std::log(double(between) / mid)))
      between = b;
  std::vector<int64_t> out{lo};
  if (between != lo && between != hi) out.push_back(between);
  out.push_back(hi);
  return out;
}

// The recipe as one process training micro-batches of `samples`.
Recipe one_process_recipe(Recipe recipe, int64_t samples) {
  recipe.training.global_batch = samples;
  recipe.training.grad_accum = 1;
  set_plain_layout(recipe.parallel, /*dp=*/1);
  return recipe;
}

// Each block's median over kProfileRepeats passes after a warm-up one (which
// builds oneDNN's primitives): a training run's step is a median too, and
// the best of a few passes is the one no other process disturbed.
constexpr int kProfileRepeats = 3;

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

parallel::MeasuredProfile profile_session(Session& session, const Recipe& recipe, int tp,
                                          int64_t samples) {
  const DType autocast = Precision(recipe, false).autocast_dtype();
  profile_blocks(session, autocast, 1);
  std::vector<BlockProfile> passes;
  for (int rep = 0; rep < kProfileRepeats; ++rep)
    passes.push_back(profile_blocks(session, autocast, 1));
  parallel::MeasuredProfile out{.tp = tp, .samples = samples, .blocks = {}};
  for (size_t i = 0; i < passes[0].forward_ms.size(); ++i) {
    std::vector<double> forward, backward;
    for (const BlockProfile& pass : passes) {
      forward.push_back(pass.forward_ms[i] * 1e-3);
      backward.push_back(pass.backward_ms[i] * 1e-3);
    }
    out.blocks.push_back({median_of(forward), median_of(backward)});
  }
  return out;
}

// The optimizer step over the whole model, per parameter.
double optimizer_seconds_per_param(Session& session) {
  for (const Tensor& p : session.model().parameters()) p.set_grad(zeros_like(p));
  session.optimizer().step();
  std::vector<double> seconds;
  for (int rep = 0; rep < kOptimizerRepeats; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    session.optimizer().step();
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return median_of(seconds) / double(std::max<int64_t>(1, session.model().num_parameters()));
}

}  // namespace

namespace {

// Binds this process to one core (as `trainer launch` binds a rank); false
// when the core is not ours to take.
bool bind_to_core(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  return sched_setaffinity(0, sizeof set, &set) == 0;
}

// The processes keeping the other ranks' cores busy while this one
// profiles: stopped, and this process's binding and thread count restored,
// however the profile ends. They die with this process too.
class Companions {
 public:
  Companions(const Recipe& recipe, int world, int per_node) {
    sched_getaffinity(0, sizeof affinity_, &affinity_);
    threads_ = num_threads();
    const std::vector<int> cores = allowed_cores();
    const int count = std::min<int>(std::min(world, per_node), int(cores.size())) - 1;
    for (int k = 1; k <= count; ++k) {
      std::fflush(nullptr);
      const pid_t pid = fork();
      if (pid == 0) run(recipe, world, cores[size_t(k)]);
      if (pid > 0) children_.push_back(pid);
    }
    if (count > 0) bind_to_core(cores[0]);
  }
  ~Companions() {
    for (pid_t pid : children_) {
      kill(pid, SIGTERM);
      waitpid(pid, nullptr, 0);
    }
    set_num_threads(threads_);
    sched_setaffinity(0, sizeof affinity_, &affinity_);
  }
  Companions(const Companions&) = delete;
  Companions& operator=(const Companions&) = delete;

 private:
  // A companion: the largest micro-batch's blocks and optimizer, over and over.
  [[noreturn]] static void run(const Recipe& recipe, int world, int core) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    bind_to_core(core);
    set_num_threads(recipe.training.threads > 0 ? int(recipe.training.threads) : 1);
    try {
      const int64_t samples = *micro_batch_sizes(recipe.training.global_batch, world, 1).rbegin();
      const Recipe one = one_process_recipe(recipe, samples);
      Session session(one, rank_layout(parallel_layout(one, 1), 0), DataAccess::assume_if_missing);
      for (;;) {
        profile_session(session, one, 1, samples);
        optimizer_seconds_per_param(session);
      }
    } catch (...) {
    }
    _exit(1);  // the profile itself reports the error
  }

  std::vector<pid_t> children_;
  cpu_set_t affinity_;
  int threads_ = 1;
};

}  // namespace

CpuProfile profile_for_cpu_plans(const Recipe& recipe, const parallel::ModelDesc& model, int world,
                                 int per_node) {
  const auto start = std::chrono::steady_clock::now();
  // The ranks of a plan share this host's memory bandwidth and caches (on a
  // VM perhaps one physical core's two threads): a rank alone runs its
  // blocks 25-45% faster than next to its peers (docs/planner.md). So the
  // other ranks' cores run the same kind of work meanwhile, in processes
  // forked before any thread pool exists, each bound to its core.
  const Companions companions(recipe, world, per_node);
  // The ranks of a CPU plan run one thread each (or the recipe's count).
  set_num_threads(recipe.training.threads > 0 ? int(recipe.training.threads) : 1);
  CpuProfile out;
  try {
    const bool splits = model.n_head > 0 || model.tp_channels > 0;
    for (int tp : divisors_of(std::min(world, per_node))) {
      if (tp > 1 && (!splits || per_node % tp != 0)) continue;
      for (int64_t samples :
           sizes_to_profile(micro_batch_sizes(recipe.training.global_batch, world, tp))) {
        Recipe one = one_process_recipe(recipe, samples);
        // As the planner's tp: with sequence parallelism for Transformers.
        const bool sequence_parallel = tp > 1 && model.n_head > 0;
        one.parallel.sequence_parallel = sequence_parallel;
        Session session(one, rank_layout(parallel_layout(one, 1), 0),
                        DataAccess::assume_if_missing);
        if (tp == 1 && out.optimizer_seconds_per_param == 0) {
          out.profiles.push_back(profile_session(session, one, tp, samples));
          out.optimizer_seconds_per_param = optimizer_seconds_per_param(session);
          continue;
        }
        if (tp > 1) {
          try {
            // Rank 0's part of the split model, its collectives moving nothing.
            session.set_tensor_parallel(parallel::shape_only_group(0, tp, sequence_parallel));
          } catch (const Error&) {
            break;  // the model does not split tp ways: plan_cluster says why
          }
        }
        out.profiles.push_back(profile_session(session, one, tp, samples));
      }
    }
  } catch (const Error& e) {
    throw Error(
        cat("--device cpu times the model's blocks on this machine, which needs the "
            "recipe's data: ",
            e.what()));
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

parallel::ClusterSpec this_machine_cluster(int nodes, int per_node) {
  if (per_node <= 0) per_node = std::max<int>(1, int(allowed_cores().size()));
  const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  return parallel::cpu_cluster(nodes, per_node, ram / (1024.0 * 1024.0 * 1024.0));
}

// CPU mode reads the data anyway: a language model's vocabulary is the
// data's (padded to a multiple of tp by the trainer), not the planning default.
Recipe with_data_vocabulary(Recipe recipe) {
  const bool text = model_traits(recipe.model.name).language_model;
  if (!text || recipe.model.vocab_size > 0) return recipe;
  try {
    const Recipe one = one_process_recipe(recipe, 1);
    Session session(one, rank_layout(parallel_layout(one, 1), 0), DataAccess::assume_if_missing);
    recipe.model.vocab_size = session.data().vocab_size();
  } catch (const Error& e) {
    throw Error(
        cat("--device cpu times the model's blocks on this machine, which needs the "
            "recipe's data: ",
            e.what()));
  }
  return recipe;
}

// CPU mode's request for the recipe on `cluster`, its timer from block
// times profiled here; what was measured is appended to notes.
parallel::PlanRequest cpu_plan_request(const Recipe& recipe, const parallel::ModelDesc& model,
                                       const parallel::ClusterSpec& cluster,
                                       std::unique_ptr<parallel::BlockTimer>* timer,
                                       std::vector<std::string>* notes) {
  parallel::PlanRequest request{.cluster = cluster, .global_batch = recipe.training.global_batch};
  request.precision = recipe.precision;
  request.bucket_mb = double(recipe.parallel.bucket_mb);
  request.workspace_gib = kCpuWorkspaceGib;
  // Recomputation costs each block's measured forward again; ZeRO-1 the
  // parameters' all-gather, for 1/dp of the optimizer's measured time.
  request.allow_recompute = true;
  request.allow_zero1 = true;
  request.max_zero = 3;  // parallel.shard up to parameters (ZeRO-3) on the CPU
  // Profiled CPU plans (and parallel.auto) leave context parallelism to the recipe.
  request.max_cp = 1;
  request.max_ep = 1;
  request.overlap_dp = false;
  CpuProfile profile = profile_for_cpu_plans(recipe, model, cluster.world(), cluster.per_node);
  request.optimizer_seconds_per_param = profile.optimizer_seconds_per_param;
  notes->push_back(cat("profiled on this machine in ", plan_number(profile.seconds),
                       " s; optimizer ", recipe.optimizer.name, " ",
                       plan_number(profile.optimizer_seconds_per_param * 1e9),
                       " ns per parameter"));
  *timer = std::make_unique<parallel::MeasuredBlockTimer>(
      std::move(profile.profiles),
      cat(recipe.training.threads > 0 ? recipe.training.threads : 1, " thread"));
  return request;
}

}  // namespace trainer
