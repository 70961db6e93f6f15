// The trainer's side of data-parallel training (DESIGN.md "parallel/"):
// joining the job when the launcher started several ranks, checking the
// recipe's layout against the world, wrapping the model in DataParallel, the
// timeline, and the few collective decisions the loop must take together.
//
//   Distributed dist = join_job(recipe);                  // world 1: no communicator
//   Session session(recipe, {dist.rank, dist.world_size});
//   DistributedRun run(dist, recipe, session.model_ptr(), trace);
//   ... backward ... run.finish_gradients(); optimizer.step(); run.zero_grad(optimizer);
//   StepVerdict v = run.agree(loss_sum, finite, stop_signal);   // the same on every rank
//
// Every rank runs the same loop and reaches each collective call at the
// same step (log, checkpoint and stop decisions depend only on the step or
// on an agreement), so no rank waits on a collective another skipped. A rank
// that dies makes the next collective of the others throw an Error naming
// it; the trainer exits with that message and the launcher stops the job.
//
// Glossary: rank/world = this process and the job size (all data-parallel:
// pp = tp = 1); main rank = rank 0, which logs and writes checkpoints.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"
#include "layers/module.h"
#include "optim/optimizer.h"
#include "parallel/ddp.h"
#include "parallel/trace.h"
#include "trainer/recipe.h"

namespace trainer {

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
  // Wraps model in DataParallel when dist is active (parameters and buffers
  // broadcast from rank 0 now; buckets of parallel.bucket_mb, overlap from
  // parallel.overlap); records a timeline when trace is set.
  DistributedRun(const Distributed& dist, const Recipe& recipe, std::shared_ptr<Module> model,
                 bool trace);

  const Distributed& dist() const { return dist_; }
  parallel::Timeline* timeline() const { return timeline_.get(); }
  parallel::DataParallel* data_parallel() const { return dp_.get(); }

  // For a non-final micro-step of gradient accumulation: no communication.
  parallel::DataParallel::NoSync no_sync(bool active);
  // After the last backward of a step: waits for the averaged gradients.
  void finish_gradients();
  // Clears gradients (keeping DataParallel's bucket views).
  void zero_grad(optim::Optimizer& optimizer);

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
  std::unique_ptr<parallel::DataParallel> dp_;
};

}  // namespace trainer
