// Language models through the trainer: sampling (the token pick against its
// closed form, GPT and the LSTM LM against a full forward pass), resume
// equivalence for a tiny GPT and LSTM LM on a generated corpus, `trainer
// sample` determinism, bits per character in the metrics, recipe errors.
#include "tests/process.h"
#include "tests/testing.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/ops.h"
#include "layers/tensor_parallel.h"
#include "models/gpt.h"
#include "models/lstm_lm.h"
#include "models/sample.h"
#include "parallel/pipeline.h"
#include "parallel/tensor_parallel.h"
#include "trainer/checkpoint.h"
#include "trainer/distributed.h"
#include "trainer/recipe.h"
#include "trainer/safetensors.h"
#include "trainer/session.h"

using namespace trainer;
using namespace trainer::testing;
namespace fs = std::filesystem;

namespace {

// A corpus of ~24 KB: sentences of a small vocabulary picked by a fixed
// linear congruential sequence (some structure to learn, no file needed).
fs::path generated_corpus() {
  fs::path path = temp_path("lm_corpus.txt");
  const char* words[] = {"the", "lord", "said", "unto", "moses",  "and",   "behold", "light",
                         "day", "of",   "was",  "good", "waters", "earth", "heaven"};
  std::string text;
  uint32_t x = 12345;
  while (text.size() < 24000) {
    for (int w = 0; w < 8; ++w) {
      x = x * 1664525u + 1013904223u;
      text += words[(x >> 16) % 15];
      text += w == 7 ? ".\n" : " ";
    }
  }
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

fs::path fresh(const std::string& name) { return fresh_temp_dir("lm_" + name); }

// A tiny recipe of the given model (gpt or lstm_lm) on the generated corpus.
fs::path tiny_recipe(const fs::path& dir, const std::string& model) {
  std::string text = "model:\n  name: " + model + R"(
  n_layer: 2
  n_head: 2
  d_model: 16
  hidden: 16
  context: 16
  dropout: 0.1
data:
  name: text
  path: )" + generated_corpus().string() +
                     R"(
  vocab: char
  val_fraction: 0.1
  seq_len: 12
  val_windows: 16
optimizer:
  name: adamw
  lr: 0.01
  weight_decay: 0.1
  clip_grad_norm: 1.0
schedule:
  name: constant
  warmup_steps: 2
training:
  steps: 8
  global_batch: 8
  grad_accum: 2
  log_every: 2
  eval_every: 4
  threads: 1
seed: 3
output_dir: )" + (dir / "run").string() +
                     "\n";
  fs::path path = dir / (model + ".yaml");
  std::ofstream(path) << text;
  return path;
}

std::string file_bytes(const fs::path& p) { return read_file(p.string()); }

// N steps straight against N/2, stop, --resume auto, N/2 more: the final
// model and optimizer files are the same bytes. The schedule is constant
// after a warmup, so the first half's run (steps=N/2) trains exactly as the
// first half of the straight one. Dropout is on (attention weights,
// residuals, between LSTM layers), so its re-keying is covered too.
// sampling: data.sampling (contiguous: the LSTM's carried state must resume too).
void check_lm_resume(const std::string& model, const std::string& sampling = "random") {
  fs::path a = fresh(model + "_" + sampling + "_straight"),
           b = fresh(model + "_" + sampling + "_resumed");
  const int64_t N = 8;
  fs::path ra = tiny_recipe(a, model), rb = tiny_recipe(b, model);
  const std::string data_sampling = "data.sampling=" + sampling;
  ProcessResult straight = run_trainer({"train", ra.string(), data_sampling});
  INFO(straight.output);
  REQUIRE(straight.code == 0);
  ProcessResult half =
      run_trainer({"train", rb.string(), data_sampling, "training.steps=" + std::to_string(N / 2)});
  INFO(half.output);
  REQUIRE(half.code == 0);
  ProcessResult rest = run_trainer({"train", rb.string(), data_sampling, "--resume", "auto"});
  INFO(rest.output);
  REQUIRE(rest.code == 0);
  REQUIRE(rest.output.find("resumed from") != std::string::npos);
  fs::path last_a = a / "run" / "checkpoints" / CheckpointDir::step_name(N);
  fs::path last_b = b / "run" / "checkpoints" / CheckpointDir::step_name(N);
  REQUIRE(file_bytes(last_a / "model-rank00000.safetensors") ==
          file_bytes(last_b / "model-rank00000.safetensors"));
  REQUIRE(file_bytes(last_a / "optimizer-rank00000.safetensors") ==
          file_bytes(last_b / "optimizer-rank00000.safetensors"));
  REQUIRE(straight.output.find("bits/char") != std::string::npos);
}

