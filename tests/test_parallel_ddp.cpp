// Data-parallel training: the timeline's arithmetic and file format in one
// process; DataParallel against a single-process reference over 2 and 3
// ranks (tests/dp_worker.cpp under `trainer launch`); and the trainer binary
// under dp=2: resume equivalence, and a killed rank stopping the job with an
// error naming it; ZeRO stage 1 (parallel.zero1) against dp=1, its resume
// and its checkpoint layout.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "parallel/trace.h"
#include "tests/dp_checks.h"
#include "tests/runs.h"
#include "tests/thread_checks.h"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"

using namespace trainer;
using namespace trainer::parallel;
using trainer::testing::Child;
using trainer::testing::output_of;
using trainer::testing::start;
namespace fs = std::filesystem;

namespace {

using Outcome = testing::ProcessResult;
using testing::finish;
using testing::launched_rank;
using testing::wait_for_output;

Outcome launch_worker(int nproc, const std::vector<std::string>& args, double timeout_s = 60) {
  std::vector<std::string> argv{
      TRAINER_BINARY,   "launch", "--nproc-per-node", std::to_string(nproc), "--program",
      DP_WORKER_BINARY, "--"};
  argv.insert(argv.end(), args.begin(), args.end());
  return finish(start(argv), timeout_s);
}

// Ranks as threads of this process (tests/thread_world.h), each running
// a check of tests/dp_checks.h; every one must pass.
void require_threads_passed(
    int ranks, const std::function<int(const std::shared_ptr<comm::Communicator>&)>& check) {
  const std::vector<testing::RankReport> reports = testing::run_checks_on_threads(ranks, check);
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r << " (its mismatches are printed above)");
    CHECK(reports[size_t(r)].code == 0);
  }
}

void check_equivalence(int ranks, bool overlap, int64_t accum, size_t bucket_bytes,
                       const std::string& path = "default") {
  INFO(ranks << " ranks, overlap " << overlap << ", grad_accum " << accum << ", buckets of "
             << bucket_bytes << " bytes, path " << path);
  require_threads_passed(ranks, [&](const auto& world) {
    return testing::run_equiv(world, overlap, accum, bucket_bytes, path);
  });
}

TEST_CASE("ddp: the ring allreduce with a caller's Reducer, and direct_reduce, 2 and 3 ranks",
          "[parallel][dp][threads]") {
  // The hook of parallel.gpu_direct (device memory reduced by a device
  // kernel), run with a host reducer that counts its calls.
  for (int ranks : {2, 3}) {
    INFO(ranks << " ranks");
    require_threads_passed(ranks, [](const auto& world) { return testing::run_reducer(world); });
  }
}

// The MLP recipe with SGD, 32 samples per step (testing::mlp_sgd_args).
std::vector<std::string> trainer_args(const fs::path& out, std::vector<std::string> extra) {
  extra.insert(extra.begin(), "training.log_every=5");
  return testing::mlp_sgd_args(out.string(), extra);
}

std::vector<std::string> single(const std::vector<std::string>& trainer) {
  std::vector<std::string> argv{TRAINER_BINARY};
  argv.insert(argv.end(), trainer.begin(), trainer.end());
  return argv;
}

// grace: seconds the launcher gives the ranks between SIGTERM and SIGKILL.
std::vector<std::string> launched(const std::vector<std::string>& trainer,
                                  const std::string& grace = "10", int nproc = 2) {
  std::vector<std::string> argv{
      TRAINER_BINARY, "launch", "--nproc-per-node", std::to_string(nproc), "--grace-seconds",
      grace,          "--"};
  argv.insert(argv.end(), trainer.begin(), trainer.end());
  return argv;
}

fs::path fresh(const std::string& name) { return testing::fresh_temp_dir("dp_" + name, false); }

std::map<std::string, Tensor> model_at(const fs::path& run, int64_t step) {
  return read_model((run / "checkpoints" / CheckpointDir::step_name(step)).string());
}

}  // namespace

TEST_CASE("timeline: covered and overlapping time of span unions", "[parallel]") {
  std::vector<TraceSpan> spans = {{"backward", Track::compute, 0, 100},
                                  {"allreduce bucket 0", Track::comm, 50, 120},
                                  {"allreduce bucket 1", Track::comm, 110, 130},
                                  {"allreduce bucket 2", Track::comm, 200, 210},
                                  {"backward", Track::compute, 205, 300}};
  auto comm = [](const TraceSpan& s) { return s.track == Track::comm; };
  auto backward = [](const TraceSpan& s) { return s.name == "backward"; };
  CHECK(covered_us(spans, comm) == 80 + 10);  // [50, 130) and [200, 210)
  CHECK(covered_us(spans, backward) == 195);
  CHECK(overlap_us(spans, comm, backward) == 50 + 5);
  CHECK(overlap_us(spans, backward, comm) == 50 + 5);
  CHECK(overlap_us(spans, comm, [](const TraceSpan&) { return false; }) == 0);
}

