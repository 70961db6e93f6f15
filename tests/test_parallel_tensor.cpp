// Tensor parallelism in the trainer: GPT split over tp = 2 and 4 ranks
// (with and without sequence parallelism) against one process, dp x tp and
// pp x tp,
// checkpoints that resume bit for bit and load at another tp, and the
// errors of layouts that do not divide (a vocabulary is padded instead).
// The ops themselves are checked in double by test_parallel_tensor_ops.
//
// Why tolerances and not bits: a row-parallel layer sums its partial
// products over the ranks, so the additions happen in another order than
// one process's GEMM. The losses of a step agree to ~1e-6 relative; over 50
// SGD steps the weights drift apart by a few float ulps per step.
#include <filesystem>
#include <regex>

#include "tests/runs.h"  // last: it brings Catch's CHECK

namespace fs = std::filesystem;
using namespace trainer;
using namespace trainer::testing;

namespace {

std::string run_dir(const std::string& name) {
  return testing::fresh_temp_dir("tp_" + name, false).string();
}

// A small GPT on the KJV characters: 2 layers, 4 heads of 16, context 32;
// the vocabulary padded to 76 (the corpus has 73 symbols) so that tp = 4
// divides it.
std::vector<std::string> gpt_args(const std::string& out, std::vector<std::string> extra) {
  std::vector<std::string> a{"train",
                             std::string(TRAINER_SOURCE_DIR) + "/recipes/gpt_kjv.yaml",
                             "output_dir=" + out,
                             "training.threads=1",
                             "training.log_every=1",
                             "training.eval_every=0",
                             "training.checkpoint_every=0",
                             "training.global_batch=8",
                             "model.n_layer=2",
                             "model.n_head=4",
                             "model.d_model=64",
                             "model.context=32",
                             "model.vocab_size=76",
                             "data.seq_len=32",
                             "data.val_windows=16",
                             "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
                             "schedule.warmup_steps=0"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

}  // namespace

TEST_CASE("tensor parallel: GPT at tp 2 and 4, with sequence parallelism, trains as one process",
          "[parallel][mp]") {
  // SGD with momentum, clipped: the clip sums the split parameters' norms
  // over the ranks and counts the replicated ones once.
  const std::vector<std::string> common = {
      "training.steps=50",      "optimizer.name=sgd",           "optimizer.lr=0.3",
      "optimizer.momentum=0.9", "optimizer.clip_grad_norm=0.5", "training.checkpoint_every=50"};
  const std::string ref = run_dir("gpt_ref");
  testing::ProcessResult r1 = run_ranks(1, gpt_args(ref, common));
  INFO(r1.output);
  REQUIRE(r1.code == 0);
  const StepLog expected = step_log(ref);
  struct Layout {
    int tp;
    bool sp;
  };
  for (Layout l : {Layout{2, false}, Layout{2, true}, Layout{4, true}}) {
    DYNAMIC_SECTION("tp " << l.tp << (l.sp ? " sequence parallel" : "")) {
      const std::string run = run_dir(cat("gpt_tp", l.tp, l.sp ? "_sp" : ""));
      std::vector<std::string> args = common;
      args.push_back(cat("parallel.tp=", l.tp));
      args.push_back(cat("parallel.sequence_parallel=", l.sp ? "true" : "false"));
      testing::ProcessResult r = run_ranks(l.tp, gpt_args(run, args));
      INFO(r.output);
      REQUIRE(r.code == 0);
      CHECK(r.output.find(cat("tp=", l.tp)) != std::string::npos);
      const StepLog got = step_log(run);
      check_close(expected.loss, got.loss, 1e-5, "loss");
      check_close(expected.grad_norm, got.grad_norm, 1e-4, "gradient norm");
      check_models(model_at(ref, 50), model_at(run, 50), 1e-5);
    }
  }
}

TEST_CASE("tensor parallel: fp16 ranks agree on overflow and track one process", "[parallel][mp]") {
  // An initial scale that overflows the first steps: both ranks must skip
  // together (or their replicated weights would part). Near the overflow
  // threshold f16 rounding may move the last skip by a step.
  const std::vector<std::string> common = {"training.steps=12", "precision=fp16",
                                           "loss_scaler.init_scale=1e9"};
  const std::string a = run_dir("fp16_ref"), b = run_dir("fp16_tp");
  testing::ProcessResult ra = run_ranks(1, gpt_args(a, common));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  std::vector<std::string> args = common;
  args.insert(args.end(), {"parallel.tp=2", "parallel.sequence_parallel=true"});
  testing::ProcessResult rb = run_ranks(2, gpt_args(b, args));
  INFO(rb.output);
  REQUIRE(rb.code == 0);
  auto skipped = [](const std::string& out) {
    const size_t at = out.rfind(" steps skipped)");
    REQUIRE(at != std::string::npos);
    return std::stoi(out.substr(out.rfind('(', at) + 1));
  };
  CHECK(skipped(rb.output) >= 10);
  CHECK(std::abs(skipped(rb.output) - skipped(ra.output)) <= 1);
  check_close(step_log(a).loss, step_log(b).loss, 1e-4, "loss");
}

TEST_CASE("tensor parallel: dp 2 x tp 2 trains as dp 2", "[parallel][mp]") {
  const std::vector<std::string> common = {"training.steps=8", "optimizer.name=sgd",
                                           "optimizer.lr=0.3", "training.checkpoint_every=8"};
  const std::string a = run_dir("dp_ref"), b = run_dir("dp_tp");
  testing::ProcessResult ra = run_ranks(2, gpt_args(a, common));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  std::vector<std::string> args = common;
  args.insert(args.end(), {"parallel.tp=2", "parallel.dp=2"});
  testing::ProcessResult rb = run_ranks(4, gpt_args(b, args));
  INFO(rb.output);
  REQUIRE(rb.code == 0);
  CHECK(rb.output.find("dp=2, pp=1, tp=2") != std::string::npos);
  check_close(step_log(a).loss, step_log(b).loss, 1e-5, "loss");
  check_models(model_at(a, 8), model_at(b, 8), 1e-5);
}

TEST_CASE(
    "tensor parallel: dp 2 x tp 2 with ZeRO-1 and sequence parallelism trains as without "
    "ZeRO-1, resumes bit for bit, and continues on other layouts",
    "[parallel][mp]") {
  // Each tensor-parallel rank shards its part's optimizer state over its dp
  // group; the LayerNorms' gradient shares add up shard by shard; the clip
  // sums the split parameters' norms over the tp ranks and the whole ones once.
  const std::vector<std::string> common = {
      "training.steps=6",   "training.checkpoint_every=2",    "optimizer.name=adamw",
      "optimizer.lr=0.003", "optimizer.clip_grad_norm=0.5",   "parallel.tp=2",
      "parallel.dp=2",      "parallel.sequence_parallel=true"};
  std::vector<std::string> sharded = common;
  sharded.push_back("parallel.zero1=true");
  const std::string a = run_dir("zero_ref"), b = run_dir("zero"), c = run_dir("zero_resumed");
  testing::ProcessResult ra = run_ranks(4, gpt_args(a, common));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  testing::ProcessResult rb = run_ranks(4, gpt_args(b, sharded));
  INFO(rb.output);
  REQUIRE(rb.code == 0);
  CHECK(rb.output.find("dp=2, pp=1, tp=2, zero1)") != std::string::npos);
  check_close(step_log(a).loss, step_log(b).loss, 1e-5, "loss");
  check_close(step_log(a).grad_norm, step_log(b).grad_norm, 1e-5, "gradient norm");
  check_models(model_at(a, 6), model_at(b, 6), 1e-5);
  // Resumed from a copy of b's step 2 checkpoint: the same bits.
  std::filesystem::create_directories(c + "/checkpoints");
  std::filesystem::copy(b + "/checkpoints/" + CheckpointDir::step_name(2),
                        c + "/checkpoints/" + CheckpointDir::step_name(2),
                        std::filesystem::copy_options::recursive);
  std::vector<std::string> resumed = gpt_args(c, sharded);
  resumed.push_back("--resume=auto");
  testing::ProcessResult rc2 = run_ranks(4, resumed);
  INFO(rc2.output);
  REQUIRE(rc2.code == 0);
  CHECK(std::regex_search(rc2.output, std::regex("resumed from \\S+ at step 2 ")));
  check_models(model_at(b, 6), model_at(c, 6), 0);
  // Continued from step 4 on other layouts: each tp rank's shards joined
  // into its parts, the parts into whole tensors, re-sliced (dp 2 with
  // ZeRO-1 at tp 1; one process). Within float tolerance of b.
  const std::string from = c + "/checkpoints/" + CheckpointDir::step_name(4);
  for (const bool one : {false, true}) {
    DYNAMIC_SECTION((one ? "one process" : "dp 2, ZeRO-1, tp 1")) {
      std::vector<std::string> other = {"training.steps=6",
                                        "training.checkpoint_every=2",
                                        "optimizer.name=adamw",
                                        "optimizer.lr=0.003",
                                        "optimizer.clip_grad_norm=0.5",
                                        "--resume",
                                        from};
      if (!one) other.insert(other.end(), {"parallel.dp=2", "parallel.zero1=true"});
      const std::string d = run_dir(one ? "zero_to_one" : "zero_to_dp");
      testing::ProcessResult rd = run_ranks(one ? 1 : 2, gpt_args(d, other));
      INFO(rd.output);
      REQUIRE(rd.code == 0);
      CHECK(rd.output.find(one ? "resharded: dp 2 -> 1, tp 2 -> 1, zero1 on -> off"
                               : "resharded: tp 2 -> 1") != std::string::npos);
      check_models(model_at(b, 6), model_at(d, 6), 1e-5);
    }
  }
}

TEST_CASE("tensor parallel: pp 2 x tp 2 trains as one process with gradient accumulation",
          "[parallel][mp]") {
  const std::vector<std::string> common = {"training.steps=6",
                                           "optimizer.name=sgd",
                                           "optimizer.lr=0.3",
                                           "optimizer.clip_grad_norm=0.5",
                                           "training.checkpoint_every=6",
                                           "training.eval_every=3"};
  const std::string a = run_dir("pp_ref"), b = run_dir("pp_tp");
  std::vector<std::string> one = common, split = common;
  one.push_back("training.grad_accum=2");
  split.insert(split.end(), {"parallel.tp=2", "parallel.pp=2", "parallel.micro_batches=2"});
  testing::ProcessResult ra = run_ranks(1, gpt_args(a, one));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  testing::ProcessResult rb = run_ranks(4, gpt_args(b, split));
  INFO(rb.output);
  REQUIRE(rb.code == 0);
  CHECK(rb.output.find("dp=1, pp=2, tp=2") != std::string::npos);
  check_close(step_log(a).loss, step_log(b).loss, 1e-5, "loss");
  check_close(step_log(a).grad_norm, step_log(b).grad_norm, 1e-5, "gradient norm");
  // The stages' parts of the checkpoint, whole tensors, merged by name.
  check_models(model_at(a, 6), model_at(b, 6), 1e-5);
}

TEST_CASE(
    "mesh: GPT on dp 2 x pp 2 x tp 2 (8 ranks) with ZeRO-1 and sequence parallelism trains "
    "as one process",
    "[parallel][mp]") {
  // All three dimensions: the head tied to the embedding across the stages,
  // each tensor-parallel rank's part sharded over its dp group, clipped.
  const std::vector<std::string> common = {
      "training.steps=6",       "optimizer.name=sgd",           "optimizer.lr=0.3",
      "optimizer.momentum=0.9", "optimizer.clip_grad_norm=0.5", "training.checkpoint_every=6"};
  const std::string a = run_dir("mesh_ref"), b = run_dir("mesh8");
  std::vector<std::string> one = common, mesh = common;
  one.push_back("training.grad_accum=2");
  mesh.insert(mesh.end(),
              {"parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.micro_batches=1",
               "parallel.zero1=true", "parallel.sequence_parallel=true"});
  testing::ProcessResult ra = run_ranks(1, gpt_args(a, one));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  testing::ProcessResult rb = run_ranks(8, gpt_args(b, mesh));
  INFO(rb.output);
  REQUIRE(rb.code == 0);
  CHECK(rb.output.find("parallel layout: world 8 (dp=2, pp=2, tp=2, zero1)") != std::string::npos);
  check_close(step_log(a).loss, step_log(b).loss, 1e-5, "loss");
  check_close(step_log(a).grad_norm, step_log(b).grad_norm, 1e-5, "gradient norm");
  check_models(model_at(a, 6), model_at(b, 6), 1e-5);
}

TEST_CASE("mesh: GPT on 8 ranks as dp 4 x pp 2, dp 2 x tp 4 and pp 2 x tp 4 trains as one process",
          "[parallel][mp]") {
  const std::vector<std::string> common = {
      "training.steps=4",       "optimizer.name=sgd",           "optimizer.lr=0.3",
      "optimizer.momentum=0.9", "optimizer.clip_grad_norm=0.5", "training.checkpoint_every=4"};
  const std::string a = run_dir("mesh8_ref");
  testing::ProcessResult ra = run_ranks(1, gpt_args(a, common));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  const std::vector<std::pair<std::string, std::vector<std::string>>> layouts = {
      {"dp=4, pp=2, tp=1", {"parallel.dp=4", "parallel.pp=2", "parallel.micro_batches=2"}},
      {"dp=2, pp=1, tp=4",
       {"parallel.dp=2", "parallel.tp=4", "parallel.zero1=true",
        "parallel.sequence_parallel=true"}},
      {"dp=1, pp=2, tp=4", {"parallel.pp=2", "parallel.tp=4", "parallel.micro_batches=4"}}};
  for (size_t k = 0; k < layouts.size(); ++k) {
    const auto& [mesh, keys] = layouts[k];
    DYNAMIC_SECTION(mesh) {
      const std::string b = run_dir(cat("mesh8_", k));
      std::vector<std::string> args = common;
      args.insert(args.end(), keys.begin(), keys.end());
      testing::ProcessResult rb = run_ranks(8, gpt_args(b, args));
      INFO(rb.output);
      REQUIRE(rb.code == 0);
      CHECK(rb.output.find("parallel layout: world 8 (" + mesh) != std::string::npos);
      check_close(step_log(a).loss, step_log(b).loss, 1e-5, "loss");
      check_close(step_log(a).grad_norm, step_log(b).grad_norm, 1e-5, "gradient norm");
      check_models(model_at(a, 4), model_at(b, 4), 1e-5);
    }
  }
}

TEST_CASE("tensor parallel: a tp 2 checkpoint resumes bit for bit and loads at tp 1 and 4",
          "[parallel][mp]") {
  SECTION("resumed at tp 2, with dropout inside and outside the split regions") {
    const std::vector<std::string> common = {"training.steps=6", "training.checkpoint_every=2",
                                             "model.dropout=0.1", "parallel.tp=2"};
    const std::string a = run_dir("resume_ref"), b = run_dir("resume");
    testing::ProcessResult ra = run_ranks(2, gpt_args(a, common));
    INFO(ra.output);
    REQUIRE(ra.code == 0);
    // Resumed from a copy of step 2's checkpoint (stopping a run this short
    // at a given step races with it).
    fs::create_directories(b + "/checkpoints");
    fs::copy(a + "/checkpoints/" + CheckpointDir::step_name(2),
             b + "/checkpoints/" + CheckpointDir::step_name(2), fs::copy_options::recursive);
    std::vector<std::string> resumed = gpt_args(b, common);
    resumed.push_back("--resume=auto");
    testing::ProcessResult rb2 = run_ranks(2, resumed);
    INFO(rb2.output);
    REQUIRE(rb2.code == 0);
    CHECK(std::regex_search(rb2.output, std::regex("resumed from \\S+ at step 2 ")));
    check_models(model_at(a, 6), model_at(b, 6), 0);
  }
  SECTION("continued at tp 1 and tp 4 from the same step, optimizer state included") {
    const std::vector<std::string> common = {"training.steps=8", "training.checkpoint_every=4",
                                             "optimizer.name=adamw"};
    const std::string a = run_dir("cross_tp2");
    std::vector<std::string> tp2 = common;
    tp2.push_back("parallel.tp=2");
    testing::ProcessResult ra = run_ranks(2, gpt_args(a, tp2));
    INFO(ra.output);
    REQUIRE(ra.code == 0);
    // The checkpoint holds whole tensors under the names of one process's model.
    const std::map<std::string, Tensor> whole = model_at(a, 4);
    REQUIRE(whole.count("transformer.h.0.attn.c_attn.weight") == 1);
    CHECK(whole.at("transformer.h.0.attn.c_attn.weight").shape() == Shape{192, 64});
    CHECK(whole.at("lm_head.weight").shape() == Shape{76, 64});
    for (int tp : {1, 4}) {
      const std::string c = run_dir(cat("cross_tp", tp, "_from2"));
      fs::create_directories(c + "/checkpoints");
      fs::copy(a + "/checkpoints/" + CheckpointDir::step_name(4),
               c + "/checkpoints/" + CheckpointDir::step_name(4), fs::copy_options::recursive);
      std::vector<std::string> args = common;
      args.push_back(cat("parallel.tp=", tp));
      std::vector<std::string> cont = gpt_args(c, args);
      cont.push_back("--resume=auto");
      testing::ProcessResult rc = run_ranks(tp, cont);
      INFO(rc.output);
      REQUIRE(rc.code == 0);
      CHECK(rc.output.find("resumed from") != std::string::npos);
      // AdamW's first steps amplify rounding noise in near-zero gradients
      // (the key biases get none in exact arithmetic): compare the losses.
      const StepLog from2 = step_log(a), here = step_log(c);
      std::map<int64_t, double> later;
      for (const auto& [step, v] : from2.loss)
        if (step > 4) later[step] = v;
      check_close(later, here.loss, 1e-4, "loss after the resume");
    }
    // Evaluation and sampling read the whole model.
    testing::ProcessResult re = run_process(
        {TRAINER_BINARY, "eval", std::string(TRAINER_SOURCE_DIR) + "/recipes/gpt_kjv.yaml",
         "model.n_layer=2", "model.n_head=4", "model.d_model=64", "model.context=32",
         "model.vocab_size=76", "data.seq_len=32", "data.val_windows=16",
         "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt", "--checkpoint",
         a + "/checkpoints"},
        {.timeout_s = 120});
    INFO(re.output);
    CHECK(re.code == 0);
    CHECK(re.output.find("bits/char") != std::string::npos);
  }
}

TEST_CASE("tensor parallel: layouts that do not divide are errors naming the keys, and --dry-run",
          "[parallel]") {
  auto dry = [](std::vector<std::string> extra) {
    std::vector<std::string> args = gpt_args(run_dir("dry"), std::move(extra));
    args.push_back("--dry-run");
    return run_ranks(1, args, {.timeout_s = 120});
  };
  testing::ProcessResult ok = dry({"parallel.tp=2"});
  INFO(ok.output);
  REQUIRE(ok.code == 0);
  // Attention and MLP halves, embedding/head by vocabulary: the whole model
  // has 2 * (12 * 64^2 + 13 * 64) + 76 * 64 + 32 * 64 + 2 * 64 parameters.
  CHECK(ok.output.find("tensor parallel: tp = 2") != std::string::npos);
  CHECK(ok.output.find("of the 107,008 parameters on each rank") != std::string::npos);

  testing::ProcessResult heads = dry({"parallel.tp=3"});
  CHECK(heads.code != 0);
  CHECK(heads.output.find("model.n_head 4 is not divisible by parallel.tp 3") != std::string::npos);
  CHECK(heads.output.find("1, 2, 4") != std::string::npos);

  // A vocabulary tp does not divide is padded with zero rows (models/gpt.h).
  testing::ProcessResult vocab = dry({"parallel.tp=4", "model.vocab_size=74"});
  INFO(vocab.output);
  CHECK(vocab.code == 0);
  CHECK(vocab.output.find("model: vocabulary 74 padded to 76 rows for parallel.tp=4") !=
        std::string::npos);

  testing::ProcessResult seq =
      dry({"parallel.tp=4", "parallel.sequence_parallel=true", "data.seq_len=30"});
  CHECK(seq.code != 0);
  CHECK(seq.output.find("parallel.sequence_parallel") != std::string::npos);

  // Rank 0 of 6 ranks started 3 per host: tp = 2 groups would straddle hosts.
  testing::ProcessResult hosts = run_process(
      [] {
        std::vector<std::string> argv{TRAINER_BINARY};
        for (const std::string& a : gpt_args(run_dir("hosts"), {"parallel.tp=2"}))
          argv.push_back(a);
        return argv;
      }(),
      {.env = {{"RANK", "0"},
               {"WORLD_SIZE", "6"},
               {"LOCAL_RANK", "0"},
               {"LOCAL_WORLD_SIZE", "3"},
               {"MASTER_ADDR", "127.0.0.1"},
               {"MASTER_PORT", "1"}},
       .timeout_s = 60});
  INFO(hosts.output);
  CHECK(hosts.code != 0);
  CHECK(hosts.output.find("parallel.tp = 2 with 3 ranks per host") != std::string::npos);
  CHECK(hosts.output.find("(1, 3)") != std::string::npos);

  testing::ProcessResult cnn =
      run_ranks(1,
                {"train", std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_mlp.yaml",
                 "output_dir=" + run_dir("mlp"), "parallel.tp=2", "--dry-run"},
                {.timeout_s = 120});
  CHECK(cnn.code != 0);
  CHECK(cnn.output.find("has no tensor-parallel form") != std::string::npos);
}
