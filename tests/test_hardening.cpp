// Bad input never crashes, hangs or poisons a run (issue 27): output
// directories that cannot be made, symlink loops, FIFOs, devices and
// directories where files are expected, hostile recipes, trainer states,
// IDX headers and image folders, non-finite checkpoints, and a resume with
// another global batch. Each is an `error: ...` naming the file, key or line
// and exit 1 (or, for the resume, a run that works), never an abort.
#include <sys/stat.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <opencv2/imgcodecs.hpp>
#include <stdexcept>

#include "data/files.h"
#include "data/idx.h"
#include "data/image_folder.h"
#include "data/loader.h"
#include "data/text.h"
#include "tests/hardening.h"
#include "tests/process.h"
#include "tests/testing.h"
#include "trainer/checkpoint.h"
#include "trainer/last_net.h"
#include "trainer/recipe.h"
#include "trainer/safetensors.h"

using namespace trainer;
using namespace trainer::testing;
using namespace trainer::testing::hardening;
namespace fs = std::filesystem;

TEST_CASE("trainer hardening: an output_dir that cannot be made is an error naming it",
          "[hardening]") {
  const fs::path dir = fresh_temp_dir("hardening_outdir");
  const fs::path file = dir / "a_file";
  write_text(file, "x");
  require_error(run_trainer(mlp_args("", {"training.steps=1"})),
                {"output_dir is empty", "output_dir=runs/x"});
  require_error(run_trainer(mlp_args("/proc/hardening_out", {"training.steps=1"})),
                {"cannot create the directory /proc/hardening_out (output_dir)",
                 "choose a writable directory"});
  require_error(run_trainer(mlp_args(file, {"training.steps=1"})),
                {"cannot create the directory " + file.string() + " (output_dir)"});
  require_error(run_trainer(mlp_args(file / "sub", {"training.steps=1"})),
                {"cannot create the directory " + (file / "sub").string()});
  CHECK_THAT(error_of([&] { data::make_directories((file / "x").string(), "output_dir"); }),
             Catch::Contains("Not a directory"));
  // A file where the TensorBoard folder goes.
  const fs::path run = dir / "run";
  write_text(run / "tb", "x");
  require_error(run_trainer(mlp_args(run, {"training.steps=1"})),
                {"cannot create the directory " + (run / "tb").string() +
                 " (the TensorBoard directory (output_dir/tb))"});
}