TEST_CASE("timeline: the trace file is Chrome-trace JSON with one process per rank", "[parallel]") {
  Timeline timeline(3);
  timeline.add("forward", Track::compute, 1000, 1500);
  { TraceScope s(&timeline, "backward"); }
  { TraceScope off(nullptr, "not recorded"); }
  timeline.add("allreduce bucket 0 (4 KiB)", Track::comm, 1200, 1700);
  fs::path path = testing::temp_path("dp_trace.json");
  timeline.write(path.string());
  nlohmann::json j = nlohmann::json::parse(read_file(path.string()));
  int spans = 0;
  bool named = false;
  for (const auto& e : j.at("traceEvents")) {
    CHECK(e.at("pid") == 3);
    if (e.at("ph") == "X") {
      ++spans;
      CHECK(e.at("dur").get<int64_t>() >= 0);
      CHECK(e.at("tid") == (e.at("cat") == "comm" ? 1 : 0));
    }
    if (e.at("ph") == "M" && e.at("name") == "process_name")
      named = e.at("args").at("name") == "rank 3";
  }
  CHECK(spans == 3);
  CHECK(named);
  fs::remove(path);
}

TEST_CASE("ddp: dp=2 at batch b matches one process at batch 2b, with and without overlap",
          "[parallel][threads]") {
  check_equivalence(2, true, 1, 512);               // several buckets, overlapped
  check_equivalence(2, false, 1, 512);              // reduced after backward
  check_equivalence(2, true, 1, size_t(26214400));  // the default 25 MB: one bucket
}

TEST_CASE("ddp: buckets in a shared region reduced in place, or copied through staging, match",
          "[parallel][threads]") {
  check_equivalence(2, true, 1, 512, "in-place");
  check_equivalence(3, true, 2, 1024, "in-place");
  check_equivalence(2, false, 1, size_t(26214400), "in-place");
  check_equivalence(2, true, 1, 512, "pipelined");
}

TEST_CASE("ddp: gradient accumulation communicates once per step and matches",
          "[parallel][threads]") {
  check_equivalence(2, true, 3, 512);
  check_equivalence(3, true, 2, 1024);
}

TEST_CASE("ddp: the equivalence holds for ranks as processes of trainer launch", "[parallel][mp]") {
  // The same check as the threads', end to end: each rank its own process.
  Outcome o = launch_worker(3, {"equiv", "1", "2", "1024", "in-place"});
  testing::require_ranks_passed(o.code, o.output, 3);
}

TEST_CASE("ddp: a rank killed in backward becomes an error naming it", "[parallel][mp]") {
  int port = 20000 + int(::getpid() % 12000) + 7;
  std::vector<Child> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.push_back(
        start({DP_WORKER_BINARY, "kill", "1"}, {{"RANK", std::to_string(r)},
                                                {"WORLD_SIZE", "2"},
                                                {"MASTER_ADDR", "127.0.0.1"},
                                                {"MASTER_PORT", std::to_string(port)},
                                                {"TRAINER_JOB_TOKEN", "dp-kill-test"}}));
  Outcome survivor = finish(ranks[0], 60), victim = finish(ranks[1], 60);
  INFO("rank 0:\n" << survivor.output << "\nrank 1:\n" << victim.output);
  CHECK(victim.code == 128 + SIGKILL);
  CHECK(survivor.code == 3);
  CHECK(survivor.output.find("rank 1 (") != std::string::npos);
}

TEST_CASE("ddp: the trainer at dp=2 matches dp=1 at the same global batch", "[parallel][mp]") {
  fs::path one = fresh("one"), two = fresh("two");
  std::vector<std::string> extra = {"training.steps=6", "training.grad_accum=2"};
  Outcome a = finish(start(single(trainer_args(one, extra))), 120);
  INFO(a.output);
  REQUIRE(a.code == 0);
  Outcome b = finish(start(launched(trainer_args(two, extra))), 120);
  INFO(b.output);
  REQUIRE(b.code == 0);
  CHECK(b.output.find("parallel layout: world 2 (dp=2") != std::string::npos);
  // Rank 0 alone logs: one progress line per logged step.
  CHECK(b.output.find("step 5/6") == b.output.rfind("step 5/6"));
  std::map<std::string, Tensor> ma = model_at(one, 6), mb = model_at(two, 6);
  REQUIRE(ma.size() == mb.size());
  for (const auto& [name, t] : ma) {
    INFO(name);
    std::vector<float> x = t.to_vector<float>(), y = mb.at(name).to_vector<float>();
    REQUIRE(x.size() == y.size());
    float worst = 0;
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(x[i] - y[i]));
    CHECK(worst < 1e-6f);
  }
}

