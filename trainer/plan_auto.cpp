// parallel.auto: the layout planned at start-up for the launched ranks, or
// kept from the checkpoint a run resumes.
#include "models/registry.h"
#include "trainer/plan.h"

#include <algorithm>
#include <cstdio>

#include "comm/bootstrap.h"
#include "comm/collectives.h"
#include "parallel/schedule.h"
#include "trainer/plan_parts.h"
#include "trainer/recipe.h"
#include "trainer/session.h"

namespace trainer {

// ---- parallel.auto ----

namespace {

// The plan rank 0 chose, as the integers it broadcasts: ok, dp, pp, tp, M,
// schedule, the stage count, the ZeRO stage, recomputation, the replica
// groups of hybrid sharding, then each stage's first block.
constexpr size_t kMaxAutoStages = 64;
constexpr size_t kHead = 10;
const char* const kAutoSchedules[] = {"none", "gpipe", "1f1b", "zbh1"};
const char* const kAutoRecompute[] = {"none", "selective", "blocks"};  // parallel::Recompute order

int64_t index_of(const char* const* begin, const char* const* end, const std::string& name) {
  const auto it = std::find(begin, end, name);
  return it == end ? -1 : it - begin;
}

std::string plan_line(const parallel::Plan& plan) {
  return cat(parallel::plan_label(plan), ": ", plan_number(plan.terms.total() * 1e3),
             " ms per step");
}

}  // namespace

namespace {

// The choice join_job_planned broadcasts, from the resolved recipe of a
// checkpoint written by `world` ranks; empty when it was not (another world
// size, or a layout the planner does not make: interleaved, an even split).
std::vector<int64_t> checkpoint_choice(const std::string& dir, int world, size_t size) {
  const TrainerStateFile saved = read_trainer_state(dir);
  if (saved.state.layout.world_size() != world || saved.recipe_yaml.empty()) return {};
  const Recipe was = parse_recipe(saved.recipe_yaml, trainer_state_file(dir));
  const ParallelRecipe& p = was.parallel;
  const int64_t schedule =
      index_of(std::begin(kAutoSchedules), std::end(kAutoSchedules), p.schedule);
  const int64_t recompute =
      index_of(std::begin(kAutoRecompute), std::end(kAutoRecompute), p.recompute);
  const bool listed = p.pp == 1 || (p.stages == "list" && p.stage_starts.size() < kMaxAutoStages);
  if (!listed || p.virtual_stages != 1 || (p.pp > 1 && schedule < 0) || recompute < 0) return {};
  std::vector<int64_t> choice(size, 0);
  const int64_t head[kHead] = {1,
                               saved.state.layout.mesh.size(parallel::kDataParallel),
                               p.pp,
                               p.tp,
                               p.pp > 1 ? p.micro_batches : was.training.grad_accum,
                               p.pp > 1 ? schedule : 0,
                               p.pp > 1 ? int64_t(p.stage_starts.size()) + 1 : 0,
                               zero_stage(p),
                               recompute,
                               saved.state.layout.replica_groups()};
  std::copy(std::begin(head), std::end(head), choice.begin());
  // As the planner gives them: the first stage's start (0), then the recipe's list.
  for (size_t k = 0; p.pp > 1 && k < p.stage_starts.size(); ++k)
    choice[kHead + 1 + k] = int64_t(p.stage_starts[k]);
  std::printf(
      "parallel.auto: keeping the layout of %s, written by the same %d ranks: dp=%lld "
      "pp=%lld tp=%lld %s=%lld\n",
      dir.c_str(), world, (long long)head[1], (long long)p.pp, (long long)p.tp,
      p.pp > 1 ? "micro_batches" : "grad_accum", (long long)head[4]);
  std::fflush(stdout);
  return choice;
}

// Rank 0's plan for `world` ranks, per_node of them on each host, as the
// integers join_job_planned broadcasts (`size` of them); an Error when no
// layout fits.
std::vector<int64_t> planned_choice(const Recipe& recipe, int world, int per_node, size_t size) {
  std::vector<int64_t> choice(size, 0);
  std::vector<std::string> notes;
  const parallel::ModelDesc model = model_for_planning(with_data_vocabulary(recipe), &notes);
  const parallel::ClusterSpec cluster = this_machine_cluster(world / per_node, per_node);
  std::unique_ptr<parallel::BlockTimer> timer;
  parallel::PlanRequest request = cpu_plan_request(recipe, model, cluster, &timer, &notes);
  request.max_chunks = 1;  // interleaved needs parallel.virtual_stages: not chosen here
  const parallel::PlanResult result = parallel::plan_cluster(model, request, *timer);
  std::vector<const parallel::Plan*> usable;
  for (const parallel::Plan& plan : result.ranked)
    if (plan.chunks == 1 && plan.stage_starts.size() <= kMaxAutoStages) usable.push_back(&plan);
  if (usable.empty())
    throw Error(cat("parallel.auto: no layout of ", world, " ranks fits (trainer plan ",
                    recipe.source, " --nodes ", world / per_node, " --per-node ", per_node,
                    " --device cpu says why)"));
  const parallel::Plan& best = *usable[0];
  std::printf("parallel.auto: %s predicted%s; %s\n", plan_line(best).c_str(),
              usable.size() > 1 ? cat(" (runner-up ", plan_line(*usable[1]), ")").c_str() : "",
              notes.back().c_str());
  std::fflush(stdout);
  const int64_t head[kHead] = {
      1,
      best.dp,
      best.pp,
      best.tp,
      best.micro_batches,
      index_of(std::begin(kAutoSchedules), std::end(kAutoSchedules), best.schedule),
      int64_t(best.stage_starts.size()),
      best.zero,
      int64_t(best.recompute),
      best.replicas};
  std::copy(std::begin(head), std::end(head), choice.begin());
  for (size_t k = 0; k < best.stage_starts.size(); ++k)
    choice[kHead + k] = int64_t(best.stage_starts[k]);
  return choice;
}

// The broadcast choice set in the recipe: the layout, the pipeline's
// schedule and stages, or grad_accum without a pipeline.
void apply_choice(const std::vector<int64_t>& choice, Recipe& recipe) {
  ParallelRecipe& p = recipe.parallel;
  p.dp = choice[1], p.pp = choice[2], p.tp = choice[3];
  p.schedule = kAutoSchedules[choice[5]];
  if (choice[7] < 0 || choice[7] > 3) throw Error("parallel.auto: a ZeRO stage out of range");
  p.shard = kShardNames[choice[7]];
  p.zero1 = choice[7] == 1;
  p.recompute = kAutoRecompute[choice[8]];
  if (choice[9] < 1 || choice[9] > choice[1])
    throw Error("parallel.auto: replica groups out of range");
  p.dp_replicate = choice[9];
  if (p.pp > 1) {
    p.micro_batches = choice[4];
    recipe.training.grad_accum = 1;
    p.stages = "list";
    p.stage_starts.assign(choice.begin() + kHead + 1, choice.begin() + kHead + choice[6]);
  } else {
    p.micro_batches = 1;
    p.schedule = "1f1b";
    recipe.training.grad_accum = choice[4];
  }
  // As the planner times tp: with sequence parallelism for Transformers.
  p.sequence_parallel = p.tp > 1 && model_traits(recipe.model.name).sequence_parallel;
}

}  // namespace

Distributed join_job_planned(Recipe& recipe, bool dry_run,
                             const std::function<std::optional<std::string>()>& resume_from) {
  const char* unsupported = dry_run                  ? "--dry-run"
                            : recipe.device != "cpu" ? "device: cuda (it plans CPU ranks)"
                            : model_traits(recipe.model.name).recurrent
                                ? "model lstm_lm (its wavefront)"
                                : nullptr;
  if (unsupported)
    throw Error(cat(recipe.source, ": parallel.auto is not supported with ", unsupported));
  // Join as pure data parallelism: the world communicator does not depend on the layout.
  Recipe provisional = recipe;
  set_plain_layout(provisional.parallel, /*dp=*/0);  // 0: every rank
  Distributed joined = join_job(provisional);
  const int world = joined.world_size();
  const comm::Bootstrap boot = comm::detect_bootstrap();
  const int per_node = std::max(1, std::min(world, boot.local_world_size));
  std::vector<int64_t> choice(kHead + kMaxAutoStages, 0);
  std::string error;
  if (joined.is_main() && resume_from) {
    try {
      const std::optional<std::string> dir = resume_from();
      std::vector<int64_t> kept =
          dir ? checkpoint_choice(*dir, world, choice.size()) : std::vector<int64_t>{};
      if (!kept.empty()) choice = kept;
    } catch (const Error& e) {
      error = e.what();
    }
  }
  if (joined.is_main() && choice[0] == 0 && error.empty()) {
    try {
      choice = planned_choice(recipe, world, per_node, choice.size());
    } catch (const Error& e) {
      error = e.what();
      choice.assign(choice.size(), 0);
    }
  }
  if (joined.active())
    comm::broadcast(*joined.world(), choice.data(), choice.size() * sizeof(int64_t), 0);
  if (choice[0] != 1)
    throw Error(joined.is_main() ? error : "parallel.auto failed on rank 0 (see its error)");
  apply_choice(choice, recipe);
  Distributed planned;
  planned.layout = rank_layout(parallel_layout(recipe, world), joined.rank());
  if (joined.active()) planned.mesh = parallel::Mesh(planned.layout.job.mesh, joined.world());
  return planned;
}

}  // namespace trainer