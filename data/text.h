// Text for language models: a corpus file read whole and encoded as token
// ids, its vocabulary, a train/val split by position, and the windows that
// training steps and evaluations read. A corpus may also be tokens encoded
// beforehand with a SentencePiece tokenizer (data/token_shards.h: shards
// mapped from disk, never read whole); its windows are the same functions
// of the token positions as a text corpus's.
//
// Glossary: T = sequence length (the tokens a model sees per row); a window
// is T + 1 consecutive tokens whose first T are the inputs and last T the
// targets (the inputs shifted by one); N = windows per batch.
//
// Vocabulary: bytes (256 ids, id = byte value, any file) or the corpus's
// characters (its distinct bytes in increasing order, so the same corpus
// always gives the same ids; the list is also saved with checkpoints); a
// token corpus has its SentencePiece tokenizer. All are Tokenizers
// (data/tokenizer.h).
//
// Split: the first (1 - val_fraction) of the tokens train, the rest
// validate; no window crosses the boundary.
//
// Training windows: an epoch is floor((train tokens - 1) / T) windows, one
// pass's worth of targets. Window i of epoch e starts at a position drawn
// from Philox(seed, kStreamShuffle + (e << 8)) block i: a pure function of
// (seed, epoch, index), as the image path keys its samples, so a resumed
// run reads the same windows. Data-parallel rank r of world w takes the
// epoch's windows r, r + w, r + 2w, ... (the tail that does not divide is
// dropped). Evaluation windows are sequential and non-overlapping: window k
// starts k * T tokens into the validation part; max_windows > 0 evaluates
// that many, evenly spread over the part.
//
// Contiguous streams (streams > 0; truncated backpropagation through time,
// as PyTorch's word_language_model batchifies): the training part is cut
// into S = streams x world streams of L = floor((train tokens - T) / S)
// tokens. In epoch e they start at o_e + j L, the offset o_e in [0, T) drawn
// from Philox(seed, kStreamShuffle + (e << 8)) so window boundaries move
// between epochs. Rank r owns streams r * streams ... (r + 1) * streams - 1;
// an epoch is floor(L / T) chunks, and the batch at position k x streams is
// window k of each of the rank's streams: row i of consecutive batches
// continues the same text, so a recurrent model carries its state across
// them. Evaluation streams cut the validation part the same way (no
// offset), window k of stream j at index k S + j, so batch(k S + first, n)
// is chunk k of streams first ... first + n - 1; max_windows > 0 keeps the
// first ceil(max_windows / S) chunks.
//
//   TextCorpus corpus = TextCorpus::load("datasets/kjv.txt", {.vocab = VocabKind::chars});
//   // or: TextCorpus corpus = load_token_corpus("datasets/kjv_tokens", 0.1);
//   TextWindows train(corpus, {.seq_len = 256, .seed = 0});
//   TextBatch b = train.batch(/*epoch=*/0, /*position=*/0, /*n=*/32);   // i64 [32, 256] x 2
//   EvalWindows val(corpus, {.seq_len = 256});
//   TextBatch v = val.batch(/*first=*/0, /*n=*/16);
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "data/token_source.h"
#include "data/tokenizer.h"

namespace trainer::data {

enum class VocabKind { bytes, chars };

// Token id <-> byte. Every id is below 256, so the corpus is one byte per token.
class Vocab final : public Tokenizer {
 public:
  static Vocab bytes();
  // The distinct bytes of text in increasing order (Error when text is empty).
  static Vocab from_text(std::string_view text);
  // A vocabulary saved earlier (e.g. with a checkpoint): distinct bytes, increasing.
  static Vocab from_symbols(const std::vector<int64_t>& symbols);

  int64_t size() const override { return int64_t(symbols_.size()); }
  VocabKind kind() const { return kind_; }
  // id -> byte, in id order.
  const std::vector<uint8_t>& symbols() const { return symbols_; }
  bool contains(uint8_t byte) const { return id_of_[byte] >= 0; }
  // Throws Error naming the first byte that is not in the vocabulary.
  std::vector<int64_t> encode(std::string_view text) const override;
  // Ids must be in [0, size()).
  std::string decode(const std::vector<int64_t>& ids) const override;
  // "char vocabulary of 73" or "byte vocabulary of 256".
  std::string description() const override;
  bool operator==(const Vocab& o) const { return symbols_ == o.symbols_; }