TEST_CASE("ddp: parallel.sync_bn makes dp=2 batch norm match dp=1 on the global batch",
          "[parallel][mp]") {
  // The small CNN has two BatchNorm2d layers: with local statistics dp=2
  // normalises each half-batch on its own and drifts from dp=1 at once.
  fs::path one = fresh("bn_one"), two = fresh("bn_two");
  auto args = [](const fs::path& out) {
    std::vector<std::string> a = trainer_args(out, {"training.steps=4", "model.name=small_cnn",
                                                    "model.dropout=0", "parallel.sync_bn=true"});
    a[1] = std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_cnn.yaml";
    return a;
  };
  Outcome a = finish(start(single(args(one))), 180);
  INFO(a.output);
  REQUIRE(a.code == 0);
  Outcome b = finish(start(launched(args(two))), 180);
  INFO(b.output);
  REQUIRE(b.code == 0);
  std::map<std::string, Tensor> ma = model_at(one, 4), mb = model_at(two, 4);
  REQUIRE(ma.size() == mb.size());
  REQUIRE(ma.count("bn1.running_var") == 1);
  for (const auto& [name, t] : ma) {
    INFO(name);
    if (t.dtype() != DType::f32) continue;  // num_batches_tracked (i64) is equal by count
    std::vector<float> x = t.to_vector<float>(), y = mb.at(name).to_vector<float>();
    REQUIRE(x.size() == y.size());
    float worst = 0, scale = 1e-2f;
    for (size_t i = 0; i < x.size(); ++i) {
      worst = std::max(worst, std::fabs(x[i] - y[i]));
      scale = std::max(scale, std::fabs(x[i]));
    }
    // Measured: sync_bn stays within 1.3e-3 of each tensor's scale; local
    // statistics miss by up to 2e-1 (bn1.bias, bn2.running_mean: 2e-2).
    CHECK(worst <= 5e-3f * scale);
  }
}

TEST_CASE("ddp: dp=2 evaluates each validation image once, with rank 0's batch-norm buffers",
          "[parallel][mp]") {
  // Local batch norm: the ranks' running statistics differ after training,
  // so a rank evaluating its share with its own buffers would move the
  // result away from one process evaluating rank 0's checkpoint.
  fs::path two = fresh("eval_two");
  std::vector<std::string> a = trainer_args(two, {"training.steps=4", "model.name=small_cnn",
                                                  "model.dropout=0", "training.eval_every=4"});
  a[1] = std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_cnn.yaml";
  Outcome b = finish(start(launched(a)), 180);
  INFO(b.output);
  REQUIRE(b.code == 0);
  std::smatch dp;
  const std::regex dp_line(
      R"(eval step 4: loss ([0-9.]+) \| top1 ([0-9.]+)% .* \| ([0-9]+) samples)");
  REQUIRE(std::regex_search(b.output, dp, dp_line));

  std::vector<std::string> eval{TRAINER_BINARY, "eval",
                                a[1],           "training.threads=1",
                                "--checkpoint", (two / "checkpoints").string()};
  Outcome e = finish(start(eval), 120);
  INFO(e.output);
  REQUIRE(e.code == 0);
  std::smatch one;
  const std::regex one_line(R"(loss ([0-9.]+) \| top1 ([0-9.]+)% .* \| ([0-9]+) samples)");
  REQUIRE(std::regex_search(e.output, one, one_line));
  CHECK(dp[3].str() == one[3].str());
  CHECK(std::stoll(one[3].str()) == 10000);
  CHECK(std::fabs(std::stod(dp[2].str()) - std::stod(one[2].str())) < 0.006);
  CHECK(std::fabs(std::stod(dp[1].str()) - std::stod(one[1].str())) < 1e-4);
}

