// Pipeline parallelism: the plan of a split (which tensors travel between
// which pieces, long skips sent straight to their consumer), the splits
// themselves, and the trainer run as pipeline stages under `trainer launch`
// against one process with gradient accumulation over the same micro-batches.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "core/ops.h"
#include "layers/linear.h"
#include "parallel/pipeline.h"
#include "tests/runs.h"  // last: it brings Catch's CHECK
#include "trainer/safetensors.h"

namespace fs = std::filesystem;
using namespace trainer;
using namespace trainer::parallel;
using namespace trainer::testing;

namespace {

// Five blocks over x; block "save" publishes a skip that block "use" reads.
BlockList skip_blocks(std::shared_ptr<Module> m) {
  auto same = [](const TensorList& in) { return TensorList{in[0]}; };
  std::vector<BlockSpec> specs;
  specs.push_back({.name = "b0", .members = {{"l0", m}}, .fn = same});
  specs.push_back({.name = "save", .outputs = {"x", "skip"}, .fn = [](const TensorList& in) {
                     return TensorList{in[0], in[0]};
                   }});
  specs.push_back({.name = "b2", .fn = same});
  specs.push_back({.name = "b3", .fn = same});
  specs.push_back({.name = "use", .inputs = {"x", "skip"}, .fn = [](const TensorList& in) {
                     return TensorList{in[0] + in[1]};
                   }});
  return BlockList({"x"}, {"x"}, std::move(specs));
}

std::string run_dir(const std::string& name) {
  return testing::fresh_temp_dir("pp_" + name, false).string();
}

std::vector<std::string> trainer_args(const std::string& recipe, const std::string& out,
                                      std::vector<std::string> extra) {
  std::vector<std::string> a{"train",
                             std::string(TRAINER_SOURCE_DIR) + "/recipes/" + recipe,
                             "output_dir=" + out,
                             "training.threads=1",
                             "data.workers=1",
                             "training.log_every=2"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// pp = P with M micro-batches against pp = 1 with grad_accum = M, and
// their evaluations (the pipeline's runs stage by stage, on batches padded
// to the micro-batch size); returns the pipeline run's output.
std::string check_pipeline_matches(const std::string& recipe, std::vector<std::string> common,
                                   int pp, int micro_batches, const std::string& schedule,
                                   int steps, double tolerance = 0, int chunks = 1) {
  const std::string tag = cat(fs::path(recipe).stem().string(), "_pp", pp, "_", schedule);
  common.push_back(cat("training.steps=", steps));
  std::vector<std::string> one = common, piped = common;
  one.push_back(cat("training.grad_accum=", micro_batches));
  piped.insert(piped.end(),
               {cat("parallel.pp=", pp), cat("parallel.micro_batches=", micro_batches),
                "parallel.schedule=" + schedule, cat("parallel.virtual_stages=", chunks)});
  const std::string a = run_dir(tag + "_ref"), b = run_dir(tag);
  testing::ProcessResult ra = run_ranks(1, trainer_args(recipe, a, one));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  testing::ProcessResult rb = run_ranks(pp, trainer_args(recipe, b, piped));
  INFO(rb.output);
  REQUIRE(rb.code == 0);
  CHECK(rb.output.find(cat("pp=", pp)) != std::string::npos);
  check_models(model_at(a, steps), model_at(b, steps), tolerance);
  const StepLog expected = step_log(a), got = step_log(b);
  check_close(expected.val_loss, got.val_loss, tolerance > 0 ? 1e-4 : 1e-5, "evaluation loss");
  if (!expected.val_top1.empty()) check_close(expected.val_top1, got.val_top1, 0, "top-1");
  return rb.output;
}

}  // namespace

TEST_CASE(
    "pipeline plan: tensors travel to the pieces that read them, a skip straight to its "
    "consumer",
    "[parallel]") {
  Generator gen(0);
  BlockList blocks = skip_blocks(std::make_shared<Linear>(2, 2, gen));
  // Pieces [0, 2) [2, 3) [3, 5): the skip written in piece 0 is read in piece 2.
  PipelinePlan plan(blocks, split_at(blocks.size(), 3, 1, {2, 3}));
  std::vector<std::string> seen;
  for (const Transfer& t : plan.transfers()) seen.push_back(cat(t.name, ":", t.from, "->", t.to));
  CHECK(seen == std::vector<std::string>{"x:0->1", "x:1->2", "skip:0->2"});
  // Piece 1 passes nothing on for the skip: it is absent there.
  const Piece& middle = plan.piece(1);
  REQUIRE(blocks.boundary(2).size() == 2);
  CHECK(middle.input_source[1] == Piece::kAbsent);
  CHECK(plan.piece(0).sends == std::vector<int>{0, 2});
  CHECK(plan.piece(2).receives == std::vector<int>{1, 2});
  CHECK(plan.piece(2).output_kept == std::vector<bool>{true});
  CHECK(plan.piece(0).input_source == std::vector<int>{Piece::kModelInput});
  // Running the pieces one after the other, handing the transfers over,
  // gives the whole model's result.
  Tensor x = uniform({3, 2}, -1.0, 1.0, gen);
  TensorList out0 = blocks.run(0, 2, {x});
  TensorList in1 = {out0[0], Tensor()};
  TensorList out1 = blocks.run(2, 3, in1);
  TensorList out2 = blocks.run(3, 5, {out1[0], out0[1]});
  CHECK(out2[0].to_vector<float>() == blocks.run({x})[0].to_vector<float>());
  // The stage modules name the parameters globally.
  StageModule first(blocks, plan.blocks_of_stage(0));
  REQUIRE(first.named_parameters().size() == 2);
  CHECK(first.named_parameters()[0].name == "l0.weight");
  CHECK(StageModule(blocks, plan.blocks_of_stage(1)).named_parameters().empty());
}

TEST_CASE("pipeline splits: even, at given blocks, balanced by cost within memory", "[parallel]") {
  CHECK(to_string(even_split(9, 3, 1)) == "[0, 3) [3, 6) [6, 9)");
  CHECK(to_string(even_split(5, 2, 1)) == "[0, 3) [3, 5)");
  CHECK(to_string(even_split(8, 2, 2)) == "[0, 2) [2, 4) [4, 6) [6, 8)");
  CHECK(to_string(split_at(9, 3, 1, {2, 7})) == "[0, 2) [2, 7) [7, 9)");
  CHECK_THROWS_WITH(split_at(9, 3, 1, {2}), Catch::Contains("3 pieces need 2"));
  CHECK_THROWS_WITH(split_at(9, 3, 1, {5, 5}), Catch::Contains("boundary 5"));
  CHECK_THROWS_WITH(even_split(3, 4, 1), Catch::Contains("fewer than the 4"));
  // Costs 1 1 1 1 4: the heavy block alone.
  CHECK(to_string(balanced_split({1, 1, 1, 1, 4}, {0, 0, 0, 0, 0}, 0, 2, 1)) == "[0, 4) [4, 5)");
  CHECK(to_string(balanced_split({1, 2, 3, 4, 5, 6}, std::vector<double>(6, 0), 0, 3, 1)) ==
        "[0, 3) [3, 5) [5, 6)");
  // Memory 5 per block, 10 per stage: no piece of three blocks.
  CHECK(to_string(balanced_split({1, 1, 1, 9}, {5, 5, 5, 5}, 10, 2, 1)) == "[0, 2) [2, 4)");
  CHECK_THROWS_WITH(balanced_split({1, 1, 1}, {5, 5, 5}, 4, 2, 1), Catch::Contains("memory limit"));
}

TEST_CASE(
    "pipeline: an MLP on 2 stages trains bit for bit as gradient accumulation, every "
    "schedule",
    "[parallel][mp]") {
  // Evaluations after steps 2 and 4; the last of their batches of 8 holds
  // one image (1001 of them), padded to 8 between the stages.
  const std::vector<std::string> common = {"training.global_batch=32", "optimizer.name=sgd",
                                           "optimizer.lr=0.05",        "optimizer.momentum=0.9",
                                           "training.eval_every=2",    "data.val_samples=1001"};
  for (const char* schedule : {"gpipe", "1f1b", "zbh1"}) {
    SECTION(schedule) { check_pipeline_matches("fmnist_mlp.yaml", common, 2, 4, schedule, 4); }
  }
}

TEST_CASE(
    "pipeline: a small CNN on 4 stages, and on 2 stages interleaved, matches "
    "gradient accumulation bit for bit",
    "[parallel][mp]") {
  const std::vector<std::string> common = {"training.global_batch=32", "optimizer.lr=0.05",
                                           "optimizer.clip_grad_norm=1.0"};
  SECTION("1f1b, pp 4") { check_pipeline_matches("fmnist_cnn.yaml", common, 4, 4, "1f1b", 3); }
  SECTION("interleaved, pp 2 x 2 chunks") {
    check_pipeline_matches("fmnist_cnn.yaml", common, 2, 4, "interleaved", 3, 0, 2);
  }
}

TEST_CASE(
    "pipeline: GPT with its embedding tied across 2 stages, and the LSTM LM, match "
    "gradient accumulation",
    "[parallel][mp]") {
  const std::string corpus = "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt";
  const std::vector<std::string> gpt = {corpus,
                                        "training.global_batch=8",
                                        "model.n_layer=2",
                                        "model.d_model=32",
                                        "model.n_head=2",
                                        "model.context=32",
                                        "data.seq_len=32",
                                        "data.val_windows=10",
                                        "optimizer.clip_grad_norm=1.0"};
  // The tied weight's two gradients add in another order than in one process.
  SECTION("gpt, 1f1b") { check_pipeline_matches("gpt_kjv.yaml", gpt, 2, 2, "1f1b", 3, 1e-5); }
  SECTION("gpt, zbh1") { check_pipeline_matches("gpt_kjv.yaml", gpt, 2, 4, "zbh1", 2, 1e-5); }
  const std::vector<std::string> lstm = {corpus,
                                         "training.global_batch=8",
                                         "model.hidden=32",
                                         "model.d_model=32",
                                         "data.seq_len=16",
                                         "model.dropout=0",
                                         "model.tie_weights=false"};
  SECTION("lstm_lm, gpipe") { check_pipeline_matches("lstm_kjv.yaml", lstm, 2, 2, "gpipe", 3); }
  SECTION("lstm_lm, zbh1") { check_pipeline_matches("lstm_kjv.yaml", lstm, 2, 2, "zbh1", 2); }
  // Its decoder tied to the embedding on the first stage, as GPT's head.
  std::vector<std::string> tied = lstm;
  tied.back() = "model.tie_weights=true";
  SECTION("lstm_lm tied, 1f1b") {
    check_pipeline_matches("lstm_kjv.yaml", tied, 2, 2, "1f1b", 3, 1e-5);
  }
}

// The LSTM LM with a layer per stage, each step's windows cut into time
// chunks that flow through the layers as a wavefront, carrying every
// layer's state from chunk to chunk and (contiguous streams) from batch to
// batch. The chunk losses are averaged in another order than one process's
// mean over the whole window, so the two agree within float tolerance.
std::vector<std::string> wavefront_args(int layers, std::vector<std::string> extra) {
  std::vector<std::string> a = {
      "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
      "training.global_batch=4",
      "training.log_every=1",
      "training.eval_every=0",
      cat("model.n_layer=", layers),
      "model.hidden=32",
      "model.d_model=32",
      "model.dropout=0",
      "model.tie_weights=false",
      "data.seq_len=32",
      "data.sampling=contiguous",
      "data.val_windows=8",
      "optimizer.name=sgd",
      "optimizer.lr=1.0",
      "optimizer.momentum=0.9",
      "optimizer.clip_grad_norm=0.5",
      "schedule.name=constant",
      "schedule.warmup_steps=0"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

TEST_CASE(
    "pipeline: the LSTM LM as a wavefront over time chunks, a layer per stage, trains as "
    "one process",
    "[parallel][mp]") {
  struct Layout {
    int layers, chunks;
  };
  for (Layout l : {Layout{2, 4}, Layout{4, 8}}) {
    DYNAMIC_SECTION(l.layers << " layers on " << l.layers << " stages, " << l.chunks
                             << " time chunks") {
      const std::vector<std::string> common =
          wavefront_args(l.layers, {"training.steps=50", "training.checkpoint_every=50"});
      const std::string a = run_dir(cat("wave_ref", l.layers)), b = run_dir(cat("wave", l.layers));
      testing::ProcessResult ra = run_ranks(1, trainer_args("lstm_kjv.yaml", a, common));
      INFO(ra.output);
      REQUIRE(ra.code == 0);
      std::vector<std::string> piped = common;
      piped.insert(piped.end(), {cat("parallel.pp=", l.layers), "parallel.schedule=wavefront",
                                 cat("parallel.time_chunks=", l.chunks)});
      testing::ProcessResult rb = run_ranks(l.layers, trainer_args("lstm_kjv.yaml", b, piped));
      INFO(rb.output);
      REQUIRE(rb.code == 0);
      CHECK(rb.output.find(cat("pp=", l.layers)) != std::string::npos);
      const StepLog expected = step_log(a), got = step_log(b);
      REQUIRE(expected.loss.size() == 50);
      check_close(expected.loss, got.loss, 1e-5, "loss");
      check_close(expected.grad_norm, got.grad_norm, 1e-4, "gradient norm");
      check_models(model_at(a, 50), model_at(b, 50), 1e-5);
      // The final evaluation's streams carry each layer's state on its stage
      // (not carrying it: 4e-5 to 1.4e-4 off).
      check_close(expected.val_loss, got.val_loss, 1e-6, "evaluation loss");
    }
  }
}

TEST_CASE("pipeline: a wavefront run resumes bit for bit with every stage's carried state",
          "[parallel][mp]") {
  const std::vector<std::string> piped =
      wavefront_args(2, {"training.steps=6", "training.checkpoint_every=2", "parallel.pp=2",
                         "parallel.schedule=wavefront", "parallel.time_chunks=4"});
  const std::string a = run_dir("wave_resume_ref"), b = run_dir("wave_resume");
  testing::ProcessResult ra = run_ranks(2, trainer_args("lstm_kjv.yaml", a, piped));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  // Resumed from a copy of step 2's checkpoint (stopping a run this short
  // at a given step races with it).
  fs::create_directories(b + "/checkpoints");
  fs::copy(a + "/checkpoints/" + CheckpointDir::step_name(2),
           b + "/checkpoints/" + CheckpointDir::step_name(2), fs::copy_options::recursive);
  std::vector<std::string> resumed = trainer_args("lstm_kjv.yaml", b, piped);
  resumed.push_back("--resume=auto");
  testing::ProcessResult rb2 = run_ranks(2, resumed);
  INFO(rb2.output);
  REQUIRE(rb2.code == 0);
  CHECK(std::regex_search(rb2.output, std::regex("resumed from \\S+ at step 2 ")));
  check_models(model_at(a, 6), model_at(b, 6));
  // Each stage saved its own layer's state, and it is not zeros.
  const std::string step2 = a + "/checkpoints/" + CheckpointDir::step_name(2);
  for (int rank : {0, 1}) {
    SafetensorsFile f = read_safetensors(cat(step2, "/stream_state.rank", rank, ".safetensors"));
    INFO("rank " << rank);
    REQUIRE(f.tensors.count(cat("h", rank)) == 1);
    CHECK(f.tensors.count(cat("h", 1 - rank)) == 0);
    CHECK(f.tensors.at(cat("c", rank)).shape() == Shape{4, 32});
    double sum = 0;
    for (float v : f.tensors.at(cat("c", rank)).to_vector<float>()) sum += std::fabs(v);
    CHECK(sum > 0.1);
  }
}

TEST_CASE("pipeline: the wavefront's keys are checked against each other and the model",
          "[parallel]") {
  auto error_of = [](const std::string& recipe, std::vector<std::string> extra) {
    extra.push_back("--dry-run");
    testing::ProcessResult r =
        run_ranks(1, trainer_args(recipe, run_dir("wave_errors"), wavefront_args(2, extra)));
    CHECK(r.code == 1);
    return r.output;
  };
  CHECK(error_of("gpt_kjv.yaml", {"model.name=gpt", "parallel.pp=2", "parallel.schedule=wavefront",
                                  "parallel.time_chunks=4"})
            .find("gpt needs whole sequences") != std::string::npos);
  CHECK(error_of("lstm_kjv.yaml", {"parallel.pp=2", "parallel.time_chunks=4"})
            .find("needs all three") != std::string::npos);
  CHECK(error_of("lstm_kjv.yaml",
                 {"parallel.pp=2", "parallel.schedule=wavefront", "parallel.time_chunks=5"})
            .find("use a divisor of 32") != std::string::npos);
  CHECK(error_of("lstm_kjv.yaml", {"parallel.pp=2", "parallel.schedule=wavefront",
                                   "parallel.time_chunks=4", "parallel.micro_batches=2"})
            .find("set parallel.micro_batches=1") != std::string::npos);
  CHECK(error_of("lstm_kjv.yaml", {"parallel.tp=2"})
            .find("parallel.pp=2 parallel.schedule=wavefront") != std::string::npos);
}

TEST_CASE("pipeline: a checkpoint of 2 stages resumes bit for bit, and loads into one process",
          "[parallel][mp]") {
  const std::vector<std::string> common = {"training.global_batch=32", "optimizer.name=adamw",
                                           "optimizer.lr=0.001", "training.checkpoint_every=2",
                                           "training.log_every=1"};
  std::vector<std::string> piped = common, one = common;
  piped.insert(piped.end(), {"parallel.pp=2", "parallel.micro_batches=2", "training.steps=6"});
  one.insert(one.end(), {"training.grad_accum=2", "training.steps=6"});
  const std::string a = run_dir("resume_ref"), b = run_dir("resume");
  // Uninterrupted, pp = 2.
  testing::ProcessResult ra = run_ranks(2, trainer_args("fmnist_mlp.yaml", a, piped));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  // Resumed under pp = 2 from step 2's checkpoint (a copy: stopping a run
  // this short at a given step races with it): the same bits.
  fs::create_directories(b + "/checkpoints");
  fs::copy(a + "/checkpoints/" + CheckpointDir::step_name(2),
           b + "/checkpoints/" + CheckpointDir::step_name(2), fs::copy_options::recursive);
  std::vector<std::string> resumed = trainer_args("fmnist_mlp.yaml", b, piped);
  resumed.push_back("--resume=auto");
  testing::ProcessResult rb2 = run_ranks(2, resumed);
  INFO(rb2.output);
  REQUIRE(rb2.code == 0);
  CHECK(std::regex_search(rb2.output, std::regex("resumed from \\S+ at step 2 ")));
  check_models(model_at(a, 6), model_at(b, 6));
  // Step 2 of the pipeline run, continued by one process with grad_accum 2.
  const std::string c = run_dir("resume_one");
  fs::create_directories(c + "/checkpoints");
  fs::copy(a + "/checkpoints/" + CheckpointDir::step_name(2),
           c + "/checkpoints/" + CheckpointDir::step_name(2), fs::copy_options::recursive);
  std::vector<std::string> cont = trainer_args("fmnist_mlp.yaml", c, one);
  cont.push_back("--resume=auto");
  testing::ProcessResult rc = run_ranks(1, cont);
  INFO(rc.output);
  REQUIRE(rc.code == 0);
  check_models(model_at(a, 6), model_at(c, 6));
  // trainer eval reads the stages' parts as one model.
  testing::ProcessResult re = run_process(
      {TRAINER_BINARY, "eval", std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_mlp.yaml",
       "data.workers=1", "--checkpoint", a + "/checkpoints"},
      {.timeout_s = 120});
  INFO(re.output);
  CHECK(re.code == 0);
  CHECK(re.output.find("top1") != std::string::npos);
}

TEST_CASE("pipeline: fp16 stages skip the same overflowing steps as one process, bit for bit",
          "[parallel][mp]") {
  // An initial scale that overflows the first steps' gradients somewhere:
  // every stage must skip them (the ranks agree), and S backs off alike.
  const std::string out = check_pipeline_matches(
      "fmnist_mlp.yaml",
      {"training.global_batch=32", "optimizer.name=sgd", "optimizer.lr=0.05", "precision=fp16",
       "loss_scaler.init_scale=1e7", "training.checkpoint_every=8"},
      2, 2, "1f1b", 8);
  CHECK(out.find("loss scale 312500 (5 steps skipped)") != std::string::npos);
}

TEST_CASE("pipeline: dp 2 x pp 2 trains as dp 2 with gradient accumulation", "[parallel][mp]") {
  const std::vector<std::string> common = {"training.global_batch=32", "optimizer.name=sgd",
                                           "optimizer.lr=0.05", "training.steps=3"};
  std::vector<std::string> dp = common, dppp = common;
  dp.push_back("training.grad_accum=2");
  dppp.insert(dppp.end(), {"parallel.pp=2", "parallel.dp=2", "parallel.micro_batches=2"});
  const std::string a = run_dir("dp_ref"), b = run_dir("dp_pp");
  testing::ProcessResult ra = run_ranks(2, trainer_args("fmnist_mlp.yaml", a, dp));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  testing::ProcessResult rb = run_ranks(4, trainer_args("fmnist_mlp.yaml", b, dppp));
  INFO(rb.output);
  REQUIRE(rb.code == 0);
  CHECK(rb.output.find("dp=2, pp=2") != std::string::npos);
  check_models(model_at(a, 3), model_at(b, 3), 1e-6);
}

TEST_CASE("pipeline: --dry-run prints each stage, bad splits and keys are errors", "[parallel]") {
  testing::ProcessResult r = run_ranks(1, trainer_args("fmnist_cnn.yaml", run_dir("dry"),
                                                       {"parallel.pp=2", "parallel.micro_batches=2",
                                                        "parallel.stages=auto", "--dry-run"}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("stage 0: conv1") != std::string::npos);
  CHECK(r.output.find("stage 1:") != std::string::npos);
  CHECK(r.output.find("predicted") != std::string::npos);
  testing::ProcessResult bad =
      run_ranks(1, trainer_args("fmnist_cnn.yaml", run_dir("dry_bad"),
                                {"parallel.pp=2", "parallel.stages=[9]", "--dry-run"}));
  CHECK(bad.code == 1);
  CHECK(bad.output.find("parallel.stages: boundary 9") != std::string::npos);
  testing::ProcessResult accum =
      run_ranks(1, trainer_args("fmnist_cnn.yaml", run_dir("dry_accum"),
                                {"parallel.pp=2", "training.grad_accum=2", "--dry-run"}));
  CHECK(accum.code == 1);
  CHECK(accum.output.find("parallel.micro_batches=2") != std::string::npos);
}

TEST_CASE("pipeline: ResNet-18 on 2 and 4 stages matches gradient accumulation bit for bit",
          "[parallel][mp]") {
  const std::vector<std::string> common = {"model.name=resnet18_small", "model.in_channels=1",
                                           "training.global_batch=8", "optimizer.lr=0.05",
                                           "data.val_samples=64"};
  SECTION("1f1b, pp 2") {
    // data.val_samples: the evaluation reads the first 64 test images only.
    const std::string out = check_pipeline_matches("fmnist_cnn.yaml", common, 2, 2, "1f1b", 2);
    CHECK(out.find("| 64 samples in") != std::string::npos);
  }
  SECTION("gpipe, pp 4") { check_pipeline_matches("fmnist_cnn.yaml", common, 4, 4, "gpipe", 2); }
}

TEST_CASE(
    "pipeline: dp 2 x pp 2 with ZeRO-1 (with and without clipping) and with "
    "SyncBatchNorm trains as dp 2",
    "[parallel][mp]") {
  for (const char* extra :
       {"parallel.zero1=true", "parallel.sync_bn=true", "optimizer.clip_grad_norm=0.5"}) {
    SECTION(extra) {
      std::vector<std::string> common = {"training.global_batch=32", "optimizer.name=sgd",
                                         "optimizer.momentum=0.9",   "optimizer.lr=0.05",
                                         "training.steps=3",         extra};
      // Clipping under ZeRO-1: the norm sums over the shards and the stages.
      if (std::string(extra).starts_with("optimizer.")) common.push_back("parallel.zero1=true");
      std::vector<std::string> dp = common, dppp = common;
      dp.push_back("training.grad_accum=2");
      dppp.insert(dppp.end(), {"parallel.pp=2", "parallel.dp=2", "parallel.micro_batches=2"});
      const std::string tag = std::string(extra).substr(10, 4);
      const std::string a = run_dir("dp_ref_" + tag), b = run_dir("dp_pp_" + tag);
      testing::ProcessResult ra = run_ranks(2, trainer_args("fmnist_cnn.yaml", a, dp));
      INFO(ra.output);
      REQUIRE(ra.code == 0);
      testing::ProcessResult rb = run_ranks(4, trainer_args("fmnist_cnn.yaml", b, dppp));
      INFO(rb.output);
      REQUIRE(rb.code == 0);
      check_models(model_at(a, 3), model_at(b, 3), 1e-6);
    }
  }
}

TEST_CASE(
    "pipeline: GPT tied across 2 stages with ZeRO-1 on dp 2 trains as without it, and resumes "
    "bit for bit",
    "[parallel][mp]") {
  // The embedding (stage 0) and the head (stage 1) share one weight: each
  // stage's ZeRO-1 shard of its gradient adds the other stage's shard of the
  // same elements, the norm counts it once, and its optimizer state is saved
  // by stage 0 and loaded by both.
  const std::vector<std::string> common = {
      "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
      "training.global_batch=8",
      "model.n_layer=2",
      "model.d_model=32",
      "model.n_head=2",
      "model.context=32",
      "data.seq_len=32",
      "optimizer.name=adamw",
      "optimizer.lr=0.003",
      "optimizer.clip_grad_norm=0.5",
      "training.steps=6",
      "training.checkpoint_every=2",
      "training.log_every=1",
      "parallel.pp=2",
      "parallel.dp=2",
      "parallel.micro_batches=2"};
  std::vector<std::string> plain = common, sharded = common;
  sharded.push_back("parallel.zero1=true");
  const std::string a = run_dir("tied_plain"), b = run_dir("tied_zero1"),
                    c = run_dir("tied_zero1_resumed");
  testing::ProcessResult ra = run_ranks(4, trainer_args("gpt_kjv.yaml", a, plain));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  testing::ProcessResult rb = run_ranks(4, trainer_args("gpt_kjv.yaml", b, sharded));
  INFO(rb.output);
  REQUIRE(rb.code == 0);
  CHECK(rb.output.find(", zero1), 1 CPU threads per rank") != std::string::npos);
  // Reduce-scatter against allreduce: the averages round alike or within an ulp.
  check_models(model_at(a, 6), model_at(b, 6), 1e-5);
  // Resumed from a copy of b's step 2 checkpoint: the same bits as b.
  fs::create_directories(c + "/checkpoints");
  fs::copy(b + "/checkpoints/" + CheckpointDir::step_name(2),
           c + "/checkpoints/" + CheckpointDir::step_name(2), fs::copy_options::recursive);
  std::vector<std::string> resumed = trainer_args("gpt_kjv.yaml", c, sharded);
  resumed.push_back("--resume=auto");
  testing::ProcessResult rc2 = run_ranks(4, resumed);
  INFO(rc2.output);
  REQUIRE(rc2.code == 0);
  CHECK(std::regex_search(rc2.output, std::regex("resumed from \\S+ at step 2 ")));
  check_models(model_at(b, 6), model_at(c, 6));
}

TEST_CASE("pipeline: the trace shows every stage's actions, messages and gradient sync",
          "[parallel][mp]") {
  const std::string out = run_dir("trace");
  testing::ProcessResult r = run_ranks(
      2, trainer_args("fmnist_mlp.yaml", out,
                      {"parallel.pp=2", "parallel.micro_batches=2", "parallel.schedule=zbh1",
                       "training.steps=2", "training.global_batch=32", "--trace"}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  std::ifstream in(out + "/trace.json");
  REQUIRE(in.good());
  const nlohmann::json trace = nlohmann::json::parse(in);
  const nlohmann::json& events = trace.is_array() ? trace : trace.at("traceEvents");
  std::map<int, std::set<std::string>> names;  // per rank (pid)
  for (const nlohmann::json& e : events)
    if (e.value("ph", "") == "X")
      names[e.at("pid").get<int>()].insert(e.at("name").get<std::string>());
  REQUIRE(names.size() == 2);
  const std::set<std::string>& first = names.begin()->second;
  const std::set<std::string>& last = names.rbegin()->second;
  for (const char* n : {"F0", "F1", "I0", "W1", "sendA0", "recvG1", "grad sync"}) {
    INFO(n);
    CHECK(first.count(n) == 1);
  }
  for (const char* n : {"F0", "I1", "W0", "recvA1", "sendG0", "grad sync"}) {
    INFO(n);
    CHECK(last.count(n) == 1);
  }
}