 private:
  Vocab(VocabKind kind, std::vector<uint8_t> symbols);

  VocabKind kind_;
  std::vector<uint8_t> symbols_;
  std::array<int16_t, 256> id_of_;  // byte -> id, -1 when absent
};

struct TextOptions {
  VocabKind vocab = VocabKind::bytes;
  double val_fraction = 0.1;  // the last fraction of the tokens, in [0, 1)
};

class TextCorpus {
 public:
  // Reads the file whole; Error when it is missing, unreadable or empty.
  static TextCorpus load(const std::string& path, const TextOptions& options = {});
  // A corpus from memory; name is used in messages.
  TextCorpus(std::string_view text, const TextOptions& options, std::string name);
  // Tokens encoded beforehand (a token directory's shards,
  // data/token_shards.h) with the tokenizer that wrote them; Error when
  // there are none or val_fraction is outside [0, 1).
  TextCorpus(TokenSource tokens, std::shared_ptr<const Tokenizer> tokenizer, double val_fraction,
             std::string name);

  const std::string& name() const { return name_; }
  // What the ids mean (a Vocab, or a SentencePiece model).
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  // The byte or character vocabulary of a text corpus (CHECKed to be one).
  const Vocab& vocab() const;
  int64_t size() const { return tokens_.size(); }
  // Tokens [0, train_tokens()) train, [train_tokens(), size()) validate.
  int64_t train_tokens() const { return train_tokens_; }
  int64_t val_tokens() const { return size() - train_tokens_; }
  const TokenSource& tokens() const { return tokens_; }

 private:
  std::string name_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  TokenSource tokens_;
  int64_t train_tokens_ = 0;
};

// N windows w of T + 1 tokens: inputs = w[0, T), targets = w[1, T + 1), i64 [N, T] each.
struct TextBatch {
  Tensor inputs;
  Tensor targets;
};

struct WindowOptions {
  int64_t seq_len = 256;  // T
  uint64_t seed = 0;
  int rank = 0;
  int world_size = 1;
  int64_t streams = 0;  // per rank; 0: random windows, else contiguous streams
};

// Random training windows (see the top of the file).
class TextWindows {
 public:
  // Error when the training part is shorter than one window.
  TextWindows(const TextCorpus& corpus, const WindowOptions& options);
  // This rank's windows per epoch.
  int64_t windows_per_epoch() const { return per_rank_; }
  int64_t seq_len() const { return options_.seq_len; }
  bool contiguous() const { return options_.streams > 0; }
  // Random windows: the start token of window `index` (counted over all
  // ranks) of an epoch.
  int64_t start(int64_t epoch, int64_t index) const;
  // This rank's windows [position, position + n) of the epoch. Contiguous:
  // position a multiple of streams and n == streams (one chunk).
  TextBatch batch(int64_t epoch, int64_t position, int64_t n) const;

 private:
  // Contiguous: the start of chunk k of this rank's local stream i.
  int64_t stream_start(int64_t epoch, int64_t i, int64_t k) const;

  const TextCorpus& corpus_;
  WindowOptions options_;
  int64_t per_rank_ = 0;
  int64_t stream_len_ = 0;  // contiguous: L
};

struct EvalOptions {
  int64_t seq_len = 256;    // T
  int64_t max_windows = 0;  // 0: every window of the validation part
  int64_t streams = 0;      // 0: sequential windows, else S contiguous streams
};

// Sequential, non-overlapping validation windows (see the top of the file).
class EvalWindows {
 public:
  // Error when the validation part is shorter than one window.
  EvalWindows(const TextCorpus& corpus, const EvalOptions& options);
  int64_t size() const { return count_; }
  int64_t streams() const { return options_.streams; }
  // Start token of evaluation window k.
  int64_t start(int64_t k) const;
  // Windows [first, first + n), n clipped to the end.
  TextBatch batch(int64_t first, int64_t n) const;

 private:
  const TextCorpus& corpus_;
  EvalOptions options_;
  int64_t available_ = 0;   // non-overlapping windows in the validation part (per stream)
  int64_t count_ = 0;       // those evaluated (over all streams)
  int64_t stream_len_ = 0;  // streams: tokens per stream
};

}  // namespace trainer::data
