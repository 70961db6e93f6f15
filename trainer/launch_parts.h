// What the files of `trainer launch` share (launch.cpp: the command, its
// options and the restart loop; launch_attempt.cpp: one start of the node's
// ranks, supervised to its end). Not for other callers: trainer/launch.h is
// the interface.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "trainer/launch.h"

namespace trainer {

// The handler run_launch installs for SIGINT and SIGTERM: the running
// LaunchAttempt forwards the signal to its ranks.
void on_launch_signal(int sig);

// A rank's process; it leads its own process group.
struct LaunchedRank {
  pid_t pid = -1;
  int rank = 0;
  bool running = false;
};

// One start of the node's ranks, supervised to the end.
class LaunchAttempt {
 public:
  // nnodes and node_index: this start's nodes, and this node's place among them.
  LaunchAttempt(const LaunchOptions& o, int nnodes, int node_index, int port,
                const std::string& token, int restart, const std::string& status_dir)
      : o_(o),
        nnodes_(nnodes),
        node_index_(node_index),
        port_(port),
        token_(token),
        restart_(restart),
        status_dir_(status_dir) {}

  // Starts the ranks and waits for them; the first failure's exit code (0 when all succeeded).
  int run();
  // A failure the launcher was asked for (SIGINT or SIGTERM): no restart.
  bool interrupted() const { return forwarded_ != 0; }

 private:
  using Clock = std::chrono::steady_clock;

  void start_ranks();
  // Fails the job for the first failing rank: reports, then stops the others.
  void fail(int rank, int code, const std::string& why);
  // Ranks whose heartbeat is older than the timeout.
  void check_heartbeats();
  void print_report();

  const LaunchOptions& o_;
  int nnodes_, node_index_;
  int port_;
  std::string token_;
  int restart_;
  std::string status_dir_;
  std::vector<LaunchedRank> children_;
  int result_ = 0, failed_rank_ = -1, forwarded_ = 0, running_ = 0;
  bool kill_pending_ = false;  // when set, surviving ranks get SIGKILL at kill_at_
  Clock::time_point kill_at_, next_heartbeat_check_;
};

}  // namespace trainer