TEST_CASE("trainer hardening: a symlink loop on the loss scaler's state is an error naming it",
          "[hardening]") {
  const fs::path run = fresh_temp_dir("hardening_scaler_loop", false);
  ProcessResult r = run_trainer(mlp_args(run, {"training.steps=2", "precision=fp16"}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  const fs::path scaler = step_dir(run, 2) / "loss_scaler.safetensors";
  fs::remove(scaler);
  fs::create_symlink(scaler.filename(), scaler);
  require_error(
      run_trainer(mlp_args(run, {"training.steps=3", "precision=fp16", "--resume", "auto"})),
      {scaler.string(), "symbolic links", "must be a regular file"});
}

TEST_CASE("trainer hardening: main's last net prints any exception as an error, exit 1",
          "[hardening]") {
  // What main runs every command under (trainer/last_net.h).
  CHECK(run_with_last_net([] { return 7; }) == 7);
  CHECK(run_with_last_net([]() -> int { throw Error("bad key"); }) == 1);
  CHECK(run_with_last_net([]() -> int { throw std::out_of_range("map::at"); }) == 1);
  CHECK(run_with_last_net([]() -> int { throw 42; }) == 1);
  CHECK(exception_type_name(std::out_of_range("x")) == "std::out_of_range");
}

TEST_CASE("trainer hardening: a recipe must be a regular file of unique plain keys",
          "[hardening][recipe]") {
  const fs::path dir = fresh_temp_dir("hardening_recipe");
  // A directory given as the recipe used to train the defaults and exit 0.
  require_error(run_trainer({"train", dir.string()}),
                {dir.string() + ": the recipe must be a regular file, but this is a directory"});
  make_fifo(dir / "fifo.yaml");
  CHECK_THAT(error_of([&] { load_recipe((dir / "fifo.yaml").string()); }),
             Catch::Contains("fifo.yaml: the recipe must be a regular file, but this is a FIFO"));
  CHECK_THAT(error_of([] { load_recipe("/dev/zero"); }),
             Catch::Contains("/dev/zero: the recipe must be a regular file, but this is a "
                             "character device"));
  auto error_of_file = [&](const std::string& name, const std::string& text) {
    write_text(dir / name, text);
    return error_of([&] { load_recipe((dir / name).string()); });
  };
  // An empty recipe (or only comments) silently used every default.
  CHECK_THAT(error_of_file("empty.yaml", ""), Catch::Contains("empty.yaml: the recipe is empty"));
  CHECK_THAT(error_of_file("comments.yaml", "# nothing\n"),
             Catch::Contains("comments.yaml: the recipe is empty"));
  // The last of two values silently won.
  CHECK_THAT(error_of_file("dup.yaml", "seed: 1\ntraining:\n  epochs: 2\n  epochs: 3\n"),
             Catch::Contains("dup.yaml:4: key 'training.epochs' is given twice (also at "
                             "" +
                             (dir / "dup.yaml").string() + ":3)"));
  CHECK_THAT(error_of_file("dup_section.yaml", "training:\n  epochs: 2\ntraining:\n  steps: 3\n"),
             Catch::Contains("dup_section.yaml:3: key 'training' is given twice"));
  // A complex key was an uncaught YAML::TypedBadConversion.
  CHECK_THAT(error_of_file("complex.yaml", "? [a, b]\n: 1\n"),
             Catch::Contains("complex.yaml:1: a key in the recipe is a list"));
  CHECK_THAT(error_of_file("complex_map.yaml", "training:\n  ? {a: 1}\n  : 2\n"),
             Catch::Contains("complex_map.yaml:2: a key in section 'training' is a map"));
  require_error(run_trainer({"train", (dir / "complex.yaml").string()}),
                {"complex.yaml:1: a key in the recipe is a list"});
  // Text recipes stay as they were: empty text is every default.
  CHECK_NOTHROW(parse_recipe("", "inline"));
}

TEST_CASE("trainer hardening: symlink loops and non-regular files in a checkpoint are errors",
          "[hardening][checkpoint]") {
  // A looping link in place of the checkpoint directory, `latest`, and trainer_state.json.
  for (const std::string& loop :
       {std::string("step"), std::string("latest"), std::string("state")}) {
    DYNAMIC_SECTION("a symlink loop on " << loop) {
      fs::path run = copy_of_base("loop_" + loop);
      fs::path link = loop == "step"     ? step_dir(run, 4)
                      : loop == "latest" ? run / "checkpoints" / "latest"
                                         : step_dir(run, 4) / "trainer_state.json";
      fs::remove_all(link);
      fs::create_symlink(link.filename(), link);
      require_error(run_trainer(mlp_args(run, {"training.steps=6", "--resume", "auto"})),
                    {"cannot inspect " + link.string(), "Too many levels of symbolic links",
                     "fix or remove the link"});
    }
  }
  SECTION("a directory, a FIFO or a device in place of model-rank00000.safetensors") {
    fs::path run = copy_of_base("model_kinds");
    const fs::path model = step_dir(run, 4) / "model-rank00000.safetensors";
    fs::remove_all(model);
    fs::create_directory(model);
    require_error(run_trainer(mlp_args(run, {"training.steps=6", "--resume", "auto"})),
                  {model.string() + ": the safetensors file must be a regular file, but this "
                                    "is a directory"});
    make_fifo(model);
    require_error(
        run_trainer(mlp_args(run, {"training.steps=6", "--resume", "auto"}), {.timeout_s = 120}),
        {model.string() + ": the safetensors file must be a regular file, but this "
                          "is a FIFO"});
    fs::remove_all(model);
    fs::create_symlink("/dev/zero", model);
    CHECK_THAT(error_of([&] { read_model(step_dir(run, 4).string()); }),
               Catch::Contains("but this is a character device"));
  }
  SECTION("a FIFO in place of trainer_state.json is not read") {
    fs::path run = copy_of_base("state_fifo");
    make_fifo(step_dir(run, 4) / "trainer_state.json");
    // Not a complete checkpoint: the one before it resumes.
    CHECK(!CheckpointDir::is_complete(step_dir(run, 4).string()));
    CHECK_THAT(error_of([&] { read_trainer_state(step_dir(run, 4).string()); }),
               Catch::Contains("but this is a FIFO"));
    ProcessResult r =
        run_trainer(mlp_args(run, {"training.steps=6", "--resume", "auto"}), {.timeout_s = 120});
    INFO(r.output);
    CHECK(r.code == 0);
    CHECK(r.output.find("resumed from " + step_dir(run, 2).string()) != std::string::npos);
  }
}

TEST_CASE("trainer hardening: trainer_state.json fields of the wrong JSON type are named",
          "[hardening][checkpoint]") {
  fs::path run = copy_of_base("state_types");
  const fs::path ckpt = step_dir(run, 4);
  const std::string state = trainer_state_file(ckpt.string());
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](nlohmann::json& j) { j["parallel"] = "x"; },
       "missing or wrong field 'parallel': it is string, expected an object"},
      {[](nlohmann::json& j) { j["parallel"]["world_size"] = "1"; },
       "missing or wrong field 'parallel.world_size': it is string, expected an integer"},
      {[](nlohmann::json& j) { j["parallel"]["dp"] = 0; },
       "missing or wrong field 'parallel.dp': 0 is outside"},
      {[](nlohmann::json& j) { j["parallel"]["zero1"] = 1; },
       "missing or wrong field 'parallel.zero1': it is number, expected true or false"},
      {[](nlohmann::json& j) { j["step"] = 2.5; },
       "missing or wrong field 'step': it is number, expected an integer"},
      {[](nlohmann::json& j) { j["position"] = nullptr; },
       "missing or wrong field 'position': it is null, expected an integer"},
      {[](nlohmann::json& j) { j.erase("epoch"); },
       "missing or wrong field 'epoch': it is missing"},
      {[](nlohmann::json& j) {
         j["vocab"] = {1, "a"};
       },
       "missing or wrong field 'vocab': it is string, expected a list of integers"},
      {[](nlohmann::json& j) {
         j["link_models"] = {{{"ranks", {0}}, {"alpha_s", 1e-6}, {"beta_s_per_byte", 1e-9}}};
       },
       "missing or wrong field 'gamma_s_per_byte': it is missing"},
      {[](nlohmann::json& j) {
         j["link_models"] = {{{"ranks", {0, 7}}}};
       },
       "missing or wrong field 'link_models.ranks': it is number, expected ranks below the "
       "world size 1"},
      {[](nlohmann::json& j) { j["recipe"] = 5; },
       "missing or wrong field 'recipe': it is number, expected a string"},
      {[](nlohmann::json& j) { j = nlohmann::json::array(); }, "not a JSON object but array"},
  };
  const std::string good = read_file(state);
  for (const Case& c : cases) {
    INFO(c.message);
    write_file_atomic(state, good);
    edit_state(ckpt, c.edit);
    CHECK_THAT(error_of([&] { read_trainer_state(ckpt.string()); }),
               Catch::Contains(state + ": " + c.message));
  }
  // The binary says the same and exits 1 (it used to abort on nlohmann's type_error).
  write_file_atomic(state, good);
  edit_state(ckpt, cases[0].edit);
  require_error(run_trainer(mlp_args(run, {"training.steps=6", "--resume", "auto"})),
                {state + ": missing or wrong field 'parallel': it is string, expected an object"});
}

