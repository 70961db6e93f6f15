// End-to-end runs of the trainer binary: SIGTERM leaves a valid checkpoint,
// resuming reproduces the uninterrupted run bit for bit, and the default
// recipe learns.
#include <filesystem>
#include <regex>

#include "tests/process.h"
#include "tests/testing.h"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"

using namespace trainer;
using namespace trainer::testing;
namespace fs = std::filesystem;

namespace {

std::string model_bytes(const std::string& checkpoint_dir) {
  return read_file(checkpoint_dir + "/model.safetensors");
}

fs::path fresh(const std::string& name) { return fresh_temp_dir("run_" + name, false); }

std::vector<std::string> recipe_args(const std::string& recipe, const fs::path& out,
                                     std::vector<std::string> extra) {
  std::vector<std::string> a{"train", std::string(TRAINER_SOURCE_DIR) + "/recipes/" + recipe,
                             "output_dir=" + out.string(), "training.threads=1", "data.workers=1"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// Straight run vs. interrupted (SIGTERM after step `stop`) + --resume auto.
void check_resume_equivalence(const std::string& recipe, std::vector<std::string> extra,
                              int64_t steps, const std::string& stop_line) {
  extra.push_back("training.steps=" + std::to_string(steps));
  fs::path straight = fresh(recipe + "_straight"), resumed = fresh(recipe + "_resumed");
  ProcessResult a = run_trainer(recipe_args(recipe, straight, extra));
  INFO(a.output);
  REQUIRE(a.code == 0);

  ProcessResult b1 = run_trainer(recipe_args(recipe, resumed, extra), {.stop_after = stop_line});
  INFO(b1.output);
  REQUIRE(b1.code == 0);
  REQUIRE(b1.output.find("received signal 15") != std::string::npos);
  CheckpointDir ckpt((resumed / "checkpoints").string(), 100);
  std::optional<std::string> mid = ckpt.latest_complete();
  REQUIRE(mid);
  REQUIRE(fs::path(*mid).filename().string() < CheckpointDir::step_name(steps));

  std::vector<std::string> resume = recipe_args(recipe, resumed, extra);
  resume.push_back("--resume");
  resume.push_back("auto");
  ProcessResult b2 = run_trainer(resume);
  INFO(b2.output);
  REQUIRE(b2.code == 0);
  REQUIRE(b2.output.find("resumed from") != std::string::npos);

  std::string last = CheckpointDir::step_name(steps);
  REQUIRE(model_bytes((straight / "checkpoints" / last).string()) ==
          model_bytes((resumed / "checkpoints" / last).string()));
  REQUIRE(read_file((straight / "checkpoints" / last / "optimizer.safetensors").string()) ==
          read_file((resumed / "checkpoints" / last / "optimizer.safetensors").string()));
}

}  // namespace

TEST_CASE("train: SIGTERM checkpoints, and resuming the MLP is bit-identical", "[train]") {
  // 400 steps: the SIGTERM sent at step 5 must land mid-run on a fast machine
  // too (the MLP runs ~1000 steps/s at one thread).
  check_resume_equivalence("fmnist_mlp.yaml", {"training.global_batch=32", "training.log_every=5"},
                           400, "step 5/400");
}

TEST_CASE("train: resuming the CNN (batch norm, dropout, grad accumulation) is bit-identical",
          "[train][slow]") {
  check_resume_equivalence(
      "fmnist_cnn.yaml",
      {"training.global_batch=32", "training.grad_accum=2", "training.log_every=5"}, 30,
      "step 5/30");
}

TEST_CASE("train: bad recipes and arguments fail with a message, not a crash", "[train]") {
  fs::path out = fresh("bad");
  ProcessResult r = run_trainer(recipe_args("fmnist_cnn.yaml", out, {"training.epoch=3"}));
  REQUIRE(r.code == 1);
  REQUIRE(r.output.find("did you mean 'training.epochs'") != std::string::npos);
  r = run_trainer(recipe_args("fmnist_cnn.yaml", out, {"--resume", "/nonexistent"}));
  REQUIRE(r.code == 1);
  REQUIRE(r.output.find("not a complete checkpoint") != std::string::npos);
  r = run_trainer(recipe_args("fmnist_cnn.yaml", out, {"model.num_classes=7"}));
  REQUIRE(r.code == 1);
  REQUIRE(r.output.find("model.num_classes is 7 but the dataset has 10") != std::string::npos);
}

TEST_CASE("train: a corrupt checkpoint is refused and the previous one is untouched", "[train]") {
  fs::path out = fresh("corrupt");
  ProcessResult r = run_trainer(
      recipe_args("fmnist_mlp.yaml", out,
                  {"training.steps=4", "training.checkpoint_every=2", "training.global_batch=16"}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  fs::path last = out / "checkpoints" / CheckpointDir::step_name(4);
  std::string good = read_file((last / "model.safetensors").string());
  std::string bad = good.substr(0, good.size() / 2);
  write_file_atomic((last / "model.safetensors").string(), bad);
  r = run_trainer(
      recipe_args("fmnist_mlp.yaml", out,
                  {"training.steps=8", "training.global_batch=16", "--resume", last.string()}));
  REQUIRE(r.code == 1);
  REQUIRE(r.output.find("not a valid safetensors file") != std::string::npos);
  REQUIRE(fs::exists(out / "checkpoints" / CheckpointDir::step_name(2) / "model.safetensors"));
}

TEST_CASE("train: --dry-run prints the summary and memory estimate", "[train]") {
  fs::path out = fresh("dry");
  ProcessResult r = run_trainer(recipe_args("fmnist_cnn.yaml", out, {"--dry-run"}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  REQUIRE(r.output.find("total  421,834 parameters") != std::string::npos);
  REQUIRE(r.output.find("memory estimate") != std::string::npos);
  REQUIRE(!fs::exists(out / "checkpoints"));
}

TEST_CASE("train: fmnist_cnn reaches 88% test accuracy in one epoch", "[train][slow]") {
  fs::path out = fresh("accuracy");
  ProcessResult r =
      run_trainer(recipe_args("fmnist_cnn.yaml", out, {"training.epochs=1", "training.threads=2"}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, std::regex("final eval top1 ([0-9.]+)%")));
  REQUIRE(std::stod(m[1]) >= 88.0);
}

TEST_CASE("train: --init-from loads weights by name, strictly by default", "[train]") {
  fs::path src = fresh("init_src"), dst = fresh("init_dst"), bad = fresh("init_bad");
  ProcessResult r = run_trainer(
      recipe_args("fmnist_mlp.yaml", src, {"training.steps=3", "training.global_batch=16"}));
  REQUIRE(r.code == 0);
  std::string weights =
      (src / "checkpoints" / CheckpointDir::step_name(3) / "model.safetensors").string();
  // lr 0 and no weight decay: the weights stay exactly those loaded.
  r = run_trainer(recipe_args("fmnist_mlp.yaml", dst,
                              {"training.steps=1", "training.global_batch=16", "optimizer.lr=0",
                               "optimizer.weight_decay=0", "--init-from", weights}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  SafetensorsFile loaded = read_safetensors(weights);
  SafetensorsFile after = read_safetensors(
      (dst / "checkpoints" / CheckpointDir::step_name(1) / "model.safetensors").string());
  for (const auto& [name, t] : loaded.tensors) {
    INFO(name);
    REQUIRE(std::memcmp(after.tensors.at(name).data_ptr(), t.data_ptr(), t.nbytes()) == 0);
  }
  // MLP weights into the CNN: every problem is listed; non-strict goes on.
  r = run_trainer(
      recipe_args("fmnist_cnn.yaml", bad,
                  {"training.steps=1", "training.global_batch=16", "--init-from", weights}));
  REQUIRE(r.code == 1);
  REQUIRE(r.output.find("missing: conv1.weight") != std::string::npos);
  REQUIRE(r.output.find("unexpected: fc3.weight") != std::string::npos);
  REQUIRE(r.output.find("mis-shaped: fc1.weight") != std::string::npos);
  r = run_trainer(recipe_args("fmnist_cnn.yaml", bad,
                              {"training.steps=1", "training.global_batch=16", "--init-from",
                               weights, "--init-non-strict"}));
  REQUIRE(r.code == 0);
}

TEST_CASE("train: non-finite losses are skipped, then abort after max_nonfinite in a row",
          "[train]") {
  fs::path out = fresh("nonfinite");
  ProcessResult r = run_trainer(
      recipe_args("fmnist_mlp.yaml", out,
                  {"training.steps=50", "training.global_batch=16", "optimizer.name=sgd",
                   "optimizer.lr=100", "training.max_nonfinite=3"}));
  INFO(r.output);
  REQUIRE(r.code == 1);
  REQUIRE(r.output.find("non-finite loss, step skipped") != std::string::npos);
  REQUIRE(r.output.find("was not finite for 4 steps in a row") != std::string::npos);
}