// The argmax of each position's logits [1, T, V] from position `from` on.
std::vector<int64_t> argmax_rows(const Tensor& logits, int64_t from) {
  std::vector<int64_t> am = argmax(logits.select(0, 0), 1).to_vector<int64_t>();
  return std::vector<int64_t>(am.begin() + from, am.end());
}

}  // namespace

TEST_CASE("sample: the token pick against its closed form", "[lm][sample]") {
  const std::vector<float> logits{0.5f, 2.0f, -1.0f, 1.0f};
  Generator gen(1, kStreamSampling);
  SampleOptions greedy{.temperature = 0.0};
  REQUIRE(pick_token(logits, greedy, gen) == 1);
  REQUIRE(gen.offset() == 0);  // greedy draws nothing
  REQUIRE(pick_token(logits, {.temperature = 1.0, .top_k = 1}, gen) == 1);

  // Frequencies of 40000 draws against softmax(logits / temperature) over the top k.
  for (auto [temperature, top_k] : {std::pair{1.0, int64_t(0)}, std::pair{0.5, int64_t(0)},
                                    std::pair{2.0, int64_t(2)}, std::pair{1.0, int64_t(3)}}) {
    INFO("temperature " << temperature << " top_k " << top_k);
    SampleOptions o{.temperature = temperature, .top_k = top_k};
    std::vector<double> expected(4, 0.0);
    std::vector<float> sorted = logits;
    std::sort(sorted.rbegin(), sorted.rend());
    double total = 0;
    for (size_t v = 0; v < 4; ++v) {
      if (top_k > 0 && logits[v] < sorted[size_t(top_k - 1)]) continue;
      expected[v] = std::exp(logits[v] / temperature);
      total += expected[v];
    }
    std::vector<double> count(4, 0.0);
    const int draws = 40000;
    for (int i = 0; i < draws; ++i) count[size_t(pick_token(logits, o, gen))] += 1;
    for (size_t v = 0; v < 4; ++v) {
      INFO("token " << v);
      REQUIRE(std::abs(count[v] / draws - expected[v] / total) < 0.01);
      if (expected[v] == 0) REQUIRE(count[v] == 0);
    }
  }
}

TEST_CASE("sample: GPT and the LSTM LM continue as their full forward pass predicts",
          "[lm][sample]") {
  auto gpt = make_gpt(
      {.vocab_size = 11, .block_size = 24, .n_layer = 2, .n_head = 2, .n_embd = 8, .seed = 5});
  auto lstm = make_lstm_lm(
      {.vocab_size = 11, .embedding_dim = 8, .hidden_size = 12, .num_layers = 2, .seed = 5});
  const std::vector<int64_t> prompt{3, 1, 4, 1, 5};
  for (Module* model : {static_cast<Module*>(gpt.get()), static_cast<Module*>(lstm.get())}) {
    // Greedy: each new token is the argmax of a forward pass over everything
    // before it (GPT's context stays within its block here; the LSTM LM's
    // carried state must give what a pass from the start gives).
    std::vector<int64_t> ids = sample(*model, prompt, {.max_new_tokens = 12, .temperature = 0});
    REQUIRE(ids.size() == prompt.size() + 12);
    REQUIRE(std::equal(prompt.begin(), prompt.end(), ids.begin()));
    Tensor logits;
    {
      autograd::NoGradGuard no_grad;
      std::vector<int64_t> prefix(ids.begin(), ids.end() - 1);
      logits = (*model)(from_vector(prefix, {1, int64_t(prefix.size())}));
    }
    REQUIRE(argmax_rows(logits, int64_t(prompt.size()) - 1) ==
            std::vector<int64_t>(ids.begin() + int64_t(prompt.size()), ids.end()));
    REQUIRE(model->is_training());  // the mode is restored

    // A seed gives the same tokens; another seed other tokens.
    SampleOptions o{.max_new_tokens = 30, .temperature = 1.0, .top_k = 5, .seed = 7};
    std::vector<int64_t> x = sample(*model, prompt, o);
    REQUIRE(sample(*model, prompt, o) == x);
    o.seed = 8;
    REQUIRE(sample(*model, prompt, o) != x);
  }
  // GPT crops its context to the block: longer outputs still work.
  REQUIRE(sample(*gpt, prompt, {.max_new_tokens = 40}).size() == 45);
  REQUIRE_THROWS_WITH(sample(*gpt, {}, {}), Catch::Contains("at least one token"));
  REQUIRE_THROWS_WITH(sample(*gpt, {11}, {}), Catch::Contains("outside the model's vocabulary"));
}

