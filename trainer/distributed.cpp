#include "trainer/distributed.h"

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
  if (p.zero1)
    throw Error(cat(what, ": the servers already hold the optimizer state, sharded; set ",
                    "parallel.zero1=false"));
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
  const int64_t model_ranks = p.pp * p.tp;
  const std::string ranks = cat(world_size, world_size == 1 ? " rank" : " ranks");
  if (p.dp > 0 && world_size % model_ranks == 0)
    // An explicit dp that another count would fit.
    return cat(r.source, ": parallel.dp = ", p.dp,
               model_ranks > 1 ? cat(" x pp x tp = ", p.dp * model_ranks) : std::string(),
               " but the job has ", ranks,
               "; launch dp x pp x tp ranks (trainer launch --nproc-per-node ", p.dp * model_ranks,
               ") or set parallel.dp=", world_size / model_ranks);
  // The world is no multiple of pp x tp: no dp fits it.
  const std::string dp_text = p.dp > 0 ? cat(p.dp) : std::string("dp");
  const int64_t launch = p.dp > 0 ? p.dp * model_ranks : model_ranks;
  return cat(r.source, ": the layout dp x pp x tp = ", dp_text, " x ", p.pp, " x ", p.tp,
             p.dp > 0 ? cat(" = ", launch, " ranks") : std::string(),
             " needs a world that is a multiple of pp x tp = ", model_ranks, ", but this job has ",
             ranks, "; launch dp x pp x tp ranks (trainer launch --nproc-per-node ", launch,
             p.dp > 0 || launch >= world_size
                 ? std::string()
                 : cat(", or ", (world_size + model_ranks - 1) / model_ranks * model_ranks),
             ") or lower parallel.pp or parallel.tp");
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