TEST_CASE("ddp: resuming under dp=2 reproduces the uninterrupted run bit for bit",
          "[parallel][mp]") {
  fs::path straight = fresh("straight"), resumed = fresh("resumed");
  // Enough steps that the SIGTERM sent at step 5 lands mid-run on a fast
  // machine too (the MLP runs up to ~1700 steps/s here).
  const int steps = 400;
  std::vector<std::string> extra = {cat("training.steps=", steps)};
  std::vector<std::string> traced = trainer_args(straight, extra);
  traced.push_back("--trace");
  Outcome a = finish(start(launched(traced)), 120);
  INFO(a.output);
  REQUIRE(a.code == 0);

  // The timeline: one file, both ranks, compute and allreduce spans.
  nlohmann::json trace = nlohmann::json::parse(read_file((straight / "trace.json").string()));
  std::set<int> ranks_with_comm, ranks_with_backward;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    if (e.at("cat") == "comm") ranks_with_comm.insert(e.at("pid").get<int>());
    if (e.at("name") == "backward") ranks_with_backward.insert(e.at("pid").get<int>());
  }
  CHECK(ranks_with_comm == std::set<int>{0, 1});
  CHECK(ranks_with_backward == std::set<int>{0, 1});

  // SIGTERM to the launcher reaches both ranks (at different steps); they
  // agree on one step, checkpoint it and exit 0 (the launcher: 128 + 15).
  Child b1 = start(launched(trainer_args(resumed, extra)));
  REQUIRE(wait_for_output(b1, cat("step 5/", steps), 60));
  ::kill(b1.pid, SIGTERM);
  Outcome b1_out = finish(b1, 60);
  INFO(b1_out.output);
  REQUIRE(b1_out.code == 128 + SIGTERM);
  REQUIRE(b1_out.output.find("received signal 15") != std::string::npos);
  std::optional<std::string> mid =
      CheckpointDir((resumed / "checkpoints").string(), 100).latest_complete();
  REQUIRE(mid);
  REQUIRE(fs::path(*mid).filename().string() < CheckpointDir::step_name(steps));

  std::vector<std::string> resume = trainer_args(resumed, extra);
  resume.insert(resume.end(), {"--resume", "auto"});
  Outcome b2 = finish(start(launched(resume)), 120);
  INFO(b2.output);
  REQUIRE(b2.code == 0);
  REQUIRE(b2.output.find("resumed from") != std::string::npos);
  const std::string last = CheckpointDir::step_name(steps);
  // The replicas share the writing: both ranks' files.
  for (const char* stem : {"model", "optimizer"})
    for (int rank = 0; rank < 2; ++rank)
      CHECK(read_file(pieces_file((straight / "checkpoints" / last).string(), stem, rank)) ==
            read_file(pieces_file((resumed / "checkpoints" / last).string(), stem, rank)));

  // One process evaluates a dp=2 checkpoint (the replicated model).
  std::vector<std::string> eval{TRAINER_BINARY,
                                "eval",
                                std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_mlp.yaml",
                                "optimizer.name=sgd",
                                "--checkpoint",
                                (straight / "checkpoints").string()};
  Outcome e = finish(start(eval), 60);
  INFO(e.output);
  CHECK(e.code == 0);
  CHECK(e.output.find("top1") != std::string::npos);

  // The layout is part of the checkpoint: one process resumes it, resharded.
  Outcome c = finish(start(single(resume)), 120);
  INFO(c.output);
  CHECK(c.code == 0);
  CHECK(c.output.find("resharded: dp 2 -> 1") != std::string::npos);
}

TEST_CASE("ddp: parallel.dp must match the number of ranks", "[parallel][mp]") {
  fs::path out = fresh("mismatch");
  Outcome o = finish(start(single(trainer_args(out, {"parallel.dp=2"}))), 60);
  INFO(o.output);
  CHECK(o.code == 1);
  CHECK(o.output.find("parallel.dp = 2 but the job has 1 rank") != std::string::npos);
}

namespace {

// SIGKILLs rank `rank` of the `trainer launch` job.
void kill_rank(const Child& job, int rank) {
  const pid_t victim = launched_rank(job.pid, rank);
  REQUIRE(victim > 0);
  ::kill(victim, SIGKILL);
}

}  // namespace

TEST_CASE("ddp: a killed trainer rank stops the job with an error naming it", "[parallel][mp]") {
  fs::path out = fresh("killed");
  Child job = start(launched(trainer_args(out, {"training.steps=100000"}), "2"));
  REQUIRE(wait_for_output(job, "step 5/", 60));
  kill_rank(job, 1);
  Outcome o = finish(job, 60);
  INFO(o.output);
  CHECK(o.code == 128 + SIGKILL);
  CHECK(o.output.find("rank 1 exited with code 137") != std::string::npos);
  // The survivor's own error, from its next collective, names the dead rank.
  CHECK(o.output.find("error: rank 0: ") != std::string::npos);
  CHECK(o.output.find("rank 1 (") != std::string::npos);
}

// ---- ZeRO stage 1 (parallel.zero1) in the trainer ----

namespace {

// The largest absolute difference between the models of two runs at step.
float model_difference(const fs::path& a, const fs::path& b, int64_t step) {
  std::map<std::string, Tensor> ma = model_at(a, step), mb = model_at(b, step);
  REQUIRE(ma.size() == mb.size());
  float worst = 0;
  for (const auto& [name, t] : ma) {
    INFO(name);
    REQUIRE(mb.count(name) == 1);
    std::vector<float> x = t.to_vector<float>(), y = mb.at(name).to_vector<float>();
    REQUIRE(x.size() == y.size());
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(x[i] - y[i]));
  }
  return worst;
}