TEST_CASE("trainer hardening: non-finite weights and optimizer state are refused unless allowed",
          "[hardening][checkpoint]") {
  fs::path run = copy_of_base("nonfinite");
  const fs::path ckpt = step_dir(run, 4);
  const fs::path model = ckpt / "model-rank00000.safetensors";
  const std::string weight = read_safetensors(model.string()).tensors.begin()->first;
  const std::string model_bytes = read_file(model.string());
  poison(model, weight, std::nanf(""));
  require_error(run_trainer(mlp_args(run, {"training.steps=6", "--resume", "auto"})),
                {model.string() + ": tensor '" + weight + "' holds nan at element 3",
                 "training.allow_non_finite=true"});
  // eval and --init-from check too.
  require_error(run_trainer({"eval", kRecipes + "fmnist_mlp.yaml", "data.val_samples=100",
                             "--checkpoint", ckpt.string()}),
                {"tensor '" + weight + "' holds nan"});
  require_error(run_trainer(mlp_args(fresh_temp_dir("hardening_init", false),
                                     {"training.steps=1", "--init-from", model.string()})),
                {model.string() + ": tensor '" + weight + "' holds nan"});
  // The switch loads it anyway.
  ProcessResult allowed = run_trainer(
      mlp_args(run, {"training.steps=5", "training.allow_non_finite=true", "--resume", "auto"}));
  INFO(allowed.output);
  CHECK(allowed.code == 0);
  CHECK(allowed.output.find("resumed from") != std::string::npos);

  // Optimizer state: an infinite AdamW moment.
  fs::path run2 = copy_of_base("nonfinite_optim");
  const fs::path optim = step_dir(run2, 4) / "optimizer-rank00000.safetensors";
  SafetensorsFile state = read_safetensors(optim.string());
  std::string entry;
  for (const auto& [name, t] : state.tensors)
    if (t.dtype() == DType::f32 && t.numel() > 3) entry = name;
  REQUIRE(!entry.empty());
  poison(optim, entry, INFINITY);
  require_error(run_trainer(mlp_args(run2, {"training.steps=6", "--resume", "auto"})),
                {optim.string() + ": tensor '" + entry + "' holds inf at element 3"});
}

