// The pipeline runtime (parallel/pipeline_runtime.h) driven action by action
// by tests/pipeline_checks.cpp: a model with a long skip connection across
// two stage boundaries against the same model run whole, bit for bit, under
// gpipe, 1f1b and zbh1 (stages as threads of this process); as processes of
// trainer launch (tests/pipeline_worker.cpp), a boundary
// tensor whose shape differs from the probe's; and a stage killed mid-step.
// The failure cases must end within a timeout with an Error naming the
// stage and what it was doing, never hang.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "tests/pipeline_checks.h"
#include "tests/process.h"  // after the others: it brings Catch's CHECK
#include "tests/thread_checks.h"

using namespace trainer;
using trainer::testing::Child;
using trainer::testing::ProcessResult;
using trainer::testing::run_process;

namespace {

// The comm timeout of the worker is 30 s: finishing well before it means a
// failure was detected, not timed out.
constexpr double kDetectSeconds = 20;
constexpr double kTimeoutSeconds = 60;

// `trainer launch` of nproc pipeline_workers with args, one thread each
// (ranks waiting on each other while OpenMP threads spin would oversubscribe
// the cores), stopped after the timeout.
ProcessResult launch(int nproc, const std::vector<std::string>& args) {
  std::vector<std::string> argv{
      TRAINER_BINARY,         "launch", "--nproc-per-node", cat(nproc), "--program",
      PIPELINE_WORKER_BINARY, "--"};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, {.env = {{"OMP_NUM_THREADS", "1"}}, .timeout_s = kTimeoutSeconds});
}

struct RankOutcome {
  int code = -1;  // exit code, 128 + signal when killed
  std::string output;
  double seconds = 0;
};

// The ranks of a job without `trainer launch`: the launcher stops the others
// once one fails, which would race a survivor's own report of the failure.
std::vector<Child> start_ranks(int nproc, const std::vector<std::string>& args,
                               const std::string& token) {
  const int port = testing::free_port();
  std::vector<Child> ranks;
  for (int r = 0; r < nproc; ++r) {
    std::vector<std::string> argv{PIPELINE_WORKER_BINARY};
    argv.insert(argv.end(), args.begin(), args.end());
    ranks.push_back(testing::start(argv, {{"RANK", cat(r)},
                                          {"WORLD_SIZE", cat(nproc)},
                                          {"LOCAL_RANK", cat(r)},
                                          {"LOCAL_WORLD_SIZE", cat(nproc)},
                                          {"MASTER_ADDR", "127.0.0.1"},
                                          {"MASTER_PORT", cat(port)},
                                          {"TRAINER_JOB_TOKEN", token},
                                          {"OMP_NUM_THREADS", "1"}}));
  }
  return ranks;
}

// Waits for every rank, each stopped (SIGKILL to its group) after the timeout.
std::vector<RankOutcome> finish_ranks(const std::vector<Child>& ranks) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<RankOutcome> outcomes(ranks.size());
  std::vector<bool> done(ranks.size(), false), killed(ranks.size(), false);
  for (size_t left = ranks.size(); left > 0;) {
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (done[r]) continue;
      int status = 0;
      if (::waitpid(ranks[r].pid, &status, WNOHANG) == ranks[r].pid) {
        done[r] = true;
        --left;
        outcomes[r].code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        outcomes[r].seconds = s;
      } else if (s > kTimeoutSeconds && !killed[r]) {
        ::kill(-ranks[r].pid, SIGKILL);
        killed[r] = true;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    outcomes[r].output = testing::output_of(ranks[r]);
    if (killed[r]) outcomes[r].output += "\n(the test stopped it after the timeout)";
    ::unlink(ranks[r].output_path.c_str());
  }
  return outcomes;
}

std::string all_outputs(const std::vector<RankOutcome>& outcomes) {
  std::string text;
  for (size_t r = 0; r < outcomes.size(); ++r)
    text += cat("---- rank ", r, " (exit ", outcomes[r].code, ", ", outcomes[r].seconds, " s)\n",
                outcomes[r].output);
  return text;
}

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE(
    "pipeline runtime: a skip across two stage boundaries gives one process's gradients bit "
    "for bit, gpipe, 1f1b and zbh1",
    "[parallel][threads]") {
  // Three stages as threads of this process (tests/thread_world.h).
  const std::vector<std::string> schedules = {"gpipe", "1f1b", "zbh1"};
  std::vector<std::string> args{"equiv"};
  args.insert(args.end(), schedules.begin(), schedules.end());
  const std::vector<trainer::testing::RankReport> reports = trainer::testing::run_checks_on_threads(
      3, [&](const auto& world) { return trainer::testing::run_pipeline_checks(world, args); });
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r << " (mismatches are printed above)");
    const trainer::testing::RankReport& report = reports[size_t(r)];
    CHECK(report.code == 0);
    CHECK(report.failures == 0);
    CHECK(report.checks >= 2 * int(schedules.size()) * 2);
    for (const std::string& s : schedules)
      CHECK(report.has_compared(cat(s, ": stage ", r, " gradients of 4 parameters")));
  }
}

