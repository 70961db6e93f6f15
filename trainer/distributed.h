// The trainer's side of parallel training: joining
// the job when the launcher started several ranks, checking the recipe's
// layout against the world and laying the ranks out on the mesh
// (parallel/mesh.h), wrapping the model in DataParallel over the mesh's
// data-parallel communicator, the timeline, and the few collective decisions
// the loop must take together.
//
//   Distributed dist = join_job(recipe);                  // world 1: no communicator
//   Session session(recipe, dist.layout);
//   DistributedRun run(dist, session, trace);             // zero1: the sharded optimizer
//   optim::Optimizer& opt = session.optimizer();
//   ... backward ... run.finish_gradients(); opt.clip_grad_norm(max); opt.step();
//   run.zero_grad(opt);
//   StepVerdict v = run.agree(loss_sum, finite, stop_signal);   // the same on every rank
//
// The optimizer is the recipe's SGD or AdamW over every parameter,
// replicated on each rank; under parallel.zero1 on several dp ranks it is a
// parallel::ZeroOptimizer: each rank keeps the optimizer state of 1/dp of
// the parameters, DataParallel's buckets are reduce-scattered into the
// ranks' shards instead of allreduced, and step() all-gathers the updated
// parameters. Its checkpoint is one file per rank.
//
// Every rank runs the same loop and reaches each collective call at the
// same step (log, checkpoint and stop decisions depend only on the step or
// on an agreement), so no rank waits on a collective another skipped. A rank
// that dies makes the next collective of the others throw an Error naming
// it; the trainer exits with that message and the launcher stops the job.
//
// Glossary: rank/world = this process and the job size; dp rank/size = its
// place among the data-parallel replicas (the whole world while pp = tp =
// 1); main rank = rank 0, which logs and writes
// the replicated parts of checkpoints; shard = one rank's part of the
// optimizer state.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "comm/alpha_beta.h"
#include "comm/communicator.h"
#include "layers/module.h"
#include "optim/optimizer.h"
#include "parallel/ddp.h"
#include "parallel/mesh.h"
#include "parallel/parameter_server.h"
#include "parallel/pipeline.h"
#include "parallel/tensor_parallel.h"
#include "parallel/trace.h"
#include "parallel/zero.h"
#include "trainer/checkpoint.h"
#include "trainer/recipe.h"

