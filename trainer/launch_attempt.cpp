// One start of `trainer launch`'s ranks on this node (LaunchAttempt): each
// rank forked with its environment and cores, then supervised until all have
// exited: the first failure stops the others, a rank without a heartbeat is
// killed, and what the ranks were doing is reported.
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "comm/watchdog.h"
#include "core/check.h"
#include "core/cpu/threads.h"
#include "trainer/launch_parts.h"

extern char** environ;

namespace trainer {

namespace {

// The signal the launcher received (on_launch_signal); 0 until one comes.
volatile sig_atomic_t g_signal = 0;

// How often the supervisor looks at its children.
constexpr auto kPollInterval = std::chrono::milliseconds(20);

// This process's environment without the variables we set for the ranks, plus those.
std::vector<std::string> child_environment(
    const std::vector<std::pair<std::string, std::string>>& vars) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    std::string name = entry.substr(0, entry.find('='));
    bool replaced = false;
    for (const auto& [k, v] : vars) replaced = replaced || k == name;
    if (!replaced) env.push_back(entry);
  }
  for (const auto& [k, v] : vars) env.push_back(k + "=" + v);
  return env;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

void signal_all(std::vector<LaunchedRank>& children, int sig) {
  for (LaunchedRank& c : children)
    if (c.running) ::kill(-c.pid, sig);  // each child leads its own process group
}

std::string core_list(const std::vector<int>& cores) {
  std::string out;
  for (size_t i = 0; i < cores.size();) {
    size_t j = i;
    while (j + 1 < cores.size() && cores[j + 1] == cores[j] + 1) ++j;
    out += cat(out.empty() ? "" : ",", cores[i], j > i ? cat("-", cores[j]) : "");
    i = j + 1;
  }
  return out;
}

// The cores local rank `local` of nproc runs on under --bind-to core: the
// local-th contiguous share of cores (the launcher's, in increasing order),
// wrapping around when there are more ranks than cores.
std::vector<int> rank_cores(const std::vector<int>& cores, int local, int nproc) {
  if (cores.empty() || nproc <= 0) return {};
  const size_t n = cores.size(), share = std::max<size_t>(1, n / size_t(nproc));
  const size_t first = (size_t(local) * share) % n;
  return std::vector<int>(cores.begin() + long(first),
                          cores.begin() + long(std::min(n, first + share)));
}

// The state letter of /proc/pid/stat ('R', 'S', 'D', 'T' stopped, 't' traced,
// 'Z'), '?' when unreadable.
char process_state(pid_t pid) {
  std::ifstream stat(cat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  return paren != std::string::npos && paren + 2 < text.size() ? text[paren + 2] : '?';
}

std::string describe_state(char state) {
  switch (state) {
    case 'T':
      return "process stopped by a signal";
    case 't':
      return "process stopped by a debugger";
    case 'D':
      return "process in uninterruptible sleep (I/O)";
    case 'Z':
      return "process exited";
    default:
      return cat("process state ", state);
  }
}

}  // namespace

void on_launch_signal(int sig) { g_signal = sig; }

void LaunchAttempt::start_ranks() {
  const int world = nnodes_ * o_.nproc_per_node;
  std::string program = o_.program.empty() ? "/proc/self/exe" : o_.program;
  std::vector<std::string> argv_strings{o_.program.empty() ? "trainer" : o_.program};
  argv_strings.insert(argv_strings.end(), o_.args.begin(), o_.args.end());

  // Ranks share the node's cores: unless the user chose, each rank's OpenMP
  // gets cores / nproc_per_node threads (torchrun sets 1), so ranks don't
  // oversubscribe the cores and spin against each other.
  const std::vector<int> cores = allowed_cores();
  std::vector<std::pair<std::string, std::string>> common{
      {"WORLD_SIZE", std::to_string(world)},
      {"LOCAL_WORLD_SIZE", std::to_string(o_.nproc_per_node)},
      {"MASTER_ADDR", o_.master_addr},
      {"MASTER_PORT", std::to_string(port_)},
      {"TRAINER_JOB_TOKEN", token_},
      {"TRAINER_RESTART_COUNT", std::to_string(restart_)}};
  if (!status_dir_.empty()) {
    // Five heartbeats per timeout, at most one a second.
    const double ms = std::clamp(o_.heartbeat_timeout * 1000 / 5, 10.0, 1000.0);
    common.push_back({"TRAINER_STATUS_DIR", status_dir_});
    common.push_back({"TRAINER_HEARTBEAT_MS", std::to_string(int(ms))});
  }
  if (!std::getenv("OMP_NUM_THREADS")) {
    const long n = std::max(1L, long(cores.size()));
    common.push_back({"OMP_NUM_THREADS", std::to_string(std::max(1L, n / o_.nproc_per_node))});
  }

  const bool bind =
      o_.bind_to == "core" || (o_.bind_to == "auto" && o_.nproc_per_node <= int(cores.size()));
  const std::vector<int> bind_cores = bind ? cores : std::vector<int>();
  if (o_.bind_to == "core" && o_.nproc_per_node > int(cores.size()) && restart_ == 0)
    std::fprintf(stderr, "trainer launch: %d ranks on %zu cores: ranks will share cores\n",
                 o_.nproc_per_node, cores.size());

  const pid_t launcher = ::getpid();
  for (int local = 0; local < o_.nproc_per_node; ++local) {
    const std::vector<int> mine = rank_cores(bind_cores, local, o_.nproc_per_node);
    if (!mine.empty() && restart_ == 0)
      std::fprintf(stderr, "trainer launch: local rank %d bound to cores %s\n", local,
                   core_list(mine).c_str());
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : mine) CPU_SET(c, &set);
    const int rank = node_index_ * o_.nproc_per_node + local;
    std::vector<std::pair<std::string, std::string>> vars{{"RANK", std::to_string(rank)},
                                                          {"LOCAL_RANK", std::to_string(local)}};
    vars.insert(vars.end(), common.begin(), common.end());
    std::vector<std::string> env = child_environment(vars);
    std::vector<char*> envp = pointers(env), argv = pointers(argv_strings);
    pid_t pid = ::fork();
    CHECK(pid >= 0) << "fork: " << std::strerror(errno);
    if (pid == 0) {
      ::setpgid(0, 0);
      // Die with the launcher, however it ends (it may already be gone).
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(128 + SIGKILL);
      if (!mine.empty() && ::sched_setaffinity(0, sizeof set, &set) != 0) {
        std::fprintf(stderr, "trainer launch: cannot bind local rank %d to cores %s: %s\n", local,
                     core_list(mine).c_str(), std::strerror(errno));
        ::_exit(127);
      }
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::execve(program.c_str(), argv.data(), envp.data());
      std::fprintf(stderr, "trainer launch: cannot run %s: %s\n", program.c_str(),
                   std::strerror(errno));
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here, so the group exists before we signal it
    children_.push_back({pid, rank, true});
  }
  running_ = int(children_.size());
}

void LaunchAttempt::print_report() {
  if (status_dir_.empty()) return;
  std::vector<comm::watchdog::Status> statuses;
  for (const LaunchedRank& c : children_)
    if (auto s = comm::watchdog::read_status(comm::watchdog::status_path(status_dir_, c.rank))) {
      // The failing rank, ended by a signal: its record is what it left.
      s->killed = !c.running && c.rank == failed_rank_ && result_ > 128;
      statuses.push_back(*s);
    }
  if (statuses.empty()) return;
  const int64_t stale = int64_t(o_.heartbeat_timeout * 1e9);
  std::fprintf(stderr, "trainer launch: what the ranks of this host were doing:\n");
  for (const std::string& line :
       comm::watchdog::report(statuses, comm::watchdog::monotonic_ns(), stale))
    std::fprintf(stderr, "trainer launch:   %s\n", line.c_str());
}

void LaunchAttempt::fail(int rank, int code, const std::string& why) {
  failed_rank_ = rank;
  result_ = code;
  std::fprintf(stderr, "trainer launch: rank %d %s; stopping the other ranks\n", rank, why.c_str());
  print_report();
  signal_all(children_, SIGTERM);
  kill_pending_ = true;
  kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(o_.grace_seconds));
}

