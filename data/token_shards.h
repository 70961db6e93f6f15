// Token shards: a corpus encoded once by a SentencePiece tokenizer
// (`trainer tokenize --model ...`, data/token_encoder.h) and read by
// language models as a corpus of tokens (data.name: tokens), without the
// text and without loading the tokens into memory.
//
// A token directory holds shard_00000.tok, shard_00001.tok, ... (five or
// more digits, numbered from 0 without gaps) and tokenizer.model, a copy
// of the tokenizer that wrote them, so it is self-contained. A shard is a
// 48-byte header followed by its tokens, every integer little-endian:
//
//   offset  bytes  field
//   0       8      magic "TRTOKENS"
//   8       4      version, 1
//   12      4      bytes per token: 2 (uint16) when every id of the
//                  vocabulary fits, i.e. vocabulary size <= 65536; else 4 (uint32)
//   16      8      vocabulary size
//   24      8      tokens in this shard (n)
//   32      8      checksum of tokenizer.model (FNV-1a 64 of its bytes)
//   40      8      checksum of bytes 0..39 (FNV-1a 64)
//   48      n x w  the tokens
//
// The file is exactly 48 + n x w bytes long. Every shard of a directory has
// the same bytes per token, vocabulary size and tokenizer checksum, those
// of its tokenizer.model. Shards are written to a temporary file and
// renamed when complete; tokenizer.model is written last, so a directory
// whose encoding stopped part way has none and is refused.
//
// Reading maps every shard read-only (mmap) and checks its header and
// length; the tokens are concatenated logically in shard order (a window
// may cross from one shard into the next) and read in place. Each id is
// checked against the vocabulary size when a window reads it.
//
//   ShardWriter w("out", {.vocab_size = 1000, .tokenizer_checksum = c, .shard_tokens = 1 << 24});
//   w.append(ids.data(), int64_t(ids.size()));
//   w.finish();
//   TokenDirectory d = open_token_directory("out");    // d.tokens[i], d.tokenizer
//   TextCorpus corpus = load_token_corpus("out", /*val_fraction=*/0.1);
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "data/files.h"
#include "data/sentencepiece.h"
#include "data/text.h"
#include "data/token_source.h"

namespace trainer::data {

inline constexpr size_t kShardHeaderBytes = 48;
inline constexpr uint32_t kShardVersion = 1;
inline constexpr char kShardMagic[9] = "TRTOKENS";
inline constexpr const char* kTokenizerFile = "tokenizer.model";

struct ShardHeader {
  uint32_t version = kShardVersion;
  uint32_t token_bytes = 2;  // 2 or 4
  uint64_t vocab_size = 0;
  uint64_t tokens = 0;
  uint64_t tokenizer_checksum = 0;
};

// The header's 48 bytes (its checksum filled in).
std::array<uint8_t, kShardHeaderBytes> encode_shard_header(const ShardHeader& header);
// The header of a file's first n bytes; Error naming `name` when they are
// too few, the magic, version, bytes per token or checksum is wrong.
ShardHeader decode_shard_header(const uint8_t* bytes, size_t n, const std::string& name);
// 2 when every id of a vocabulary of this size fits in uint16, else 4.
uint32_t token_bytes_for(int64_t vocab_size);
// "shard_00000.tok" for index 0.
std::string shard_file_name(int64_t index);

struct ShardWriterOptions {
  int64_t vocab_size = 0;
  uint64_t tokenizer_checksum = 0;
  int64_t shard_tokens = int64_t(1) << 24;  // tokens per shard (the last one may hold fewer)
};

// Writes a directory's shards in order, each atomically. The directory is
// made if needed and must not hold shards or a tokenizer.model yet (an
// Error says so: shards of two encodings must never mix).
class ShardWriter {
 public:
  ShardWriter(std::string dir, const ShardWriterOptions& options);
  ~ShardWriter();
  // Ids in [0, vocab_size).
  void append(const int32_t* ids, int64_t n);
  // Writes the shard in progress; nothing is appended after it.
  void finish();
  int64_t tokens() const { return tokens_; }
  int64_t shards() const { return shards_; }
  uint32_t token_bytes() const { return token_bytes_; }

 private:
  void close_shard();

  std::string dir_;
  ShardWriterOptions options_;
  uint32_t token_bytes_;
  std::unique_ptr<AtomicFile> file_;  // the shard in progress
  int64_t in_shard_ = 0, tokens_ = 0, shards_ = 0;
  std::vector<uint8_t> buffer_;
};

// A token directory opened for reading: its shards mapped and checked, and
// its tokenizer.
struct TokenDirectory {
  std::string dir;
  TokenSource tokens;  // every shard, in order; ids checked against the vocabulary
  std::shared_ptr<const SentencePieceTokenizer> tokenizer;
  int64_t shards = 0;
  uint32_t token_bytes = 0;
};
// Error naming the directory or the shard for: no shards, a gap in their
// numbers, no tokenizer.model, a shard too short for its header, a wrong
// magic, version, bytes per token or header checksum, a length that is not
// the header's, or a vocabulary or tokenizer checksum other than
// tokenizer.model's.
TokenDirectory open_token_directory(const std::string& dir);

// The corpus of a token directory: its tokens, split by val_fraction as a
// text corpus is, with its SentencePiece tokenizer.
TextCorpus load_token_corpus(const std::string& dir, double val_fraction);

}  // namespace trainer::data