namespace trainer {

class Model;  // layers/block_list.h

namespace parallel {
class PipelineRuntime;
class ShardedParameters;
}  // namespace parallel
class Session;
struct EvalMetrics;
struct EvalSums;

// This process's place in the job: the training data is sharded over the
// dp ranks (and the ep ranks: parallel::kBatchDims), the global batch split
// over dp_size() of them. Evaluation shares the validation set over the dp
// ranks only (eval_rank, eval_size): ep ranks evaluate the same windows,
// which they exchange rows of.
struct RankLayout {
  ParallelLayout job;
  int rank = 0;  // world rank
  parallel::MeshCoord coord;
  int world_size() const { return job.world_size(); }
  int dp_rank() const { return parallel::group_index(job.mesh, coord, parallel::kBatchDims); }
  int dp_size() const { return job.mesh.size(parallel::kBatchDims); }
  int eval_rank() const { return parallel::group_index(job.mesh, coord, parallel::kDataParallel); }
  int eval_size() const { return job.mesh.size(parallel::kDataParallel); }
  int size(parallel::Dims dims) const { return job.mesh.size(dims); }
  int index(parallel::Dims dims) const { return parallel::group_index(job.mesh, coord, dims); }
  // parallel.zero1 on more than one dp rank.
  bool shards_optimizer() const { return job.zero1; }
};

// The recipe's layout on world_size ranks: parallel.dp (0: world / (pp x
// tp)) x pp x tp must equal the world, so the world must be a multiple of
// pp x tp; the pipeline keys (micro_batches, schedule) are refused with
// pp = 1. zero1 is set when parallel.zero1 has several dp ranks to shard
// over. Throws Error naming the recipe keys and the launch that fits.
ParallelLayout parallel_layout(const Recipe& recipe, int world_size);
// The ZeRO stage parallel.shard asks for (0 to 3; parallel.zero1 is 1).
int zero_stage(const ParallelRecipe& parallel);
// parallel.ep: an Error naming the keys when the recipe's experts do not
// divide over the ranks or the layout has what expert parallelism does not
// run with (trainer/expert_parallel_run.cpp).
void check_expert_keys(const Recipe& recipe);
// Sharding's mixed precision (FSDP2's policy): the dtype ZeRO-3 gathers the
// parameters in (parallel.param_dtype; auto: bf16 under precision bf16) and
// the one ZeRO-2 and -3 reduce the gradients in (parallel.reduce_dtype);
// unset means the parameters' own. Error naming the key for a combination
// that does not apply (bf16 parameters without precision bf16 or ZeRO-3, a
// bf16 reduction below ZeRO-2).
struct ShardDtypes {
  std::optional<DType> param, reduce;
};
ShardDtypes shard_dtypes(const Recipe& recipe, int stage);
// ", zero3, gathers bf16, reduces bf16" for the layout lines; "" unsharded.
std::string shard_label(const Recipe& recipe, const ParallelLayout& layout);
// World rank `rank` of that layout.
RankLayout rank_layout(const ParallelLayout& job, int rank);

struct Distributed {
  RankLayout layout;
  parallel::Mesh mesh;  // no communicators for a single process
  // parallel.mode = parameter_server: the servers (the last world ranks,
  // outside the layout and the mesh, which span the workers) and the
  // communicator of every rank, which carries the workers' pushes and pulls.
  int servers = 0;
  bool is_server = false;
  std::shared_ptr<comm::Communicator> everyone;
  bool active() const { return mesh.world() != nullptr; }
  bool is_main() const { return layout.rank == 0; }
  int rank() const { return layout.rank; }
  int world_size() const { return layout.world_size(); }
  const std::shared_ptr<comm::Communicator>& world() const { return mesh.world(); }
};

// parallel.micro_batches as a run on dp data-parallel replicas uses it. A
// count the recipe gives is kept. 0 (auto, the default): 1 without a
// pipeline and under the LSTM LM's wavefront (its time chunks are the
// micro-batches); on a pipeline the largest count up to 2 x pp that divides
// the replica's batch (training.global_batch / dp), a multiple of pp under
// the interleaved schedule. Up to 2 x pp keeps GPipe's and 1F1B's bubble,
// (pp - 1) / (M + pp - 1), under a third of a step with micro-batches as
// large as that allows. `trainer plan` resolves the recipe's count with it.
int64_t resolved_micro_batches(const Recipe& recipe, int64_t dp);
// The share of a step the recipe's pipeline stages idle with M
// micro-batches, on uniform stages (parallel::pipeline_step_time): (pp - 1)
// / (M + pp - 1) for GPipe and 1F1B.
double pipeline_bubble(const Recipe& recipe, int64_t micro_batches);

// Joins the job the launcher started (comm/bootstrap.h) and builds the
// mesh; a single process when started alone. Checks the recipe's layout
// against the world first, then resolves what depends on it in the recipe:
// parallel.micro_batches (resolved_micro_batches; rank 0 prints what auto
// chose and why, and warns when a pipeline is given fewer micro-batches
// than stages). dry_run: a process started alone takes the layout of the
// recipe's dp x pp x tp ranks as rank 0 (no communicator).
Distributed join_job(Recipe& recipe, bool dry_run = false);

// What the ranks decided together about one optimizer step.
struct StepVerdict {
  double loss = 0;     // the mean loss over the ranks
  bool finite = true;  // every rank's loss was finite: take the step
  bool stop = false;   // some rank received SIGTERM/SIGINT: checkpoint and exit
};

class DistributedRun {
 public:
  // Wraps the session's model in DataParallel over the dp communicator when
  // dist is active (parameters and buffers broadcast from dp rank 0 now; buckets of
  // parallel.bucket_mb, overlap from parallel.overlap); records a timeline
  // when trace is set. When the session shards its optimizer, builds it over
  // the buckets and hands it to the session (collective).
  DistributedRun(const Distributed& dist, Session& session, bool trace);
  ~DistributedRun();

  const Distributed& dist() const { return dist_; }
  // This rank's pipeline stage (parallel.pp > 1), else null.
  parallel::PipelineRuntime* pipeline() const { return pipeline_.get(); }
  parallel::Timeline* timeline() const { return timeline_.get(); }
  parallel::DataParallel* data_parallel() const { return dp_.get(); }
  // The worker's side of parameter servers (parallel.mode), else null.
  parallel::ParameterServerClient* parameter_server() const { return ps_.get(); }

  // For a non-final micro-step of gradient accumulation: no communication.
  parallel::DataParallel::NoSync no_sync(bool active);
  // After every backward (each micro-step's): under sharded gradients the
  // reductions of this backward start (they accumulate in the shards).
  void end_backward();
  // After the last backward of a step: waits for the averaged gradients;
  // on a pipeline, the two stages holding a tied weight then add up their
  // gradients of it (the same sum on both).
  void finish_gradients();
  // Whether the model is split over ranks (pipeline stages, tensor
  // parallelism): its gradient norm is then clip_gradients'.
  bool splits_model() const { return pipeline_ || tp_ || expert_comm_; }
  // Clips the gradients of a split model to a global 2-norm of max_norm,
  // summed over every parameter in the order of the whole model's optimizer
  // (over the stages, and over the tensor-parallel ranks for split
  // parameters, counting replicated ones once), and returns it.
  double clip_gradients(double max_norm) const;
  // The tensor-parallel group (parallel.tp > 1), else null.
  parallel::CommGroup* tensor_parallel() const { return tp_.get(); }
  // Clears gradients (keeping DataParallel's bucket views). Every
  // iteration, a skipped step's too.
  void zero_grad(optim::Optimizer& optimizer);

  // The validation metrics, the same bits on every rank: dp rank 0's
  // buffers are broadcast, each dp rank evaluates its share of the
  // validation set and the shares are added up in rank order (collective
  // over the dp ranks). On a pipeline each stage runs only its own pieces
  // (forward only, batch after batch, as a training forward passes
  // activations) and the stage with the last piece computes the sums.
  EvalMetrics evaluate(Session& session) const;

