#include "trainer/distributed.h"
#include "models/registry.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>

#include "comm/bootstrap.h"
#include "comm/collectives.h"
#include "optim/clip.h"
#include "parallel/device_staging.h"
#include "parallel/pipeline_runtime.h"
#include "parallel/planner.h"
#include "parallel/sync_batchnorm.h"
#include "trainer/device.h"
#include "trainer/metrics.h"
#include "trainer/model_setup.h"
#include "trainer/pipeline_split.h"
#include "trainer/session.h"
#include "trainer/tensorboard.h"

namespace trainer {

namespace {

// parallel.mode = parameter_server: the workers among world_size ranks,
// after checking what the servers' way of training allows.
int parameter_server_workers(const Recipe& r, int world_size) {
  const ParallelRecipe& p = r.parallel;
  const std::string what = cat(r.source, ": parallel.mode = parameter_server");
  if (p.servers >= world_size)
    throw Error(cat(what, " with parallel.servers = ", p.servers, " leaves no worker among the ",
                    world_size, world_size == 1 ? " rank" : " ranks", "; launch at least ",
                    p.servers + 1, " ranks (trainer launch --nproc-per-node ", p.servers + 1,
                    ") or lower parallel.servers"));
  if (p.pp != 1 || p.tp != 1)
    throw Error(cat(what, ": the servers hold whole replicas' parameters; pipeline and tensor ",
                    "parallelism need parallel.mode = allreduce (parallel.pp = ", p.pp,
                    ", parallel.tp = ", p.tp, ")"));
  if (zero_stage(p) > 0)
    throw Error(cat(what, ": the servers already hold the optimizer state, sharded; set ",
                    "parallel.shard=none (and parallel.zero1=false)"));
  if (r.optimizer.clip_grad_norm > 0)
    throw Error(cat(what, ": optimizer.clip_grad_norm needs the norm of the global gradient, ",
                    "which no rank sees; set optimizer.clip_grad_norm=0 or use parallel.mode = "
                    "allreduce"));
  if (r.device == "cuda" || r.precision == "fp16")
    throw Error(cat(what, ": the servers update f32 parameters on the CPU; use device=cpu and ",
                    "precision fp32 or bf16 (device = ", r.device, ", precision = ", r.precision,
                    ")"));
  return world_size - int(p.servers);
}

// Why the recipe's dp x pp x tp ranks are not the world's, and what to
// launch or set instead.
std::string layout_mismatch(const Recipe& r, int world_size) {
  const ParallelRecipe& p = r.parallel;
  const int64_t model_ranks = p.ep * p.pp * p.cp * p.tp;
  // "pp x tp", with ep and cp when the recipe uses them.
  std::string dims = "pp", sizes = cat(p.pp);
  if (p.ep > 1) dims = "ep x " + dims, sizes = cat(p.ep, " x ", sizes);
  if (p.cp > 1) dims += " x cp", sizes += cat(" x ", p.cp);
  dims += " x tp", sizes += cat(" x ", p.tp);
  const std::string ranks = cat(world_size, world_size == 1 ? " rank" : " ranks");
  if (p.dp > 0 && world_size % model_ranks == 0)
    // An explicit dp that another count would fit.
    return cat(r.source, ": parallel.dp = ", p.dp,
               model_ranks > 1 ? cat(" x ", dims, " = ", p.dp * model_ranks) : std::string(),
               " but the job has ", ranks, "; launch dp x ", dims,
               " ranks (trainer launch --nproc-per-node ", p.dp * model_ranks,
               ") or set parallel.dp=", world_size / model_ranks);
  // The world is no multiple of the model's ranks: no dp fits it.
  const std::string dp_text = p.dp > 0 ? cat(p.dp) : std::string("dp");
  const int64_t launch = p.dp > 0 ? p.dp * model_ranks : model_ranks;
  return cat(r.source, ": the layout dp x ", dims, " = ", dp_text, " x ", sizes,
             p.dp > 0 ? cat(" = ", launch, " ranks") : std::string(),
             " needs a world that is a multiple of ", dims, " = ", model_ranks,
             ", but this job has ", ranks, "; launch dp x ", dims,
             " ranks (trainer launch --nproc-per-node ", launch,
             p.dp > 0 || launch >= world_size
                 ? std::string()
                 : cat(", or ", (world_size + model_ranks - 1) / model_ranks * model_ranks),
             ") or lower parallel.pp", p.ep > 1 ? ", parallel.ep" : "",
             p.cp > 1 ? ", parallel.cp" : "", " or parallel.tp");
}

// The count auto chose (parallel.micro_batches unset) and why, or the
// bubble an explicit count below pp leaves: one line for rank 0 to print,
// "" when there is nothing to say.
std::string micro_batches_note(const Recipe& given, int64_t chosen, int64_t dp) {
  const ParallelRecipe& p = given.parallel;
  const bool wavefront = p.time_chunks > 1 || p.schedule == "wavefront";
  if (p.pp == 1 || wavefront) return "";
  const std::string bubble =
      cat(int(std::lround(100 * pipeline_bubble(given, chosen))), "% of each step");
  const int64_t replica_batch = given.training.global_batch / std::max<int64_t>(dp, 1);
  if (p.micro_batches == 0)
    return cat("parallel.micro_batches: ", chosen,
               " (unset: the largest count up to 2 x pp = ", 2 * p.pp,
               p.schedule == "interleaved" ? ", a multiple of pp," : "", " that divides the ",
               replica_batch, " samples of a replica's step); the ", p.schedule,
               " pipeline's bubble is ", bubble,
               chosen < p.pp ? cat("; a training.global_batch divisible by ", 2 * p.pp * dp,
                                   " would allow ", 2 * p.pp, " micro-batches")
                             : std::string());
  if (p.micro_batches >= p.pp) return "";
  return cat("warning: parallel.micro_batches = ", p.micro_batches, " with parallel.pp = ", p.pp,
             ": the stages idle ", bubble, " (the ", p.schedule, " pipeline's bubble",
             p.schedule == "gpipe" || p.schedule == "1f1b" ? ", (pp - 1) / (M + pp - 1)" : "",
             "); use at least 2 x pp = ", 2 * p.pp, " micro-batches dividing the ", replica_batch,
             " samples of a replica's step, or leave parallel.micro_batches unset to have them "
             "chosen");
}

}  // namespace

int64_t resolved_micro_batches(const Recipe& recipe, int64_t dp) {
  const ParallelRecipe& p = recipe.parallel;
  if (p.micro_batches > 0) return p.micro_batches;
  if (p.pp == 1 || p.time_chunks > 1 || p.schedule == "wavefront") return 1;
  const int64_t global = recipe.training.global_batch;
  if (dp < 1 || global % dp != 0) return 1;  // the session says why the batch does not split
  const int64_t replica_batch = global / dp;
  // Interleaved 1F1B runs micro-batches in groups of pp.
  const int64_t step = p.schedule == "interleaved" ? p.pp : 1;
  for (int64_t m = 2 * p.pp / step * step; m >= step; m -= step)
    if (replica_batch % m == 0) return m;
  return step;
}

double pipeline_bubble(const Recipe& recipe, int64_t micro_batches) {
  const ParallelRecipe& p = recipe.parallel;
  // One micro-batch's forward 1 and backward 2, as `trainer plan` draws them.
  const double forward = 1, backward = 2;
  const double step = parallel::pipeline_step_time(p.schedule, int(p.pp), int(micro_batches),
                                                   int(p.virtual_stages), forward, backward);
  return step > 0 ? 1 - double(micro_batches) * (forward + backward) / step : 0;
}

namespace {

// The keys of tensor parallelism the rest of the recipe must allow.
void check_tensor_parallel_keys(const Recipe& r) {
  const ParallelRecipe& p = r.parallel;
  if (p.tp > 1) {
    if (model_traits(r.model.name).recurrent)
      throw Error(cat(r.source, ": parallel.tp = ", p.tp,
                      ": the LSTM LM is split by layers, not within them: run a layer per rank "
                      "with parallel.tp=1 parallel.pp=",
                      std::min<int64_t>(p.tp, r.model.n_layer),
                      " parallel.schedule=wavefront parallel.time_chunks=4 (the sequence cut "
                      "into time chunks that flow through the layers as a wavefront)"));
    if (r.device == "cuda")
      throw Error(cat(r.source, ": parallel.tp = ", p.tp,
                      " with device cuda: tensor-parallel layers run on CPU tensors only; use "
                      "device=cpu"));
    const int64_t seq = window_tokens(r);
    if (p.sequence_parallel && seq % p.tp != 0)
      throw Error(cat(r.source, ": parallel.sequence_parallel splits the sequence over the ", p.tp,
                      " tensor-parallel ranks, but the ", seq,
                      "-token windows (data.seq_len, or model.context) do not divide by "
                      "parallel.tp; use a multiple of ",
                      p.tp));
  }
}

// Context parallelism: GPT and Llama on CPU tensors, windows that split
// into equal chunks.
void check_context_keys(const Recipe& r) {
  const ParallelRecipe& p = r.parallel;
  if (p.cp == 1) return;
  const std::string what = cat(r.source, ": parallel.cp = ", p.cp);
  if (r.model.name != "gpt" && r.model.name != "llama")
    throw Error(cat(
        what, ": context parallelism splits a Transformer's sequences; model.name = ", r.model.name,
        " has no context-parallel form (gpt and llama have); use "
        "parallel.cp=1"));
  if (r.device == "cuda")
    throw Error(cat(what,
                    " with device cuda: context-parallel attention runs on CPU tensors "
                    "only; use device=cpu"));
  if (r.parallel.mode != "allreduce")
    throw Error(cat(what, " with parallel.mode = ", r.parallel.mode,
                    ": context parallelism needs parallel.mode=allreduce"));
  const int64_t seq = window_tokens(r), chunks = p.cp_load_balance ? 2 * p.cp : p.cp;
  if (seq % chunks != 0)
    throw Error(cat(what, ": the ", seq, "-token windows (data.seq_len) do not split into ", chunks,
                    " equal chunks",
                    p.cp_load_balance ? " (causal load balancing: 2 x parallel.cp of them)" : "",
                    "; use a data.seq_len that is a multiple of ", chunks,
                    p.cp_load_balance
                        ? cat(", or parallel.cp_load_balance=false (a multiple of ", p.cp, ")")
                        : std::string()));
}

// The LSTM LM's wavefront: time chunks as micro-batches.
void check_time_chunk_keys(const Recipe& r) {
  const ParallelRecipe& p = r.parallel;
  if (p.time_chunks > 1 || p.schedule == "wavefront") {
    const int64_t seq = window_tokens(r);
    const std::string what =
        cat(": parallel.time_chunks = ", p.time_chunks, " with parallel.schedule = ", p.schedule);
    if (!model_traits(r.model.name).recurrent)
      throw Error(cat(r.source, what, ": time chunks are the LSTM LM's wavefront (model.name = ",
                      "lstm_lm); ", r.model.name,
                      " needs whole sequences: leave parallel.time_chunks at 1 and choose gpipe, "
                      "1f1b, interleaved or zbh1"));
    if (p.time_chunks < 2 || p.schedule != "wavefront" || p.pp < 2)
      throw Error(cat(r.source, what, ", parallel.pp = ", p.pp,
                      ": the LSTM LM's wavefront needs all three: parallel.pp >= 2 stages (up to "
                      "model.n_layer = ",
                      r.model.n_layer,
                      ", one layer each), parallel.schedule=wavefront and parallel.time_chunks >= "
                      "2"));
    if (p.micro_batches > 1)
      throw Error(cat(r.source, what, ": the time chunks are the wavefront's micro-batches; set ",
                      "parallel.micro_batches=1 (parallel.micro_batches = ", p.micro_batches, ")"));
    if (seq % p.time_chunks != 0)
      throw Error(cat(r.source, what, ": the ", seq,
                      "-token windows (data.seq_len) do not divide into parallel.time_chunks; use "
                      "a divisor of ",
                      seq));
  }
}

// The pipeline keys: refused without a pipeline, checked against each other with one.
void check_pipeline_keys(const Recipe& r) {
  const ParallelRecipe& p = r.parallel;
  const ParallelRecipe defaults;
  if (p.pp == 1) {
    // Read by pipeline schedules only; accepted at their defaults so recipes
    // can spell them out (micro_batches: unset, or the 1 it resolves to).
    if (p.micro_batches > 1)
      throw Error(cat(r.source, ": parallel.micro_batches = ", p.micro_batches,
                      " is the number of micro-batches a pipeline (parallel.pp > 1) splits each "
                      "step into; with pp = 1 leave it unset (or 1) and use training.grad_accum "
                      "to split a step"));
    if (p.schedule != defaults.schedule || p.virtual_stages != 1)
      throw Error(cat(r.source, ": parallel.schedule = '", p.schedule,
                      "' (parallel.virtual_stages = ", p.virtual_stages,
                      ") orders a pipeline's (parallel.pp > 1) forward and backward passes; with "
                      "pp = 1 there is one stage and nothing to order: leave them at '",
                      defaults.schedule, "' and 1"));
  } else {
    if (r.training.grad_accum != 1)
      throw Error(cat(r.source, ": training.grad_accum = ", r.training.grad_accum,
                      " with parallel.pp = ", p.pp,
                      ": a pipeline splits each step into parallel.micro_batches; set "
                      "training.grad_accum=1 and parallel.micro_batches=",
                      r.training.grad_accum * std::max<int64_t>(p.micro_batches, 1)));
    if (p.virtual_stages > 1 && p.schedule != "interleaved")
      throw Error(cat(r.source, ": parallel.virtual_stages = ", p.virtual_stages,
                      " needs parallel.schedule=interleaved (the others run one chunk per stage)"));
    if (p.schedule == "interleaved" && p.virtual_stages < 2)
      throw Error(cat(r.source,
                      ": parallel.schedule=interleaved needs parallel.virtual_stages "
                      ">= 2 model chunks per stage"));
  }
}

// Sharded gradients and parameters: what they do not compose with yet.
void check_sharding_keys(const Recipe& r, int stage) {
  const std::string what = cat(r.source, ": parallel.shard = ", kShardNames[stage]);
  if (r.device != "cpu")
    throw Error(cat(what, " on device ", r.device,
                    ": sharded gradients and parameters run on the CPU; use parallel.shard = "
                    "optimizer on GPUs"));
}

// parallel.dp_replicate: the replica groups of hybrid sharding (1 without).
int64_t hybrid_replicas(const Recipe& r, int64_t dp, int stage) {
  const int64_t replicas = r.parallel.dp_replicate;
  if (replicas == 1) return 1;
  const std::string what = cat(r.source, ": parallel.dp_replicate = ", replicas);
  if (stage == 0)
    throw Error(cat(what, " with parallel.shard = none: replica groups of hybrid sharding need ",
                    "something to shard inside them; set parallel.shard (optimizer, gradients or ",
                    "parameters) or parallel.dp_replicate=1"));
  if (dp % replicas != 0 || dp / replicas < 2)
    throw Error(cat(what, " with dp = ", dp, ": hybrid sharding needs groups of at least 2 ranks ",
                    "that divide the dp ranks; use a divisor of ", dp, " below it as ",
                    "parallel.dp_replicate (or 1 to shard over all ", dp, ")"));
  return replicas;
}

}  // namespace

ShardDtypes shard_dtypes(const Recipe& r, int stage) {
  const ParallelRecipe& p = r.parallel;
  ShardDtypes out;
  const bool bf16 = r.precision == "bf16";
  if (p.param_dtype == "bf16" && (stage != 3 || !bf16))
    throw Error(cat(r.source, ": parallel.param_dtype = bf16 with parallel.shard = ",
                    kShardNames[stage], " and precision ", r.precision,
                    ": only sharded parameters (parallel.shard = parameters) are gathered, in "
                    "bf16 under precision bf16; use parallel.param_dtype = auto"));
  if (p.param_dtype == "bf16" || (p.param_dtype == "auto" && stage == 3 && bf16))
    out.param = DType::bf16;
  if (p.reduce_dtype == "bf16" && stage < 2)
    throw Error(cat(r.source, ": parallel.reduce_dtype = bf16 with parallel.shard = ",
                    kShardNames[stage], ": gradients are reduced in bf16 when they are sharded ",
                    "(parallel.shard = gradients or parameters); use parallel.reduce_dtype = f32"));
  if (p.reduce_dtype == "bf16") out.reduce = DType::bf16;
  return out;
}

std::string shard_label(const Recipe& r, const ParallelLayout& layout) {
  if (!layout.zero1) return "";
  const ShardDtypes d = shard_dtypes(r, layout.zero_stage);
  return cat(", zero", layout.zero_stage, d.param ? cat(", gathers ", *d.param) : "",
             d.reduce ? cat(", reduces ", *d.reduce) : "");
}

int zero_stage(const ParallelRecipe& p) {
  const auto* it = std::find(std::begin(kShardNames), std::end(kShardNames), p.shard);
  CHECK(it != std::end(kShardNames)) << "parallel.shard '" << p.shard << "'";
  const int stage = int(it - std::begin(kShardNames));
  return stage == 0 && p.zero1 ? 1 : stage;
}

ParallelLayout parallel_layout(const Recipe& r, int world_size) {
  if (r.parallel.mode == "parameter_server") world_size = parameter_server_workers(r, world_size);
  const ParallelRecipe& p = r.parallel;
  check_tensor_parallel_keys(r);
  check_time_chunk_keys(r);
  check_pipeline_keys(r);
  check_context_keys(r);
  check_expert_keys(r);
  const int64_t model_ranks = p.ep * p.pp * p.cp * p.tp;
  const int64_t dp = p.dp == 0 ? world_size / model_ranks : p.dp;
  if (dp == 0 || dp * model_ranks != world_size) throw Error(layout_mismatch(r, world_size));
  ParallelLayout layout;
  const int stage = zero_stage(p);
  // Hybrid sharding: dp_replicate groups of dp_shard ranks. Otherwise the
  // dp ranks are one dimension, dp_replicate, sharded or not.
  const int64_t replicas = hybrid_replicas(r, dp, stage);
  const int64_t shard_group = replicas > 1 ? dp / replicas : 1;
  layout.mesh = parallel::MeshShape{{parallel::Dim::dp_replicate, int(dp / shard_group)},
                                    {parallel::Dim::dp_shard, int(shard_group)},
                                    {parallel::Dim::ep, int(p.ep)},
                                    {parallel::Dim::pp, int(p.pp)},
                                    {parallel::Dim::cp, int(p.cp)},
                                    {parallel::Dim::tp, int(p.tp)}};
  // The shards spread over the dp ranks and the cp ranks, which hold the
  // same parameters (their gradients are of other tokens of the same windows).
  const bool shards = dp * p.cp > 1;
  if (stage > 1 && shards) check_sharding_keys(r, stage);
  if (shards) shard_dtypes(r, stage);  // refuses a combination that does not apply
  layout.zero1 = stage > 0 && shards;
  layout.zero_stage = layout.zero1 ? stage : 0;
  return layout;
}

RankLayout rank_layout(const ParallelLayout& job, int rank) {
  return RankLayout{.job = job, .rank = rank, .coord = parallel::mesh_coord(job.mesh, rank)};
}

Distributed join_job(Recipe& recipe, bool dry_run) {
  comm::Bootstrap boot = comm::detect_bootstrap();
  // Here and not in parallel_layout: the planner's CPU profiles time a tp
  // rank's part on one process with sequence parallelism on (trainer/plan_cpu.cpp).
  if (recipe.parallel.sequence_parallel && recipe.parallel.tp == 1)
    throw Error(cat(recipe.source,
                    ": parallel.sequence_parallel needs parallel.tp > 1: it splits the sequence "
                    "over the tensor-parallel ranks, and parallel.tp = 1 has none; set "
                    "parallel.tp=2 (or more, launching as many ranks per replica) or "
                    "parallel.sequence_parallel=false"));
  // A dry run started alone describes rank 0 of the layout the recipe asks for.
  const int64_t model_ranks =
      recipe.parallel.ep * recipe.parallel.pp * recipe.parallel.cp * recipe.parallel.tp;
  const bool ps = recipe.parallel.mode == "parameter_server";
  const int world = dry_run && boot.world_size == 1
                        ? int(std::max<int64_t>(recipe.parallel.dp, 1) * model_ranks +
                              (ps ? recipe.parallel.servers : 0))
                        : boot.world_size;
  const ParallelLayout job = parallel_layout(recipe, world);
  // The tensor-parallel group is the mesh's innermost dimension: ranks
  // [k tp, (k + 1) tp), on one host when the host's ranks divide by tp.
  const int tp = job.mesh[parallel::Dim::tp], local = boot.local_world_size;
  if (tp > 1 && world == boot.world_size && tp <= local && local % tp != 0) {
    std::string fits;
    for (int d = 1; d <= local; ++d)
      if (local % d == 0) fits += (fits.empty() ? "" : ", ") + std::to_string(d);
    throw Error(cat(recipe.source, ": parallel.tp = ", tp, " with ", local,
                    " ranks per host: some tensor-parallel groups would span two hosts, though ",
                    tp, " ranks fit on one; use a parallel.tp dividing ", local, " (", fits,
                    ") or start a multiple of ", tp, " ranks per host"));
  }
  const int64_t micro_batches = resolved_micro_batches(recipe, job.mesh.size(parallel::kBatchDims));
  const std::string note =
      micro_batches_note(recipe, micro_batches, job.mesh.size(parallel::kBatchDims));
  recipe.parallel.micro_batches = micro_batches;
  if (!note.empty() && boot.rank == 0) {
    std::FILE* out = note.starts_with("warning") ? stderr : stdout;
    std::fprintf(out, "%s\n", note.c_str());
    std::fflush(out);
  }
  if (world != boot.world_size) {
    Distributed spare;
    spare.layout = rank_layout(job, 0);
    return spare;
  }
  Distributed d;
  if (ps) {
    // Workers first, the servers last; the mesh spans the workers.
    const int workers = job.world_size();
    d.servers = int(recipe.parallel.servers);
    d.is_server = boot.rank >= workers;
    d.everyone = comm::init_world(boot);
    d.layout = rank_layout(job, d.is_server ? 0 : boot.rank);
    d.layout.rank = boot.rank;
    std::shared_ptr<comm::Communicator> mine = d.everyone->split(d.is_server ? -1 : 0, boot.rank);
    if (mine) d.mesh = parallel::Mesh(job.mesh, mine);
    return d;
  }
  d.layout = rank_layout(job, boot.rank);
  if (boot.world_size > 1) d.mesh = parallel::Mesh(job.mesh, comm::init_world(boot));
  return d;
}

}  // namespace trainer