TEST_CASE(
    "pipeline runtime: a boundary tensor whose shape differs from the probe's is an error "
    "naming both stages, and the receiving stage does not hang",
    "[parallel][mp]") {
  // The probe ran at micro-batch size 4, the step runs at 3.
  const std::string message =
      "pipeline stage 0 sends 'x' of micro-batch 0 to stage 1 as [3, 8] f32, but both stages "
      "expect [4, 8] f32";
  SECTION("under trainer launch") {
    ProcessResult o = launch(2, {"mismatch"});
    INFO(o.output);
    CHECK(o.code != 0);
    CHECK(contains(o.output, "rank 0: error: " + message));
    CHECK(!contains(o.output, "finished the step"));
    CHECK(o.seconds < kDetectSeconds);
  }
  SECTION("each stage's own report") {
    std::vector<RankOutcome> ranks = finish_ranks(start_ranks(2, {"mismatch"}, "pp-mismatch"));
    INFO(all_outputs(ranks));
    CHECK(ranks[0].code == 3);
    CHECK(contains(ranks[0].output, "rank 0: error: " + message));
    // The receiver sees its peer leave while it waits for the activation.
    CHECK(ranks[1].code == 3);
    CHECK(
        contains(ranks[1].output, "rank 1: error: pipeline stage 1 (recvA0), waiting on stage 0"));
    CHECK(ranks[1].seconds < kDetectSeconds);
  }
}

TEST_CASE(
    "pipeline runtime: a stage killed mid-step is an error on its peers naming the stage and "
    "the receive it waited on",
    "[parallel][mp]") {
  SECTION("pp 2, the last stage dies") {
    // Stage 1 dies before B0; stage 0 has sent its warm-up activations and
    // waits for the first gradient.
    std::vector<RankOutcome> ranks = finish_ranks(start_ranks(2, {"kill", "1"}, "pp-kill-2"));
    INFO(all_outputs(ranks));
    CHECK(ranks[1].code == 128 + SIGKILL);
    CHECK(contains(ranks[1].output, "rank 1: killing itself before B0"));
    REQUIRE(ranks[0].code == 3);
    // Waiting for the first gradient, or (when the transport learns of the
    // death first) still sending its warm-up activations.
    CHECK((contains(ranks[0].output,
                    "rank 0: error: pipeline stage 0 (recvG0), waiting on stage 1 ('x')") ||
           (contains(ranks[0].output, "rank 0: error: pipeline stage 0 (sendA") &&
            contains(ranks[0].output, "sending 'x' to stage 1"))));
    CHECK(contains(ranks[0].output, "the peer failed"));
    CHECK(ranks[0].seconds < kDetectSeconds);
  }
  SECTION("pp 3, the middle stage dies") {
    // Both neighbours wait on it: stage 0 for the gradient of 'x' (that of
    // the skip would come from stage 2), stage 2 for an activation (which
    // one depends on how many of the victim's sends were delivered).
    std::vector<RankOutcome> ranks = finish_ranks(start_ranks(3, {"kill", "1"}, "pp-kill-3"));
    INFO(all_outputs(ranks));
    CHECK(ranks[1].code == 128 + SIGKILL);
    CHECK(ranks[0].code == 3);
    CHECK((contains(ranks[0].output,
                    "rank 0: error: pipeline stage 0 (recvG0), waiting on stage 1 ('x'), stage 2 "
                    "('skip')") ||
           (contains(ranks[0].output, "rank 0: error: pipeline stage 0 (sendA") &&
            contains(ranks[0].output, "sending 'x' to stage 1"))));
    CHECK(ranks[2].code == 3);
    // Waiting for an activation, or sending a gradient to the dead stage.
    CHECK(((contains(ranks[2].output, "rank 2: error: pipeline stage 2 (recvA") &&
            contains(ranks[2].output, "waiting on stage 1 ('x'), stage 0 ('skip')")) ||
           (contains(ranks[2].output, "rank 2: error: pipeline stage 2 (sendG") &&
            contains(ranks[2].output, "sending 'x' to stage 1"))));
    for (int r : {0, 2}) CHECK(ranks[size_t(r)].seconds < kDetectSeconds);
  }
  SECTION("pp 2, the first stage dies during an evaluation") {
    // Stage 0 has sent batches 0 and 1; stage 1 waits for batch 2's inputs.
    std::vector<RankOutcome> ranks =
        finish_ranks(start_ranks(2, {"kill-evaluation", "0"}, "pp-kill-eval"));
    INFO(all_outputs(ranks));
    CHECK(ranks[0].code == 128 + SIGKILL);
    CHECK(contains(ranks[0].output, "rank 0: killing itself before evaluating batch 2"));
    REQUIRE(ranks[1].code == 3);
    CHECK(
        contains(ranks[1].output,
                 "rank 1: error: pipeline stage 1 (recvA2) of an evaluation, waiting on stage 0"));
    CHECK(contains(ranks[1].output, "the peer failed"));
    CHECK(ranks[1].seconds < kDetectSeconds);
  }
}
