// `trainer launch`: starts the ranks of this node as child processes, the way
// torchrun does, and supervises them.
//
//   trainer launch --nproc-per-node 4 -- train recipe.yaml
//   trainer launch --nproc-per-node 8 --nnodes 2 --node-rank 0 --master-addr node01 --master-port
//   29500 -- train r.yaml
//
// Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT and TRAINER_JOB_TOKEN (the launcher's own TRAINER_JOB_TOKEN when
// set; else a fresh random one on a single node, or one derived from the
// master address and port across nodes, where every launcher must agree),
// and OMP_NUM_THREADS = cores / nproc-per-node unless the launcher's
// environment sets it (torchrun sets 1). With --bind-to core (the default
// when there are at least as many cores as local ranks: --bind-to auto), local rank l
// runs on its own share of the launcher's cores (the l-th contiguous group of
// cores / nproc-per-node of them; ranks wrap around when there are more ranks
// than cores), as mpirun --bind-to core does: a rank's threads stay on its
// cores, and ranks do not migrate onto each other's (unbound, two ranks
// started together were seen sharing one core of two for seconds).
// --bind-to none leaves placement to the scheduler, as torchrun does.
// SIGINT and SIGTERM are forwarded to the children. When a child fails, the
// others get SIGTERM, then SIGKILL after the grace period, and the launcher
// returns the failed child's exit code (128 + signal for a killed one).
#pragma once

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace trainer {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;            // 0: a free port of this host (single node only)
  std::string program;            // empty: this trainer binary
  std::vector<std::string> args;  // passed to every rank
  double grace_seconds = 10.0;    // between SIGTERM and SIGKILL when stopping ranks
  std::string bind_to = "auto";   // "core", "none", or "auto": core if cores >= ranks
};

// Registers the subcommand; its options fill `options`.
CLI::App* add_launch_command(CLI::App& app, LaunchOptions& options);

// Runs the local ranks to completion; returns the launcher's exit code.
int run_launch(const LaunchOptions& options);

}  // namespace trainer
