#include "trainer/launch.h"

#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "comm/bootstrap.h"
#include "core/check.h"
#include "core/cpu/threads.h"

extern char** environ;

namespace trainer {

namespace {

using Clock = std::chrono::steady_clock;

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

// How often the supervisor looks at its children.
constexpr auto kPollInterval = std::chrono::milliseconds(20);

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  CHECK(fd >= 0) << std::strerror(errno);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(addr);
  CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) << std::strerror(errno);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::string random_token() {
  std::random_device device;
  std::string token = "launch:";
  for (int i = 0; i < 4; ++i) {
    char hex[9];
    std::snprintf(hex, sizeof(hex), "%08x", device());
    token += hex;
  }
  return token;
}

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

struct Child {
  pid_t pid = -1;
  int rank = 0;
  bool running = false;
};

void signal_all(std::vector<Child>& children, int sig) {
  for (Child& c : children)
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

}  // namespace

CLI::App* add_launch_command(CLI::App& app, LaunchOptions& o) {
  CLI::App* cmd = app.add_subcommand(
      "launch", "start the ranks of this node (torchrun-style) and supervise them");
  cmd->add_option("--nproc-per-node", o.nproc_per_node, "ranks on this node")
      ->required()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--nnodes", o.nnodes, "nodes in the job")->check(CLI::PositiveNumber);
  cmd->add_option("--node-rank", o.node_rank, "index of this node")->check(CLI::NonNegativeNumber);
  cmd->add_option("--master-addr", o.master_addr, "host of rank 0 (serves the rendezvous store)");
  cmd->add_option("--master-port", o.master_port,
                  "port of the store; 0 picks a free one (single node)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--program", o.program, "run this program instead of the trainer binary");
  cmd->add_option("--grace-seconds", o.grace_seconds,
                  "SIGTERM to SIGKILL delay when stopping ranks");
  cmd->add_option("--bind-to", o.bind_to,
                  "core: each local rank runs on its own share of the cores; none: the "
                  "scheduler places them; auto (default): core when there are at least as many "
                  "cores as local ranks, else none")
      ->check(CLI::IsMember({"auto", "none", "core"}));
  cmd->add_option("args", o.args, "arguments of every rank, after --");
  return cmd;
}

int run_launch(const LaunchOptions& o) {
  if (o.node_rank >= o.nnodes)
    throw Error(cat("--node-rank ", o.node_rank, " is not below --nnodes ", o.nnodes));
  if (o.nnodes > 1 && o.master_port == 0)
    throw Error("--master-port is required with --nnodes > 1 (every node must name the same port)");
  const int world = o.nnodes * o.nproc_per_node;
  const int port = o.master_port ? o.master_port : free_port();
  std::string token = comm::job_token_from_environment().value_or(
      o.nnodes > 1 ? cat("launch:", o.master_addr, ":", port) : random_token());
  std::string program = o.program.empty() ? "/proc/self/exe" : o.program;
  std::vector<std::string> argv_strings{o.program.empty() ? "trainer" : o.program};
  argv_strings.insert(argv_strings.end(), o.args.begin(), o.args.end());

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  // Ranks share the node's cores: unless the user chose, each rank's OpenMP
  // gets cores / nproc_per_node threads (torchrun sets 1), so ranks don't
  // oversubscribe the cores and spin against each other.
  const std::vector<int> cores = allowed_cores();
  std::vector<std::pair<std::string, std::string>> threads;
  if (!std::getenv("OMP_NUM_THREADS")) {
    const long n = std::max(1L, long(cores.size()));
    threads.push_back({"OMP_NUM_THREADS", std::to_string(std::max(1L, n / o.nproc_per_node))});
  }

  const bool bind =
      o.bind_to == "core" || (o.bind_to == "auto" && o.nproc_per_node <= int(cores.size()));
  const std::vector<int> bind_cores = bind ? cores : std::vector<int>();
  if (o.bind_to == "core" && o.nproc_per_node > int(cores.size()))
    std::fprintf(stderr, "trainer launch: %d ranks on %zu cores: ranks will share cores\n",
                 o.nproc_per_node, cores.size());

  std::vector<Child> children;
  for (int local = 0; local < o.nproc_per_node; ++local) {
    const std::vector<int> mine = rank_cores(bind_cores, local, o.nproc_per_node);
    if (!mine.empty())
      std::fprintf(stderr, "trainer launch: local rank %d bound to cores %s\n", local,
                   core_list(mine).c_str());
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : mine) CPU_SET(c, &set);
    int rank = o.node_rank * o.nproc_per_node + local;
    std::vector<std::pair<std::string, std::string>> vars{
        {"RANK", std::to_string(rank)},
        {"WORLD_SIZE", std::to_string(world)},
        {"LOCAL_RANK", std::to_string(local)},
        {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
        {"MASTER_ADDR", o.master_addr},
        {"MASTER_PORT", std::to_string(port)},
        {"TRAINER_JOB_TOKEN", token}};
    vars.insert(vars.end(), threads.begin(), threads.end());
    std::vector<std::string> env = child_environment(vars);
    std::vector<char*> envp = pointers(env), argv = pointers(argv_strings);
    pid_t pid = ::fork();
    CHECK(pid >= 0) << "fork: " << std::strerror(errno);
    if (pid == 0) {
      ::setpgid(0, 0);
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
    children.push_back({pid, rank, true});
  }

  int result = 0, failed_rank = -1, forwarded = 0, running = int(children.size());
  // When set, surviving ranks get SIGKILL at kill_at.
  bool kill_pending = false;
  Clock::time_point kill_at;
  const auto grace =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.grace_seconds));
  while (running > 0) {
    if (g_signal && !forwarded) {
      forwarded = g_signal;
      std::fprintf(stderr, "trainer launch: forwarding signal %d to %d ranks\n", forwarded,
                   running);
      signal_all(children, forwarded);
      kill_pending = true;
      kill_at = Clock::now() + grace;
    }
    // Reap every child that has exited since the last poll. A rank killed by
    // a signal is the cause when others exited with errors in the same poll:
    // they saw it die (a dead peer is an error within milliseconds), so it
    // is the one reported.
    std::vector<std::pair<Child*, int>> exited;  // child, raw wait status
    for (int status = 0;;) {
      pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (Child& c : children)
        if (c.pid == pid) exited.push_back({&c, status});
    }
    if (!exited.empty()) {
      std::stable_partition(exited.begin(), exited.end(),
                            [](const auto& e) { return WIFSIGNALED(e.second); });
      for (auto& [c, status] : exited) {
        c->running = false;
        --running;
        int code = exit_code(status);
        if (code != 0 && failed_rank < 0 && !forwarded) {
          failed_rank = c->rank;
          result = code;
          std::fprintf(stderr,
                       "trainer launch: rank %d exited with code %d; stopping the other ranks\n",
                       c->rank, code);
          signal_all(children, SIGTERM);
          kill_pending = true;
          kill_at = Clock::now() + grace;
        }
      }
      continue;
    }
    if (kill_pending && Clock::now() >= kill_at) {
      signal_all(children, SIGKILL);
      kill_pending = false;
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  if (failed_rank < 0 && forwarded) return 128 + forwarded;
  return result;
}

}  // namespace trainer
