#include "trainer/launch.h"

#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <thread>
#include <tuple>

#include "comm/bootstrap.h"
#include "comm/watchdog.h"
#include "core/check.h"
#include "core/cpu/threads.h"
#include "trainer/node_rendezvous.h"
#include "trainer/numbers.h"

extern char** environ;

namespace trainer {

namespace {

using Clock = std::chrono::steady_clock;

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

// How often the supervisor looks at its children.
constexpr auto kPollInterval = std::chrono::milliseconds(20);

// Bounds on what one launcher takes on. Correctness tests run up to 4 ranks
// per core (8 ranks on 2 cores); past 8 a job is almost surely a typo, and
// --oversubscribe says it is not (as mpirun's does).
constexpr int kRanksPerCore = 8;
constexpr int kMaxRanksPerNode = 4096;
constexpr int kMaxNodes = 65536;
constexpr int64_t kMaxWorld = 1 << 20;  // the recipe's parallel.dp bound
constexpr int kMaxRestarts = 1000;
constexpr double kMaxSeconds = 3600;
constexpr double kMaxHeartbeatSeconds = 86400;
// The commands a rank of the trainer binary can run.
constexpr const char* kRankCommands[] = {"train", "eval", "sample", "plan", "info"};

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
  cmd->add_option(
         "--nproc-per-node", o.nproc_per_node,
         cat("ranks on this node (at most ", kRanksPerCore, " per core unless --oversubscribe)"))
      ->required()
      ->check(integer_in(1, kMaxRanksPerNode));
  cmd->add_flag("--oversubscribe", o.oversubscribe,
                cat("allow more than ", kRanksPerCore, " ranks per core of this host"));
  cmd->add_option_function<std::string>(
         "--nnodes",
         [&o](const std::string& v) {
           const size_t colon = v.find(':');
           auto number = [&](const std::string& text) {
             const std::optional<int64_t> n = parse_integer(text);
             if (!n || *n < 1 || *n > kMaxNodes)
               throw CLI::ValidationError(
                   "--nnodes", cat("'", v, "': use N or MIN:MAX, each in [1, ", kMaxNodes, "]"));
             return int(*n);
           };
           o.nnodes = number(v.substr(colon == std::string::npos ? 0 : colon + 1));
           o.min_nodes = colon == std::string::npos ? 0 : number(v.substr(0, colon));
           if (o.min_nodes > o.nnodes)
             throw CLI::ValidationError("--nnodes", cat("'", v, "': MIN is above MAX"));
         },
         "nodes in the job: N, or MIN:MAX to run on the nodes that come (elastic)")
      ->type_name("N|MIN:MAX");
  cmd->add_option("--settle-seconds", o.settle_seconds,
                  "with --nnodes MIN:MAX: how long node 0 waits for more nodes once MIN joined")
      ->check(number_in(0, kMaxSeconds));
  cmd->add_option("--node-rank", o.node_rank, "index of this node")
      ->check(integer_in(0, kMaxNodes - 1));
  cmd->add_option("--master-addr", o.master_addr, "host of rank 0 (serves the rendezvous store)");
  cmd->add_option("--master-port", o.master_port,
                  "port of the store; 0 picks a free one (single node)")
      ->check(integer_in(0, 65535));
  cmd->add_option("--program", o.program, "run this program instead of the trainer binary");
  cmd->add_option("--grace-seconds", o.grace_seconds,
                  "SIGTERM to SIGKILL delay when stopping ranks")
      ->check(number_in(0, kMaxSeconds));
  cmd->add_option("--bind-to", o.bind_to,
                  "core: each local rank runs on its own share of the cores; none: the "
                  "scheduler places them; auto (default): core when there are at least as many "
                  "cores as local ranks, else none")
      ->check(CLI::IsMember({"auto", "none", "core"}));
  cmd->add_option("--max-restarts", o.max_restarts,
                  "after a failure, stop every rank and start the job again, up to this many "
                  "times; `trainer train` resumes from the newest complete checkpoint")
      ->check(integer_in(0, kMaxRestarts));
  cmd->add_option("--heartbeat-timeout", o.heartbeat_timeout,
                  "seconds without a heartbeat after which a rank is reported as not running "
                  "(stopped, not scheduled) and the job fails; 0: off")
      ->check(number_in(0, kMaxHeartbeatSeconds));
  cmd->add_option("args", o.args, "arguments of every rank, after --");
  return cmd;
}

namespace {

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

// One start of the node's ranks, supervised to the end.
class Attempt {
 public:
  // nnodes and node_index: this start's nodes, and this node's place among them.
  Attempt(const LaunchOptions& o, int nnodes, int node_index, int port, const std::string& token,
          int restart, const std::string& status_dir)
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
  std::vector<Child> children_;
  int result_ = 0, failed_rank_ = -1, forwarded_ = 0, running_ = 0;
  bool kill_pending_ = false;  // when set, surviving ranks get SIGKILL at kill_at_
  Clock::time_point kill_at_, next_heartbeat_check_;
};

void Attempt::start_ranks() {
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

void Attempt::print_report() {
  if (status_dir_.empty()) return;
  std::vector<comm::watchdog::Status> statuses;
  for (const Child& c : children_)
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

void Attempt::fail(int rank, int code, const std::string& why) {
  failed_rank_ = rank;
  result_ = code;
  std::fprintf(stderr, "trainer launch: rank %d %s; stopping the other ranks\n", rank, why.c_str());
  print_report();
  signal_all(children_, SIGTERM);
  kill_pending_ = true;
  kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(o_.grace_seconds));
}

void Attempt::check_heartbeats() {
  if (status_dir_.empty() || o_.heartbeat_timeout <= 0 || failed_rank_ >= 0 || forwarded_) return;
  const Clock::time_point now = Clock::now();
  if (now < next_heartbeat_check_) return;
  next_heartbeat_check_ = now + std::chrono::milliseconds(100);
  const int64_t now_ns = comm::watchdog::monotonic_ns(),
                stale = int64_t(o_.heartbeat_timeout * 1e9);
  for (Child& c : children_) {
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

int Attempt::run() {
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
    std::vector<std::pair<Child*, int>> exited;  // child, raw wait status
    for (int status = 0;;) {
      pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (Child& c : children_)
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

// The launcher's status directory (comm/watchdog.h), removed with it.
class StatusDir {
 public:
  StatusDir() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "trainer-launch-XXXXXX").string();
    if (::mkdtemp(pattern.data())) path_ = pattern;
  }
  ~StatusDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  // Empty when it could not be made (the watchdog is off then).
  const std::string& path() const { return path_; }
  void clear() const {
    std::error_code ignored;
    for (const auto& entry : std::filesystem::directory_iterator(path_, ignored))
      std::filesystem::remove(entry.path(), ignored);
  }

 private:
  std::string path_;
};

}  // namespace

void validate_launch_options(const LaunchOptions& o) {
  if (o.program.empty() && o.args.empty())
    throw Error(
        cat("trainer launch: give the ranks' command after --, e.g. `trainer launch "
            "--nproc-per-node ",
            o.nproc_per_node, " -- train recipes/fmnist_cnn.yaml`"));
  if (o.program.empty()) {
    bool known = false;
    for (const char* command : kRankCommands) known = known || o.args[0] == command;
    if (!known)
      throw Error(cat("trainer launch: '", o.args[0],
                      "' is not a trainer command; the ranks run train, eval, sample, plan or "
                      "info (or give --program)"));
  }
  if (o.nproc_per_node < 1 || o.nproc_per_node > kMaxRanksPerNode)
    throw Error(
        cat("--nproc-per-node ", o.nproc_per_node, " is out of range [1, ", kMaxRanksPerNode, "]"));
  if (o.nnodes < 1 || o.nnodes > kMaxNodes)
    throw Error(cat("--nnodes ", o.nnodes, " is out of range [1, ", kMaxNodes, "]"));
  checked_product(o.nnodes, o.nproc_per_node, kMaxWorld,
                  "the job's ranks --nnodes x --nproc-per-node");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    throw Error(cat("--node-rank ", o.node_rank, " is not below --nnodes ", o.nnodes));
  if (o.nnodes > 1 && o.master_port == 0)
    throw Error("--master-port is required with --nnodes > 1 (every node must name the same port)");
  for (const auto& [name, value, hi] :
       {std::tuple{"--grace-seconds", o.grace_seconds, kMaxSeconds},
        std::tuple{"--settle-seconds", o.settle_seconds, kMaxSeconds},
        std::tuple{"--heartbeat-timeout", o.heartbeat_timeout, kMaxHeartbeatSeconds}})
    if (const std::string problem = number_problem(value, 0, hi); !problem.empty())
      throw Error(cat(name, ": ", problem));
  const int64_t cores = std::max<int64_t>(1, int64_t(allowed_cores().size()));
  if (!o.oversubscribe && o.nproc_per_node > kRanksPerCore * cores)
    throw Error(cat("--nproc-per-node ", o.nproc_per_node, " is more than ", kRanksPerCore,
                    " ranks per core of this host's ", cores, " cores (", kRanksPerCore * cores,
                    "); lower it, or pass --oversubscribe to start them anyway"));
}

int run_launch(const LaunchOptions& o) {
  validate_launch_options(o);
  const std::string token = comm::job_token_from_environment().value_or(
      o.nnodes > 1 ? cat("launch:", o.master_addr, ":", o.master_port) : random_token());

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  const bool elastic = o.min_nodes > 0 && o.min_nodes < o.nnodes;
  std::unique_ptr<NodeRendezvous> nodes;
  if (elastic) {
    if (o.master_port >= 65535) throw Error("--master-port: the node rendezvous needs port + 1");
    nodes = std::make_unique<NodeRendezvous>(
        NodeRendezvousOptions{.host = o.master_addr,
                              .port = o.master_port + 1,
                              .token = token,
                              .node_rank = o.node_rank,
                              .min_nodes = o.min_nodes,
                              .max_nodes = o.nnodes,
                              .settle = comm::Millis(int64_t(o.settle_seconds * 1000))});
  }
  StatusDir status;
  for (int restart = 0;; ++restart) {
    status.clear();
    // A fresh port for every start on one node: the last one's may linger.
    const int port = o.master_port ? o.master_port : free_port();
    int nnodes = o.nnodes, index = o.node_rank, round = restart;
    if (nodes) {
      const Membership m = nodes->join(restart);
      nnodes = int(m.members.size());
      index = m.index;
      round = m.round;
      std::string list;
      for (int n : m.members) list += cat(list.empty() ? "" : ", ", n);
      std::fprintf(stderr, "trainer launch: round %d: %d of %d nodes (node ranks %s), %d ranks\n",
                   round, nnodes, o.nnodes, list.c_str(), nnodes * o.nproc_per_node);
    }
    Attempt attempt(o, nnodes, index, port, token, round, status.path());
    const int code = attempt.run();
    if (code == 0 || attempt.interrupted() || restart >= o.max_restarts) {
      if (code != 0 && o.max_restarts > 0 && !attempt.interrupted())
        std::fprintf(stderr, "trainer launch: giving up after %d restarts\n", restart);
      return code;
    }
    std::fprintf(stderr,
                 "trainer launch: restart %d of %d: starting the ranks again; they resume from "
                 "the newest complete checkpoint\n",
                 restart + 1, o.max_restarts);
  }
}

}  // namespace trainer
