// `trainer tokenize` (trainer/tokenize.h): the command line around
// data/sentencepiece.h and data/token_encoder.h, and the progress display.
#include "trainer/tokenize.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/cpu/threads.h"
#include "data/token_encoder.h"
#include "data/token_shards.h"
#include "trainer/metrics.h"
#include "trainer/numbers.h"

namespace trainer {

namespace {

constexpr int64_t kMaxVocab = int64_t(1) << 24;
constexpr int64_t kMaxShardTokens = int64_t(1) << 40;
constexpr double kLineSeconds = 10;  // between progress lines when stderr is no terminal

int default_threads(int threads) {
  return threads > 0 ? threads : std::max<int>(1, int(allowed_cores().size()));
}

std::string megabytes(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", double(bytes) / 1e6);
  return buf;
}

std::string rate(double tokens, double seconds) {
  const double r = seconds > 0 ? tokens / seconds : 0;
  return r >= 1e6 ? cat(number_text(std::round(r / 1e4) / 100), "M")
                  : cat(number_text(std::round(r / 1e3)), "k");
}

// The progress of an encoding on stderr: a bar redrawn in place on a
// terminal, else a line every kLineSeconds.
class ProgressDisplay {
 public:
  ProgressDisplay() : tty_(::isatty(STDERR_FILENO) == 1) {}
  void operator()(const data::EncodeProgress& p) {
    const double done = p.total_bytes > 0 ? double(p.bytes) / double(p.total_bytes) : 1.0;
    const std::string figures =
        cat(int(done * 100), "% ", megabytes(p.bytes), " of ", megabytes(p.total_bytes), ", ",
            with_commas(p.tokens), " tokens, ", rate(double(p.tokens), p.seconds), " tokens/s");
    if (tty_) {
      const int width = 30, filled = int(done * width);
      std::fprintf(stderr, "\rtokenize [%s%s] %s   ", std::string(size_t(filled), '#').c_str(),
                   std::string(size_t(width - filled), '.').c_str(), figures.c_str());
      drawn_ = true;
    } else if (p.seconds >= last_ + kLineSeconds) {
      std::fprintf(stderr, "tokenize: %s\n", figures.c_str());
      last_ = p.seconds;
    }
    std::fflush(stderr);
  }
  ~ProgressDisplay() {
    if (drawn_) std::fputc('\n', stderr);
  }

