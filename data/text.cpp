// Text corpora, vocabularies and windows for language models.
#include "data/text.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "core/check.h"
#include "core/rng.h"
#include "data/files.h"

namespace trainer::data {

namespace {

// "'a'" for printable bytes, "byte 0x0a" otherwise.
std::string describe_byte(uint8_t b) {
  if (b >= 0x20 && b < 0x7f) return cat("'", char(b), "'");
  char buf[16];
  std::snprintf(buf, sizeof buf, "byte 0x%02x", unsigned(b));
  return buf;
}

Vocab corpus_vocab(std::string_view text, VocabKind kind, const std::string& name) {
  if (text.empty()) throw Error(cat("the text corpus ", name, " is empty"));
  return kind == VocabKind::chars ? Vocab::from_text(text) : Vocab::bytes();
}

// Rows [N, T] of inputs and targets from the windows starting at `starts`.
TextBatch gather_windows(const TokenSource& tokens, const std::vector<int64_t>& starts, int64_t T) {
  const int64_t N = int64_t(starts.size());
  TextBatch b{empty({N, T}, DType::i64), empty({N, T}, DType::i64)};
  int64_t* in = b.inputs.data<int64_t>();
  int64_t* out = b.targets.data<int64_t>();
  std::vector<int64_t> w(size_t(T + 1));
  for (int64_t n = 0; n < N; ++n) {
    tokens.read(starts[size_t(n)], T + 1, w.data());
    std::copy(w.begin(), w.end() - 1, in + n * T);
    std::copy(w.begin() + 1, w.end(), out + n * T);
  }
  return b;
}

int64_t train_part(int64_t tokens, double val_fraction, const std::string& name) {
  if (!(val_fraction >= 0.0 && val_fraction < 1.0))
    throw Error(cat("text corpus ", name, ": val_fraction ", val_fraction, " is outside [0, 1)"));
  return tokens - int64_t(std::llround(double(tokens) * val_fraction));
}

}  // namespace

Vocab::Vocab(VocabKind kind, std::vector<uint8_t> symbols)
    : kind_(kind), symbols_(std::move(symbols)) {
  id_of_.fill(-1);
  for (size_t i = 0; i < symbols_.size(); ++i) id_of_[symbols_[i]] = int16_t(i);
}

Vocab Vocab::bytes() {
  std::vector<uint8_t> all(256);
  for (int i = 0; i < 256; ++i) all[size_t(i)] = uint8_t(i);
  return Vocab(VocabKind::bytes, std::move(all));
}

Vocab Vocab::from_text(std::string_view text) {
  if (text.empty()) throw Error("a character vocabulary needs a non-empty text");
  bool seen[256] = {};
  for (char c : text) seen[uint8_t(c)] = true;
  std::vector<uint8_t> symbols;
  for (int b = 0; b < 256; ++b)
    if (seen[b]) symbols.push_back(uint8_t(b));
  return Vocab(VocabKind::chars, std::move(symbols));
}

Vocab Vocab::from_symbols(const std::vector<int64_t>& symbols) {
  if (symbols.empty()) throw Error("vocabulary: no symbols");
  std::vector<uint8_t> bytes;
  for (size_t i = 0; i < symbols.size(); ++i) {
    if (symbols[i] < 0 || symbols[i] > 255 || (i > 0 && symbols[i] <= symbols[i - 1]))
      throw Error(cat("vocabulary: symbol ", i, " = ", symbols[i],
                      " is not a byte above the one before it"));
    bytes.push_back(uint8_t(symbols[i]));
  }
  return Vocab(bytes.size() == 256 ? VocabKind::bytes : VocabKind::chars, std::move(bytes));
}

std::vector<int64_t> Vocab::encode(std::string_view text) const {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    int16_t id = id_of_[uint8_t(text[i])];
    if (id < 0)
      throw Error(cat(describe_byte(uint8_t(text[i])), " (offset ", i,
                      ") is not in the corpus's character vocabulary of ", size(), " symbols"));
    ids[i] = id;
  }
  return ids;
}

