// Counter-based random numbers: Philox 4x32-10 (Salmon et al., SC'11).
//
// A number is a pure function of (seed, stream, offset): the 64-bit seed is
// the Philox key, the 128-bit counter is (offset, stream). There is no state
// to carry between threads or devices, so the CPU and CUDA kernels produce the
// same numbers by construction, in any order and any thread count.
//
// Streams name a purpose (init, dropout, augmentation, shuffling...), keyed
// with rank and step by the caller (docs/architecture.md "Determinism").
//
// Element i of a draw uses:
//   uniform / bernoulli: counter offset + i/4, lane i%4
//   normal:              counter offset + i/2, Box-Muller on lanes 0,1; the
//                        cosine branch for even i, the sine branch for odd i.
//
//   Generator gen(/*seed=*/42, /*stream=*/kStreamInit);
//   Tensor w = normal({64, 3, 7, 7}, 0.0, 0.02, gen);   // advances gen
#pragma once

#include <cmath>
#include <cstdint>

#include "core/hd.h"

namespace trainer {

struct Philox4x32 {
  uint32_t v[4];
};

TRAINER_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = uint64_t(a) * uint64_t(b);
  hi = uint32_t(p >> 32);
  lo = uint32_t(p);
}

// Philox 4x32 with 10 rounds on a 128-bit counter and a 64-bit key.
TRAINER_HD Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, ctr.v[0], hi0, lo0);
    philox_mulhilo(kM1, ctr.v[2], hi1, lo1);
    ctr = Philox4x32{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// Where a draw starts: the key plus the counter of its element 0.
struct PhiloxKey {
  uint64_t seed = 0;
  uint64_t stream = 0;
  uint64_t offset = 0;  // in 128-bit counter blocks
};

TRAINER_HD Philox4x32 philox_block(PhiloxKey key, uint64_t block) {
  uint64_t c = key.offset + block;
  Philox4x32 ctr{
      {uint32_t(c), uint32_t(c >> 32), uint32_t(key.stream), uint32_t(key.stream >> 32)}};
  return philox4x32_10(ctr, uint32_t(key.seed), uint32_t(key.seed >> 32));
}

// A uniform float in [0, 1) from the top 24 bits.
TRAINER_HD float uint_to_unit(uint32_t x) { return float(x >> 8) * (1.0f / 16777216.0f); }
// A uniform float in (0, 1], safe for log().
TRAINER_HD float uint_to_unit_open0(uint32_t x) {
  return float((x >> 8) + 1) * (1.0f / 16777216.0f);
}

// Element i of a uniform [0, 1) draw.
TRAINER_HD float philox_uniform(PhiloxKey key, uint64_t i) {
  Philox4x32 r = philox_block(key, i / 4);
  return uint_to_unit(r.v[i % 4]);
}

// Elements 2b and 2b + 1 of a standard normal draw, from counter block b.
// Box-Muller runs in double on both host and device so the rounded float
// agrees bit for bit in practice.
struct NormalPair {
  float v[2];
};
TRAINER_HD NormalPair philox_normal_pair(PhiloxKey key, uint64_t block) {
  Philox4x32 r = philox_block(key, block);
  double u1 = double(uint_to_unit_open0(r.v[0]));
  double u2 = double(uint_to_unit(r.v[1]));
  double radius = sqrt(-2.0 * log(u1));
  double theta = 6.283185307179586476925 * u2;
  return NormalPair{{float(radius * cos(theta)), float(radius * sin(theta))}};
}

// Element i of a standard normal draw.
TRAINER_HD float philox_normal(PhiloxKey key, uint64_t i) {
  return philox_normal_pair(key, i / 2).v[i % 2];
}

// Blocks consumed by a draw of n elements.
TRAINER_HD uint64_t philox_uniform_blocks(uint64_t n) { return (n + 3) / 4; }
TRAINER_HD uint64_t philox_normal_blocks(uint64_t n) { return (n + 1) / 2; }

// Named streams, so two purposes never draw the same numbers.
enum RngStream : uint64_t {
  kStreamDefault = 0,
  kStreamInit = 1,
  kStreamDropout = 2,
  kStreamAugment = 3,
  kStreamShuffle = 4,
  kStreamSampling = 5,
};

// A (seed, stream) pair and a running offset. Each draw takes its key from
// next() and advances the offset by the blocks it used.
class Generator {
 public:
  explicit Generator(uint64_t seed = 0, uint64_t stream = kStreamDefault, uint64_t offset = 0)
      : seed_(seed), stream_(stream), offset_(offset) {}
  PhiloxKey next(uint64_t blocks) {
    PhiloxKey k{seed_, stream_, offset_};
    offset_ += blocks;
    return k;
  }
  uint64_t seed() const { return seed_; }
  uint64_t stream() const { return stream_; }
  uint64_t offset() const { return offset_; }
  void set_offset(uint64_t offset) { offset_ = offset; }

 private:
  uint64_t seed_, stream_, offset_;
};

}  // namespace trainer