void LaunchAttempt::check_heartbeats() {
  if (status_dir_.empty() || o_.heartbeat_timeout <= 0 || failed_rank_ >= 0 || forwarded_) return;
  const Clock::time_point now = Clock::now();
  if (now < next_heartbeat_check_) return;
  next_heartbeat_check_ = now + std::chrono::milliseconds(100);
  const int64_t now_ns = comm::watchdog::monotonic_ns(),
                stale = int64_t(o_.heartbeat_timeout * 1e9);
  for (LaunchedRank& c : children_) {
    if (!c.running) continue;
    auto s = comm::watchdog::read_status(comm::watchdog::status_path(status_dir_, c.rank));
    if (!s || s->heartbeat_ns == 0 || now_ns - s->heartbeat_ns <= stale) continue;
    const char state = process_state(c.pid);
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%.1f", double(now_ns - s->heartbeat_ns) / 1e9);
    // A stopped process keeps SIGTERM pending: it goes at once.
    ::kill(-c.pid, SIGKILL);
    fail(c.rank, 128 + SIGKILL,
         cat("(pid ", c.pid, ") stopped making progress: no heartbeat for ", seconds,
             " s (--heartbeat-timeout ", o_.heartbeat_timeout, "), ", describe_state(state)));
    return;
  }
}

int LaunchAttempt::run() {
  start_ranks();
  while (running_ > 0) {
    if (g_signal && !forwarded_) {
      forwarded_ = g_signal;
      std::fprintf(stderr, "trainer launch: forwarding signal %d to %d ranks\n", forwarded_,
                   running_);
      signal_all(children_, forwarded_);
      kill_pending_ = true;
      kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(o_.grace_seconds));
    }
    // Reap every child that has exited since the last poll. A rank killed by
    // a signal is the cause when others exited with errors in the same poll:
    // they saw it die (a dead peer is an error within milliseconds), so it
    // is the one reported.
    std::vector<std::pair<LaunchedRank*, int>> exited;  // child, raw wait status
    for (int status = 0;;) {
      pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (LaunchedRank& c : children_)
        if (c.pid == pid) exited.push_back({&c, status});
    }
    if (!exited.empty()) {
      std::stable_partition(exited.begin(), exited.end(),
                            [](const auto& e) { return WIFSIGNALED(e.second); });
      for (auto& [c, status] : exited) {
        c->running = false;
        --running_;
        const int code = exit_code(status);
        if (code != 0 && failed_rank_ < 0 && !forwarded_)
          fail(c->rank, code, cat("exited with code ", code));
      }
      continue;
    }
    check_heartbeats();
    if (kill_pending_ && Clock::now() >= kill_at_) {
      signal_all(children_, SIGKILL);
      kill_pending_ = false;
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  if (failed_rank_ < 0 && forwarded_) return 128 + forwarded_;
  return result_;
}

}  // namespace trainer