 private:
  bool tty_;
  bool drawn_ = false;
  double last_ = 0;
};

// An option of the other form, when given.
void refuse(bool given, const char* option, const char* form) {
  if (given)
    throw Error(cat("trainer tokenize: ", option, " is for ", form,
                    "; `trainer tokenize --help` shows both forms"));
}

int train_tokenizer(const TokenizeArgs& a, std::vector<std::string> corpora) {
  refuse(a.shard_tokens > 0, "--shard-tokens", "encoding (--model)");
  if (a.vocab_size == 0)
    throw Error("trainer tokenize --train: give the vocabulary size (--vocab-size N, e.g. 8000)");
  const std::string type = a.type.empty() ? "bpe" : a.type;
  const data::SentencePieceSummary s = data::train_sentencepiece(
      {.corpora = std::move(corpora),
       .vocab_size = a.vocab_size,
       .type = type,
       .character_coverage = a.character_coverage > 0 ? a.character_coverage : 0.9995,
       .threads = default_threads(a.threads),
       .out = a.out});
  std::printf(
      "trained tokenizer %s: %s, %lld pieces (byte fallback), checksum %s, from %s lines (%s "
      "bytes) in %.1f s; %s lists the pieces\n",
      s.model_path.c_str(), type == "bpe" ? "BPE" : "unigram", (long long)s.vocab_size,
      data::checksum_hex(s.checksum).c_str(), with_commas(s.lines).c_str(),
      with_commas(s.bytes).c_str(), s.seconds, s.vocab_path.c_str());
  return 0;
}

int encode_corpora(const TokenizeArgs& a) {
  refuse(a.vocab_size > 0, "--vocab-size", "training (--train)");
  refuse(!a.type.empty(), "--type", "training (--train)");
  refuse(a.character_coverage > 0, "--character-coverage", "training (--train)");
  if (a.corpora.empty())
    throw Error("trainer tokenize --model: give the corpus files to encode after the options");
  auto tokenizer = data::SentencePieceTokenizer::load(a.model);
  const int threads = default_threads(a.threads);
  data::EncodeSummary s;
  {
    ProgressDisplay display;
    s = data::encode_corpora(
        *tokenizer,
        {.corpora = a.corpora,
         .out = a.out,
         .shard_tokens = a.shard_tokens > 0 ? a.shard_tokens : int64_t(1) << 24,
         .threads = threads},
        [&](const data::EncodeProgress& p) { display(p); });
  }
  if (s.mismatched_lines > 0)
    std::fprintf(stderr,
                 "warning: %lld lines do not decode to their text with %s (the first: %s): it "
                 "normalises text or has no byte fallback; `trainer tokenize --train` trains one "
                 "that gives every byte back\n",
                 (long long)s.mismatched_lines, a.model.c_str(), s.first_mismatch.c_str());
  std::printf(
      "encoded %lld file%s (%s bytes, %s lines) into %s tokens (%.2f bytes per token) in %.1f s "
      "(%s tokens/s, %d thread%s): %lld shard%s of uint%d in %s, with %s\n",
      (long long)s.files, s.files == 1 ? "" : "s", with_commas(s.bytes).c_str(),
      with_commas(s.lines).c_str(), with_commas(s.tokens).c_str(),
      double(s.bytes) / double(std::max<int64_t>(s.tokens, 1)), s.seconds,
      rate(double(s.tokens), s.seconds).c_str(), threads, threads == 1 ? "" : "s",
      (long long)s.shards, s.shards == 1 ? "" : "s", int(s.token_bytes * 8), a.out.c_str(),
      data::kTokenizerFile);
  return 0;
}

}  // namespace

CLI::App* add_tokenize_command(CLI::App& app, TokenizeArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "tokenize",
      "train a SentencePiece tokenizer (--train), or encode corpora into token shards (--model)");
  cmd->add_option("--train", a.train, "train a tokenizer on these text files")->expected(1, -1);
  cmd->add_option("--model", a.model, "encode the corpora with this tokenizer model");
  cmd->add_option("corpora", a.corpora, "text files to encode (with --model), or to train on");
  cmd->add_option("--out", a.out,
                  "--train: the model file to write (tok.model; tok.vocab beside it); --model: "
                  "the directory of token shards to write")
      ->required();
  cmd->add_option("--vocab-size", a.vocab_size, "--train: pieces in the vocabulary")
      ->check(integer_in(1, kMaxVocab));
  cmd->add_option("--type", a.type, "--train: bpe (default) or unigram")
      ->check(CLI::IsMember({"bpe", "unigram"}));
  cmd->add_option("--character-coverage", a.character_coverage,
                  "--train: the share of the corpus's characters that get pieces of their own, "
                  "the rarest others becoming bytes (default 0.9995)")
      ->check(number_in(0.5, 1.0));
  cmd->add_option("--shard-tokens", a.shard_tokens,
                  "--model: tokens per shard file (default 16777216, 2^24)")
      ->check(integer_in(1, kMaxShardTokens));
  cmd->add_option("--threads", a.threads, "threads; 0: every core this process may use")
      ->capture_default_str()
      ->check(integer_in(0, 4096));
  return cmd;
}

int tokenize_command(const TokenizeArgs& a) {
  if (a.train.empty() == a.model.empty())
    throw Error(
        "trainer tokenize: give either --train CORPUS... (train a tokenizer) or --model "
        "tok.model CORPUS... (encode corpora into token shards)");
  if (!a.train.empty()) {
    std::vector<std::string> corpora = a.train;
    corpora.insert(corpora.end(), a.corpora.begin(), a.corpora.end());
    return train_tokenizer(a, std::move(corpora));
  }
  return encode_corpora(a);
}

}  // namespace trainer