ParallelLayout parallel_layout(const Recipe& r, int world_size) {
  if (r.parallel.mode == "parameter_server") world_size = parameter_server_workers(r, world_size);
  const ParallelRecipe& p = r.parallel;
  if (p.tp > 1) {
    if (r.model.name == "lstm_lm")
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
    const int64_t seq = r.data.seq_len > 0 ? r.data.seq_len : r.model.context;
    if (p.sequence_parallel && seq % p.tp != 0)
      throw Error(cat(r.source, ": parallel.sequence_parallel splits the sequence over the ", p.tp,
                      " tensor-parallel ranks, but the ", seq,
                      "-token windows (data.seq_len, or model.context) do not divide by "
                      "parallel.tp; use a multiple of ",
                      p.tp));
  }
  const ParallelRecipe defaults;
  if (p.time_chunks > 1 || p.schedule == "wavefront") {
    const int64_t seq = r.data.seq_len > 0 ? r.data.seq_len : r.model.context;
    const std::string what =
        cat(": parallel.time_chunks = ", p.time_chunks, " with parallel.schedule = ", p.schedule);
    if (r.model.name != "lstm_lm")
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
  const int64_t model_ranks = p.pp * p.tp;
  const int64_t dp = p.dp == 0 ? world_size / model_ranks : p.dp;
  if (dp == 0 || dp * model_ranks != world_size) throw Error(layout_mismatch(r, world_size));
  ParallelLayout layout;
  layout.mesh = parallel::MeshShape{{parallel::Dim::dp_replicate, int(dp)},
                                    {parallel::Dim::pp, int(p.pp)},
                                    {parallel::Dim::tp, int(p.tp)}};
  layout.zero1 = p.zero1 && dp > 1;
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
  const int64_t model_ranks = recipe.parallel.pp * recipe.parallel.tp;
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
  const int64_t micro_batches =
      resolved_micro_batches(recipe, job.mesh.size(parallel::kDataParallel));
  const std::string note =
      micro_batches_note(recipe, micro_batches, job.mesh.size(parallel::kDataParallel));
  recipe.parallel.micro_batches = micro_batches;
  if (!note.empty() && boot.rank == 0) {
    std::FILE* out = note.starts_with("warning") ? stderr : stdout;
    std::fprintf(out, "%s\n", note.c_str());
    std::fflush(out);
  }
  if (world != boot.world_size) return Distributed{.layout = rank_layout(job, 0)};
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

namespace {

// The weights tied across stages whose other copy the gradient norm counts.
std::vector<Tensor> tied_copies_counted_elsewhere(const Session& session) {
  std::vector<Tensor> out;
  for (const Session::TiedAcrossStages& t : session.tied_across_stages())
    if (!t.owner) out.push_back(t.param);
  return out;
}

// The recipe's stage split, the same on every rank: "auto", and any split
// under parallel.stage_memory_mb, is profiled on world rank 0 and broadcast.
parallel::StageSplit agreed_split(Session& session, const Distributed& dist) {
  const Recipe& r = session.recipe();
  if (r.parallel.stages != "auto" && r.parallel.stage_memory_mb <= 0)
    return choose_split(session, nullptr);
  const int pieces = int(dist.layout.job.mesh[parallel::Dim::pp] * r.parallel.virtual_stages);
  std::vector<int64_t> bounds(size_t(pieces) + 1, 0);
  std::string error;
  if (dist.is_main()) {
    try {
      const DType autocast = r.precision == "bf16" ? DType::bf16 : DType::f32;
      BlockProfile profile = profile_blocks(session, autocast);
      parallel::StageSplit split = choose_split(session, &profile);
      std::printf("%s", describe_stages(session, split, &profile).c_str());
      for (size_t k = 0; k < split.bounds.size(); ++k) bounds[k] = int64_t(split.bounds[k]);
    } catch (const Error& e) {
      error = e.what();
      bounds.assign(bounds.size(), -1);
    }
  }
  comm::broadcast(*dist.world(), bounds.data(), bounds.size() * sizeof(int64_t), 0);
  if (bounds[0] < 0)
    throw Error(dist.is_main() ? error : "parallel.stages: auto failed on rank 0 (see its error)");
  parallel::StageSplit split{.stages = dist.layout.job.mesh[parallel::Dim::pp],
                             .chunks = int(r.parallel.virtual_stages)};
  for (int64_t b : bounds) split.bounds.push_back(size_t(b));
  return split;
}

}  // namespace

DistributedRun::DistributedRun(const Distributed& dist, Session& session, bool trace)
    : dist_(dist), session_(&session) {
  if (trace) timeline_ = std::make_unique<parallel::Timeline>(dist.rank());
  if (!dist.active()) return;
  // Replicas synchronise over the dp ranks only: the other dimensions hold other parts.
  const std::shared_ptr<comm::Communicator>& dp_comm = dist.mesh.comm(parallel::kDataParallel);
  const Recipe& recipe = session.recipe();
  // The stage split first: "auto" profiles the whole model on rank 0 alone.
  std::optional<parallel::StageSplit> split;
  if (dist.layout.job.mesh[parallel::Dim::pp] > 1) split = agreed_split(session, dist);
  if (dist.layout.job.mesh[parallel::Dim::tp] > 1) {
    tp_ = parallel::make_comm_group(dist.mesh.comm(parallel::Dim::tp),
                                    recipe.parallel.sequence_parallel);
    session.set_tensor_parallel(tp_);
    if (dist.is_main() && !session.tensor_parallel_note().empty()) {
      std::printf("%s\n", session.tensor_parallel_note().c_str());
      std::fflush(stdout);
    }
  }
  if (split) {
    session.set_pipeline(*split, dist.layout.coord[parallel::Dim::pp]);
    pipeline_ = std::make_unique<parallel::PipelineRuntime>(
        *session.pipeline_plan(), dist.layout.coord[parallel::Dim::pp],
        dist.mesh.comm(parallel::Dim::pp), session.blocks(), timeline_.get());
  }
  std::shared_ptr<Module> model = session.trained_ptr();
  if (tp_) {
    for (const Tensor& p : parallel::parameters_split_as(*model, ParameterSplit::Kind::sharded))
      sharded_.insert(p.impl());
    if (tp_->sequence_parallel())
      gradient_shares_ =
          parallel::parameters_split_as(*model, ParameterSplit::Kind::partial_gradient);
  }
  if (dist.everyone) {
    // Parameter servers: the optimizer pushes and pulls; no allreduce.
    if (recipe.parallel.sync_bn && dp_comm->size() > 1)
      parallel::convert_sync_batchnorm(*session.model_ptr(), dp_comm);
    const std::vector<optim::ParamGroup> groups = session.trained_param_groups();
    ps_ = std::make_shared<parallel::ParameterServerClient>(
        dist.everyone, parallel::assign_shards(groups, dist.servers), dist.layout.dp_size(), groups,
        [&recipe](std::vector<optim::ParamGroup> g) {
          return make_optimizer(recipe, std::move(g));
        });
    session.set_remote_optimizer(ps_);
    return;
  }
  // One replica: nothing to synchronise (a pipeline's stages alone).
  if (dp_comm->size() == 1) return;
  // Before DataParallel registers its hooks: the converted layers keep their
  // parameters, so the buckets are the same either way.
  if (recipe.parallel.sync_bn) parallel::convert_sync_batchnorm(*session.model_ptr(), dp_comm);
  const bool sharded = session.shards_optimizer();
  parallel::DataParallelOptions o;
  o.bucket_bytes = size_t(recipe.parallel.bucket_mb) << 20;
  o.overlap = recipe.parallel.overlap;
  // parallel.allreduce (validated by the recipe); auto keeps the shared-memory
  // channel on one host and the measured model's choice across hosts.
  o.allreduce.algorithm = *comm::parse_allreduce_algorithm(recipe.parallel.allreduce);
  o.timeline = timeline_.get();
  // ZeRO-1 stages GPU buckets itself (its collectives run on host buffers,
  // parallel/zero.h). Plain GPU gradients: each bucket copied to pinned host
  // memory on a comm stream, allreduced there and copied back
  // (parallel/device_staging.h). SyncBatchNorm stages its statistics.
  if (sharded) o.reduce = parallel::zero_bucket_reduce(&zero_);
  // ZeRO-1: a weight tied across stages is sharded alike on both (finish_gradients).
  if (sharded)
    for (const Session::TiedAcrossStages& t : session.tied_across_stages())
      o.own_bucket.push_back(t.param);
#if TRAINER_HAVE_CUDA
  const Device device = module_device(*model);
  // parallel.gpu_direct: the buckets' device memory goes to UCX, reduced by
  // a CUDA kernel (parallel/cuda_staging.h); checked by training_device.
  const bool direct =
      recipe.parallel.gpu_direct != "off" &&
      uses_gpu_direct(recipe, device, dist.world_size(), parallel::ucx_supports_cuda_memory());
  if (device.is_cuda() && !sharded)
    o.reduce = direct ? parallel::gpu_direct_reduce(device)
                      : parallel::staged_reduce(parallel::cuda_bucket_copier(device),
                                                {.allreduce = o.allreduce});
#endif
  dp_ = std::make_unique<parallel::DataParallel>(model, dp_comm, o);
  if (!sharded) return;
  auto make = [&recipe](std::vector<optim::ParamGroup> groups) {
    return make_optimizer(recipe, std::move(groups));
  };
  // The gradient norm: every stage's parameters, every tensor-parallel
  // rank's parts of the split ones, the whole ones once.
  std::vector<Tensor> skips = tied_copies_counted_elsewhere(session);
  if (tp_ && dist.layout.coord[parallel::Dim::tp] != 0)
    for (const Tensor& p : model->parameters())
      if (!sharded_.count(p.impl())) skips.push_back(p);
  zero_ = std::make_shared<parallel::ZeroOptimizer>(
      dp_comm, session.trained_param_groups(), make,
      parallel::ZeroOptions{
          .buckets = &dp_->buckets(),
          .norm_also_over = {dist.mesh.comm(parallel::Dim::pp), dist.mesh.comm(parallel::Dim::tp)},
          .norm_skips = std::move(skips)});
  session.set_sharded_optimizer(zero_);
}

DistributedRun::~DistributedRun() = default;

parallel::DataParallel::NoSync DistributedRun::no_sync(bool active) {
  return parallel::DataParallel::NoSync(dp_.get(), active && dp_ != nullptr);
}

void DistributedRun::finish_gradients() {
  if (dp_) dp_->finish();
  // Sequence parallelism: the LayerNorms' gradient shares added up (under
  // ZeRO-1 this rank's shard of them: the tensor-parallel ranks' buckets,
  // and so their shards, are laid out alike).
  if (!gradient_shares_.empty() && zero_)
    for (const Tensor& p : gradient_shares_)
      zero_->update_reduced_gradient(
          p, [&](Tensor& piece, int64_t, int64_t) { tp_->allreduce(piece, false); });
  else if (!gradient_shares_.empty())
    parallel::sum_partial_gradients(gradient_shares_, *tp_);
  if (!pipeline_) return;
  // A weight tied across stages: each copy's gradient plus the other's.
  // Under ZeRO-1 each rank holds its shard of the averaged gradient only; the
  // weight has a bucket of its own on both stages, so the shards are the
  // same elements there and are added shard by shard.
  const auto& tied = session_->tied_across_stages();
  for (size_t k = 0; k < tied.size(); ++k) {
    const Session::TiedAcrossStages& t = tied[k];
    if (zero_) {
      zero_->update_reduced_gradient(
          t.param, [&](Tensor& piece, int64_t, int64_t) { add_tied_gradient(k, piece); });
      continue;
    }
    if (!t.param.grad().defined()) t.param.set_grad(zeros_like(t.param));
    Tensor grad = t.param.grad();
    add_tied_gradient(k, grad);
  }
}

void DistributedRun::add_tied_gradient(size_t k, Tensor& grad) const {
  // Both stages compute own + other's: the same bits on both (a + b == b + a).
  const Session::TiedAcrossStages& t = session_->tied_across_stages()[k];
  comm::Communicator& pp = *dist_.mesh.comm(parallel::Dim::pp);
  Tensor mine = grad.contiguous().clone(), theirs = empty_like(mine);
  const comm::P2PTag tag{.micro_batch = (int64_t(1) << comm::P2PTag::kMicroBatchBits) - 1,
                         .direction = comm::P2PDirection::gradient,
                         .stream = int64_t(k)};
  comm::Work sent = pp.send(mine, t.peer, tag);
  comm::Work got = pp.recv(theirs, t.peer, tag);
  try {
    got.wait();
    sent.wait();
  } catch (const Error& e) {
    throw Error(cat("pipeline stage ", dist_.layout.coord[parallel::Dim::pp],
                    ", exchanging the gradient of ", t.name, " (tied across stages) with stage ",
                    t.peer, ": ", e.what()));
  }
  autograd::NoGradGuard no_grad;
  add_(grad, theirs);
}

double DistributedRun::clip_gradients(double max_norm) const {
  CHECK(splits_model()) << "clip_gradients of a model no ranks split";
  std::set<const TensorImpl*> mine, not_owned;
  for (const Tensor& p : session_->trained().parameters()) mine.insert(p.impl());
  for (const Session::TiedAcrossStages& t : session_->tied_across_stages())
    if (!t.owner) not_owned.insert(t.param.impl());
  const bool first_tp_rank = dist_.layout.coord[parallel::Dim::tp] == 0;
  const std::vector<NamedTensor>& all = session_->global_parameters();
  // One entry per parameter, set by the stage that owns it (a replicated
  // one by the first tensor-parallel rank, a split one by all): the others
  // add zeros, so the total sums over the parameters in one order.
  std::vector<double> sums(all.size(), 0.0);
  for (size_t k = 0; k < all.size(); ++k) {
    const TensorImpl* impl = all[k].tensor.impl();
    if (mine.count(impl) && !not_owned.count(impl) && (first_tp_rank || sharded_.count(impl)))
      sums[k] = optim::grad_power_sum(all[k].tensor, 2.0);
  }
  if (pipeline_)
    comm::allreduce(*dist_.mesh.comm(parallel::Dim::pp), sums.data(), sums.size(), DType::f64,
                    {.op = comm::ReduceOp::sum});
  if (tp_)
    comm::allreduce(*dist_.mesh.comm(parallel::Dim::tp), sums.data(), sums.size(), DType::f64,
                    {.op = comm::ReduceOp::sum});
  double total = 0;
  for (double v : sums) total += v;
  const double norm = std::sqrt(total);
  optim::clip_to_norm(session_->trained().parameters(), max_norm, norm);
  return norm;
}

void DistributedRun::zero_grad(optim::Optimizer& optimizer) {
  // The sharded optimizer forgets its reduction; DataParallel then points
  // the gradients at its zeroed buckets again.
  if (zero_ || !dp_) optimizer.zero_grad();
  if (dp_) dp_->zero_grad();
}

EvalMetrics DistributedRun::evaluate(Session& session) const {
  if (!dist_.active()) return session.evaluate();
  if (dp_) dp_->broadcast_buffers(0);
  EvalSums mine = pipeline_ ? evaluate_pipeline(session) : session.evaluate_shard();
  // Gathered, not allreduced: a ring's sums would round differently on each
  // rank, and best-checkpoint decisions must agree.
  constexpr int kValues = 5;
  const double local[kValues] = {mine.loss, double(mine.top1), double(mine.top5),
                                 double(mine.samples), double(mine.skipped)};
  comm::Communicator& dp_comm = *dist_.mesh.comm(parallel::kDataParallel);
  std::vector<double> all(kValues * size_t(dp_comm.size()));
  comm::allgather(dp_comm, local, all.data(), sizeof(local));
  EvalSums sums;
  for (int r = 0; r < dp_comm.size(); ++r) {
    const double* v = all.data() + kValues * r;
    sums.loss += v[0];
    sums.top1 += int64_t(v[1]);
    sums.top5 += int64_t(v[2]);
    sums.samples += int64_t(v[3]);
    sums.skipped += int64_t(v[4]);
  }
  return eval_metrics(sums, session.is_language_model());
}

EvalSums DistributedRun::evaluate_pipeline(Session& session) const {
  const parallel::PipelinePlan& plan = pipeline_->plan();
  const int last = plan.split().stage_of(plan.pieces() - 1);
  const bool sums_here = dist_.layout.coord[parallel::Dim::pp] == last;
  BatchSource& source = session.data();
  EvalSums sums;
  {
    autograd::NoGradGuard no_grad;
    session.model().eval();
    source.start_eval();
    // The wavefront's messages are time chunks of the windows (probed so).
    const int K = std::max(1, int(session.recipe().parallel.time_chunks));
    StepBatch batch;
    for (int64_t m = 0; source.next_eval(batch); ++m)
      for (int k = 0; k < K; ++k) {
        const StepBatch chunk = time_chunk(batch, k, K);
        const TensorList outputs = pipeline_->evaluate(m * K + k, source.eval_inputs(chunk));
        source.keep_eval_outputs(outputs);
        if (sums_here) source.add_eval_sums(chunk, outputs, sums);
      }
    pipeline_->finish_step();
    session.model().train();
  }
  // The last stage's sums, to every stage of this pipeline.
  double v[4] = {sums.loss, double(sums.top1), double(sums.top5), double(sums.samples)};
  comm::broadcast(*dist_.mesh.comm(parallel::Dim::pp), v, sizeof v, last);
  return EvalSums{v[0], int64_t(v[1]), int64_t(v[2]), int64_t(v[3])};
}

StepVerdict DistributedRun::agree(double loss, bool finite, bool stop, bool has_loss) const {
  if (!dist_.active()) return StepVerdict{loss, finite, stop};
  // Sums of (loss, non-finite ranks, stopping ranks, ranks with a loss): one message.
  double v[4] = {finite && has_loss ? loss : 0.0, finite ? 0.0 : 1.0, stop ? 1.0 : 0.0,
                 has_loss ? 1.0 : 0.0};
  comm::allreduce(*dist_.world(), v, 4, DType::f64, {.op = comm::ReduceOp::sum});
  StepVerdict verdict;
  verdict.finite = v[1] == 0;
  verdict.loss = verdict.finite ? v[0] / v[3] : std::nan("");
  verdict.stop = v[2] > 0;
  return verdict;
}

bool DistributedRun::any_rank(bool flag) const {
  if (!dist_.active()) return flag;
  double v = flag ? 1.0 : 0.0;
  comm::allreduce(*dist_.world(), &v, 1, DType::f64, {.op = comm::ReduceOp::max});
  return v > 0;
}

void DistributedRun::barrier() const {
  if (dist_.active()) comm::barrier(*dist_.world());
}

namespace {

// Link models as text, a line each: "<ranks>|<alpha>|<beta>|<gamma>" with
// the numbers as hexadecimal floats (exact), the ranks space-separated.
std::string encode_link_models(const std::map<std::vector<int>, comm::LinkModel>& models) {
  std::string text;
  for (const auto& [ranks, m] : models) {
    for (size_t k = 0; k < ranks.size(); ++k) text += cat(k ? " " : "", ranks[k]);
    char numbers[128];
    std::snprintf(numbers, sizeof numbers, "|%a|%a|%a\n", m.alpha, m.beta, m.gamma);
    text += numbers;
  }
  return text;
}

void decode_link_models(const std::string& text,
                        std::map<std::vector<int>, comm::LinkModel>& into) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const size_t bar = line.find('|');
    CHECK(bar != std::string::npos) << "link model record without '|': " << line;
    std::vector<int> ranks;
    std::istringstream rank_list(line.substr(0, bar));
    for (int r; rank_list >> r;) ranks.push_back(r);
    comm::LinkModel m;
    CHECK_EQ(std::sscanf(line.c_str() + bar, "|%la|%la|%la", &m.alpha, &m.beta, &m.gamma), 3)
        << line;
    into.emplace(std::move(ranks), m);
  }
}

}  // namespace

