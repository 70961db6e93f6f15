// Subword language models end to end: a SentencePiece tokenizer trained on
// the King James Bible gives back every line of it; `trainer tokenize`
// trains a tokenizer and encodes a corpus into token shards; a tiny GPT
// trains on them (data.name: tokens), resumes bit for bit, evaluates, and
// `trainer sample` writes text with the tokenizer, refusing a checkpoint of
// another tokenizer.
#include "tests/process.h"
#include "tests/testing.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "data/sentencepiece.h"
#include "data/token_shards.h"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"

using namespace trainer;
using namespace trainer::testing;
namespace fs = std::filesystem;

namespace {

const std::string kKjv = std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt";

// The first `lines` lines of the KJV corpus as a file of their own.
fs::path kjv_head(const fs::path& dir, int lines) {
  std::ifstream in(kKjv, std::ios::binary);
  REQUIRE(in.good());  // scripts/setup.sh writes datasets/kjv.txt
  std::string text, line;
  for (int i = 0; i < lines && std::getline(in, line); ++i) text += line + "\n";
  const fs::path path = dir / "kjv_head.txt";
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// A tiny GPT on the token directory `tokens`.
fs::path tiny_recipe(const fs::path& dir, const fs::path& tokens, const std::string& key) {
  const std::string text = R"(model:
  name: gpt
  n_layer: 2
  n_head: 2
  d_model: 16
  context: 16
  dropout: 0.1
data:
  )" + key + R"(: tokens
  path: )" + tokens.string() +
                           R"(
  val_fraction: 0.1
  seq_len: 12
  val_windows: 16
optimizer:
  name: adamw
  lr: 0.01
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
  const fs::path path = dir / "gpt_tokens.yaml";
  std::ofstream(path) << text;
  return path;
}

ProcessResult ok(const std::vector<std::string>& args) {
  ProcessResult r = run_trainer(args);
  INFO(r.output);
  REQUIRE(r.code == 0);
  return r;
}

}  // namespace

TEST_CASE("tokenize: a tokenizer trained on the KJV gives back every line of it", "[tokens][kjv]") {
  const fs::path dir = fresh_temp_dir("tokenize_kjv");
  const data::SentencePieceSummary s = data::train_sentencepiece(
      {.corpora = {kKjv}, .vocab_size = 1000, .threads = 2, .out = (dir / "kjv.model").string()});
  REQUIRE(s.lines == 31102);
  REQUIRE(s.vocab_size == 1000);
  auto tok = data::SentencePieceTokenizer::load(s.model_path);
  std::ifstream in(kKjv, std::ios::binary);
  int64_t lines = 0, bytes = 0, tokens = 0;
  for (std::string line; std::getline(in, line); ++lines) {
    line += '\n';
    const std::vector<int64_t> ids = tok->encode(line);
    if (tok->decode(ids) != line) FAIL("line " << lines + 1 << " does not come back: " << line);
    bytes += int64_t(line.size());
    tokens += int64_t(ids.size());
  }
  REQUIRE(lines == 31102);
  // Subwords: under 3 tokens per 8 bytes (a character vocabulary: 8).
  CHECK(double(tokens) < 3.0 * double(bytes) / 8.0);
}