TEST_CASE("sample: only the tokens below SampleOptions::vocab_size are picked", "[lm][sample]") {
  // Rows past the corpus's symbols (model.vocab_size larger than the
  // data's): at a high temperature near-uniform logits would pick them often.
  auto gpt = make_gpt(
      {.vocab_size = 11, .block_size = 24, .n_layer = 1, .n_head = 2, .n_embd = 8, .seed = 5});
  for (double temperature : {0.0, 5.0}) {
    INFO("temperature " << temperature);
    const std::vector<int64_t> ids =
        sample(*gpt, {1, 2}, {.max_new_tokens = 200, .temperature = temperature, .vocab_size = 4});
    CHECK(*std::max_element(ids.begin(), ids.end()) < 4);
  }
  REQUIRE_THROWS_WITH(sample(*gpt, {5}, {.vocab_size = 4}),
                      Catch::Contains("outside the model's vocabulary"));
}

TEST_CASE("train: resuming a GPT language model is bit-identical", "[train][lm]") {
  check_lm_resume("gpt");
}

TEST_CASE("train: resuming an LSTM language model is bit-identical", "[train][lm]") {
  check_lm_resume("lstm_lm");
}

TEST_CASE("train: an LSTM LM carrying its state over contiguous streams resumes bit-identically",
          "[train][lm]") {
  check_lm_resume("lstm_lm", "contiguous");
  // The carried state is saved with each checkpoint, and it is not zeros.
  fs::path mid = temp_path("lm_lstm_lm_contiguous_resumed") / "run" / "checkpoints" /
                 CheckpointDir::step_name(4) / "stream_state.rank0.safetensors";
  SafetensorsFile f = read_safetensors(mid.string());
  REQUIRE(f.tensors.count("h") == 1);
  REQUIRE(f.tensors.at("h").shape() == Shape{2, 4, 16});  // layers, micro-batch, hidden
  double sum = 0;
  for (float v : f.tensors.at("c").to_vector<float>()) sum += std::fabs(v);
  REQUIRE(sum > 0.1);
}