fs::path checkpoint_file(const fs::path& run, int64_t step, const std::string& file) {
  return run / "checkpoints" / CheckpointDir::step_name(step) / file;
}

}  // namespace

TEST_CASE("zero1: the trainer at dp=2 with sharded optimizer state matches dp=1",
          "[parallel][mp]") {
  // The same recipe on one rank (zero1 has nothing to shard there) and on
  // two; gradient clipping exercises the sharded gradient norm.
  for (const std::string optimizer : {"sgd", "adamw"}) {
    INFO(optimizer);
    fs::path one = fresh("z1_one_" + optimizer), two = fresh("z1_two_" + optimizer);
    std::vector<std::string> extra = {"training.steps=6", "training.grad_accum=2",
                                      "parallel.zero1=true", "optimizer.clip_grad_norm=0.5",
                                      "optimizer.name=" + optimizer};
    if (optimizer == "sgd") extra.push_back("optimizer.momentum=0.9");
    if (optimizer == "adamw") extra.push_back("optimizer.lr=0.002");
    Outcome a = finish(start(single(trainer_args(one, extra))), 120);
    INFO(a.output);
    REQUIRE(a.code == 0);
    Outcome b = finish(start(launched(trainer_args(two, extra))), 120);
    INFO(b.output);
    REQUIRE(b.code == 0);
    CHECK(b.output.find("parallel layout: world 2 (dp=2, pp=1, tp=1, zero1)") != std::string::npos);
    // AdamW divides by sqrt(v), which magnifies the rounding of the averaged gradient.
    CHECK(model_difference(one, two, 6) < (optimizer == "sgd" ? 1e-6f : 1e-5f));
    // Each rank holds about half of the state (the buckets' blocks are padded).
    const auto whole = fs::file_size(checkpoint_file(one, 6, "optimizer-rank00000.safetensors"));
    for (int r = 0; r < 2; ++r) {
      fs::path shard =
          pieces_file((two / "checkpoints" / CheckpointDir::step_name(6)).string(), "optimizer", r);
      REQUIRE(fs::exists(shard));
      CHECK(fs::file_size(shard) < whole * 6 / 10);
    }
  }
}

TEST_CASE("zero1: resuming under dp=2 reproduces the uninterrupted run bit for bit",
          "[parallel][mp]") {
  fs::path straight = fresh("z1_straight"), resumed = fresh("z1_resumed");
  std::vector<std::string> extra = {"training.steps=12", "training.checkpoint_every=6",
                                    "parallel.zero1=true", "optimizer.name=adamw",
                                    "optimizer.lr=0.002"};
  Outcome a = finish(start(launched(trainer_args(straight, extra))), 120);
  INFO(a.output);
  REQUIRE(a.code == 0);
  // The run as if stopped after its step-6 checkpoint.
  const std::string mid = CheckpointDir::step_name(6);
  fs::create_directories(resumed / "checkpoints");
  fs::copy(straight / "checkpoints" / mid, resumed / "checkpoints" / mid);
  std::vector<std::string> resume = trainer_args(resumed, extra);
  resume.insert(resume.end(), {"--resume", "auto"});
  Outcome b = finish(start(launched(resume)), 120);
  INFO(b.output);
  REQUIRE(b.code == 0);
  REQUIRE(b.output.find("resumed from") != std::string::npos);
  for (const std::string file :
       {"model-rank00000.safetensors", "model-rank00001.safetensors",
        "optimizer-rank00000.safetensors", "optimizer-rank00001.safetensors"}) {
    INFO(file);
    REQUIRE(fs::exists(checkpoint_file(resumed, 12, file)));
    CHECK(read_file(checkpoint_file(straight, 12, file).string()) ==
          read_file(checkpoint_file(resumed, 12, file).string()));
  }
  nlohmann::json state =
      nlohmann::json::parse(read_file(checkpoint_file(resumed, 12, "trainer_state.json")));
  CHECK(state.at("parallel").at("zero1") == true);
  CHECK(state.at("parallel").at("dp") == 2);

  // One process evaluates it: the model is whole, the optimizer not needed.
  std::vector<std::string> eval{TRAINER_BINARY, "eval",
                                std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_mlp.yaml",
                                "--checkpoint", (resumed / "checkpoints").string()};
  Outcome e = finish(start(eval), 60);
  INFO(e.output);
  CHECK(e.code == 0);
  CHECK(e.output.find("top1") != std::string::npos);
}

