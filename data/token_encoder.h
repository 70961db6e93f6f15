// Encoding text corpora into a token directory (data/token_shards.h) with
// a SentencePiece tokenizer, on several threads.
//
// Each corpus file is read in chunks of whole lines (about 256 KiB); a batch
// of chunks is encoded in parallel, one chunk per task, each line with its
// line break, and the tokens are appended to the shards in file and line
// order, so the result does not depend on the thread count. After each file
// the tokenizer's end-of-text id (eos) is appended, marking the document
// boundary; it decodes to nothing, so decoding the shards in order (or each
// shard on its own, concatenated) gives the files' bytes exactly. Every line
// is decoded again as it is encoded and compared with its text: a line that
// does not come back (only possible with a model without byte fallback, or
// one that normalises text) is counted and the first is named. The
// directory's tokenizer.model is written last.
//
//   EncodeOptions o{.corpora = {"datasets/kjv.txt"}, .out = "datasets/kjv_tokens"};
//   EncodeSummary s = encode_corpora(*SentencePieceTokenizer::load("tok.model"), o,
//                                    [](const EncodeProgress& p) { ... });
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/sentencepiece.h"

namespace trainer::data {

struct EncodeOptions {
  std::vector<std::string> corpora;
  std::string out;                          // the token directory
  int64_t shard_tokens = int64_t(1) << 24;  // tokens per shard
  int threads = 1;
  size_t chunk_bytes = size_t(1) << 18;  // text per task
};

struct EncodeProgress {
  int64_t bytes = 0, total_bytes = 0;  // of all corpora
  int64_t tokens = 0;
  int64_t files = 0;  // done
  double seconds = 0;
};

struct EncodeSummary {
  int64_t files = 0, bytes = 0, lines = 0, tokens = 0, shards = 0;
  uint32_t token_bytes = 0;
  int64_t mismatched_lines = 0;  // lines that did not decode to their text
  std::string first_mismatch;    // "file:line" of the first
  double seconds = 0;
};

// Writes the shards and tokenizer.model into options.out; Error naming the
// corpus or the directory (a missing corpus, no tokens at all, a directory
// that already holds shards). `progress` is called after each batch.
EncodeSummary encode_corpora(const SentencePieceTokenizer& tokenizer, const EncodeOptions& options,
                             const std::function<void(const EncodeProgress&)>& progress = {});

}  // namespace trainer::data
