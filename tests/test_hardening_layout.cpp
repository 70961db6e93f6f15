// Parallel layouts a user gets wrong or leaves half set (issue 38): keys
// that do nothing on the layout asked for are errors, a layout the world
// cannot hold says what to launch, a vocabulary tp does not divide is
// padded (and its checkpoints read on one process), and a pipeline left
// without parallel.micro_batches gets a count chosen for it, with a word
// about its bubble. The trainer runs as a subprocess, tiny: a 2-layer GPT
// of width 32 on the KJV characters (73 of them), one thread per rank.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "tests/hardening.h"
#include "tests/runs.h"
#include "trainer/checkpoint_tool.h"
#include "trainer/distributed.h"
#include "trainer/recipe.h"
#include "trainer/safetensors.h"

using namespace trainer;
using namespace trainer::testing;
using namespace trainer::testing::hardening;
namespace fs = std::filesystem;

namespace {

// `train` of recipes/gpt_kjv.yaml made tiny, at a constant learning rate
// (so that runs of different lengths take the same steps), then extra.
std::vector<std::string> tiny_gpt_args(const fs::path& out, std::vector<std::string> extra) {
  std::vector<std::string> a{"train",
                             kRecipes + "gpt_kjv.yaml",
                             "output_dir=" + out.string(),
                             "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
                             "training.threads=1",
                             "training.steps=2",
                             "training.log_every=1",
                             "training.eval_every=0",
                             "training.checkpoint_every=0",
                             "model.n_layer=2",
                             "model.d_model=32",
                             "model.n_head=2",
                             "model.context=32",
                             "data.seq_len=32",
                             "data.val_windows=8",
                             "schedule.name=constant",
                             "schedule.warmup_steps=0"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// The same arguments for `trainer eval` or `sample` of a run's checkpoints.
std::vector<std::string> tiny_gpt_reader(const std::string& command, const fs::path& run) {
  std::vector<std::string> a = tiny_gpt_args(run, {"--checkpoint", run.string()});
  a[0] = command;
  return a;
}

Recipe recipe_with(const std::vector<std::string>& overrides) {
  return load_recipe(kRecipes + "gpt_kjv.yaml", overrides);
}

}  // namespace

TEST_CASE("layout: parallel.sequence_parallel with parallel.tp = 1 is an error, not ignored",
          "[hardening][parallel]") {
  const fs::path out = fresh_temp_dir("layout_sp", false);
  require_error(run_trainer(tiny_gpt_args(out, {"parallel.sequence_parallel=true", "--dry-run"})),
                {"gpt_kjv.yaml: parallel.sequence_parallel needs parallel.tp > 1",
                 "set parallel.tp=2", "parallel.sequence_parallel=false"});
  CHECK_FALSE(fs::exists(out));
}

TEST_CASE("layout: pp x tp larger than the world names the world that fits it",
          "[hardening][parallel][mp]") {
  const fs::path out = fresh_temp_dir("layout_world", false);
  // Before: "launch ... --nproc-per-node 0 or set parallel.dp=0" (world / (pp x tp) = 0).
  auto no_zero_count = [](const ProcessResult& r) {
    CHECK(r.output.find("--nproc-per-node 0") == std::string::npos);
    CHECK(r.output.find("parallel.dp=0") == std::string::npos);
  };
  const ProcessResult tp4 = run_ranks(2, tiny_gpt_args(out, {"parallel.tp=4"}));
  require_error(tp4, {"gpt_kjv.yaml: the layout dp x pp x tp = dp x 1 x 4",
                      "needs a world that is a multiple of pp x tp = 4", "this job has 2 ranks",
                      "trainer launch --nproc-per-node 4", "lower parallel.pp or parallel.tp"});
  no_zero_count(tp4);
  const ProcessResult pp4 = run_ranks(1, tiny_gpt_args(out, {"parallel.pp=4"}));
  require_error(pp4, {"dp x 4 x 1 needs a world that is a multiple of pp x tp = 4",
                      "this job has 1 rank;", "trainer launch --nproc-per-node 4"});
  no_zero_count(pp4);
  // An explicit dp: the count it needs.
  const ProcessResult dp2 = run_ranks(1, tiny_gpt_args(out, {"parallel.pp=2", "parallel.dp=2"}));
  require_error(dp2, {"dp x pp x tp = 2 x 2 x 1 = 4 ranks", "trainer launch --nproc-per-node 4"});
  no_zero_count(dp2);
  // A world that fits as it is named: the dp to set, as before.
  CHECK_THAT(error_of([] {
               parallel_layout(recipe_with({"parallel.pp=2", "parallel.dp=2"}), 2);
             }),
             Catch::Contains("set parallel.dp=1"));
}

TEST_CASE(
    "layout: tp = 2 pads the 73-character vocabulary to 74 rows, trains as one process, and its "
    "checkpoint evaluates, samples and resumes on one process",
    "[hardening][parallel][mp]") {
  const fs::path ref = fresh_temp_dir("layout_vocab_ref", false);
  const fs::path split = fresh_temp_dir("layout_vocab_tp2", false);
  // One process, 4 steps with a checkpoint at 2; tp = 2 for the first 2.
  const ProcessResult r1 =
      run_ranks(1, tiny_gpt_args(ref, {"training.steps=4", "training.checkpoint_every=2"}));
  INFO(r1.output);
  REQUIRE(r1.code == 0);
  const ProcessResult r2 = run_ranks(2, tiny_gpt_args(split, {"parallel.tp=2"}));
  INFO(r2.output);
  REQUIRE(r2.code == 0);
  CHECK(r2.output.find("model: vocabulary 73 padded to 74 rows for parallel.tp=2; the padded "
                       "rows are never sampled or predicted") != std::string::npos);
  const StepLog one = step_log(ref.string()), two = step_log(split.string());
  std::map<int64_t, double> first_two(one.loss.begin(), one.loss.find(3));
  check_close(first_two, two.loss, 1e-5, "loss at tp 2");

  // The checkpoint holds the padded rows, zero; the rest is one process's.
  const std::map<std::string, Tensor> padded = model_at(split.string(), 2),
                                      whole = model_at(ref.string(), 2);
  for (const char* name : {"transformer.wte.weight", "lm_head.weight"}) {
    INFO(name);
    const Tensor& t = padded.at(name);
    REQUIRE(t.shape() == Shape{74, 32});
    CHECK(t.narrow(0, 73, 1).to_vector<float>() == std::vector<float>(32, 0.0f));
    check_models({{name, whole.at(name)}}, {{name, t.narrow(0, 0, 73).contiguous()}}, 1e-5);
  }

  // Read on one process: the padding dropped.
  const ProcessResult eval = run_trainer(tiny_gpt_reader("eval", split));
  INFO(eval.output);
  REQUIRE(eval.code == 0);
  REQUIRE(two.val_loss.count(2) == 1);
  std::smatch loss;
  REQUIRE(std::regex_search(eval.output, loss, std::regex("\\): loss ([0-9.]+) \\|")));
  CHECK(std::stod(loss[1].str()) == Approx(two.val_loss.at(2)).epsilon(1e-4));
  std::vector<std::string> sample = tiny_gpt_reader("sample", split);
  sample.insert(sample.end(), {"--tokens", "64", "--temperature", "2"});
  const ProcessResult text = run_trainer(sample);
  INFO(text.output);
  CHECK(text.code == 0);

  // Resumed on one process: the steps one process takes.
  std::vector<std::string> resume = tiny_gpt_args(split, {"training.steps=4", "--resume", "auto"});
  const ProcessResult r3 = run_ranks(1, resume);
  INFO(r3.output);
  REQUIRE(r3.code == 0);
  CHECK(r3.output.find("resharded: tp 2 -> 1") != std::string::npos);
  check_close(one.loss, step_log(split.string()).loss, 1e-4, "loss resumed at tp 1");
}

TEST_CASE("layout: sampling never picks the rows past the corpus's symbols", "[hardening][lm]") {
  // model.vocab_size 200 over 73 symbols: near-uniform logits at
  // initialisation made most picks an id the vocabulary cannot decode.
  const fs::path out = fresh_temp_dir("layout_sample_rows", false);
  const ProcessResult trained =
      run_trainer(tiny_gpt_args(out, {"training.steps=1", "model.vocab_size=200"}));
  INFO(trained.output);
  REQUIRE(trained.code == 0);
  std::vector<std::string> sample = tiny_gpt_reader("sample", out);
  sample.insert(sample.end(), {"model.vocab_size=200", "--tokens", "200", "--temperature", "3"});
  const ProcessResult text = run_trainer(sample);
  INFO(text.output);
  CHECK(text.code == 0);
  CHECK(text.output.find("token id") == std::string::npos);
}

TEST_CASE("layout: micro-batches chosen for a pipeline when unset, resolved before use",
          "[hardening][parallel]") {
  auto resolved = [](std::vector<std::string> overrides, int64_t dp) {
    return resolved_micro_batches(recipe_with(overrides), dp);
  };
  // gpt_kjv's global batch is 16.
  CHECK(recipe_with({}).parallel.micro_batches == 0);
  CHECK(resolved({}, 1) == 1);
  CHECK(resolved({"parallel.pp=2"}, 1) == 4);
  CHECK(resolved({"parallel.pp=2"}, 2) == 4);
  CHECK(resolved({"parallel.pp=2"}, 8) == 2);
  CHECK(resolved({"parallel.pp=4"}, 1) == 8);
  CHECK(resolved({"parallel.pp=4", "training.global_batch=6"}, 1) == 6);
  CHECK(resolved({"parallel.pp=2", "training.global_batch=5"}, 1) == 1);
  CHECK(resolved({"parallel.pp=3", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                  "training.global_batch=12"},
                 1) == 6);
  CHECK(resolved({"parallel.pp=4", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                  "training.global_batch=12"},
                 1) == 4);
  CHECK(resolved({"parallel.pp=2", "parallel.micro_batches=3"}, 1) == 3);
  CHECK(resolved({"model.name=lstm_lm", "parallel.pp=2", "parallel.schedule=wavefront",
                  "parallel.time_chunks=4"},
                 1) == 1);
  // GPipe and 1F1B idle (pp - 1) / (M + pp - 1) of a step.
  CHECK(pipeline_bubble(recipe_with({"parallel.pp=2"}), 1) == Approx(0.5));
  CHECK(pipeline_bubble(recipe_with({"parallel.pp=4", "parallel.schedule=gpipe"}), 8) ==
        Approx(3.0 / 11));
  // The pipeline keys with pp = 1: unset or 1, as before.
  CHECK_NOTHROW(parallel_layout(recipe_with({"parallel.micro_batches=1"}), 1));
  CHECK_NOTHROW(parallel_layout(recipe_with({"parallel.micro_batches=0"}), 1));
}

TEST_CASE(
    "layout: a pipeline without parallel.micro_batches trains on a chosen count, said once, and "
    "one given fewer micro-batches than stages is warned about its bubble",
    "[hardening][parallel][mp]") {
  const fs::path out = fresh_temp_dir("layout_micro", false);
  const ProcessResult chosen =
      run_ranks(2, tiny_gpt_args(out, {"training.steps=1", "parallel.pp=2"}));
  INFO(chosen.output);
  REQUIRE(chosen.code == 0);
  CHECK(chosen.output.find("parallel.micro_batches: 4 (unset: the largest count up to 2 x pp = 4 "
                           "that divides the 16 samples of a replica's step); the 1f1b "
                           "pipeline's bubble is 20% of each step") != std::string::npos);
  CHECK(chosen.output.find("\n  micro_batches: 4\n") != std::string::npos);  // the resolved recipe
  CHECK(chosen.output.find("micro-batch 4 x micro_batches 4 per rank") != std::string::npos);
  CHECK(chosen.output.find("warning: parallel.micro_batches") == std::string::npos);
  CHECK(read_file((out / "recipe.yaml").string()).find("micro_batches: 4") != std::string::npos);

  const ProcessResult one =
      run_ranks(1, tiny_gpt_args(out, {"parallel.pp=2", "parallel.micro_batches=1", "--dry-run"}));
  INFO(one.output);
  REQUIRE(one.code == 0);
  CHECK(one.output.find("warning: parallel.micro_batches = 1 with parallel.pp = 2: the stages "
                        "idle 50% of each step") != std::string::npos);
  CHECK(one.output.find("parallel.micro_batches: ") == std::string::npos);
  const ProcessResult enough =
      run_ranks(1, tiny_gpt_args(out, {"parallel.pp=2", "parallel.micro_batches=2", "--dry-run"}));
  INFO(enough.output);
  REQUIRE(enough.code == 0);
  CHECK(enough.output.find("warning: parallel.micro_batches") == std::string::npos);
}

TEST_CASE(
    "layout: checkpoints of the earlier formats (one process, ZeRO-1 shards, tp gathered, tp "
    "with ZeRO-1, pipeline parts) resume on one process as the steps one process takes",
    "[hardening][checkpoint]") {
  // tests/data/legacy_checkpoints: step 2 of the same run on five layouts,
  // written before every layout wrote its pieces (README.md there).
  const fs::path fixtures = fs::path(TRAINER_SOURCE_DIR) / "tests/data/legacy_checkpoints";
  const std::vector<std::string> small{"model.d_model=16",        "model.context=16",
                                       "data.seq_len=16",         "data.val_windows=4",
                                       "training.global_batch=8", "training.checkpoint_every=1"};
  auto args = [&](const fs::path& out, std::vector<std::string> extra) {
    extra.insert(extra.begin(), small.begin(), small.end());
    return tiny_gpt_args(out, extra);
  };
  const fs::path ref = fresh_temp_dir("legacy_ref", false);
  const ProcessResult r = run_ranks(1, args(ref, {"training.steps=3"}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  const std::map<std::string, Tensor> at2 = model_at(ref.string(), 2),
                                      at3 = model_at(ref.string(), 3);
  for (const char* kind : {"single", "dp2_zero1", "tp2", "tp2_dp2_zero1", "pp2"}) {
    INFO(kind);
    const fs::path run = fresh_temp_dir(std::string("legacy_") + kind, false);
    fs::create_directories(run / "checkpoints");
    fs::copy(fixtures / kind, run / "checkpoints" / "step_00000002");
    write_file_atomic((run / "checkpoints" / "latest").string(), "step_00000002\n");
    // Read as it is: the model of step 2 (the tp layouts' vocabulary padded
    // to 74 rows; the padding is zero and dropped on load).
    std::map<std::string, Tensor> saved = model_at(run.string(), 2);
    for (auto& [name, t] : saved)
      if (t.dim() == 2 && t.size(0) == 74) t = t.narrow(0, 0, 73).contiguous();
    check_models(at2, saved, 1e-5);
    // Resumed: step 3 as one process takes it from step 2 (the optimizer
    // state of step 2 read too: Adam's third step from a lost state would
    // move each weight by about the learning rate).
    const ProcessResult resumed = run_ranks(1, args(run, {"training.steps=3", "--resume", "auto"}));
    INFO(resumed.output);
    REQUIRE(resumed.code == 0);
    check_models(at3, model_at(run.string(), 3), 1e-5);
    CHECK(has_pieces((run / "checkpoints" / "step_00000003").string(), "model"));
  }
}

TEST_CASE(
    "layout: a tp = 2 checkpoint is described and verified by `checkpoint info`, exported as "
    "one file of whole tensors, and found from its run, folder or pointer file",
    "[hardening][checkpoint][mp]") {
  const fs::path run = fresh_temp_dir("layout_export", false);
  const ProcessResult r = run_ranks(2, tiny_gpt_args(run, {"parallel.tp=2"}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  const fs::path step = run / "checkpoints" / "step_00000002";
  // Every rank wrote its own parts: no gather.
  CHECK(fs::exists(pieces_file(step.string(), "model", 0)));
  CHECK(fs::exists(pieces_file(step.string(), "model", 1)));
  for (const std::string& given : {run.string(), (run / "checkpoints").string(),
                                   (run / "checkpoints" / "latest").string(), step.string()})
    CHECK(find_checkpoint(given, "--checkpoint") == step.string());
  CHECK_THAT(error_of([&] { find_checkpoint((run / "metrics.jsonl").string(), "--checkpoint"); }),
             Catch::Contains("names no complete checkpoint beside it"));
  CHECK_THAT(error_of([&] { find_checkpoint((run / "nothing").string(), "--resume"); }),
             Catch::Contains("--resume " + (run / "nothing").string() +
                             ": not a complete checkpoint: no such file or directory"));

  const ProcessResult info = run_trainer({"checkpoint", "info", run.string()});
  INFO(info.output);
  CHECK(info.code == 0);
  for (const char* line :
       {"step 2, epoch 0", "layout: world 2 (dp=1, pp=1, tp=2)", "model-rank00001.safetensors",
        "transformer.h.0.attn.c_attn.weight  [96, 32] f32  2 pieces", "lm_head.weight  [74, 32]",
        "verified: every file whole, every tensor's pieces cover it once, the index matches the "
        "files, all values finite"})
    CHECK(info.output.find(line) != std::string::npos);

  // The index maps each tensor to its pieces: file, bytes, boxes.
  const std::string index_path = checkpoint_index_file(step.string());
  const nlohmann::json index = nlohmann::json::parse(read_file(index_path));
  const nlohmann::json& qkv = index["model"]["transformer.h.0.attn.c_attn.weight"];
  CHECK(qkv["shape"] == nlohmann::json({96, 32}));
  REQUIRE(qkv["pieces"].size() == 2);
  for (const nlohmann::json& piece : qkv["pieces"]) {
    const std::string file = (step / piece["file"].get<std::string>()).string();
    bool found = false;
    for (const SafetensorsEntry& e : read_safetensors_header(file).entries)
      if (e.name == piece["key"].get<std::string>()) {
        found = true;
        CHECK(piece["offsets"] == nlohmann::json({e.begin, e.end}));
        CHECK(e.shape == Shape{48, 32});
      }
    CHECK(found);
    CHECK(piece["boxes"].size() == 3);  // its heads' q, k and v rows
  }
  CHECK(index["files"].contains("optimizer-rank00001.safetensors"));
  // An index that does not describe the files is named.
  nlohmann::json wrong = index;
  wrong["model"]["lm_head.weight"]["pieces"][0]["offsets"][0] = 1;
  write_file_atomic(index_path, wrong.dump());
  const ProcessResult stale = run_trainer({"checkpoint", "info", step.string()});
  CHECK(stale.code == 1);
  CHECK(stale.output.find(index_path + ": model 'lm_head.weight' is not what the checkpoint's "
                                       "files hold") != std::string::npos);
  write_file_atomic(index_path, index.dump());

  // Exported in bf16 from the pointer file: PyTorch's names and shapes (the
  // padded row cut), each tensor the checkpoint's.
  const fs::path out = run / "gpt.safetensors";
  const ProcessResult exported = run_trainer({"export", (run / "checkpoints" / "latest").string(),
                                              "--out", out.string(), "--dtype", "bf16"});
  INFO(exported.output);
  REQUIRE(exported.code == 0);
  const std::map<std::string, Tensor> saved = model_at(run.string(), 2);
  const SafetensorsFile file = read_safetensors(out.string());
  CHECK(file.tensors.size() == saved.size());
  for (const auto& [name, t] : file.tensors) {
    INFO(name);
    CHECK(t.dtype() == DType::bf16);
    Tensor whole = saved.at(name);
    if (whole.size(0) == 74) whole = whole.narrow(0, 0, 73).contiguous();
    REQUIRE(t.shape() == whole.shape());
    CHECK(t.to(DType::f32).to_vector<float>() ==
          whole.to(DType::bf16).to(DType::f32).to_vector<float>());
  }
  // A corrupt file is named by `checkpoint info`.
  write_file_atomic(pieces_file(step.string(), "optimizer", 1), "junk");
  const ProcessResult bad = run_trainer({"checkpoint", "info", step.string()});
  CHECK(bad.code == 1);
  CHECK(bad.output.find(pieces_file(step.string(), "optimizer", 1)) != std::string::npos);
}