TEST_CASE(
    "trainer hardening: resuming with another global batch from an epoch's last partial "
    "batch continues",
    "[hardening]") {
  // 60000 samples: global batch 64 takes steps at positions 0, 64, ..., and
  // a run stopped after step 936 of batch 64 is at 59904, beyond batch 128's
  // last whole step (468 x 128 = 59904 is its epoch end). It looped forever.
  // The position of that run is set on a quick run's checkpoint.
  for (const auto& [position, batch] : {std::pair<int64_t, int>{59904, 128}, {59968, 96}}) {
    INFO("position " << position << ", global batch " << batch);
    fs::path run = copy_of_base(cat("rebatch_", batch));
    edit_state(step_dir(run, 4), [&](nlohmann::json& j) { j["position"] = position; });
    ProcessResult r =
        run_trainer(mlp_args(run, {"training.steps=6", "training.log_every=1",
                                   cat("training.global_batch=", batch), "--resume", "auto"}),
                    {.timeout_s = 120});
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.find(cat("position ", position, ")")) != std::string::npos);
    // The rest of epoch 0 is less than a step: training goes on in epoch 1.
    CHECK(r.output.find("epoch 1 step 5/6") != std::string::npos);
    CHECK(CheckpointDir::is_complete(step_dir(run, 6).string()));
  }
  // A position between two steps of the new batch resumes at that sample.
  fs::path run = copy_of_base("rebatch_between");
  edit_state(step_dir(run, 4), [](nlohmann::json& j) { j["position"] = 64; });
  ProcessResult r =
      run_trainer(mlp_args(run, {"training.steps=6", "--resume", "auto"}), {.timeout_s = 120});
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(read_trainer_state(step_dir(run, 6).string()).state.position == 64 + 2 * 128);
}

