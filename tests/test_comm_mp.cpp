// Multi-process comm tests: ranks are processes started by `trainer launch`
// (or forked here with torchrun-style variables when the launcher must not
// interfere), running tests/comm_worker.cpp. World sizes 1, 2, 3, 4 and 8;
// the worker checks closed forms and prints any mismatch with rank, index,
// expected and actual, which the failure message here includes.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "tests/testing.h"

namespace {

struct Outcome {
  int code = -1;  // exit code, 128 + signal when killed
  std::string output;
  double seconds = 0;
};

// Runs argv with extra environment variables, output to a temporary file,
// stopping it (SIGTERM, then SIGKILL) after timeout_s so a test never hangs.
Outcome run(const std::vector<std::string>& argv,
            const std::vector<std::pair<std::string, std::string>>& env, double timeout_s) {
  char path[] = "/tmp/test_comm_XXXXXX";
  int out = ::mkstemp(path);
  REQUIRE(out >= 0);
  auto start = std::chrono::steady_clock::now();
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(out, 1);
    ::dup2(out, 2);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  Outcome o;
  int status = 0;
  bool terminated = false;
  for (;;) {
    if (::waitpid(pid, &status, WNOHANG) == pid) break;
    double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed > timeout_s && !terminated) {
      ::kill(-pid, SIGTERM);
      terminated = true;
    }
    if (elapsed > timeout_s + 15) ::kill(-pid, SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  o.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  o.output = text.str();
  ::close(out);
  ::unlink(path);
  if (terminated) o.output += "\n(the test stopped it after the timeout)";
  return o;
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

namespace {

// Forks n workers with torchrun-style variables (under the launcher the
// survivors would be stopped, not tested) and returns their outcomes.
std::vector<Outcome> run_world(int n, const std::vector<std::string>& args) {
  std::vector<std::thread> threads;
  std::vector<Outcome> outcomes(size_t(n), Outcome{});
  int port = 20000 + int(::getpid() % 20000);
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

TEST_CASE("comm: a killed peer becomes an error naming it on every survivor", "[comm][mp]") {
  const int n = 3, victim = 1;
  std::vector<Outcome> outcomes = run_world(n, {"kill", std::to_string(victim), "3000"});
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r << ":\n" << outcomes[r].output);
    if (r == victim) {
      CHECK(outcomes[r].code == 128 + SIGKILL);
      continue;
    }
    CHECK(outcomes[r].code == 3);
    CHECK(outcomes[r].output.find("allreduce(ring)") != std::string::npos);
    CHECK(outcomes[r].output.find(trainer::cat("rank ", victim, " (")) != std::string::npos);
    CHECK(outcomes[r].seconds < 30);
  }
}

TEST_CASE("comm: a hung peer becomes a timeout error on every survivor", "[comm][mp]") {
  const int n = 3, victim = 2, timeout_ms = 1500;
  std::vector<Outcome> outcomes =
      run_world(n, {"hang", std::to_string(victim), std::to_string(timeout_ms)});
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r << ":\n" << outcomes[r].output);
    if (r == victim) {
      CHECK(outcomes[r].code == 5);
      continue;
    }
    CHECK(outcomes[r].code == 3);
    CHECK(outcomes[r].output.find("allreduce(ring)") != std::string::npos);
    CHECK(outcomes[r].output.find("timed out") != std::string::npos);
    double caught = -1;
    std::sscanf(outcomes[r].output.substr(outcomes[r].output.find("caught after")).c_str(),
                "caught after %lf", &caught);
    CHECK(caught >= 0.9 * timeout_ms / 1000.0);
    CHECK(caught < 3.0 * timeout_ms / 1000.0);
  }
}
