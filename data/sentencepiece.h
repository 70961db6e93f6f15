// SentencePiece subword tokenizers: training one on text corpora, and a
// Tokenizer (data/tokenizer.h) over a model file.
//
// Training (train_sentencepiece) reads the corpora line by line (each line
// a sentence, without its line break) and fixes the options a language
// model wants: byte fallback (a character outside the pieces becomes its
// UTF-8 bytes, one token each: nothing is unknown), no normalisation
// (normalization_rule_name identity), whitespace kept as it is
// (remove_extra_whitespaces false, no dummy prefix), digits split into
// single pieces, and the special ids unk 0, bos 1, eos 2, pad 3. Lines
// longer than 4192 bytes are left out of training (not of encoding). It
// writes the model (OUT) and the list of pieces with their scores (OUT with
// .model replaced by .vocab, as spm_train writes them), each atomically.
//
// Encoding is exact: decode(encode(text)) == text for any bytes. The parts
// of a text SentencePiece itself would not give back (bytes that are not
// UTF-8, which it would replace with U+FFFD, and U+2581, its whitespace
// mark, which it would decode as a space) are encoded as their byte pieces
// directly, and decoding maps every id to its bytes (a piece's text with
// U+2581 as a space, a byte piece's byte, control ids such as eos to
// nothing) without SentencePiece's UTF-8 clean-up. That needs the model's
// byte pieces: with a model trained without byte fallback such text is
// encoded as SentencePiece encodes it (with unknown pieces).
//
// The checksum of a model is FNV-1a (64 bits) over its file's bytes: token
// shards record it, so tokens are never read with another tokenizer.
//
//   SentencePieceTrainOptions o{.corpora = {"datasets/kjv.txt"}, .vocab_size = 1000,
//                               .out = "tok.model"};
//   SentencePieceSummary s = train_sentencepiece(o);
//   auto tok = SentencePieceTokenizer::load("tok.model");
//   std::vector<int64_t> ids = tok->encode("In the beginning\n");
//   std::string text = tok->decode(ids);   // "In the beginning\n"
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace trainer::data {

// FNV-1a, 64 bits, of bytes.
uint64_t fnv1a64(std::string_view bytes);
// 16 lower-case hex digits.
std::string checksum_hex(uint64_t checksum);

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // Error naming the path when the file is missing or not a SentencePiece model.
  static std::shared_ptr<const SentencePieceTokenizer> load(const std::string& path);
  // A model's bytes; `name` is used in messages.
  static std::shared_ptr<const SentencePieceTokenizer> from_bytes(std::string model,
                                                                  std::string name);
  ~SentencePieceTokenizer() override;

  int64_t size() const override { return int64_t(surface_.size()); }
  std::vector<int64_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int64_t>& ids) const override;
  std::string description() const override;
  // Appends the ids of text to out (the encoder's path: no conversion).
  void encode_into(std::string_view text, std::vector<int32_t>& out) const;
  // Appends the text of ids to out.
  void decode_into(const int32_t* ids, int64_t n, std::string& out) const;

  const std::string& name() const { return name_; }
  const std::string& model_bytes() const { return model_; }
  uint64_t checksum() const { return checksum_; }
  // -1 when the model defines none.
  int64_t eos_id() const { return eos_id_; }
  // Whether every byte has its byte piece (byte fallback): encoding is exact.
  bool has_byte_pieces() const { return byte_pieces_; }

 private:
  SentencePieceTokenizer(std::string model, std::string name);
  void encode_pieces(std::string_view text, std::vector<int32_t>& out) const;

  std::string name_;
  std::string model_;
  uint64_t checksum_ = 0;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
  std::vector<std::string> surface_;  // id -> its bytes in decoded text
  std::array<int32_t, 256> byte_id_;  // byte -> its byte piece, -1 when absent
  bool byte_pieces_ = false;
  int64_t eos_id_ = -1;
};

struct SentencePieceTrainOptions {
  std::vector<std::string> corpora;  // text files, read line by line
  int64_t vocab_size = 8000;
  std::string type = "bpe";  // bpe | unigram
  double character_coverage = 0.9995;
  int threads = 1;
  std::string out;  // the model file (tok.model)
  // At most this many lines sampled from the corpora for training (0: all).
  int64_t max_sentences = 10000000;
};

struct SentencePieceSummary {
  std::string model_path, vocab_path;
  int64_t vocab_size = 0;
  uint64_t checksum = 0;
  int64_t lines = 0, bytes = 0;  // read from the corpora
  double seconds = 0;
};

// Trains a model and writes it (see the top of the file); Error naming the
// corpus or the option when SentencePiece refuses (an empty corpus, a
// vocabulary larger than the corpus can fill).
SentencePieceSummary train_sentencepiece(const SentencePieceTrainOptions& options);

// The .vocab file beside a model file: "tok.model" -> "tok.vocab", "tok" -> "tok.vocab".
std::string vocab_path_of(const std::string& model_path);

}  // namespace trainer::data
