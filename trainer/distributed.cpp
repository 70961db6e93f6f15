#include "trainer/distributed.h"

#include <cmath>

#include "comm/bootstrap.h"
#include "comm/collectives.h"
#include "optim/clip.h"
#include "parallel/device_staging.h"
#include "parallel/sync_batchnorm.h"
#include "trainer/device.h"
#include "trainer/session.h"

namespace trainer {

ParallelLayout parallel_layout(const Recipe& r, int world_size) {
  const ParallelRecipe& p = r.parallel;
  if (p.pp != 1 || p.tp != 1)
    throw Error(
        cat(r.source, ": parallel.pp = ", p.pp, ", parallel.tp = ", p.tp,
            ": pipeline and tensor parallelism are not built yet (the mesh lays the "
            "ranks out, but no stage or tensor-parallel layer runs on it); use pp = tp = 1"));
  // Read by pipeline schedules only; accepted at their defaults so recipes can spell them out.
  const ParallelRecipe defaults;
  if (p.micro_batches != defaults.micro_batches)
    throw Error(cat(r.source, ": parallel.micro_batches = ", p.micro_batches,
                    " is the number of micro-batches a pipeline (parallel.pp > 1) splits each "
                    "step into; with pp = 1 leave it at ",
                    defaults.micro_batches, " and use training.grad_accum to split a step"));
  if (p.schedule != defaults.schedule)
    throw Error(cat(r.source, ": parallel.schedule = '", p.schedule,
                    "' orders a pipeline's (parallel.pp > 1) forward and backward passes; with "
                    "pp = 1 there is one stage and nothing to order: leave it at '",
                    defaults.schedule, "'"));
  const int64_t model_ranks = p.pp * p.tp;
  const int64_t dp = p.dp == 0 ? world_size / model_ranks : p.dp;
  if (dp * model_ranks != world_size)
    throw Error(cat(r.source, ": parallel.dp = ", dp,
                    model_ranks > 1 ? cat(" x pp x tp = ", dp * model_ranks) : std::string(),
                    " but the job has ", world_size, world_size == 1 ? " rank" : " ranks",
                    "; launch dp x pp x tp ranks (trainer launch --nproc-per-node ",
                    dp * model_ranks, ") or set parallel.dp=", world_size / model_ranks));
  ParallelLayout layout;
  layout.mesh = {.dp = int(dp), .pp = int(p.pp), .tp = int(p.tp)};
  layout.zero1 = p.zero1 && dp > 1;
  return layout;
}

RankLayout rank_layout(const ParallelLayout& job, int rank) {
  return RankLayout{.job = job, .rank = rank, .coord = parallel::mesh_coord(job.mesh, rank)};
}

Distributed join_job(const Recipe& recipe) {
  comm::Bootstrap boot = comm::detect_bootstrap();
  const ParallelLayout job = parallel_layout(recipe, boot.world_size);
  Distributed d;
  d.layout = rank_layout(job, boot.rank);
  if (boot.world_size > 1) d.mesh = parallel::Mesh(job.mesh, comm::init_world(boot));
  return d;
}

DistributedRun::DistributedRun(const Distributed& dist, Session& session, bool trace)
    : dist_(dist) {
  if (trace) timeline_ = std::make_unique<parallel::Timeline>(dist.rank());
  if (!dist.active()) return;
  // Replicas synchronise over the dp ranks only (DESIGN.md "Parallel layout").
  const std::shared_ptr<comm::Communicator>& dp_comm = dist.mesh.dp_comm();
  const Recipe& recipe = session.recipe();
  std::shared_ptr<Module> model = session.model_ptr();
  // Before DataParallel registers its hooks: the converted layers keep their
  // parameters, so the buckets are the same either way.
  if (recipe.parallel.sync_bn) parallel::convert_sync_batchnorm(*model, dp_comm);
  const bool sharded = session.shards_optimizer();
  parallel::DataParallelOptions o;
  o.bucket_bytes = size_t(recipe.parallel.bucket_mb) << 20;
  o.overlap = recipe.parallel.overlap;
  o.timeline = timeline_.get();
  // ZeRO-1 stages GPU buckets itself (its collectives run on host buffers,
  // parallel/zero.h). Plain GPU gradients: each bucket copied to pinned host
  // memory on a comm stream, allreduced there and copied back
  // (parallel/device_staging.h). SyncBatchNorm stages its statistics.
  if (sharded) o.reduce = parallel::zero_bucket_reduce(&zero_);
#if TRAINER_HAVE_CUDA
  const Device device = module_device(*model);
  // parallel.gpu_direct: the buckets' device memory goes to UCX, reduced by
  // a CUDA kernel (parallel/cuda_staging.h); checked by training_device.
  const bool direct =
      recipe.parallel.gpu_direct != "off" &&
      uses_gpu_direct(recipe, device, dist.world_size(), parallel::ucx_supports_cuda_memory());
  if (device.is_cuda() && !sharded)
    o.reduce = direct ? parallel::gpu_direct_reduce(device)
                      : parallel::staged_reduce(parallel::cuda_bucket_copier(device));
#endif
  dp_ = std::make_unique<parallel::DataParallel>(model, dp_comm, o);
  if (!sharded) return;
  auto make = [&recipe](std::vector<optim::ParamGroup> groups) {
    return make_optimizer(recipe, std::move(groups));
  };
  zero_ =
      std::make_shared<parallel::ZeroOptimizer>(dp_comm, param_groups(recipe, *model), make,
                                                parallel::ZeroOptions{.buckets = &dp_->buckets()});
  session.set_sharded_optimizer(zero_);
}

parallel::DataParallel::NoSync DistributedRun::no_sync(bool active) {
  return parallel::DataParallel::NoSync(dp_.get(), active && dp_ != nullptr);
}

void DistributedRun::finish_gradients() {
  if (dp_) dp_->finish();
}

void DistributedRun::zero_grad(optim::Optimizer& optimizer) {
  // The sharded optimizer forgets its reduction; DataParallel then points
  // the gradients at its zeroed buckets again.
  if (zero_ || !dp_) optimizer.zero_grad();
  if (dp_) dp_->zero_grad();
}

EvalMetrics DistributedRun::evaluate(Session& session) const {
  if (!dist_.active()) return session.evaluate();
  dp_->broadcast_buffers(0);
  EvalSums mine = session.evaluate_shard();
  // Gathered, not allreduced: a ring's sums would round differently on each
  // rank, and best-checkpoint decisions must agree.
  const double local[4] = {mine.loss, double(mine.top1), double(mine.top5), double(mine.samples)};
  comm::Communicator& dp_comm = *dist_.mesh.dp_comm();
  std::vector<double> all(4 * size_t(dp_comm.size()));
  comm::allgather(dp_comm, local, all.data(), sizeof(local));
  EvalSums sums;
  for (int r = 0; r < dp_comm.size(); ++r) {
    const double* v = all.data() + 4 * r;
    sums.loss += v[0];
    sums.top1 += int64_t(v[1]);
    sums.top5 += int64_t(v[2]);
    sums.samples += int64_t(v[3]);
  }
  return eval_metrics(sums, session.is_language_model());
}

StepVerdict DistributedRun::agree(double loss, bool finite, bool stop) const {
  if (!dist_.active()) return StepVerdict{loss, finite, stop};
  // Sums of (loss, non-finite ranks, stopping ranks): one message.
  double v[3] = {finite ? loss : 0.0, finite ? 0.0 : 1.0, stop ? 1.0 : 0.0};
  comm::allreduce(*dist_.world(), v, 3, DType::f64, {.op = comm::ReduceOp::sum});
  StepVerdict verdict;
  verdict.finite = v[1] == 0;
  verdict.loss = verdict.finite ? v[0] / dist_.world_size() : std::nan("");
  verdict.stop = v[2] > 0;
  return verdict;
}

void DistributedRun::barrier() const {
  if (dist_.active()) comm::barrier(*dist_.world());
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

}  // namespace trainer
