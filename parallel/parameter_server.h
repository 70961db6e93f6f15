// Parameter servers (the centralized way to keep replicas in step, as
// ps-lite and BytePS do): S server ranks each own a shard of the parameters
// and apply the optimizer to it; W worker ranks compute gradients, push each
// shard's to its server and pull the fresh parameters back, over UCX
// point-to-point messages (shared memory on one host).
//
//   ShardMap shards = assign_shards(param_groups, servers);        // the same on every rank
//   // worker: the optimizer the training loop steps
//   auto client = std::make_shared<ParameterServerClient>(world, shards, workers, groups, make);
//   client->set_lr(lr); client->step();          // push gradients, pull parameters
//   // server rank: serves until every worker has finished
//   ServerReport r = serve_parameters(world, shards, workers, groups, make, {.sync = Sync::ssp,
//                                     .staleness = 2});
//
// Ranks: workers are world ranks [0, W), servers [W, W + S); server k holds
// shard k. Synchronisation (the server decides when a worker's pull is answered):
//   bsp  the server waits for every worker's gradient of a step, applies
//        their mean once (summed in worker order) and answers them all: the
//        same training as allreduce data parallelism at the same global batch;
//   asp  each gradient is applied as it arrives (scaled by 1/W, so W of them
//        weigh one synchronous step) and its worker answered at once;
//   ssp  as asp, but a worker that has pushed c gradients is answered only
//        when the slowest worker has pushed at least c - s (stale synchronous
//        parallel, Ho et al. 2013): no worker runs more than s steps ahead.
// The staleness of an applied gradient is the number of updates the shard
// received between the worker's pull of the parameters it used and the
// gradient's application (0 under bsp); every answer carries it.
//
// Messages between worker w and server k are numbered per direction (the
// P2PTag's micro-batch field), each a header (f64[4]: command, step, lr) and
// a payload: kInit (worker 0's parameters, before its first push, after any
// checkpoint was loaded), kPush (gradients; answered by a header {version,
// staleness} and the parameters), kGetState / kSetState (the shard's
// optimizer state, flattened in the order LocalOptimizer::state() lists it,
// f64, for checkpoints) and kDone. Errors name each message by what it is
// ("the gradients of gradient push message 12"), and a rank that dies by its
// role: the ranks exchanging with it say "parameter server 0 (rank 2):
// worker 1 (rank 1) died: ...", and a server leaves its watchdog record
// waiting on the dead worker, so `trainer launch` reports that worker, not
// the server the others wait on, as the one that never arrived.
//
// Glossary: shard = the whole tensors one server owns (balanced by bytes);
// version = the number of updates a shard has received; clock = the number
// of gradients a worker has pushed.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "optim/optimizer.h"

namespace trainer::parallel {

enum class Sync { bsp, asp, ssp };
// "bsp" | "asp" | "ssp"; Error otherwise.
Sync parse_sync(const std::string& name);

// Which server owns each parameter (by name), whole tensors balanced by bytes.
struct ShardMap {
  int servers = 0;
  std::map<std::string, int> owner;
  std::vector<int64_t> elements;  // per server
};
ShardMap assign_shards(const std::vector<optim::ParamGroup>& groups, int servers);
// The groups restricted to the parameters of server k (groups keep their options).
std::vector<optim::ParamGroup> shard_groups(const std::vector<optim::ParamGroup>& groups,
                                            const ShardMap& shards, int k);

using OptimizerFactory =
    std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>;

// The worker's optimizer: step() pushes the gradients and pulls the
// parameters; state() on worker 0 fetches the servers' state (on the others
// it has the layout only), load_state() on worker 0 sends it to them, so
// checkpoints look like a local optimizer's.
class ParameterServerClient final : public optim::Optimizer {
 public:
  // world: every rank (workers first); groups: this worker's whole model.
  ParameterServerClient(std::shared_ptr<comm::Communicator> world, ShardMap shards, int workers,
                        std::vector<optim::ParamGroup> groups, const OptimizerFactory& make);
  // Tells the servers this worker is done (they serve until all are).
  ~ParameterServerClient() override;

  void step() override;
  void zero_grad(bool set_to_none = true) override;
  // This worker's gradients only (the loop's grad-norm figure).
  double clip_grad_norm(double max_norm) override;
  void set_lr(double lr) override { lr_ = lr; }
  double lr() const override { return lr_; }
  const std::vector<optim::ParamGroup>& param_groups() const override { return groups_; }
  std::vector<NamedTensor> state() const override;
  void load_state(const std::vector<NamedTensor>& state) override;

  // The largest staleness of the gradients of the last step (over the servers).
  int64_t last_staleness() const { return last_staleness_; }

 private:
  struct Link;  // one server's buffers and message counters
  void send(Link& link, int command, const Tensor* payload) const;
  void push_and_pull();
  // An Error of an exchange with the servers, as the death of those that
  // died (rethrown as it is when none did).
  [[noreturn]] void rethrow_naming_dead_servers(const Error& error) const;

  std::shared_ptr<comm::Communicator> world_;
  ShardMap shards_;
  int workers_;
  std::vector<optim::ParamGroup> groups_;
  // A local optimizer over the same parameters, never stepped: the layout
  // of the state, and where state() unpacks the servers' parts.
  std::unique_ptr<optim::Optimizer> shadow_;
  std::vector<std::unique_ptr<Link>> links_;
  double lr_ = 0;
  int64_t step_ = 0;
  int64_t last_staleness_ = 0;
  bool initialized_ = false;
};

struct ServeOptions {
  Sync sync = Sync::bsp;
  int64_t staleness = 0;  // ssp's bound
};

// What a server did, for its log line and the tests.
struct ServerReport {
  int64_t updates = 0;                   // optimizer steps of the shard
  int64_t gradients = 0;                 // gradients applied
  std::map<int64_t, int64_t> staleness;  // staleness -> gradients
  std::string summary() const;           // "2400 gradients, staleness mean 0.9, max 3: ..."
};

// Serves shard k = world rank - workers until every worker has said it is done.
ServerReport serve_parameters(std::shared_ptr<comm::Communicator> world, const ShardMap& shards,
                              int workers, const std::vector<optim::ParamGroup>& groups,
                              const OptimizerFactory& make, const ServeOptions& options);

}  // namespace trainer::parallel
