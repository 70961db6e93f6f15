// Multi-process comm tests: ranks are processes started by `trainer launch`
// (or forked here with torchrun-style variables when the launcher must not
// interfere), running tests/comm_worker.cpp. World sizes 1, 2, 3, 4 and 8;
// the worker checks closed forms and prints any mismatch with rank, index,
// expected and actual, which the failure message here includes.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <thread>

#include "tests/process.h"

namespace {

using Outcome = trainer::testing::ProcessResult;

// Runs argv with extra environment variables, stopping it (SIGTERM, then
// SIGKILL) after timeout_s so a test never hangs.
Outcome run(const std::vector<std::string>& argv,
            const std::vector<std::pair<std::string, std::string>>& env, double timeout_s) {
  return trainer::testing::run_process(argv, {.env = env, .timeout_s = timeout_s});
}

Outcome launch(int nproc, const std::vector<std::string>& worker_args, double timeout_s,
               const std::vector<std::string>& launcher_args = {}) {
  std::vector<std::string> argv{TRAINER_BINARY,        "launch",    "--nproc-per-node",
                                std::to_string(nproc), "--program", COMM_WORKER_BINARY};
  argv.insert(argv.end(), launcher_args.begin(), launcher_args.end());
  argv.push_back("--");
  argv.insert(argv.end(), worker_args.begin(), worker_args.end());
  return run(argv, {}, timeout_s);
}

void check_collectives(int nproc) {
  Outcome o = launch(nproc, {"collectives"}, 120);
  INFO(o.output);
  REQUIRE(o.code == 0);
  for (int r = 0; r < nproc; ++r)
    CHECK(o.output.find(trainer::cat("rank ", r, ": ")) != std::string::npos);
  CHECK(o.output.find("0 failed") != std::string::npos);
}

}  // namespace

TEST_CASE("comm: every collective, dtype and op on 1, 2, 3, 4 and 8 ranks", "[comm][mp]") {
  for (int n : {1, 2, 3, 4, 8}) {
    INFO("world size " << n);
    check_collectives(n);
  }
}

TEST_CASE("comm: segments left behind by killed ranks do not block a later job's channel",
          "[comm][mp]") {
  // Named segments (trainer-<pid>-<communicator>, as a killed rank 0 of an
  // older build left them in /dev/shm) for the next 4000 pids to be handed
  // out: the 2-rank job must still get its channel, whose memory has no name
  // (the collectives check a shared region on it).
  auto read_long = [](const char* path) {
    long v = 0;
    if (FILE* f = std::fopen(path, "r")) {
      if (std::fscanf(f, "%ld", &v) != 1) v = 0;
      std::fclose(f);
    }
    return v;
  };
  const long last = read_long("/proc/sys/kernel/ns_last_pid");
  const long max = read_long("/proc/sys/kernel/pid_max");
  struct Leftovers {
    std::vector<std::string> paths;
    ~Leftovers() {
      for (const std::string& path : paths) ::unlink(path.c_str());
    }
  } made;
  for (long pid = last + 1; pid < std::min(last + 4000, max); ++pid) {
    std::string path = trainer::cat("/dev/shm/trainer-", pid, "-0");
    int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
    if (fd < 0) continue;
    ::close(fd);
    made.paths.push_back(path);
  }
  check_collectives(2);
}

TEST_CASE("comm: every collective, dtype and op on 8 ranks", "[comm][mp][slow]") {
  check_collectives(8);
}

TEST_CASE("comm: launch stops the other ranks when one fails and returns its code", "[comm][mp]") {
  Outcome o = launch(3, {"fail", "1", "7"}, 60, {"--grace-seconds", "2"});
  INFO(o.output);
  CHECK(o.code == 7);
  CHECK(o.output.find("rank 1 exited with code 7") != std::string::npos);
  CHECK(o.seconds < 20);
}