TEST_CASE("data hardening: FIFOs, devices and directories are refused where a file is expected",
          "[hardening][data]") {
  const fs::path dir = fresh_temp_dir("hardening_kinds");
  make_fifo(dir / "fifo");
  fs::create_directory(dir / "folder");
  // Each would block forever (a FIFO) or read without end (/dev/zero).
  for (const std::string& path :
       {(dir / "fifo").string(), std::string("/dev/zero"), (dir / "folder").string()}) {
    INFO(path);
    const std::string kind = path == "/dev/zero"                 ? "a character device"
                             : path == (dir / "folder").string() ? "a directory"
                                                                 : "a FIFO";
    CHECK_THAT(error_of([&] { data::read_regular_file(path, "the thing"); }),
               Catch::Contains(path + ": the thing must be a regular file, but this is " + kind));
    CHECK_THAT(error_of([&] { data::read_idx(path); }), Catch::Contains("but this is " + kind));
    CHECK_THAT(error_of([&] { data::TextCorpus::load(path); }),
               Catch::Contains("but this is " + kind));
    CHECK_THAT(error_of([&] { read_safetensors(path); }), Catch::Contains("but this is " + kind));
  }
  // A symlink loop on a data file.
  fs::create_symlink("loop.idx", dir / "loop.idx");
  CHECK_THAT(error_of([&] { data::read_idx((dir / "loop.idx").string()); }),
             Catch::Contains("Too many levels of symbolic links"));
  // A FIFO named like an image is a bad sample (skipped or refused by the policy), never read.
  fs::path root = dir / "images";
  cv::Mat pixels(8, 8, CV_8UC3, cv::Scalar(1, 2, 3));
  std::vector<uint8_t> jpeg;
  REQUIRE(cv::imencode(".jpg", pixels, jpeg));
  fs::create_directories(root / "a");
  write_bytes(root / "a" / "good.jpg", jpeg);
  make_fifo(root / "a" / "pipe.jpg");
  data::ImageFolder folder(root.string());
  REQUIRE(folder.size() == 2);
  REQUIRE_THROWS_AS(folder.load(1, 0), data::BadSampleError);
  CHECK_THAT(error_of([&] { folder.load(1, 0); }),
             Catch::Contains("pipe.jpg") && Catch::Contains("a FIFO"));
}

TEST_CASE("data hardening: IDX headers past 2^64, 0x0 and huge images are errors",
          "[hardening][data][idx]") {
  const fs::path dir = fresh_temp_dir("hardening_idx");
  // [2^16, 2^24, 2^24] u8 is 2^64 bytes, which wrapped to 0 and matched an
  // empty payload; the reader then read out of bounds.
  write_bytes(dir / "wrap.idx", idx_header(0x08, {1u << 16, 1u << 24, 1u << 24}));
  CHECK_THAT(error_of([&] { data::read_idx((dir / "wrap.idx").string()); }),
             Catch::Contains("wrap.idx: IDX dims [65536, 16777216, 16777216] are implausibly "
                             "large"));
  write_bytes(dir / "zero_wide.idx", idx_header(0x08, {0, 0xFFFFFFFFu, 0xFFFFFFFFu}));
  CHECK_THAT(error_of([&] { data::read_idx((dir / "zero_wide.idx").string()); }),
             Catch::Contains("implausibly large"));
  // A header announcing more than the file holds is refused before allocating.
  write_bytes(dir / "short.idx", idx_header(0x0D, {1u << 20, 1u << 10}));
  CHECK_THAT(error_of([&] { data::read_idx((dir / "short.idx").string()); }),
             Catch::Contains("truncated IDX payload"));
  // 0x0 images (a CHECK abort) and sides past what OpenCV takes (a cv::Exception).
  write_fmnist(dir / "empty_images", 3, 0, 0);
  CHECK_THAT(error_of([&] {
               data::load_fashion_mnist((dir / "empty_images").string(), data::Split::train);
             }),
             Catch::Contains("images [3, 0, 0]: expected at least one image, each side in [1, "));
  write_fmnist(dir / "no_images", 0, 28, 28);
  CHECK_THAT(
      error_of([&] { data::load_fashion_mnist((dir / "no_images").string(), data::Split::train); }),
      Catch::Contains("expected at least one image"));
  write_fmnist(dir / "wide", 1, 1, 1u << 20);
  CHECK_THAT(
      error_of([&] { data::load_fashion_mnist((dir / "wide").string(), data::Split::train); }),
      Catch::Contains("images [1, 1, 1048576]"));
  // The trainer says so and exits 1.
  require_error(
      run_trainer(mlp_args(fresh_temp_dir("hardening_idx_run", false),
                           {"training.steps=1", "data.root=" + (dir / "empty_images").string()})),
      {"-images-idx3-ubyte: images [3, 0, 0]"});
}