TEST_CASE("train: a language model logs bits per character, and sample is deterministic",
          "[train][lm]") {
  fs::path dir = fresh("bpc");
  fs::path recipe = tiny_recipe(dir, "gpt");
  ProcessResult r = run_trainer({"train", recipe.string(), "training.steps=4"});
  INFO(r.output);
  REQUIRE(r.code == 0);
  REQUIRE(r.output.find("tokens/s") != std::string::npos);

  int val_records = 0;
  std::ifstream jsonl(dir / "run" / "metrics.jsonl");
  for (std::string line; std::getline(jsonl, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j["split"] != "val") continue;
    ++val_records;
    double loss = j["loss"], bpc = j["bits_per_char"];
    REQUIRE(loss > 0);
    REQUIRE(bpc == Approx(loss / std::log(2.0)).epsilon(1e-12));
  }
  REQUIRE(val_records == 1);

  // The checkpoint records the vocabulary; eval reports bits per char.
  fs::path ckpt = dir / "run" / "checkpoints" / CheckpointDir::step_name(4);
  nlohmann::json state = nlohmann::json::parse(read_file((ckpt / "trainer_state.json").string()));
  REQUIRE(state["vocab"].size() > 10);
  ProcessResult e = run_trainer({"eval", recipe.string(), "--checkpoint", (dir / "run").string()});
  INFO(e.output);
  REQUIRE(e.code == 0);
  REQUIRE(e.output.find("bits/char") != std::string::npos);

  auto sample_args = [&](const std::string& seed, const std::string& temperature) {
    return std::vector<std::string>{
        "sample",        recipe.string(), "--checkpoint", ckpt.string(), "--prompt",
        "the lord",      "--tokens",      "40",           "--seed",      seed,
        "--temperature", temperature};
  };
  // The text follows a header line (on stderr) naming the settings.
  auto text_of = [&](const std::vector<std::string>& args) {
    ProcessResult s = run_trainer(args);
    INFO(s.output);
    REQUIRE(s.code == 0);
    REQUIRE(s.output.find('\n') != std::string::npos);
    return s.output.substr(s.output.find('\n') + 1);
  };
  std::string s1 = text_of(sample_args("1", "1.0"));
  REQUIRE(s1.rfind("the lord", 0) == 0);
  REQUIRE(s1.size() == 8 + 40 + 1);  // prompt, 40 tokens, a line break
  REQUIRE(text_of(sample_args("1", "1.0")) == s1);
  REQUIRE(text_of(sample_args("2", "1.0")) != s1);
  // Greedy ignores the seed.
  REQUIRE(text_of(sample_args("1", "0")) == text_of(sample_args("2", "0")));

  ProcessResult bad =
      run_trainer({"sample", recipe.string(), "--checkpoint", ckpt.string(), "--prompt", "Zebra"});
  REQUIRE(bad.code == 1);
  REQUIRE(bad.output.find("--prompt: 'Z' (offset 0) is not in the corpus's character") !=
          std::string::npos);
  // A checkpoint of another vocabulary is refused.
  ProcessResult other =
      run_trainer({"sample", recipe.string(), "data.vocab=byte", "--checkpoint", ckpt.string()});
  REQUIRE(other.code == 1);
  REQUIRE(other.output.find("does not match the recipe's model") != std::string::npos);
}

TEST_CASE("train: bad language-model recipes fail with a message", "[train][lm]") {
  fs::path dir = fresh("bad");
  const std::string recipe = tiny_recipe(dir, "gpt").string();
  // In process: the messages the CLI prints after "error: ".
  auto fails_with = [&](const std::vector<std::string>& overrides, const std::string& message) {
    INFO(overrides.front());
    REQUIRE_THROWS_WITH(Session(load_recipe(recipe, overrides)), Catch::Contains(message));
  };
  fails_with({"data.vocab=word"}, "key 'data.vocab' = 'word' is not one of: byte, char");
  fails_with({"data.seq_len=-1"}, "key 'data.seq_len' = -1 is out of range");
  fails_with({"data.seq_lenn=4"}, "did you mean 'data.seq_len'");
  fails_with({"data.seq_len=32"}, "data.seq_len 32 is longer than model.context 16");
  fails_with({"model.vocab_size=5"}, "model.vocab_size 5 is smaller than the");
  fails_with({"data.name=fashion_mnist"}, "model.name 'gpt' cannot read data.name 'fashion_mnist'");
  fails_with({"model.name=small_cnn"}, "model.name 'small_cnn' cannot read data.name 'text'");
  fails_with({"data.path=/nonexistent/kjv.txt"},
             "cannot open the text corpus /nonexistent/kjv.txt");
  fails_with({"data.path="}, "data.path must name the text corpus");
  fails_with({"data.seq_len=16", "data.val_fraction=0.0"}, "the validation part has 0 tokens");
  fails_with({"model.n_head=3"}, "model.d_model 16 is not divisible by model.n_head 3");
  fails_with({"model.name=lstm_lm", "model.hidden=24"},
             "model.tie_weights needs model.d_model (16) == model.hidden (24)");
  fails_with({"training.global_batch=4096"}, "training windows of an epoch");

  // The binary: exit code 1 and the message; --dry-run prints the model,
  // the corpus and the memory estimate.
  ProcessResult bad = run_trainer({"train", recipe, "data.vocab=word", "--dry-run"});
  REQUIRE(bad.code == 1);
  REQUIRE(bad.output.find("error: ") != std::string::npos);
  ProcessResult ok = run_trainer({"train", recipe, "--dry-run"});
  INFO(ok.output);
  REQUIRE(ok.code == 0);
  REQUIRE(ok.output.find("char vocabulary of") != std::string::npos);
  REQUIRE(ok.output.find("memory estimate") != std::string::npos);
  REQUIRE(!fs::exists(dir / "run" / "checkpoints"));
}