std::map<std::vector<int>, comm::LinkModel> DistributedRun::link_models() const {
  std::map<std::vector<int>, comm::LinkModel> models = comm::link_models();
  if (!dist_.active()) return models;
  // Each rank knows the models of its own communicators: all of them gathered.
  comm::Communicator& world = *dist_.world();
  std::string mine = encode_link_models(models);
  const int64_t length = int64_t(mine.size());
  std::vector<int64_t> lengths(size_t(world.size()));
  comm::allgather(world, &length, lengths.data(), sizeof length);
  const size_t longest = size_t(*std::max_element(lengths.begin(), lengths.end()));
  if (longest == 0) return models;
  mine.resize(longest);
  std::string all(longest * lengths.size(), '\0');
  comm::allgather(world, mine.data(), all.data(), longest);
  for (size_t r = 0; r < lengths.size(); ++r)
    decode_link_models(all.substr(r * longest, size_t(lengths[r])), models);
  return models;
}

bool DistributedRun::keep_link_models(const std::map<std::vector<int>, comm::LinkModel>& models,
                                      int saved) const {
  if (models.empty() || saved != dist_.world_size()) return false;
  for (const auto& [ranks, model] : models) comm::preset_link_model(ranks, model);
  return true;
}

void DistributedRun::end_trace_window(int64_t steps_done) {
  // 50 steps show the steady state and keep the file a few MB.
  constexpr int64_t kTracedSteps = 50;
  if (timeline_ && steps_done >= kTracedSteps) timeline_->set_recording(false);
}

