// DistributedSampler: which dataset indices a data-parallel rank reads in an
// epoch, and in which order.
//
// The epoch's permutation of [0, dataset_size) is a pure function of
// (seed, epoch): randperm with Generator(seed, kStreamShuffle + (epoch << 8)).
// The low 8 bits of a stream name the purpose (core/rng.h), the bits above
// carry the epoch, so no two epochs or purposes share numbers. As in
// PyTorch's DistributedSampler the permutation is then made a multiple of
// world_size, by dropping its tail (drop_last) or by wrapping around to its
// start (pad), and rank r takes positions r, r + world, r + 2 world, ...
// Every rank gets the same count, the ranks' lists are disjoint (up to the
// padding) and together cover the epoch.
//
// Glossary: rank/world = data-parallel rank and world size; position = how
// many of this rank's samples of the epoch were already consumed.
//
//   DistributedSampler sampler({.dataset_size = 1281167, .rank = 3, .world_size = 8, .seed = 42});
//   std::vector<int64_t> mine = sampler.indices(/*epoch=*/5, /*position=*/1024);  // resume
#pragma once

#include <cstdint>
#include <vector>

namespace trainer::data {

struct SamplerOptions {
  int64_t dataset_size = 0;
  int rank = 0;
  int world_size = 1;
  uint64_t seed = 0;
  bool shuffle = true;     // false: the identity order (evaluation)
  bool drop_last = false;  // drop the tail instead of padding by wrapping around
  // Neither drop nor pad (evaluation): rank r takes r, r + world, ... below
  // dataset_size, so every sample is read exactly once and the ranks' counts
  // differ by at most one.
  bool exact = false;
};

class DistributedSampler {
 public:
  explicit DistributedSampler(const SamplerOptions& options);
  // This rank's samples per epoch.
  int64_t num_samples() const { return num_samples_; }
  // The epoch after dropping or padding: num_samples() * world_size (exact:
  // the dataset size).
  int64_t total_size() const {
    return options_.exact ? options_.dataset_size : num_samples_ * options_.world_size;
  }
  const SamplerOptions& options() const { return options_; }
  // This rank's dataset indices for the epoch, from position on.
  std::vector<int64_t> indices(int64_t epoch, int64_t position = 0) const;
  // The whole epoch's order before sharding (total_size() entries).
  std::vector<int64_t> epoch_order(int64_t epoch) const;

 private:
  SamplerOptions options_;
  int64_t num_samples_ = 0;
};

}  // namespace trainer::data