TEST_CASE("comm: launch gives each rank its share of the cores unless OMP_NUM_THREADS is set",
          "[comm][mp]") {
  const std::vector<std::string> launch_sh{TRAINER_BINARY,
                                           "launch",
                                           "--nproc-per-node",
                                           "2",
                                           "--program",
                                           "/bin/sh",
                                           "--",
                                           "-c",
                                           "echo rank $RANK threads $OMP_NUM_THREADS"};
  std::vector<std::string> unset{"/usr/bin/env", "-u", "OMP_NUM_THREADS"};
  unset.insert(unset.end(), launch_sh.begin(), launch_sh.end());
  Outcome o = run(unset, {}, 30);
  INFO(o.output);
  REQUIRE(o.code == 0);
  cpu_set_t allowed;
  REQUIRE(::sched_getaffinity(0, sizeof allowed, &allowed) == 0);
  const long share = std::max(1L, long(CPU_COUNT(&allowed)) / 2);
  CHECK(o.output.find(trainer::cat("rank 0 threads ", share, "\n")) != std::string::npos);
  CHECK(o.output.find(trainer::cat("rank 1 threads ", share, "\n")) != std::string::npos);

  Outcome chosen = run(launch_sh, {{"OMP_NUM_THREADS", "3"}}, 30);
  INFO(chosen.output);
  REQUIRE(chosen.code == 0);
  CHECK(chosen.output.find("rank 1 threads 3\n") != std::string::npos);
}

TEST_CASE(
    "comm: launch binds each rank to its own cores (--bind-to core, or auto with enough cores)",
    "[comm][mp]") {
  cpu_set_t allowed;
  REQUIRE(::sched_getaffinity(0, sizeof allowed, &allowed) == 0);
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  // Each rank prints the cores it may run on, one per line.
  const std::string script =
      "for c in $(grep Cpus_allowed_list /proc/self/status | cut -f2 | tr , ' '); do "
      "case $c in *-*) seq ${c%-*} ${c#*-};; *) echo $c;; esac; done | sed \"s/^/rank $RANK core "
      "/\"";
  for (std::string bind : {"core", "none", "auto", ""}) {
    INFO("--bind-to " << bind);
    std::vector<std::string> argv{TRAINER_BINARY, "launch", "--nproc-per-node", "2"};
    if (!bind.empty()) argv.insert(argv.end(), {"--bind-to", bind});
    argv.insert(argv.end(), {"--program", "/bin/sh", "--", "-c", script});
    Outcome o = run(argv, {}, 30);
    // auto, the default, binds when there are at least as many cores as ranks.
    if (bind.empty() || bind == "auto") bind = cores.size() >= 2 ? "core" : "none";
    INFO(o.output);
    REQUIRE(o.code == 0);
    std::vector<int> of[2];
    for (int r = 0; r < 2; ++r)
      for (int c : cores)
        if (o.output.find(trainer::cat("rank ", r, " core ", c, "\n")) != std::string::npos)
          of[r].push_back(c);
    if (bind == "none") {  // every rank may run anywhere
      CHECK(of[0] == cores);
      CHECK(of[1] == cores);
      continue;
    }
    CHECK(o.output.find("local rank 1 bound to cores") != std::string::npos);
    // Each rank gets half the cores (one, on a single core: they share it).
    const size_t share = std::max<size_t>(1, cores.size() / 2);
    CHECK(of[0].size() == share);
    CHECK(of[1].size() == share);
    if (cores.size() >= 2) {
      CHECK(of[0].front() == cores.front());
      CHECK(of[0].back() < of[1].front());
    }
  }
  Outcome bad = run({TRAINER_BINARY, "launch", "--nproc-per-node", "2", "--bind-to", "socket",
                     "--program", "/bin/true"},
                    {}, 30);
  INFO(bad.output);
  CHECK(bad.code != 0);
  CHECK(bad.output.find("--bind-to") != std::string::npos);
}

namespace {

// Forks n workers with torchrun-style variables (under the launcher the
// survivors would be stopped, not tested) and returns their outcomes.
std::vector<Outcome> run_world(int n, const std::vector<std::string>& args) {
  std::vector<std::thread> threads;
  std::vector<Outcome> outcomes(size_t(n), Outcome{});
  int port = 20000 + int(::getpid() % 12000);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::vector<std::string> argv{COMM_WORKER_BINARY};
      argv.insert(argv.end(), args.begin(), args.end());
      outcomes[size_t(r)] = run(argv,
                                {{"RANK", std::to_string(r)},
                                 {"WORLD_SIZE", std::to_string(n)},
                                 {"MASTER_ADDR", "127.0.0.1"},
                                 {"MASTER_PORT", std::to_string(port)},
                                 {"TRAINER_JOB_TOKEN", "failure-test"}},
                                60);
    });
  }
  for (auto& t : threads) t.join();
  return outcomes;
}

}  // namespace