TEST_CASE("tokenize: train a tokenizer, encode shards, train a GPT on them, resume, sample",
          "[tokens]") {
  const fs::path dir = fresh_temp_dir("tokenize_gpt");
  const fs::path corpus = kjv_head(dir, 3000), model = dir / "tok.model";
  ProcessResult trained = ok({"tokenize", "--train", corpus.string(), "--vocab-size", "400",
                              "--out", model.string(), "--threads", "1"});
  CHECK(trained.output.find("trained tokenizer " + model.string() + ": BPE, 400 pieces") !=
        std::string::npos);
  REQUIRE(fs::exists(dir / "tok.vocab"));
  // Encoded in shards of 20000 tokens: windows cross their boundaries.
  const fs::path tokens = dir / "tokens";
  ProcessResult encoded = ok({"tokenize", "--model", model.string(), corpus.string(), "--out",
                              tokens.string(), "--shard-tokens", "20000", "--threads", "2"});
  CHECK(encoded.output.find("shards of uint16 in " + tokens.string()) != std::string::npos);
  const data::TokenDirectory d = data::open_token_directory(tokens.string());
  REQUIRE(d.shards > 3);
  std::vector<int64_t> ids(size_t(d.tokens.size()));
  d.tokens.read(0, d.tokens.size(), ids.data());
  REQUIRE(d.tokenizer->decode(ids) == read_file(corpus.string()));

  // Straight against stopped half way and resumed: the same bytes. The
  // first half reads the dataset by its other key name, data.kind.
  const fs::path a = dir / "straight", b = dir / "resumed";
  fs::create_directories(a);
  fs::create_directories(b);
  const fs::path ra = tiny_recipe(a, tokens, "name"), rb = tiny_recipe(b, tokens, "kind");
  ProcessResult dry = ok({"train", ra.string(), "--dry-run"});
  CHECK(dry.output.find(cat(" tokens in ", d.shards, " shards (train ")) != std::string::npos);
  CHECK(dry.output.find("SentencePiece vocabulary of 400") != std::string::npos);
  ok({"train", ra.string()});
  ok({"train", rb.string(), "training.steps=4"});
  ProcessResult rest = ok({"train", rb.string(), "--resume", "auto"});
  REQUIRE(rest.output.find("resumed from") != std::string::npos);
  const fs::path last_a = a / "run" / "checkpoints" / CheckpointDir::step_name(8),
                 last_b = b / "run" / "checkpoints" / CheckpointDir::step_name(8);
  for (const char* f : {"model-rank00000.safetensors", "optimizer-rank00000.safetensors"})
    REQUIRE(read_file((last_a / f).string()) == read_file((last_b / f).string()));
  const nlohmann::json state =
      nlohmann::json::parse(read_file((last_a / "trainer_state.json").string()));
  REQUIRE(state["tokenizer"]["checksum"] == data::checksum_hex(d.tokenizer->checksum()));
  REQUIRE(state["tokenizer"]["vocab_size"] == 400);
  REQUIRE_FALSE(state.contains("vocab"));

  ProcessResult e = ok({"eval", ra.string(), "--checkpoint", (a / "run").string()});
  CHECK(e.output.find("bits/token") != std::string::npos);
  ProcessResult info = ok({"checkpoint", "info", last_a.string()});
  CHECK(info.output.find("tokenizer: SentencePiece, 400 pieces, checksum " +
                         data::checksum_hex(d.tokenizer->checksum())) != std::string::npos);
  const std::string metrics = read_file((a / "run" / "metrics.jsonl").string());
  CHECK(metrics.find("\"bits_per_token\"") != std::string::npos);
  CHECK(metrics.find("\"bits_per_char\"") == std::string::npos);
  auto sample = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"sample",   ra.string(), "--checkpoint", last_a.string(),
                                     "--prompt", "And God",   "--tokens",     "30",
                                     "--seed",   "5"};
    args.insert(args.end(), extra.begin(), extra.end());
    ProcessResult s = ok(args);
    return s.output.substr(s.output.find('\n') + 1);  // after the settings line (stderr)
  };
  const std::string text = sample({});
  REQUIRE(text.rfind("And God", 0) == 0);
  REQUIRE(text.size() > std::string("And God").size() + 5);
  REQUIRE(sample({}) == text);

  // Another tokenizer of the same size: its ids mean other text.
  ok({"tokenize", "--train", corpus.string(), "--vocab-size", "400", "--type", "unigram", "--out",
      (dir / "other.model").string()});
  const fs::path other = dir / "other_tokens";
  ok({"tokenize", "--model", (dir / "other.model").string(), corpus.string(), "--out",
      other.string()});
  ProcessResult refused = run_trainer(
      {"sample", ra.string(), "data.path=" + other.string(), "--checkpoint", last_a.string()});
  REQUIRE(refused.code == 1);
  REQUIRE(refused.output.find("the checkpoint was trained with the tokenizer " +
                              (tokens / "tokenizer.model").string()) != std::string::npos);
  // A text recipe on a token checkpoint, and the reverse, are refused too.
  ProcessResult text_recipe =
      run_trainer({"eval", ra.string(), "data.name=text", "data.path=" + corpus.string(),
                   "model.vocab_size=400", "--checkpoint", last_a.string()});
  REQUIRE(text_recipe.code == 1);
  REQUIRE(text_recipe.output.find("was trained on SentencePiece tokens") != std::string::npos);
}

TEST_CASE("tokenize: wrong uses of the command are errors saying what to do", "[tokens]") {
  const fs::path dir = fresh_temp_dir("tokenize_errors");
  const fs::path corpus = kjv_head(dir, 200);
  auto fails_with = [&](const std::vector<std::string>& args, const std::string& message) {
    std::vector<std::string> all = {"tokenize"};
    all.insert(all.end(), args.begin(), args.end());
    ProcessResult r = run_trainer(all);
    INFO(r.output);
    REQUIRE(r.code == 1);
    REQUIRE(r.output.find(message) != std::string::npos);
  };
  fails_with({"--out", "x"}, "give either --train CORPUS...");
  fails_with({"--train", corpus.string(), "--out", (dir / "t.model").string()},
             "give the vocabulary size (--vocab-size N");
  fails_with({"--train", corpus.string(), "--vocab-size", "400", "--shard-tokens", "5", "--out",
              (dir / "t.model").string()},
             "--shard-tokens is for encoding (--model)");
  fails_with(
      {"--model", (dir / "none.model").string(), corpus.string(), "--out", (dir / "out").string()},
      "none.model");
  fails_with({"--train", corpus.string(), "--vocab-size", "400", "--type", "word", "--out", "x"},
             "--type");
  fails_with({"--train", (dir / "missing.txt").string(), "--vocab-size", "400", "--out",
              (dir / "t.model").string()},
             "cannot open the text corpus");
  ok({"tokenize", "--train", corpus.string(), "--vocab-size", "400", "--out",
      (dir / "t.model").string()});
  fails_with({"--model", (dir / "t.model").string(), "--vocab-size", "9", corpus.string(), "--out",
              (dir / "out").string()},
             "--vocab-size is for training (--train)");
  fails_with({"--model", (dir / "t.model").string(), "--out", (dir / "out").string()},
             "give the corpus files to encode");
}
