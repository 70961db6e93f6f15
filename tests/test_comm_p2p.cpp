// Point-to-point messages between processes (Communicator::send / recv,
// comm/p2p.h): tests/comm_worker_p2p.cpp's scenarios at 2, 3 and 4 ranks,
// under `trainer launch`, over UCX's shared-memory transports (the path
// between ranks of one host) and over UCX's TCP transport (UCX_TLS=tcp, the
// path between hosts) with the communicator's shared-memory channel off; and
// a killed rank, which every other rank's wait must name within seconds.
#include <signal.h>
#include <unistd.h>

#include <thread>

#include "tests/process.h"
#include "tests/testing.h"

namespace {

using Outcome = trainer::testing::ProcessResult;
using Env = std::vector<std::pair<std::string, std::string>>;

// UCX over TCP only (and self): what ranks on different hosts use.
const Env kTcp = {{"UCX_TLS", "tcp,self"}};

Outcome launch_p2p(int nproc, const Env& env, const std::vector<std::string>& args) {
  std::vector<std::string> argv{TRAINER_BINARY,
                                "launch",
                                "--nproc-per-node",
                                std::to_string(nproc),
                                "--program",
                                COMM_WORKER_BINARY,
                                "--",
                                "p2p"};
  argv.insert(argv.end(), args.begin(), args.end());
  return trainer::testing::run_process(argv, {.env = env, .timeout_s = 120});
}

void check_p2p(int nproc, const Env& env, const std::vector<std::string>& args = {}) {
  Outcome o = launch_p2p(nproc, env, args);
  trainer::testing::require_ranks_passed(o.code, o.output, nproc);
}

// Forks n workers with torchrun-style variables (under the launcher the
// survivors would be stopped, not tested); rank `victim` kills itself.
std::vector<Outcome> run_killed(int n, int victim, const Env& extra) {
  std::vector<std::thread> threads;
  std::vector<Outcome> outcomes(size_t(n), Outcome{});
  const int port = 20000 + int((::getpid() * 7 + n * 31 + victim) % 12000);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      Env env = extra;
      env.insert(env.end(), {{"RANK", std::to_string(r)},
                             {"WORLD_SIZE", std::to_string(n)},
                             {"MASTER_ADDR", "127.0.0.1"},
                             {"MASTER_PORT", std::to_string(port)},
                             {"TRAINER_JOB_TOKEN", "p2p-kill-test"}});
      outcomes[size_t(r)] = trainer::testing::run_process(
          {COMM_WORKER_BINARY, "p2p-kill", std::to_string(victim)}, {.env = env, .timeout_s = 60});
    });
  for (auto& t : threads) t.join();
  return outcomes;
}

void check_killed(int n, int victim, const Env& env) {
  std::vector<Outcome> outcomes = run_killed(n, victim, env);
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r << " of " << n << ", victim " << victim << ":\n"
                 << outcomes[size_t(r)].output);
    if (r == victim) {
      CHECK(outcomes[size_t(r)].code == 128 + SIGKILL);
      continue;
    }
    CHECK(outcomes[size_t(r)].code == 3);
    CHECK(outcomes[size_t(r)].output.find(trainer::cat("from rank ", victim, " (world rank ",
                                                       victim, ")")) != std::string::npos);
    CHECK(outcomes[size_t(r)].output.find(" 0 failed") != std::string::npos);
    CHECK(outcomes[size_t(r)].seconds < 20);
  }
}

}  // namespace

TEST_CASE("comm: point-to-point on 1, 2, 3 and 4 ranks over UCX shared memory", "[comm][mp]") {
  for (int n : {1, 2, 3, 4}) {
    INFO("world size " << n);
    check_p2p(n, {});
  }
}

TEST_CASE("comm: point-to-point on 2, 3 and 4 ranks over UCX TCP", "[comm][mp]") {
  for (int n : {2, 3, 4}) {
    INFO("world size " << n);
    check_p2p(n, kTcp, {"no-shm"});
  }
}

TEST_CASE("comm: a killed peer fails every wait on it, naming it", "[comm][mp]") {
  check_killed(2, 1, {});
  check_killed(3, 0, {});
  check_killed(4, 2, {});
  check_killed(3, 1, kTcp);
}