void DistributedRun::write_trace(const std::string& path) const {
  if (!timeline_) return;
  if (dist_.active())
    timeline_->write_merged(*dist_.world(), path);
  else
    timeline_->write(path);
}

void serve_parameter_shard(const Distributed& dist, Session& session) {
  const Recipe& r = session.recipe();
  const std::vector<optim::ParamGroup> groups = session.trained_param_groups();
  const parallel::ShardMap shards = parallel::assign_shards(groups, dist.servers);
  const int workers = dist.layout.dp_size(), k = dist.rank() - workers;
  std::printf(
      "parameter server %d of %d (rank %d): %lld of %lld parameters, for %d workers, %s\n", k,
      dist.servers, dist.rank(), (long long)shards.elements[size_t(k)],
      (long long)std::accumulate(shards.elements.begin(), shards.elements.end(), int64_t(0)),
      workers,
      r.parallel.sync == "ssp" ? cat("ssp, staleness ", r.parallel.staleness).c_str()
                               : r.parallel.sync.c_str());
  std::fflush(stdout);
  // SIGTERM and SIGINT stop the workers, which checkpoint (the servers' state
  // with it) and say they are done: the server serves until then.
  std::signal(SIGTERM, SIG_IGN);
  std::signal(SIGINT, SIG_IGN);
  const parallel::ServerReport report = parallel::serve_parameters(
      dist.everyone, shards, workers, groups,
      [&r](std::vector<optim::ParamGroup> g) { return make_optimizer(r, std::move(g)); },
      {.sync = parallel::parse_sync(r.parallel.sync), .staleness = r.parallel.staleness});
  std::printf("parameter server %d: %s\n", k, report.summary().c_str());
  std::fflush(stdout);
  // The staleness histogram, one record per server in the run's metrics.jsonl.
  Scalars scalars{{"server", double(k)}, {"gradients", double(report.gradients)}};
  for (const auto& [staleness, count] : report.staleness)
    scalars.push_back({cat("staleness_", staleness), double(count)});
  MetricsLog(r.output_dir, /*tensorboard=*/false).write("staleness", report.updates, scalars);
  TensorBoardWriter(r.output_dir + "/tb", cat(".server", k))
      .add_histogram(cat("staleness/server", k), report.staleness, report.updates);
}

}  // namespace trainer