TEST_CASE("zero1: a checkpoint resumes on another dp size and sharding, re-sliced",
          "[parallel][mp]") {
  // dp = 2 with ZeRO-1, stopped at step 6 of 12: continued on 4 ranks with
  // ZeRO-1, on one process, and on 2 ranks without it, each must train as
  // the uninterrupted run: the same samples (the data position dealt out
  // again) and the same optimizer state (the shards joined and re-sliced).
  // Only the averaging order of the gradients differs.
  std::vector<std::string> extra = {"training.steps=12", "training.checkpoint_every=6",
                                    "optimizer.momentum=0.9", "training.global_batch=32"};
  fs::path straight = fresh("z1_reshard_straight");
  std::vector<std::string> sharded = extra;
  sharded.push_back("parallel.zero1=true");
  Outcome a = finish(start(launched(trainer_args(straight, sharded))), 120);
  INFO(a.output);
  REQUIRE(a.code == 0);
  struct Continue {
    const char* name;
    int ranks;
    bool zero1;
    const char* resharded;
  };
  for (Continue c : {Continue{"dp4", 4, true, "resharded: dp 2 -> 4; the optimizer state"},
                     Continue{"dp1", 1, false, "resharded: dp 2 -> 1, zero1 on -> off"},
                     Continue{"dp2_whole", 2, false, "resharded: zero1 on -> off"}}) {
    INFO(c.name);
    fs::path run = fresh(cat("z1_reshard_", c.name));
    const std::string mid = CheckpointDir::step_name(6);
    fs::create_directories(run / "checkpoints");
    fs::copy(straight / "checkpoints" / mid, run / "checkpoints" / mid);
    std::vector<std::string> args = extra;
    args.push_back(c.zero1 ? "parallel.zero1=true" : "parallel.zero1=false");
    args = trainer_args(run, args);
    args.insert(args.end(), {"--resume", "auto"});
    std::vector<std::string> argv = single(args);
    if (c.ranks > 1) {
      argv = launched(args);
      argv[3] = std::to_string(c.ranks);  // --nproc-per-node
    }
    Outcome b = finish(start(argv), 180);
    INFO(b.output);
    REQUIRE(b.code == 0);
    CHECK(b.output.find(c.resharded) != std::string::npos);
    if (c.ranks != 2)
      CHECK(b.output.find(cat("the epoch's data position kept: 96 samples on each of 2 ranks -> ",
                              192 / c.ranks, " on each of ", c.ranks)) != std::string::npos);
    CHECK(model_difference(straight, run, 12) < 1e-6f);
  }
  // A global batch that does not divide the position is an error, not a skipped sample.
  fs::path odd = fresh("z1_reshard_odd");
  const std::string mid = CheckpointDir::step_name(6);
  fs::create_directories(odd / "checkpoints");
  fs::copy(straight / "checkpoints" / mid, odd / "checkpoints" / mid);
  std::vector<std::string> args = trainer_args(
      odd, {"training.steps=12", "training.global_batch=40", "optimizer.momentum=0.9"});
  args.insert(args.end(), {"--resume", "auto"});
  Outcome e = finish(start(single(args)), 60);
  INFO(e.output);
  CHECK(e.code != 0);
  CHECK(e.output.find("not a whole number of steps of training.global_batch = 40") !=
        std::string::npos);
}

TEST_CASE(
    "checkpoints: a rank killed in the middle of an asynchronous write leaves latest at the last "
    "complete checkpoint, which resumes bit for bit, and synchronous writes are the same files",
    "[parallel][mp][checkpoint]") {
  const fs::path straight = fresh("async_straight"), killed = fresh("async_killed"),
                 sync = fresh("async_sync");
  const std::vector<std::string> extra = {"training.steps=8", "training.checkpoint_every=2",
                                          "parallel.zero1=true"};
  Outcome a = finish(start(launched(trainer_args(straight, extra))), 120);
  INFO(a.output);
  REQUIRE(a.code == 0);
  CHECK(a.output.find("(written in the background; the step waited") != std::string::npos);
  // Each write pauses 3 s after the model's pieces: step 2's is committed
  // when step 4's checkpoint starts (never two in flight), and rank 1 dies
  // in the middle of step 4's.
  Child job = start(launched(trainer_args(killed, extra), "2"),
                    {{"TRAINER_FAULT_CHECKPOINT_DELAY_MS", "3000"}});
  REQUIRE(wait_for_output(job, "checkpoints/step_00000002 (written in the background", 120));
  kill_rank(job, 1);
  Outcome o = finish(job, 60);
  INFO(o.output);
  CHECK(o.code != 0);
  const std::optional<std::string> latest =
      CheckpointDir((killed / "checkpoints").string(), 100).latest_complete();
  REQUIRE(latest);
  CHECK(fs::path(*latest).filename() == "step_00000002");
  CHECK(!CheckpointDir::is_complete((killed / "checkpoints" / "step_00000004").string()));
  // Resumed: the uninterrupted run's files, byte for byte.
  std::vector<std::string> resume = trainer_args(killed, extra);
  resume.insert(resume.end(), {"--resume", "auto"});
  Outcome b = finish(start(launched(resume)), 120);
  INFO(b.output);
  REQUIRE(b.code == 0);
  // And written synchronously, the same files again.
  std::vector<std::string> sync_args = extra;
  sync_args.push_back("training.async_checkpoint=false");
  Outcome c = finish(start(launched(trainer_args(sync, sync_args))), 120);
  INFO(c.output);
  REQUIRE(c.code == 0);
  CHECK(c.output.find("written in the background") == std::string::npos);
  for (const std::string file :
       {"model-rank00000.safetensors", "model-rank00001.safetensors",
        "optimizer-rank00000.safetensors", "optimizer-rank00001.safetensors"}) {
    INFO(file);
    const std::string want = read_file(checkpoint_file(straight, 8, file).string());
    CHECK(read_file(checkpoint_file(killed, 8, file).string()) == want);
    CHECK(read_file(checkpoint_file(sync, 8, file).string()) == want);
  }
}