namespace {

// The victim of n ranks is SIGKILLed mid-run (algorithm: see comm_worker); the
// survivors must fail fast with an error naming the operation and the victim.
void check_killed_peer(int n, int victim, const std::string& algorithm, const std::string& op) {
  std::vector<Outcome> outcomes = run_world(n, {"kill", std::to_string(victim), "3000", algorithm});
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r << " (" << algorithm << "):\n" << outcomes[r].output);
    if (r == victim) {
      CHECK(outcomes[r].code == 128 + SIGKILL);
      continue;
    }
    CHECK(outcomes[r].code == 3);
    CHECK(outcomes[r].output.find(op) != std::string::npos);
    CHECK(outcomes[r].output.find(trainer::cat("rank ", victim, " (")) != std::string::npos);
    CHECK(outcomes[r].seconds < 30);
  }
}

// The victim stops taking part; the survivors must time out after about timeout_ms.
void check_hung_peer(int n, int victim, const std::string& algorithm, const std::string& op) {
  const int timeout_ms = 1500;
  std::vector<Outcome> outcomes =
      run_world(n, {"hang", std::to_string(victim), std::to_string(timeout_ms), algorithm});
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r << " (" << algorithm << "):\n" << outcomes[r].output);
    if (r == victim) {
      CHECK(outcomes[r].code == 5);
      continue;
    }
    CHECK(outcomes[r].code == 3);
    CHECK(outcomes[r].output.find(op) != std::string::npos);
    CHECK(outcomes[r].output.find("timed out") != std::string::npos);
    double caught = -1;
    const size_t at = outcomes[r].output.find("caught after");
    REQUIRE(at != std::string::npos);
    std::sscanf(outcomes[r].output.substr(at).c_str(), "caught after %lf", &caught);
    CHECK(caught >= 0.9 * timeout_ms / 1000.0);
    CHECK(caught < 3.0 * timeout_ms / 1000.0);
  }
}

}  // namespace

TEST_CASE("comm: a killed peer becomes an error naming it on every survivor", "[comm][mp]") {
  check_killed_peer(3, 1, "ring", "allreduce(ring)");
}

TEST_CASE("comm: a peer killed during a shared-memory allreduce is named by every survivor",
          "[comm][mp]") {
  check_killed_peer(3, 1, "shm-pipelined", "allreduce(shm)");
  check_killed_peer(4, 2, "shm-staged", "allreduce(shm)");
  check_killed_peer(2, 0, "shm-direct", "allreduce(shm)");
  check_killed_peer(3, 2, "shm-in-place", "allreduce(shm)");
}

// Every other algorithm: each survivor gets an Error within seconds. Those
// that wait on the victim name it; one that waits on a survivor which has
// stopped on that error names the survivor, so only one naming is required.
TEST_CASE("comm: a peer killed during any allreduce algorithm stops every survivor", "[comm][mp]") {
  const int n = 4, victim = 1;
  for (std::string algorithm :
       {"recursive_doubling", "tree", "butterfly", "all_to_all", "master_worker", "round_robin"}) {
    std::vector<Outcome> outcomes =
        run_world(n, {"kill", std::to_string(victim), "3000", algorithm});
    int naming = 0;
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r << " (" << algorithm << "):\n" << outcomes[r].output);
      if (r == victim) {
        CHECK(outcomes[r].code == 128 + SIGKILL);
        continue;
      }
      CHECK(outcomes[r].code == 3);
      CHECK(outcomes[r].output.find("allreduce(") != std::string::npos);
      CHECK(outcomes[r].seconds < 30);
      naming += outcomes[r].output.find(trainer::cat("rank ", victim, " (")) != std::string::npos;
    }
    INFO(algorithm);
    CHECK(naming >= 1);
  }
}

TEST_CASE("comm: a hung peer becomes a timeout error on every survivor", "[comm][mp]") {
  check_hung_peer(3, 2, "ring", "allreduce(ring)");
  check_hung_peer(3, 2, "shm-pipelined", "allreduce(shm)");
  check_hung_peer(2, 1, "shm-in-place", "allreduce(shm)");
}
