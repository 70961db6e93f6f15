// End-to-end runs of the trainer binary: SIGTERM leaves a valid checkpoint,
// resuming reproduces the uninterrupted run bit for bit, and the default
// recipe learns.
#include <filesystem>
#include <regex>

#include "tests/process.h"
#include "tests/testing.h"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"
#include "trainer/session.h"

using namespace trainer;
using namespace trainer::testing;
namespace fs = std::filesystem;

namespace {

std::string model_bytes(const std::string& checkpoint_dir) {
  return read_file(checkpoint_dir + "/model-rank00000.safetensors");
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
  REQUIRE(
      read_file((straight / "checkpoints" / last / "optimizer-rank00000.safetensors").string()) ==
      read_file((resumed / "checkpoints" / last / "optimizer-rank00000.safetensors").string()));
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
  std::string good = read_file((last / "model-rank00000.safetensors").string());
  std::string bad = good.substr(0, good.size() / 2);
  write_file_atomic((last / "model-rank00000.safetensors").string(), bad);
  r = run_trainer(
      recipe_args("fmnist_mlp.yaml", out,
                  {"training.steps=8", "training.global_batch=16", "--resume", last.string()}));
  REQUIRE(r.code == 1);
  REQUIRE(r.output.find("not a valid safetensors file") != std::string::npos);
  REQUIRE(fs::exists(out / "checkpoints" / CheckpointDir::step_name(2) /
                     "model-rank00000.safetensors"));
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

TEST_CASE("train: --dry-run and plan need no dataset on disk", "[train]") {
  // The ImageNet recipe with its data nowhere: the model, the steps of an
  // epoch (ImageNet-1k's 1,281,167 images at 256) and the memory estimate,
  // with a line saying what was assumed.
  fs::path out = fresh("dry_nodata");
  ProcessResult r = run_trainer(
      recipe_args("resnet50_imagenet.yaml", out, {"data.root=/nonexistent/imagenet", "--dry-run"}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("total  25,557,032 parameters") != std::string::npos);
  CHECK(r.output.find("450360 steps (5004 per epoch)") != std::string::npos);
  CHECK(r.output.find("data: /nonexistent/imagenet/train is not on disk; assumed 1,281,167 "
                      "training and 50,000 validation images of 1000 classes") !=
        std::string::npos);
  CHECK(r.output.find("memory estimate") != std::string::npos);
  // Training itself still needs the data, and says where it looked.
  ProcessResult t = run_trainer(recipe_args(
      "resnet50_imagenet.yaml", out, {"data.root=/nonexistent/imagenet", "training.steps=1"}));
  CHECK(t.code == 1);
  CHECK(t.output.find("/nonexistent/imagenet/train") != std::string::npos);
  // Fashion-MNIST elsewhere: its own sizes; and the CPU planner profiles without it.
  ProcessResult m = run_trainer(
      recipe_args("fmnist_cnn.yaml", out, {"data.root=/nonexistent/fmnist", "--dry-run"}));
  INFO(m.output);
  REQUIRE(m.code == 0);
  CHECK(m.output.find("assumed 60,000 training and 10,000 validation images of 10 classes and "
                      "1 channels (Fashion-MNIST's)") != std::string::npos);
  ProcessResult p =
      run_trainer({"plan", std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_cnn.yaml",
                   "data.root=/nonexistent/fmnist", "--nodes", "1", "--per-node", "2", "--device",
                   "cpu", "--top", "3"});
  INFO(p.output);
  REQUIRE(p.code == 0);
  CHECK(p.output.find("best plan as recipe overrides") != std::string::npos);
}

TEST_CASE("train: parallel.stage_memory_mb is checked on the schedule's table", "[train]") {
  // The small CNN cut in two evenly, 8 micro-batches. Stage 0's parameters
  // are tiny next to its activations per micro-batch (a, measured here), so
  // a limit of 3.5 a fits 3 in flight on it: GPipe's 8 do not (the table's
  // F3 is the first over), 1F1B's 2 do.
  fs::path out = fresh("stage_memory");
  auto dry = [&](const std::string& schedule, const std::string& stages, double mb) {
    return run_trainer(recipe_args(
        "fmnist_cnn.yaml", out,
        {"parallel.pp=2", "parallel.micro_batches=8", "parallel.schedule=" + schedule,
         "parallel.stages=" + stages, cat("parallel.stage_memory_mb=", mb), "--dry-run"}));
  };
  ProcessResult free = dry("1f1b", "even", 0);
  INFO(free.output);
  REQUIRE(free.code == 0);
  std::smatch m;
  REQUIRE(std::regex_search(free.output, m,
                            std::regex("stage 0: conv1 .. conv2, .* and ([0-9.]+) MiB of "
                                       "activations per micro-batch")));
  const double a = std::stod(m[1]);
  const double limit = 3.5 * a;
  ProcessResult gpipe = dry("gpipe", "even", limit);
  INFO(gpipe.output);
  CHECK(gpipe.code == 1);
  CHECK(gpipe.output.find("parallel.schedule gpipe with 8 micro-batches holds more activations "
                          "than parallel.stage_memory_mb") != std::string::npos);
  CHECK(gpipe.output.find("stage 0 action 6 (F3): 4 micro-batches in flight, above the limit "
                          "of 3") != std::string::npos);
  CHECK(gpipe.output.find("use parallel.schedule=1f1b") != std::string::npos);
  ProcessResult one_f_one_b = dry("1f1b", "even", limit);
  INFO(one_f_one_b.output);
  CHECK(one_f_one_b.code == 0);
  CHECK(one_f_one_b.output.find("pipeline: 2 stages, blocks [0, 2) [2, 4)") != std::string::npos);
  // auto splits for the schedule's peak: GPipe's 8 micro-batches of stage 0 fit in no split.
  ProcessResult automatic = dry("gpipe", "auto", limit);
  INFO(automatic.output);
  CHECK(automatic.code == 1);
  CHECK(automatic.output.find("parallel.schedule gpipe keeps up to 8 micro-batches in flight") !=
        std::string::npos);
}

TEST_CASE("train: a stage that reads no batch gets the same positions without decoding",
          "[train]") {
  // A middle pipeline stage needs only where each batch ends (checkpoints
  // and resume): the image source gives it positions, the loader idle.
  const Recipe r = load_recipe(std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_mlp.yaml",
                               {"data.workers=1", "training.global_batch=4096"});
  Session reading(r), skipping(r);
  skipping.data().set_reads_batches(false);
  REQUIRE(reading.data().batches_have_tensors());
  REQUIRE_FALSE(skipping.data().batches_have_tensors());
  for (int64_t start : {int64_t(0), int64_t(8192), int64_t(8000)}) {
    INFO("from position " << start);
    reading.start_epoch(1, start);
    skipping.start_epoch(1, start);
    std::vector<int64_t> want, got;
    StepBatch a, b;
    while (reading.next_batch(a)) {
      REQUIRE(a.inputs.defined());
      want.push_back(a.position);
      REQUIRE(skipping.next_batch(b));
      REQUIRE_FALSE(b.inputs.defined());
      REQUIRE(b.items == a.items);
      got.push_back(b.position);
    }
    REQUIRE_FALSE(skipping.next_batch(b));  // the same epoch end
    REQUIRE(!want.empty());
    REQUIRE(got == want);
  }
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
      (src / "checkpoints" / CheckpointDir::step_name(3) / "model-rank00000.safetensors").string();
  // lr 0 and no weight decay: the weights stay exactly those loaded.
  r = run_trainer(recipe_args("fmnist_mlp.yaml", dst,
                              {"training.steps=1", "training.global_batch=16", "optimizer.lr=0",
                               "optimizer.weight_decay=0", "--init-from", weights}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  SafetensorsFile loaded = read_safetensors(weights);
  SafetensorsFile after = read_safetensors(
      (dst / "checkpoints" / CheckpointDir::step_name(1) / "model-rank00000.safetensors").string());
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
