// Tokens read in place from memory or mapped shards; see token_source.h.
#include "data/token_source.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "core/check.h"

namespace trainer::data {

namespace {

// An unsigned little-endian integer of `Width` bytes.
template <int Width>
uint64_t load_le(const uint8_t* p) {
  if constexpr (Width == 1) {
    return *p;
  } else if constexpr (std::endian::native == std::endian::little) {
    std::conditional_t<Width == 2, uint16_t, uint32_t> v;
    std::memcpy(&v, p, Width);
    return v;
  } else {
    uint64_t v = 0;
    for (int b = Width - 1; b >= 0; --b) v = v << 8 | p[b];
    return v;
  }
}

template <int Width>
void copy_tokens(const TokenSource::Segment& s, int64_t first, int64_t n, int64_t limit,
                 int64_t* out) {
  const uint8_t* p = s.data + first * Width;
  for (int64_t i = 0; i < n; ++i) out[i] = int64_t(load_le<Width>(p + i * Width));
  if (limit <= 0) return;
  for (int64_t i = 0; i < n; ++i)
    if (out[i] >= limit)
      throw Error(cat(s.name, ": token ", first + i, " of the file is ", out[i],
                      ", not below the vocabulary size ", limit,
                      " it was written for; the file is damaged: encode the corpus again "
                      "(`trainer tokenize --model ...`)"));
}

}  // namespace

TokenSource TokenSource::bytes(std::vector<uint8_t> tokens) {
  auto owner = std::make_shared<std::vector<uint8_t>>(std::move(tokens));
  Segment s{.data = owner->data(), .width = 1, .count = int64_t(owner->size()), .name = "memory"};
  return TokenSource({s}, owner);
}

TokenSource::TokenSource(std::vector<Segment> segments, std::shared_ptr<const void> owner,
                         int64_t limit)
    : segments_(std::move(segments)), owner_(std::move(owner)), limit_(limit) {
  for (const Segment& s : segments_) {
    CHECK(s.width == 1 || s.width == 2 || s.width == 4) << "token width " << s.width;
    CHECK(s.count >= 0 && (s.count == 0 || s.data)) << s.name << ": " << s.count << " tokens";
    starts_.push_back(size_);
    size_ += s.count;
  }
}

int64_t TokenSource::operator[](int64_t i) const {
  int64_t id = 0;
  read(i, 1, &id);
  return id;
}

void TokenSource::read(int64_t begin, int64_t n, int64_t* out) const {
  CHECK(begin >= 0 && n >= 0 && begin + n <= size_)
      << "tokens [" << begin << ", " << begin + n << ") of " << size_;
  // The last segment starting at or before `begin` (empty ones skipped below).
  size_t k = size_t(std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin()) - 1;
  while (n > 0) {
    const Segment& s = segments_[k];
    const int64_t first = begin - starts_[k], take = std::min(n, s.count - first);
    if (take > 0) {
      switch (s.width) {
        case 1:
          copy_tokens<1>(s, first, take, limit_, out);
          break;
        case 2:
          copy_tokens<2>(s, first, take, limit_, out);
          break;
        default:
          copy_tokens<4>(s, first, take, limit_, out);
          break;
      }
      begin += take, n -= take, out += take;
    }
    ++k;
  }
}

}  // namespace trainer::data
