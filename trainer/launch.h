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
// Children die with the launcher (PR_SET_PDEATHSIG), even when it is killed
// with SIGKILL.
//
// Watchdog (comm/watchdog.h): each rank keeps a status file in the
// launcher's status directory and stamps a heartbeat in it. A rank whose
// heartbeat is older than --heartbeat-timeout (stopped with SIGSTOP, not
// scheduled) is named as the failed rank ("rank 1 (pid 4242) stopped making
// progress: no heartbeat for 10.0 s, process stopped by a signal") and
// killed. When the job fails, the launcher prints one line per rank of this
// host (last completed operation, the operation it waits in and for whom)
// and the ranks that never arrived.
//
// Restarts: with --max-restarts K a failed job is stopped whole and started
// again, up to K times; the ranks get TRAINER_RESTART_COUNT and `trainer
// train` then resumes from the newest complete checkpoint (as --resume
// auto). Across nodes every node's launcher restarts its ranks; they meet
// again at the same master address and port. With --nnodes MIN:MAX the
// launchers first meet in a rendezvous of their own (node 0's launcher serves
// it on the master port + 1) and the job runs on the nodes that came, at
// least MIN: a job that loses a node restarts on the others, and `trainer
// train` resumes the checkpoint resharded for the smaller world.
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
  int min_nodes = 0;           // --nnodes MIN:MAX: elastic (trainer/node_rendezvous.h); 0: nnodes
  double settle_seconds = 10;  // elastic: how long node 0 waits for more than MIN nodes
  int max_restarts = 0;        // restarts of the whole job after a failure
  double heartbeat_timeout = 30;  // seconds without a heartbeat that fail a rank; 0: off
  bool oversubscribe = false;     // allow more ranks per core than the launcher's bound
};

// Registers the subcommand; its options fill `options`.
CLI::App* add_launch_command(CLI::App& app, LaunchOptions& options);

// Throws Error naming the option when `options` cannot make a job: no
// command for the ranks, a node rank past --nnodes, more ranks than the
// bounds (per core of this host without --oversubscribe; 2^20 in the job),
// a non-finite or out-of-range time. run_launch calls it first.
void validate_launch_options(const LaunchOptions& options);

// Runs the local ranks to completion; returns the launcher's exit code.
int run_launch(const LaunchOptions& options);

}  // namespace trainer