namespace {

// A small GPT: the tensor- and pipeline-parallel layouts need a model that splits.
std::vector<std::string> small_gpt_args(const fs::path& out, std::vector<std::string> extra) {
  std::vector<std::string> a{"train",
                             std::string(TRAINER_SOURCE_DIR) + "/recipes/gpt_kjv.yaml",
                             "output_dir=" + out.string(),
                             "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
                             "training.threads=1",
                             "training.log_every=1",
                             "training.eval_every=0",
                             "model.n_layer=2",
                             "model.n_head=4",
                             "model.d_model=64",
                             "model.context=32",
                             "data.seq_len=32",
                             "data.val_windows=4",
                             "optimizer.name=adamw"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

}  // namespace

TEST_CASE(
    "checkpoints: under tp 2, pp 2 and dp 2 x tp 2 with ZeRO-1 a random rank killed at a random "
    "point of an asynchronous write resumes bit for bit",
    "[parallel][mp][checkpoint]") {
  struct Layout {
    std::string name;
    int ranks;
    std::vector<std::string> args;
  };
  for (const Layout& layout :
       {Layout{"tp", 2, {"parallel.tp=2"}}, Layout{"pp", 2, {"parallel.pp=2"}},
        Layout{"dp_tp", 4, {"parallel.tp=2", "parallel.zero1=true"}}}) {
    const uint32_t seed = std::random_device()();
    std::mt19937 random(seed);
    const int victim = int(random() % uint32_t(layout.ranks));
    const int after_ms = int(random() % 2000);
    INFO(layout.name << ": seed " << seed << ", rank " << victim << " killed " << after_ms
                     << " ms into step 4's write");
    const fs::path straight = fresh("async_" + layout.name + "_straight"),
                   killed = fresh("async_" + layout.name + "_killed");
    std::vector<std::string> extra = {"training.steps=8", "training.checkpoint_every=2",
                                      cat("training.global_batch=", 2 * layout.ranks)};
    extra.insert(extra.end(), layout.args.begin(), layout.args.end());
    Outcome a = finish(start(launched(small_gpt_args(straight, extra), "10", layout.ranks)), 180);
    INFO(a.output);
    REQUIRE(a.code == 0);
    // Each write pauses 3 s after the model's pieces: once step 2's is
    // committed, step 4's is in flight for at least that long.
    Child job = start(launched(small_gpt_args(killed, extra), "2", layout.ranks),
                      {{"TRAINER_FAULT_CHECKPOINT_DELAY_MS", "3000"}});
    REQUIRE(wait_for_output(job, "checkpoints/step_00000002 (written in the background", 180));
    std::this_thread::sleep_for(std::chrono::milliseconds(after_ms));
    kill_rank(job, victim);
    Outcome o = finish(job, 60);
    INFO(o.output);
    CHECK(o.code != 0);
    const std::optional<std::string> latest =
        CheckpointDir::latest_in((killed / "checkpoints").string());
    REQUIRE(latest);
    CHECK(fs::path(*latest).filename() == "step_00000002");
    std::vector<std::string> resume = small_gpt_args(killed, extra);
    resume.insert(resume.end(), {"--resume", "auto"});
    Outcome b = finish(start(launched(resume, "10", layout.ranks)), 180);
    INFO(b.output);
    REQUIRE(b.code == 0);
    CHECK(b.output.find("resumed from") != std::string::npos);
    const fs::path want = checkpoint_file(straight, 8, ""), got = checkpoint_file(killed, 8, "");
    for (const auto& e : fs::directory_iterator(want)) {
      const std::string file = e.path().filename().string();
      if (!file.ends_with(".safetensors")) continue;
      INFO(file);
      CHECK(read_file((got / file).string()) == read_file(e.path().string()));
    }
  }
}

TEST_CASE("checkpoints: a state over training.async_checkpoint_mb is written synchronously",
          "[parallel][mp][checkpoint]") {
  const fs::path out = fresh("async_cap");
  Outcome o =
      finish(start(launched(trainer_args(out, {"training.steps=2", "training.checkpoint_every=2",
                                               "training.async_checkpoint_mb=1"}))),
             120);
  INFO(o.output);
  REQUIRE(o.code == 0);
  CHECK(o.output.find("checkpoint: a rank's state is over training.async_checkpoint_mb (1 MiB; "
                      "this rank's: ") != std::string::npos);
  CHECK(CheckpointDir::is_complete(checkpoint_file(out, 2, "").string()));
}

namespace {

// a and b within tolerance (of each tensor's largest magnitude, at least
// 1), a vocabulary padded for tensor parallelism cut to the other's rows.
void check_close_models(const std::map<std::string, Tensor>& a,
                        const std::map<std::string, Tensor>& b, double tolerance) {
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    INFO(name);
    REQUIRE(b.count(name) == 1);
    Tensor x = t, y = b.at(name);
    if (x.dim() > 0 && y.dim() > 0 && x.size(0) != y.size(0)) {
      const int64_t rows = std::min(x.size(0), y.size(0));
      x = x.narrow(0, 0, rows).contiguous(), y = y.narrow(0, 0, rows).contiguous();
    }
    REQUIRE(x.shape() == y.shape());
    if (x.dtype() != DType::f32) continue;
    double worst = 0, scale = 1;
    const std::vector<float> u = x.to_vector<float>(), v = y.to_vector<float>();
    for (size_t i = 0; i < u.size(); ++i) {
      worst = std::max(worst, double(std::fabs(u[i] - v[i])));
      scale = std::max(scale, double(std::fabs(u[i])));
    }
    CHECK(worst <= tolerance * scale);
  }
}

}  // namespace

TEST_CASE(
    "checkpoints: a GPT checkpoint of each layout (one process, dp 2 with ZeRO-1, tp 2, pp 2) "
    "resumes under every other, the same model within float tolerance",
    "[parallel][mp][checkpoint]") {
  struct Layout {
    std::string name;
    int ranks;
    std::vector<std::string> args;
  };
  const std::vector<Layout> layouts = {{"single", 1, {}},
                                       {"dp2_zero1", 2, {"parallel.zero1=true"}},
                                       {"tp2", 2, {"parallel.tp=2"}},
                                       {"pp2", 2, {"parallel.pp=2"}}};
  // SGD with momentum: state to reshard, and no Adam normalisation to
  // magnify the layouts' rounding differences.
  const std::vector<std::string> common = {
      "optimizer.name=sgd",          "optimizer.lr=0.1",
      "optimizer.momentum=0.9",      "model.dropout=0",
      "training.checkpoint_every=2", "training.global_batch=4"};
  auto run = [&](const Layout& l, const fs::path& out, int64_t steps, bool resume) {
    std::vector<std::string> extra = common;
    extra.push_back(cat("training.steps=", steps));
    extra.insert(extra.end(), l.args.begin(), l.args.end());
    std::vector<std::string> args = small_gpt_args(out, extra);
    if (resume) args.insert(args.end(), {"--resume", "auto"});
    Outcome o = finish(start(l.ranks == 1 ? single(args) : launched(args)), 180);
    INFO(l.name << ": " << o.output);
    REQUIRE(o.code == 0);
    if (resume) CHECK(o.output.find("resumed from") != std::string::npos);
  };
  std::map<std::string, std::map<std::string, Tensor>> written;
  for (const Layout& from : layouts) {
    const fs::path source = fresh("reshard_" + from.name);
    run(from, source, 2, false);
    written[from.name] = model_at(source, 2);
    INFO("written under " << from.name);
    check_close_models(written["single"], written[from.name], 1e-5);
    std::map<std::string, Tensor> continued;  // under the first target
    for (const Layout& to : layouts) {
      INFO("resumed under " << to.name);
      const fs::path target = fresh("reshard_" + from.name + "_to_" + to.name);
      fs::create_directories(target / "checkpoints");
      fs::copy(source / "checkpoints" / CheckpointDir::step_name(2),
               target / "checkpoints" / CheckpointDir::step_name(2), fs::copy_options::recursive);
      run(to, target, 4, true);
      const std::map<std::string, Tensor> model = model_at(target, 4);
      if (continued.empty()) continued = model;
      check_close_models(continued, model, 1e-5);
    }
  }
}
