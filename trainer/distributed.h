// The trainer's side of data-parallel training (DESIGN.md "parallel/"):
// joining the job when the launcher started several ranks, checking the
// recipe's layout against the world, wrapping the model in DataParallel, the
// timeline, and the few collective decisions the loop must take together.
//
//   Distributed dist = join_job(recipe);                  // world 1: no communicator
//   Session session(recipe, {dist.rank, dist.world_size});
//   DistributedRun run(dist, session, trace);             // zero1: the sharded optimizer
//   TrainOptimizer& opt = session.optimizer();
//   ... backward ... run.finish_gradients(); opt.clip_grad_norm(max); opt.step();
//   run.zero_grad(opt);
//   StepVerdict v = run.agree(loss_sum, finite, stop_signal);   // the same on every rank
//
// The optimizer (TrainOptimizer) is the recipe's SGD or AdamW over every
// parameter, replicated on each rank; under parallel.zero1 on several ranks
// it is a parallel::ZeroOptimizer: each rank keeps the optimizer state of
// 1/world of the parameters, DataParallel's buckets are reduce-scattered
// into the ranks' shards instead of allreduced, and step() all-gathers the
// updated parameters. Its checkpoint is one file per rank.
//
// Every rank runs the same loop and reaches each collective call at the
// same step (log, checkpoint and stop decisions depend only on the step or
// on an agreement), so no rank waits on a collective another skipped. A rank
// that dies makes the next collective of the others throw an Error naming
// it; the trainer exits with that message and the launcher stops the job.
//
// Glossary: rank/world = this process and the job size (all data-parallel:
// pp = tp = 1); main rank = rank 0, which logs and writes the replicated
// parts of checkpoints; shard = one rank's part of the optimizer state.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "layers/module.h"
#include "optim/optimizer.h"
#include "parallel/ddp.h"
#include "parallel/trace.h"
#include "parallel/zero.h"
#include "trainer/recipe.h"

namespace trainer {

class Session;
struct EvalMetrics;

struct Distributed {
  std::shared_ptr<comm::Communicator> world;  // null: a single process
  int rank = 0;
  int world_size = 1;
  bool active() const { return world != nullptr; }
  bool is_main() const { return rank == 0; }
};

// The data-parallel degree of the recipe on world_size ranks: parallel.dp
// (0: the world size), which must equal it; pipeline and tensor parallelism
// are not built yet. Throws Error naming the recipe keys otherwise.
int64_t data_parallel_degree(const Recipe& recipe, int world_size);

// Whether the optimizer state is sharded: parallel.zero1 on more than one
// rank (one rank holds all of it either way).
bool shards_optimizer(const Recipe& recipe, int world_size);

// The optimizer the loop steps and checkpoints save: the recipe's optimizer
// over every parameter, or this rank's shard of it (parallel/zero.h).
class TrainOptimizer {
 public:
  explicit TrainOptimizer(std::unique_ptr<optim::Optimizer> full);
  explicit TrainOptimizer(std::shared_ptr<parallel::ZeroOptimizer> sharded);

  bool sharded() const { return zero_ != nullptr; }
  void set_lr(double lr);
  double lr() const;
  // Clips the averaged gradient to a global 2-norm of max_norm and returns
  // the norm before clipping (sharded: of the whole gradient; collective).
  double clip_grad_norm(double max_norm);
  // One update of every parameter (sharded: collective).
  void step();
  // Drops the gradients; sharded: also forgets a reduction whose step was skipped.
  void zero_grad();
  // The state (sharded: this rank's shard, its names recording the layout),
  // aliasing the live buffers.
  std::vector<NamedTensor> state() const;
  // Restores a state saved by state(); otherwise throws Error saying what
  // differs and changes nothing.
  void load_state(const std::vector<NamedTensor>& state);

 private:
  std::unique_ptr<optim::Optimizer> full_;
  std::shared_ptr<parallel::ZeroOptimizer> zero_;
};

// Joins the job the launcher started (comm/bootstrap.h); a single process
// when started alone. Checks the recipe's layout against the world.
Distributed join_job(const Recipe& recipe);

// What the ranks decided together about one optimizer step.
struct StepVerdict {
  double loss = 0;     // the mean loss over the ranks
  bool finite = true;  // every rank's loss was finite: take the step
  bool stop = false;   // some rank received SIGTERM/SIGINT: checkpoint and exit
};

class DistributedRun {
 public:
  // Wraps the session's model in DataParallel when dist is active
  // (parameters and buffers broadcast from rank 0 now; buckets of
  // parallel.bucket_mb, overlap from parallel.overlap); records a timeline
  // when trace is set. When the session shards its optimizer, builds it over
  // the buckets and hands it to the session (collective).
  DistributedRun(const Distributed& dist, Session& session, bool trace);

  const Distributed& dist() const { return dist_; }
  parallel::Timeline* timeline() const { return timeline_.get(); }
  parallel::DataParallel* data_parallel() const { return dp_.get(); }

  // For a non-final micro-step of gradient accumulation: no communication.
  parallel::DataParallel::NoSync no_sync(bool active);
  // After the last backward of a step: waits for the averaged gradients.
  void finish_gradients();
  // Clears gradients (keeping DataParallel's bucket views). Every
  // iteration, a skipped step's too.
  void zero_grad(TrainOptimizer& optimizer);

  // The validation metrics, the same bits on every rank: rank 0's buffers
  // are broadcast, each rank evaluates its share of the validation set and
  // the shares are added up in rank order (collective).
  EvalMetrics evaluate(Session& session) const;

  // One small allreduce per step (local values on a single process).
  StepVerdict agree(double loss, bool finite, bool stop) const;
  // Every rank reaches this point before any continues (checkpoint commits).
  void barrier() const;

  // Stops recording after the first steps (a long run's trace would be huge).
  void end_trace_window(int64_t steps_done);
  // Writes the timeline: all ranks' spans in one file written by rank 0
  // (collective). Does nothing without tracing.
  void write_trace(const std::string& path) const;

 private:
  Distributed dist_;
  std::unique_ptr<parallel::Timeline> timeline_;
  // Before dp_: its bucket reduction reads zero_ while backward runs.
  std::shared_ptr<parallel::ZeroOptimizer> zero_;
  std::unique_ptr<parallel::DataParallel> dp_;
};

}  // namespace trainer