TEST_CASE("pipeline: a stage's session gives memory only to its own blocks' tensors",
          "[train][lm][pipeline]") {
  fs::path dir = fresh("stage_memory");
  for (const std::string model : {"gpt", "lstm_lm"}) {
    INFO(model);
    const std::string tie = "model.tie_weights=true";
    const Recipe r = load_recipe(tiny_recipe(dir, model).string(),
                                 {"parallel.pp=2", "training.grad_accum=1",
                                  "parallel.micro_batches=2", "model.n_layer=3", tie});
    Session whole(load_recipe(tiny_recipe(dir, model).string(), {"model.n_layer=3", tie}));
    std::map<std::string, Tensor> want;
    for (const NamedTensor& t : whole.model().state()) want[t.name] = t.tensor;
    Session stage(r, rank_layout(parallel_layout(r, 2), 1));
    // Built deferred: no tensor has memory until its stage is known.
    for (const NamedTensor& t : stage.model().state())
      if (t.tensor.numel() > 0) CHECK(is_deferred(t.tensor));
    const parallel::StageSplit split = parallel::even_split(stage.blocks().size(), 2, 1);
    stage.set_pipeline(split, 1);
    std::set<std::string> mine;
    std::set<const TensorImpl*> held;
    for (const NamedTensor& t : stage.held_state()) {
      mine.insert(t.name);
      held.insert(t.tensor.impl());
      INFO(t.name);
      REQUIRE_FALSE(is_deferred(t.tensor));
      require_close(t.tensor, want.at(t.name), 0.0, 0.0, t.name);  // the one process's values
    }
    int others = 0;
    for (const NamedTensor& t : stage.model().state())
      if (!held.count(t.tensor.impl()) && t.tensor.numel() > 0) {
        INFO(t.name);
        CHECK(is_deferred(t.tensor));
        ++others;
      }
    CHECK(others > 0);
    // The embedding is stage 0's; the tied head or decoder makes stage 1 hold it too.
    CHECK(mine.count(model == "gpt" ? "lm_head.weight" : "decoder.weight"));
  }
}

TEST_CASE(
    "tensor parallel: a rank's session makes only its parts as slices of one process's tensors",
    "[train][lm][tp]") {
  fs::path dir = fresh("tp_memory");
  const std::string recipe = tiny_recipe(dir, "gpt").string();
  Session whole(load_recipe(recipe, {"model.n_layer=2"}));
  std::map<std::string, Tensor> want;
  for (const NamedTensor& t : whole.model().state()) want[t.name] = t.tensor;
  const Recipe r = load_recipe(recipe, {"model.n_layer=2", "parallel.tp=2"});
  Session part(r, rank_layout(parallel_layout(r, 2), 1));
  for (const NamedTensor& t : part.model().state())
    if (t.tensor.numel() > 0) CHECK(is_deferred(t.tensor));
  part.set_tensor_parallel(parallel::shape_only_group(1, 2, false));
  const std::map<std::string, ParameterSplit> splits = part.model().parameter_splits();
  int sharded = 0;
  for (const NamedTensor& t : part.model().state()) {
    INFO(t.name);
    REQUIRE_FALSE(is_deferred(t.tensor));
    auto split = splits.find(t.name);
    if (split != splits.end() && split->second.kind == ParameterSplit::Kind::sharded) {
      ++sharded;
      require_close(t.tensor, shard_of(want.at(t.name), split->second), 0.0, 0.0, t.name);
    } else {
      require_close(t.tensor, want.at(t.name), 0.0, 0.0, t.name);
    }
  }
  CHECK(sharded > 4);
}

