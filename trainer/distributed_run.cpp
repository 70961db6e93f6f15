// DistributedRun: the parallelisms applied to a session as passes (tensor,
// pipeline, data or parameter servers), and what a step needs of them:
// gradients averaged and tied weights summed, the gradient norm of a split
// model.
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
#include "parallel/context_parallel.h"
#include "parallel/device_staging.h"
#include "parallel/fsdp.h"
#include "parallel/pipeline_runtime.h"
#include "parallel/placement.h"
#include "parallel/planner.h"
#include "parallel/split_model.h"
#include "parallel/sync_batchnorm.h"
#include "trainer/device.h"
#include "trainer/metrics.h"
#include "trainer/pipeline_split.h"
#include "trainer/precision.h"
#include "trainer/session.h"
#include "trainer/tensorboard.h"

namespace trainer {

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
  const int pieces = int(dist.layout.size(parallel::Dim::pp) * r.parallel.virtual_stages);
  std::vector<int64_t> bounds(size_t(pieces) + 1, 0);
  std::string error;
  if (dist.is_main()) {
    try {
      const DType autocast = Precision(r, false).autocast_dtype();
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
  parallel::StageSplit split{.stages = dist.layout.size(parallel::Dim::pp),
                             .chunks = int(r.parallel.virtual_stages),
                             .bounds = {}};
  for (int64_t b : bounds) split.bounds.push_back(size_t(b));
  return split;
}

}  // namespace

DistributedRun::DistributedRun(const Distributed& dist, Session& session, bool trace)
    : dist_(dist), session_(&session) {
  if (trace) timeline_ = std::make_unique<parallel::Timeline>(dist.rank());
  if (!dist.active()) return;
  // The parallelisms as passes over the session, in this order: tensor,
  // pipeline, then data (or parameter servers); the optimizer comes after
  // them (Session::optimizer, or the sharded one of apply_data_parallel).
  // The stage split first: "auto" profiles the whole model on rank 0 alone.
  std::optional<parallel::StageSplit> split;
  if (dist.layout.size(parallel::Dim::pp) > 1) split = agreed_split(session, dist);
  if (dist.layout.size(parallel::Dim::tp) > 1) apply_tensor_parallel(session);
  if (dist.layout.size(parallel::Dim::cp) > 1) apply_context_parallel(session);
  if (dist.layout.size(parallel::Dim::ep) > 1) apply_expert_parallel(session);
  if (split) apply_pipeline(session, *split);
  // Of what this rank trains (its stage's, under a pipeline).
  if (tp_) record_split_parameters(session);
  for (const NamedTensor& t : session.held_state()) names_.emplace(t.tensor.impl(), t.name);
  if (dist.everyone)
    apply_parameter_servers(session);
  else
    apply_data_parallel(session);
}

void DistributedRun::apply_tensor_parallel(Session& session) {
  const Recipe& recipe = session.recipe();
  tp_ = parallel::make_comm_group(dist_.mesh.comm(parallel::Dim::tp),
                                  recipe.parallel.sequence_parallel);
  session.set_tensor_parallel(tp_);
  session.record_pass(
      "tensor", cat("tp=", tp_->size(), tp_->sequence_parallel() ? ", sequence parallel" : ""));
  if (dist_.is_main() && !session.tensor_parallel_note().empty()) {
    std::printf("%s\n", session.tensor_parallel_note().c_str());
    std::fflush(stdout);
  }
}

void DistributedRun::apply_context_parallel(Session& session) {
  const ParallelRecipe& p = session.recipe().parallel;
  const ContextAttention attention =
      p.cp_attention == "all_to_all" ? ContextAttention::all_to_all : ContextAttention::ring;
  session.set_context_parallel(
      make_context_group(dist_.mesh.comm(parallel::Dim::cp), attention, p.cp_load_balance));
  session.record_pass("context", cat("cp=", p.cp, ", ", p.cp_attention,
                                     p.cp_load_balance ? ", load-balanced" : ""));
}

void DistributedRun::record_split_parameters(const Session& session) {
  if (tp_->sequence_parallel())
    gradient_shares_ =
        parallel::parameters_split_as(session.trained(), ParameterSplit::Kind::partial_gradient);
}

void DistributedRun::apply_pipeline(Session& session, const parallel::StageSplit& split) {
  const int stage = dist_.layout.index(parallel::Dim::pp);
  session.set_pipeline(split, stage);
  session.record_pass("pipeline",
                      cat("stage ", stage, " of ", split.stages,
                          split.chunks > 1 ? cat(", ", split.chunks, " chunks each") : ""));
  pipeline_ = std::make_unique<parallel::PipelineRuntime>(*session.pipeline_plan(), stage,
                                                          dist_.mesh.comm(parallel::Dim::pp),
                                                          session.blocks(), timeline_.get());
}

void DistributedRun::apply_parameter_servers(Session& session) {
  // The optimizer pushes and pulls; no allreduce.
  const Recipe& recipe = session.recipe();
  const std::shared_ptr<comm::Communicator> dp_comm = dist_.mesh.comm(parallel::kDataParallel);
  if (recipe.parallel.sync_bn && dp_comm->size() > 1)
    parallel::convert_sync_batchnorm(*session.model_ptr(), dp_comm);
  const std::vector<optim::ParamGroup> groups = session.trained_param_groups();
  ps_ = std::make_shared<parallel::ParameterServerClient>(
      dist_.everyone, parallel::assign_shards(groups, dist_.servers), dist_.layout.dp_size(),
      groups,
      [&recipe](std::vector<optim::ParamGroup> g) { return make_optimizer(recipe, std::move(g)); });
  session.set_remote_optimizer(ps_);
  session.record_pass("parameter servers",
                      cat(dist_.servers, " servers, ", dp_comm->size(), " workers"));
}

void DistributedRun::apply_data_parallel(Session& session) {
  // Replicas synchronise over the dp ranks (and the cp ranks, whose
  // gradients are of other tokens of the same windows): the other
  // dimensions hold other parts.
  const std::shared_ptr<comm::Communicator> dp_comm = replica_comm();
  // One replica: nothing to synchronise (a pipeline's stages alone).
  if (dp_comm->size() == 1) return;
  const Recipe& recipe = session.recipe();
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
  o.exclude = expert_params_;
  // The sharded optimizer reduces the buckets into its shards (and stages
  // GPU buckets itself: its collectives run on host buffers, parallel/zero.h).
  std::shared_ptr<Module> model = session.trained_ptr();
  // The model whose blocks run (a pipeline stage runs its own of them).
  Model* blocks_model = session.model_ptr().get();
  const int stage = dist_.layout.job.zero_stage;
  const std::vector<std::vector<size_t>> units =
      sharded ? shard_buckets(session, blocks_model, o) : std::vector<std::vector<size_t>>();
  // Plain GPU gradients: each bucket copied to pinned host memory on a comm
  // stream, allreduced there and copied back (parallel/device_staging.h).
  // SyncBatchNorm stages its statistics.
#if TRAINER_HAVE_CUDA
  const Device device = module_device(*model);
  // parallel.gpu_direct: the buckets' device memory goes to UCX, reduced by
  // a CUDA kernel (parallel/cuda_staging.h); checked by training_device.
  const bool direct =
      recipe.parallel.gpu_direct != "off" &&
      uses_gpu_direct(recipe, device, dist_.world_size(), parallel::ucx_supports_cuda_memory());
  if (device.is_cuda() && !sharded)
    o.reduce = direct ? parallel::gpu_direct_reduce(device)
                      : parallel::staged_reduce(parallel::cuda_bucket_copier(device),
                                                {.allreduce = o.allreduce});
#endif
  dp_ = std::make_unique<parallel::DataParallel>(model, dp_comm, o);
  if (sharded) build_sharded_optimizer(session);
  if (stage == 3) {
    sharded_parameters_ = std::make_unique<parallel::ShardedParameters>(
        *blocks_model, units, *dp_, &zero_,
        parallel::ShardingOptions{
            .reshard_after_forward = recipe.parallel.reshard_after_forward,
            .keep_last = int(recipe.parallel.keep_last_blocks),
            // A pipeline stage keeps each unit for the step (not per
            // micro-batch) when asked, and under zbh1, whose deferred weight
            // gradients (W) run after other micro-batches' forwards.
            .keep_for_step = pipeline_ && (!recipe.parallel.reshard_after_forward ||
                                           recipe.parallel.schedule == "zbh1"),
            .timeline = timeline_.get()});
    session.set_parameter_shards([this] {
      return sharded_parameters_->sharded()
                 ? zero_->parameter_shards()
                 : std::map<const TensorImpl*, parallel::ParameterShard>();
    });
  }
  const int replicas = dist_.layout.job.replica_groups();
  session.record_pass("data", cat("dp=", dp_comm->size(), shard_label(recipe, dist_.layout.job),
                                  replicas > 1 ? cat(", hybrid: ", replicas, " replicas of ",
                                                     dp_comm->size() / replicas, " shards")
                                               : ""));
}

std::vector<std::vector<size_t>> DistributedRun::shard_buckets(const Session& session,
                                                               Model* blocks_model,
                                                               parallel::DataParallelOptions& o) {
  const int stage = dist_.layout.job.zero_stage;
  o.reduce = parallel::zero_bucket_reduce(&zero_);
  // ZeRO-1 on the CPU reduce-scatters the buckets where backward wrote them.
  if (stage <= 1 && session.recipe().device == "cpu") {
    o.reduce_in_place = true;
    o.bucket_numel_multiple = shard_comm()->size();
  }
  // ZeRO-1: a weight tied across stages is sharded alike on both (finish_gradients).
  for (const Session::TiedAcrossStages& t : session.tied_across_stages())
    o.own_bucket.push_back(t.param);
  // ZeRO-2 and -3: gradients reduce-scattered from transient buckets, one
  // per unit of blocks; under ZeRO-3 the units' parameters are gathered per use.
  std::vector<std::vector<size_t>> units;
  if (stage >= 2) {
    CHECK(blocks_model) << "ZeRO-" << stage << " shards a model's blocks";
    o.transient_buckets = true;
    o.bucket_numel_multiple = shard_comm()->size();
    std::vector<size_t> stage_blocks;  // a pipeline stage's: the others never run here
    if (const parallel::PipelinePlan* plan = session.pipeline_plan())
      for (auto [begin, end] : plan->blocks_of_stage(session.stage()))
        for (size_t b = begin; b < end; ++b) stage_blocks.push_back(b);
    units = parallel::merge_units(
        blocks_model->blocks(), parallel::sharding_units(blocks_model->blocks(), stage_blocks),
        int64_t(session.recipe().parallel.shard_unit_mb * 262144));  // MiB of f32
    o.units = parallel::unit_parameters(blocks_model->blocks(), units);
    o.transient_buffer = [this](int64_t numel, DType dtype) {
      return zero_->transient_buffer(numel, dtype);
    };
  }
  if (stage == 3) {
    // On one host the gathered units are the ranks' blocks where they lie,
    // each block whole pages (parallel/zero.h gather_in_place).
    const DType master = session.trained().parameters().front().dtype();
    const ShardDtypes d = shard_dtypes(session.recipe(), stage);
    gather_in_place_ = session.recipe().device == "cpu" && shard_comm()->size() > 1 &&
                       shard_comm()->shm() != nullptr && (!d.param || *d.param == master);
    if (gather_in_place_) o.bucket_numel_multiple *= parallel::gather_in_place_align(master);
    o.on_bucket_started = [this](int bucket) {
      if (sharded_parameters_) sharded_parameters_->bucket_started(bucket);
    };
  }
  return units;
}

void DistributedRun::build_sharded_optimizer(Session& session) {
  const Recipe& recipe = session.recipe();
  auto make = [&recipe](std::vector<optim::ParamGroup> groups) {
    return make_optimizer(recipe, std::move(groups));
  };
  // The gradient norm counts each parameter once: every stage's, every
  // tensor-parallel rank's part of a split one, and a whole one on the rank
  // that holds its written copy (parallel/placement.h).
  std::vector<Tensor> skips = tied_copies_counted_elsewhere(session);
  if (tp_)
    for (const Tensor& p : session.trained().parameters())
      if (!counted_in_norm(p)) skips.push_back(p);
  // Hybrid sharding: shards within a group, their gradients averaged across the groups.
  const bool hybrid = dist_.layout.job.hybrid();
  const ShardDtypes dtypes = shard_dtypes(recipe, dist_.layout.job.zero_stage);
  zero_ = std::make_shared<parallel::ZeroOptimizer>(
      shard_comm(), session.trained_param_groups(), make,
      parallel::ZeroOptions{
          .stage = std::max(dist_.layout.job.zero_stage, 1),
          .buckets = &dp_->buckets(),
          .reduce_in_buckets = dp_->options().reduce_in_place,
          .replicate = hybrid ? dist_.mesh.comm(parallel::Dim::dp_replicate) : nullptr,
          .param_dtype = dtypes.param,
          .reduce_dtype = dtypes.reduce,
          .gather_in_place = gather_in_place_,
          .local = expert_params_,
          .local_copies = shard_comm()->size() / dist_.layout.size(parallel::Dim::ep),
          .norm_also_over = {dist_.mesh.comm(parallel::Dim::pp),
                             dist_.mesh.comm(parallel::Dim::tp)},
          .norm_skips = std::move(skips)});
  session.set_sharded_optimizer(zero_);
}

std::shared_ptr<comm::Communicator> DistributedRun::replica_comm() const {
  parallel::Dims dims = parallel::kDataParallel;
  for (parallel::Dim d : {parallel::Dim::cp, parallel::Dim::ep})
    if (dist_.layout.size(d) > 1) dims = dims | d;
  return dist_.mesh.comm(dims);
}

std::shared_ptr<comm::Communicator> DistributedRun::eval_comm() const {
  return dist_.mesh.comm(dist_.layout.size(parallel::Dim::cp) > 1
                             ? parallel::kDataParallel | parallel::Dim::cp
                             : parallel::kDataParallel);
}

std::shared_ptr<comm::Communicator> DistributedRun::shard_comm() const {
  // Hybrid sharding shards within dp_shard; the cp and ep ranks always join
  // the shards (as torchtitan's dp_shard_cp), holding the same dense
  // parameters (the experts stay whole, ZeroOptions::local).
  parallel::Dims dims =
      dist_.layout.job.hybrid() ? parallel::Dims(parallel::Dim::dp_shard) : parallel::kDataParallel;
  for (parallel::Dim d : {parallel::Dim::cp, parallel::Dim::ep})
    if (dist_.layout.size(d) > 1) dims = dims | d;
  return dist_.mesh.comm(dims);
}

bool DistributedRun::counted_in_norm(const Tensor& p) const {
  // Within one replica, the copy its placement writes: a tensor-parallel
  // part on its rank, a whole tensor on the first tensor-parallel rank. The
  // cp ranks hold copies too, each norm counted as the first one's.
  auto name = names_.find(p.impl());
  CHECK(name != names_.end()) << "the gradient norm of a tensor this rank does not hold";
  const parallel::ParallelPlan& plan = session_->parallel_plan();
  parallel::MeshCoord coord = plan.coord;
  for (parallel::Dim d : parallel::kAllDims)
    if (parallel::kDataParallel.contains(d) || d == parallel::Dim::cp) coord.set(d, 0);
  return parallel::writes(plan.placement(name->second), coord);
}

DistributedRun::~DistributedRun() = default;

parallel::DataParallel::NoSync DistributedRun::no_sync(bool active) {
  return parallel::DataParallel::NoSync(dp_.get(), active && dp_ != nullptr);
}

void DistributedRun::finish_gradients() {
  if (dp_) dp_->finish();
  if (expert_comm_) reduce_expert_gradients();
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
  const Session::TiedAcrossStages& t = session_->tied_across_stages()[k];
  parallel::add_tied_gradient(*dist_.mesh.comm(parallel::Dim::pp), t.peer, int64_t(k), t.name,
                              grad);
}

double DistributedRun::clip_gradients(double max_norm) const {
  CHECK(splits_model()) << "clip_gradients of a model no ranks split";
  std::set<const TensorImpl*> mine, not_owned;
  for (const Tensor& p : session_->trained().parameters()) mine.insert(p.impl());
  for (const Session::TiedAcrossStages& t : session_->tied_across_stages())
    if (!t.owner) not_owned.insert(t.param.impl());
  std::vector<Tensor> order;
  for (const NamedTensor& p : session_->global_parameters()) order.push_back(p.tensor);
  // A parameter counts on the stage that owns it, and there on the rank
  // that holds its written copy (a split one on every tensor-parallel rank).
  auto counted = [&](size_t k) {
    const TensorImpl* impl = order[k].impl();
    return mine.count(impl) && !not_owned.count(impl) && counted_in_norm(order[k]);
  };
  std::vector<comm::Communicator*> over;
  if (pipeline_) over.push_back(dist_.mesh.comm(parallel::Dim::pp).get());
  if (tp_) over.push_back(dist_.mesh.comm(parallel::Dim::tp).get());
  if (expert_comm_) over.push_back(dist_.mesh.comm(parallel::Dim::ep).get());
  return parallel::clip_split_gradients(order, counted, over, session_->trained().parameters(),
                                        max_norm);
}

void DistributedRun::zero_grad(optim::Optimizer& optimizer) {
  // The sharded optimizer forgets its reduction; DataParallel then points
  // the gradients at its zeroed buckets again.
  if (zero_ || !dp_) optimizer.zero_grad();
  if (dp_) dp_->zero_grad();
  for (const Tensor& p : expert_params_) p.set_grad(Tensor());  // not in dp_'s buckets
  if (sharded_parameters_) sharded_parameters_->end_step();
}

void DistributedRun::end_backward() {
  if (dp_) dp_->end_backward();
}

}  // namespace trainer
