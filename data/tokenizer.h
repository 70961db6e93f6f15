// What a language model's token ids mean: text -> ids and back. Two kinds
// implement it:
//
//   Vocab (data/text.h): one id per byte, either all 256 bytes or the
//     distinct bytes of a corpus ("byte" and "char" vocabularies);
//   SentencePieceTokenizer (data/sentencepiece.h): a SentencePiece model
//     (BPE or unigram subwords with byte fallback), as `trainer tokenize`
//     trains it and the token shards of data/token_shards.h are encoded with.
//
// The batch source of a language model hands its tokenizer to `trainer
// sample`, which encodes the prompt and decodes what the model generates,
// whichever kind it is.
//
//   const Tokenizer& t = session.vocab();
//   std::vector<int64_t> ids = t.encode("In the beginning");
//   std::string text = t.decode(ids);          // "In the beginning"
//   std::printf("%s\n", t.description().c_str());  // "char vocabulary of 73"
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace trainer::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Ids are [0, size()).
  virtual int64_t size() const = 0;
  // Error when the text holds what the tokenizer cannot encode (a byte
  // outside a character vocabulary), naming it.
  virtual std::vector<int64_t> encode(std::string_view text) const = 0;
  // The text of ids in [0, size()).
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  // For summaries: "char vocabulary of 73", "byte vocabulary of 256",
  // "SentencePiece vocabulary of 1000 (DIR/tokenizer.model, checksum ...)".
  virtual std::string description() const = 0;
};

}  // namespace trainer::data