TEST_CASE(
    "tensor parallel: a vocabulary tp does not divide gets zero rows, the other tensors stay one "
    "process's, and checkpoints are fitted to either",
    "[train][lm][tp]") {
  // 23 rows over tp = 2: padded to 24, rank 1 holding rows 12..22 and the padding.
  fs::path dir = fresh("tp_padded_vocab");
  const std::string recipe = tiny_recipe(dir, "gpt").string();
  Session whole(load_recipe(recipe, {"model.vocab_size=23"}));
  std::map<std::string, Tensor> want;
  for (const NamedTensor& t : whole.model().state()) want[t.name] = t.tensor;
  const Recipe r = load_recipe(recipe, {"model.vocab_size=23", "parallel.tp=2"});
  Session part(r, rank_layout(parallel_layout(r, 2), 1));
  part.set_tensor_parallel(parallel::shape_only_group(1, 2, false));
  CHECK(part.tensor_parallel_note() ==
        "model: vocabulary 23 padded to 24 rows for parallel.tp=2; the padded rows are never "
        "sampled or predicted (zero, and left out of the loss)");
  const auto& gpt = dynamic_cast<const GPT&>(part.model());
  CHECK(gpt.vocab_rows() == 24);
  CHECK(gpt.options().vocab_size == 23);
  const std::map<std::string, ParameterSplit> splits = part.model().parameter_splits();
  for (const NamedTensor& t : part.model().state()) {
    INFO(t.name);
    if (t.name == "transformer.wte.weight" || t.name == "lm_head.weight") {
      REQUIRE(t.tensor.shape() == Shape{12, 16});
      require_close(t.tensor.narrow(0, 0, 11).contiguous(),
                    want.at(t.name).narrow(0, 12, 11).contiguous(), 0.0, 0.0, t.name);
      CHECK(t.tensor.narrow(0, 11, 1).to_vector<float>() == std::vector<float>(16, 0.0f));
      continue;
    }
    // No draw of the initialisation's stream went to the padding.
    auto split = splits.find(t.name);
    const bool sharded =
        split != splits.end() && split->second.kind == ParameterSplit::Kind::sharded;
    require_close(t.tensor, sharded ? shard_of(want.at(t.name), split->second) : want.at(t.name),
                  0.0, 0.0, t.name);
  }

  // A checkpoint written at tp = 1, into the padded model: zero rows added
  // to the weights and their optimizer state.
  const Tensor wte = want.at("transformer.wte.weight");
  std::map<std::string, Tensor> loaded{{"transformer.wte.weight", wte},
                                       {"lm_head.weight", wte},
                                       {"transformer.wte.weight.exp_avg", wte * 2.0}};
  part.model().upgrade_loaded_state(loaded, "ckpt");
  for (const auto& [name, t] : loaded) {
    INFO(name);
    REQUIRE(t.shape() == Shape{24, 16});
    CHECK(t.narrow(0, 23, 1).to_vector<float>() == std::vector<float>(16, 0.0f));
  }
  // Written at tp = 2, into the one-process model: the padding dropped.
  whole.model().upgrade_loaded_state(loaded, "ckpt");
  for (const auto& [name, t] : loaded) CHECK(t.shape() == Shape{23, 16});
  require_close(loaded.at("transformer.wte.weight"), wte, 0.0, 0.0, "wte");
  // Rows past the vocabulary that are not zero are no padding: left for the
  // loader to report as mis-shaped.
  std::map<std::string, Tensor> other{{"transformer.wte.weight", ones({24, 16})},
                                      {"lm_head.weight", ones({24, 16})}};
  whole.model().upgrade_loaded_state(other, "ckpt");
  CHECK(other.at("transformer.wte.weight").shape() == Shape{24, 16});
}