  // One small allreduce over the world per step (local values on a single
  // process). The loss is the mean over the ranks that hold one
  // (has_loss: a pipeline's last stage).
  StepVerdict agree(double loss, bool finite, bool stop, bool has_loss = true) const;
  // Whether flag is set on any rank (one small allreduce over the world;
  // flag itself on a single process).
  bool any_rank(bool flag) const;
  // "memory: peak 12.5 MiB of tensors, 80.1 MiB resident": the largest of
  // any rank (collective over the world).
  std::string memory_summary() const;
  // Every rank reaches this point before any continues (checkpoint commits).
  void barrier() const;
  // The allreduce cost models every rank has found so far, joined
  // (collective over the world; comm/alpha_beta.h): what a checkpoint keeps.
  std::map<std::vector<int>, comm::LinkModel> link_models() const;
  // A resumed checkpoint's models, written by a run over `saved` ranks:
  // preset (comm::preset_link_model) when this run has as many; true then.
  bool keep_link_models(const std::map<std::vector<int>, comm::LinkModel>& models, int saved) const;

  // Stops recording after the first steps (a long run's trace would be huge).
  void end_trace_window(int64_t steps_done);
  // Writes the timeline: all ranks' spans in one file written by rank 0
  // (collective). Does nothing without tracing.
  void write_trace(const std::string& path) const;

 private:
  // The passes, in the order the constructor applies them.
  void apply_tensor_parallel(Session& session);
  void apply_context_parallel(Session& session);
  // parallel.ep (trainer/expert_parallel_run.cpp): the MoE layers' experts
  // divided over the ep ranks; their gradients averaged over expert_comm_.
  void apply_expert_parallel(Session& session);
  void reduce_expert_gradients();
  void apply_pipeline(Session& session, const parallel::StageSplit& split);
  void record_split_parameters(const Session& session);
  void apply_parameter_servers(Session& session);
  void apply_data_parallel(Session& session);
  void build_sharded_optimizer(Session& session);
  // The bucket options of the sharded optimizer (reduced into its shards,
  // ZeRO-1 in place, ZeRO-2/3 transient per unit); the units of ZeRO-2/3.
  std::vector<std::vector<size_t>> shard_buckets(const Session& session, Model* blocks_model,
                                                 parallel::DataParallelOptions& o);
  // The ranks that shard the optimizer state (and gradients, parameters)
  // among them: the dp group, or under hybrid sharding this rank's dp_shard group.
  std::shared_ptr<comm::Communicator> shard_comm() const;
  // The ranks whose gradients add up: the dp group, times the cp group
  // under context parallelism and the ep group under expert parallelism.
  std::shared_ptr<comm::Communicator> replica_comm() const;
  // The ranks whose evaluation sums add up: the dp and cp groups.
  std::shared_ptr<comm::Communicator> eval_comm() const;
  // Whether this rank counts parameter p (which it trains) in the gradient
  // norm of its replica and stage: a tensor-parallel part on every rank, a
  // whole tensor on the first tensor-parallel rank (parallel/placement.h).
  bool counted_in_norm(const Tensor& p) const;
  // This pipeline's sums over this dp rank's share of the validation set,
  // on every stage (collective over the pp group; parallel/pipeline_eval.h).
  EvalSums evaluate_pipeline(Session& session) const;
  // Adds the other stage's gradient of tied weight k (tied_across_stages) to
  // grad, which that stage exchanges too (collective over the pair).
  void add_tied_gradient(size_t k, Tensor& grad) const;

  Distributed dist_;
  Session* session_ = nullptr;
  std::unique_ptr<parallel::Timeline> timeline_;
  std::shared_ptr<parallel::CommGroup> tp_;
  // Of what this rank trains: the parameters tensor parallelism shards, and
  // those whose gradients are shares to sum (sequence parallelism).
  std::map<const TensorImpl*, std::string> names_;  // what this rank holds, by global name
  TensorList gradient_shares_;
  // Expert parallelism: the experts this rank holds, and the ranks holding
  // the same ones (dp x cp), over which their gradients are averaged.
  TensorList expert_params_;
  std::shared_ptr<comm::Communicator> expert_comm_;
  std::unique_ptr<parallel::PipelineRuntime> pipeline_;
  // Before dp_: its bucket reduction reads zero_ while backward runs.
  std::shared_ptr<parallel::ZeroOptimizer> zero_;
  std::unique_ptr<parallel::DataParallel> dp_;
  // ZeRO-3: the gathers of the blocks' parameters (after dp_: it reads its buckets).
  std::unique_ptr<parallel::ShardedParameters> sharded_parameters_;
  bool gather_in_place_ = false;  // ZeRO-3 on one host: units read where they lie
  std::shared_ptr<parallel::ParameterServerClient> ps_;
};

// A server rank of parallel.mode = parameter_server: serves its shard of the
// session's parameters until every worker is done; prints its report.
void serve_parameter_shard(const Distributed& dist, Session& session);

}  // namespace trainer