std::string Vocab::description() const {
  return cat(kind_ == VocabKind::bytes ? "byte" : "char", " vocabulary of ", size());
}

std::string Vocab::decode(const std::vector<int64_t>& ids) const {
  std::string text(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    CHECK(ids[i] >= 0 && ids[i] < size()) << "token id " << ids[i] << ", vocabulary " << size();
    text[i] = char(symbols_[size_t(ids[i])]);
  }
  return text;
}

TextCorpus TextCorpus::load(const std::string& path, const TextOptions& options) {
  std::string text;
  try {
    text = read_regular_file(path, "the text corpus");
  } catch (const Error& e) {
    throw Error(cat(e.what(), " (scripts/setup.sh writes datasets/kjv.txt; or set data.path)"));
  }
  return TextCorpus(text, options, path);
}

TextCorpus::TextCorpus(std::string_view text, const TextOptions& options, std::string name)
    : name_(std::move(name)) {
  auto vocab = std::make_shared<Vocab>(corpus_vocab(text, options.vocab, name_));
  train_tokens_ = train_part(int64_t(text.size()), options.val_fraction, name_);
  std::vector<int64_t> ids = vocab->encode(text);
  tokens_ = TokenSource::bytes(std::vector<uint8_t>(ids.begin(), ids.end()));
  tokenizer_ = std::move(vocab);
}

TextCorpus::TextCorpus(TokenSource tokens, std::shared_ptr<const Tokenizer> tokenizer,
                       double val_fraction, std::string name)
    : name_(std::move(name)), tokenizer_(std::move(tokenizer)), tokens_(std::move(tokens)) {
  CHECK(tokenizer_ != nullptr) << name_ << ": no tokenizer";
  if (tokens_.size() == 0) throw Error(cat("the token corpus ", name_, " holds no tokens"));
  train_tokens_ = train_part(tokens_.size(), val_fraction, name_);
}

const Vocab& TextCorpus::vocab() const {
  const Vocab* v = dynamic_cast<const Vocab*>(tokenizer_.get());
  CHECK(v != nullptr) << name_ << " is not a text corpus with a byte or character vocabulary";
  return *v;
}

TextWindows::TextWindows(const TextCorpus& corpus, const WindowOptions& options)
    : corpus_(corpus), options_(options) {
  const int64_t T = options.seq_len;
  CHECK(T >= 1) << "sequence length " << T;
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size)
    throw Error(
        cat("text windows: rank ", options.rank, " is outside world size ", options.world_size));
  if (corpus.train_tokens() < T + 1)
    throw Error(cat("text corpus ", corpus.name(), ": the training part has ",
                    corpus.train_tokens(), " tokens, fewer than one window of T + 1 = ", T + 1,
                    "; use a longer corpus or a shorter sequence length"));
  if (options.streams > 0) {
    const int64_t streams = options.streams * options.world_size;
    stream_len_ = (corpus.train_tokens() - T) / streams;
    if (stream_len_ < T)
      throw Error(cat("text corpus ", corpus.name(), ": the training part's ",
                      corpus.train_tokens(), " tokens cannot make ", streams,
                      " contiguous streams of at least one window of ", T,
                      " tokens; use fewer streams (a smaller batch) or random windows"));
    per_rank_ = stream_len_ / T * options.streams;
    return;
  }
  per_rank_ = (corpus.train_tokens() - 1) / T / options.world_size;
  if (per_rank_ == 0)
    throw Error(cat("text corpus ", corpus.name(), ": ", (corpus.train_tokens() - 1) / T,
                    " training windows cannot give each of ", options.world_size,
                    " ranks one window"));
}

int64_t TextWindows::start(int64_t epoch, int64_t index) const {
  CHECK(epoch >= 0 && index >= 0) << "epoch " << epoch << ", window " << index;
  // Starts in [0, train - T - 1]; a 64-bit draw modulo at most 2^40 starts
  // is uniform to within 2^-24.
  const uint64_t starts = uint64_t(corpus_.train_tokens() - options_.seq_len);
  PhiloxKey key{options_.seed, kStreamShuffle + (uint64_t(epoch) << 8), 0};
  Philox4x32 r = philox_block(key, uint64_t(index));
  uint64_t u = uint64_t(r.v[0]) | uint64_t(r.v[1]) << 32;
  return int64_t(u % starts);
}

