// `trainer launch` (trainer/launch.h): the command's options and their
// checks, and the loop that starts the node's ranks again after a failure
// (each start: LaunchAttempt, launch_attempt.cpp).
#include "trainer/launch.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <tuple>

#include "comm/bootstrap.h"
#include "core/check.h"
#include "core/cpu/threads.h"
#include "trainer/launch_parts.h"
#include "trainer/node_rendezvous.h"
#include "trainer/numbers.h"

namespace trainer {

namespace {

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

// A port for rank 0's store, kept bound (not listening, SO_REUSEADDR) by
// the launcher while its ranks run: no other process's bind to port 0 is
// handed the same port before rank 0 listens on it (two launchers started
// at once on one host otherwise could be), and rank 0, binding with
// SO_REUSEADDR, still can.
class ReservedPort {
 public:
  ReservedPort() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd_ >= 0) << std::strerror(errno);
    int one = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof(addr);
    CHECK(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0)
        << std::strerror(errno);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~ReservedPort() { ::close(fd_); }
  ReservedPort(const ReservedPort&) = delete;
  ReservedPort& operator=(const ReservedPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

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
  sa.sa_handler = on_launch_signal;
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
    std::optional<ReservedPort> reserved;
    if (!o.master_port) reserved.emplace();
    const int port = o.master_port ? o.master_port : reserved->port();
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
    LaunchAttempt attempt(o, nnodes, index, port, token, round, status.path());
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
