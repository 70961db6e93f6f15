// A corpus's tokens as one read-only sequence of ids, wherever they are
// stored: bytes held in memory (a text corpus encoded by its Vocab,
// data/text.h) or the memory-mapped shards of a token directory
// (data/token_shards.h), 2 or 4 little-endian bytes per token, read in
// place and concatenated logically in shard order. The windows of
// data/text.h read ranges of it, so text and token shards share one
// windowing code.
//
// A source may carry a limit (the vocabulary size its tokens were written
// for): a token read at or above it is an Error naming the segment (the
// shard file) and the position, since mapped shards are never read whole
// up front.
//
//   TokenSource s = TokenSource::bytes({'a', 'b', 'c'});
//   int64_t ids[2];
//   s.read(/*begin=*/1, /*n=*/2, ids);   // {98, 99}
//   int64_t first = s[0];                // 97
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace trainer::data {

class TokenSource {
 public:
  // A run of consecutive tokens: `width` bytes each, 1 (a byte) or 2 or 4
  // (unsigned, little-endian).
  struct Segment {
    const uint8_t* data = nullptr;
    int width = 1;
    int64_t count = 0;
    std::string name;  // for messages: a shard's path
  };

  TokenSource() = default;
  // Tokens held in memory, one byte each.
  static TokenSource bytes(std::vector<uint8_t> tokens);
  // The segments in order; `owner` keeps their memory alive (mappings, a
  // buffer). limit > 0: every id read must be below it.
  TokenSource(std::vector<Segment> segments, std::shared_ptr<const void> owner, int64_t limit = 0);

  int64_t size() const { return size_; }
  const std::vector<Segment>& segments() const { return segments_; }
  // Token i (CHECKed to be in [0, size())).
  int64_t operator[](int64_t i) const;
  // Tokens [begin, begin + n) into out[0, n), across segment boundaries.
  void read(int64_t begin, int64_t n, int64_t* out) const;

 private:
  std::vector<Segment> segments_;
  std::vector<int64_t> starts_;  // the first token of each segment
  std::shared_ptr<const void> owner_;
  int64_t size_ = 0;
  int64_t limit_ = 0;
};

}  // namespace trainer::data