int64_t TextWindows::stream_start(int64_t epoch, int64_t i, int64_t k) const {
  PhiloxKey key{options_.seed, kStreamShuffle + (uint64_t(epoch) << 8), 0};
  const int64_t offset = int64_t(philox_block(key, 0).v[0] % uint32_t(options_.seq_len));
  const int64_t stream = int64_t(options_.rank) * options_.streams + i;
  return offset + stream * stream_len_ + k * options_.seq_len;
}

TextBatch TextWindows::batch(int64_t epoch, int64_t position, int64_t n) const {
  if (position < 0 || n < 0 || position + n > per_rank_ ||
      (contiguous() && (position % options_.streams != 0 || n != options_.streams)))
    throw Error(cat("text windows [", position, ", ", position + n,
                    ") are outside this rank's epoch of ", per_rank_,
                    contiguous() ? cat(" windows in chunks of ", options_.streams) : " windows",
                    "; was the checkpoint written with another corpus, sequence "
                    "length, batch or world size?"));
  std::vector<int64_t> starts;
  for (int64_t p = position; p < position + n; ++p)
    starts.push_back(contiguous() ? stream_start(epoch, p % options_.streams, p / options_.streams)
                                  : start(epoch, p * options_.world_size + options_.rank));
  return gather_windows(corpus_.tokens(), starts, options_.seq_len);
}

EvalWindows::EvalWindows(const TextCorpus& corpus, const EvalOptions& options)
    : corpus_(corpus), options_(options) {
  const int64_t T = options.seq_len;
  CHECK(T >= 1 && options.max_windows >= 0) << "sequence length " << T;
  CHECK(options.streams >= 0) << "evaluation streams " << options.streams;
  const int64_t streams = std::max<int64_t>(options.streams, 1);
  stream_len_ = corpus.val_tokens() > 0 ? (corpus.val_tokens() - 1) / streams : 0;
  available_ = stream_len_ / T;
  if (available_ == 0)
    throw Error(cat("text corpus ", corpus.name(), ": the validation part has ",
                    corpus.val_tokens(), " tokens, fewer than ",
                    options.streams > 0 ? cat(streams, " streams of ") : std::string(),
                    "one window of T + 1 = ", T + 1,
                    "; raise the validation fraction or shorten the sequence length",
                    options.streams > 0 ? " or the batch" : ""));
  if (options.streams == 0) {
    count_ = options.max_windows > 0 ? std::min(options.max_windows, available_) : available_;
    return;
  }
  // Whole chunks: max_windows rounds up to a multiple of the streams.
  int64_t chunks = available_;
  if (options.max_windows > 0)
    chunks = std::min(chunks, (options.max_windows + streams - 1) / streams);
  count_ = chunks * streams;
}

int64_t EvalWindows::start(int64_t k) const {
  CHECK(k >= 0 && k < count_) << "evaluation window " << k << " of " << count_;
  if (options_.streams > 0)
    return corpus_.train_tokens() + (k % options_.streams) * stream_len_ +
           (k / options_.streams) * options_.seq_len;
  // Evenly spread: window floor(k * available / count) of the sequential ones.
  int64_t sequential = k * available_ / count_;
  return corpus_.train_tokens() + sequential * options_.seq_len;
}

TextBatch EvalWindows::batch(int64_t first, int64_t n) const {
  CHECK(first >= 0 && first < count_ && n >= 1) << "evaluation windows " << first << " + " << n;
  std::vector<int64_t> starts;
  for (int64_t k = first; k < std::min(first + n, count_); ++k) starts.push_back(start(k));
  return gather_windows(corpus_.tokens(), starts, options_.seq_len);
}

}  // namespace trainer::data
