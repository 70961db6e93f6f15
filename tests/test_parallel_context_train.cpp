// Context parallelism in the trainer: a small GPT and a small Llama on the
// KJV characters train as one process at cp 2 (ring) and cp 4
// (all-to-all), dp 2 x cp 2, cp 2 x tp 2 (with and without sequence
// parallelism) and cp 2 x pp 2, and sharded
// (ZeRO-1, -2, -3 over the dp x cp ranks), the losses,
// gradient norms and weights within float tolerance; a cp checkpoint is an
// ordinary one (trainer eval reads it alone, and it resumes at cp 1); bad
// layouts are refused naming the keys.
#include "tests/runs.h"  // last: it brings Catch's CHECK

using namespace trainer;
using namespace trainer::testing;

namespace {

std::string run_dir(const std::string& name) {
  return testing::fresh_temp_dir("context_" + name, false).string();
}

// 2 layers of width 64, 4 heads, windows of 64 characters.
std::vector<std::string> context_args(const std::string& model, const std::string& out,
                                      std::vector<std::string> extra) {
  std::vector<std::string> a{"train",
                             std::string(TRAINER_SOURCE_DIR) + "/recipes/gpt_kjv.yaml",
                             "output_dir=" + out,
                             "model.name=" + model,
                             "model.n_layer=2",
                             "model.n_head=4",
                             "model.d_model=64",
                             "model.context=64",
                             "data.seq_len=64",
                             "data.val_windows=16",
                             "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
                             "training.threads=1",
                             "training.log_every=1",
                             "training.eval_every=6",
                             "training.global_batch=8",
                             "training.steps=6",
                             "training.checkpoint_every=6",
                             "optimizer.name=sgd",
                             "optimizer.lr=0.3",
                             "optimizer.momentum=0.9",
                             "optimizer.clip_grad_norm=0.5",
                             "schedule.warmup_steps=0"};
  if (model == "llama")
    for (const char* k : {"model.num_key_value_heads=2", "model.intermediate_size=96",
                          "model.tie_word_embeddings=false"})
      a.push_back(k);
  a.push_back("model.vocab_size=76");  // divides by tp: the checkpoints hold no padding
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

}  // namespace

TEST_CASE("context parallelism: GPT and Llama train as one process under cp layouts",
          "[parallel][mp][context]") {
  struct Layout {
    std::string name;
    int ranks;
    std::vector<std::string> keys;
  };
  for (const std::string model : {"gpt", "llama"}) {
    const std::string ref = run_dir(model + "_ref");
    ProcessResult r1 = run_ranks(1, context_args(model, ref, {}));
    INFO(r1.output);
    REQUIRE(r1.code == 0);
    const StepLog expected = step_log(ref);
    REQUIRE(expected.loss.size() == 6);
    const std::vector<Layout> layouts =
        model == "gpt"
            ? std::vector<Layout>{{"cp 2 ring", 2, {"parallel.cp=2"}},
                                  {"cp 4 all-to-all",
                                   4,
                                   {"parallel.cp=4", "parallel.cp_attention=all_to_all"}},
                                  {"dp 2 x cp 2", 4, {"parallel.dp=2", "parallel.cp=2"}},
                                  {"cp 2 x pp 2",
                                   4,
                                   {"parallel.cp=2", "parallel.pp=2", "parallel.micro_batches=2"}},
                                  {"cp 2 x tp 2 sequence parallel",
                                   4,
                                   {"parallel.cp=2", "parallel.tp=2",
                                    "parallel.sequence_parallel=true"}},
                                  {"cp 2 ZeRO-3",
                                   2,
                                   {"parallel.cp=2", "parallel.shard=parameters"}},
                                  {"dp 2 x cp 2 ZeRO-2",
                                   4,
                                   {"parallel.dp=2", "parallel.cp=2", "parallel.shard=gradients"}},
                                  {"hybrid 2 x (dp 2 x cp 2) ZeRO-3",
                                   8,
                                   {"parallel.dp=4", "parallel.cp=2", "parallel.shard=parameters",
                                    "parallel.dp_replicate=2"}}}
            : std::vector<Layout>{
                  {"cp 2 ring unbalanced", 2, {"parallel.cp=2", "parallel.cp_load_balance=false"}},
                  {"cp 2 all-to-all", 2, {"parallel.cp=2", "parallel.cp_attention=all_to_all"}},
                  {"cp 2 x tp 2", 4, {"parallel.cp=2", "parallel.tp=2"}},
                  {"cp 2 all-to-all ZeRO-1",
                   2,
                   {"parallel.cp=2", "parallel.cp_attention=all_to_all",
                    "parallel.shard=optimizer"}},
                  {"cp 2 x tp 2 ZeRO-3",
                   4,
                   {"parallel.cp=2", "parallel.tp=2", "parallel.shard=parameters"}}};
    for (size_t k = 0; k < layouts.size(); ++k) {
      const Layout& l = layouts[k];
      INFO(model << " " << l.name);
      const std::string run = run_dir(cat(model, "_layout", k));
      ProcessResult r = run_ranks(l.ranks, context_args(model, run, l.keys));
      INFO(r.output);
      REQUIRE(r.code == 0);
      const StepLog got = step_log(run);
      check_close(expected.loss, got.loss, 1e-5, "loss");
      check_close(expected.grad_norm, got.grad_norm, 1e-4, "gradient norm");
      check_models(model_at(ref, 6), model_at(run, 6), 1e-5);
      if (k == 0 || l.name == "cp 2 ZeRO-3") {
        // The cp checkpoint read by one process: eval, and a resume at cp 1.
        std::vector<std::string> eval = context_args(model, run, {"--checkpoint", run});
        eval[0] = "eval";
        ProcessResult e = run_ranks(1, eval);
        INFO(e.output);
        CHECK(e.code == 0);
        std::vector<std::string> more = context_args(model, run, {"training.steps=8"});
        ProcessResult resumed = run_ranks(1, more);
        INFO(resumed.output);
        CHECK(resumed.code == 0);
        CHECK(step_log(run).loss.size() == 8);
      }
    }
  }
}

TEST_CASE("context parallelism: layouts the trainer refuses name their keys",
          "[parallel][context]") {
  const std::string out = run_dir("refused");
  auto refused = [&](std::vector<std::string> keys, std::vector<std::string> expected) {
    keys.push_back("--dry-run");
    ProcessResult r = run_ranks(1, context_args("gpt", out, keys));
    INFO(r.output);
    CHECK(r.code != 0);
    for (const std::string& e : expected) CHECK(r.output.find(e) != std::string::npos);
  };
  refused({"parallel.cp=3"}, {"parallel.cp = 3",
                              "64-token windows (data.seq_len) do not split "
                              "into 6 equal chunks",
                              "multiple of 6"});
  refused({"parallel.cp=2", "model.name=lstm_lm"}, {"no context-parallel form"});
  // Found when the ranks split the model, not by a dry run.
  ProcessResult heads = run_ranks(
      2, context_args("gpt", out,
                      {"parallel.cp=2", "parallel.cp_attention=all_to_all", "model.n_head=1"}));
  INFO(heads.output);
  CHECK(heads.code != 0);
  CHECK(heads.output.find("model.n_head 1 (1 per tensor-parallel rank) is not divisible by "
                          "parallel.cp 2") != std::string::npos);
}