TEST_CASE("data hardening: an image folder of bad files only is an error under bad_files: skip",
          "[hardening][data][folder]") {
  const fs::path root = fresh_temp_dir("hardening_bad_images");
  for (const char* split : {"train", "val"})
    for (const char* label : {"a", "b"})
      for (int i = 0; i < 3; ++i) write_text(root / split / label / cat(i, ".jpg"), "junk");
  // It aborted in batch norm on a batch of zero images.
  ProcessResult r = run_trainer(
      {"train", kRecipes + "fmnist_cnn.yaml", "output_dir=" + (root / "out").string(),
       "data.name=image_folder", "data.root=" + root.string(), "data.bad_files=skip",
       "model.in_channels=3", "model.num_classes=2", "data.image_size=16", "data.workers=1",
       "training.steps=2", "training.global_batch=2", "training.threads=1"});
  require_error(r, {"samples of batch 0", "are bad files, skipped: nothing is left to train on",
                    "not a decodable image"});
}

TEST_CASE("trainer hardening: trainer plan refuses a FIFO as its cluster file", "[hardening]") {
  const fs::path dir = fresh_temp_dir("hardening_cluster");
  make_fifo(dir / "cluster.yaml");
  require_error(run_trainer({"plan", kRecipes + "fmnist_cnn.yaml", "--nodes", "2", "--cluster",
                             (dir / "cluster.yaml").string()},
                            {.timeout_s = 60}),
                {"cluster.yaml: the cluster file (--cluster) must be a regular file, but this is a "
                 "FIFO"});
}

TEST_CASE("trainer hardening: SIGTERM while a read hangs checkpoints the last step within seconds",
          "[hardening]") {
  // Every sample read takes 3 s: a batch of 8 over 2 workers takes 12 s.
  // The signal comes after step 1 (~12 s), while the loop waits for batch 2.
  const std::vector<std::string> extra = {"training.steps=3", "training.global_batch=8",
                                          "training.log_every=1", "data.workers=2",
                                          "training.eval_every=0"};
  const fs::path stopped = fresh_temp_dir("hardening_stall", false);
  const auto t0 = std::chrono::steady_clock::now();
  ProcessResult r =
      run_trainer(mlp_args(stopped, extra), {.env = {{"TRAINER_FAULT_LOAD_DELAY_MS", "3000"}},
                                             .stop_after = "step 1/3",
                                             .timeout_s = 90});
  INFO(r.output);
  REQUIRE(r.code == 0);
  REQUIRE(r.output.find("received signal 15; data loader: gave up waiting for batch 1") !=
          std::string::npos);
  REQUIRE(r.output.find("checkpoint written at step 1, exiting") != std::string::npos);
  // Batch 2 would have come at about 24 s; the grace is 2 s after the signal
  // (~12 s): out at ~14.5 s, with room for a slow machine or a sanitizer.
  REQUIRE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 21.0);

  // The checkpoint is whole: resumed without the delay, the run ends bit for
  // bit where an uninterrupted one does.
  std::vector<std::string> resume = mlp_args(stopped, extra);
  resume.insert(resume.end(), {"--resume", "auto"});
  ProcessResult b = run_trainer(resume);
  INFO(b.output);
  REQUIRE(b.code == 0);
  const fs::path straight = fresh_temp_dir("hardening_stall_straight", false);
  ProcessResult a = run_trainer(mlp_args(straight, extra));
  REQUIRE(a.code == 0);
  const std::string step3 = CheckpointDir::step_name(3) + "/model-rank00000.safetensors";
  REQUIRE(data::read_regular_file((stopped / "checkpoints" / step3).string(), "a") ==
          data::read_regular_file((straight / "checkpoints" / step3).string(), "b"));
}
