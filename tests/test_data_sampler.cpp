// DistributedSampler: partitions for world sizes 1-8 (disjoint, complete,
// equal counts), PyTorch's padding and dropping, determinism and resume.
#include "tests/testing.h"

#include <map>

#include "data/sampler.h"

using namespace trainer;
using namespace trainer::data;

namespace {

std::vector<std::vector<int64_t>> shards(int64_t n, int world, bool drop_last, int64_t epoch,
                                         bool shuffle = true) {
  std::vector<std::vector<int64_t>> out;
  for (int rank = 0; rank < world; ++rank) {
    DistributedSampler s(SamplerOptions{n, rank, world, /*seed=*/7, shuffle, drop_last});
    out.push_back(s.indices(epoch));
  }
  return out;
}

}  // namespace

TEST_CASE("sampler: shards partition the epoch for world sizes 1-8", "[data][sampler]") {
  for (int64_t n : {1, 5, 8, 13, 64, 100}) {
    for (int world = 1; world <= 8; ++world) {
      for (bool drop_last : {false, true}) {
        if (drop_last && n < world) continue;
        INFO("n " << n << " world " << world << " drop_last " << drop_last);
        auto parts = shards(n, world, drop_last, /*epoch=*/3);
        const int64_t per_rank = drop_last ? n / world : (n + world - 1) / world;
        std::map<int64_t, int> seen;
        for (const auto& part : parts) {
          REQUIRE(int64_t(part.size()) == per_rank);
          for (int64_t i : part) {
            REQUIRE(i >= 0);
            REQUIRE(i < n);
            ++seen[i];
          }
        }
        const int64_t total = per_rank * world;
        if (drop_last) {
          // Disjoint: every index at most once, n - total of them left out.
          REQUIRE(int64_t(seen.size()) == total);
          for (auto& [i, count] : seen) REQUIRE(count == 1);
        } else {
          // Complete: every index, the padding repeats the first total - n of the order.
          REQUIRE(int64_t(seen.size()) == n);
          int64_t repeats = 0;
          for (auto& [i, count] : seen) repeats += count - 1;
          REQUIRE(repeats == total - n);
        }
      }
    }
  }
}

TEST_CASE("sampler: exact shards read every sample once, with or without shuffling",
          "[data][sampler]") {
  for (int64_t n : {1, 5, 8, 13, 100}) {
    for (int world = 1; world <= 8; ++world) {
      for (bool shuffle : {false, true}) {
        INFO("n " << n << " world " << world << " shuffle " << shuffle);
        std::vector<int64_t> seen(size_t(n), 0);
        for (int rank = 0; rank < world; ++rank) {
          SamplerOptions o{n, rank, world, /*seed=*/7, shuffle};
          o.exact = true;
          DistributedSampler s(o);
          std::vector<int64_t> part = s.indices(/*epoch=*/2);
          // Rank r holds positions r, r + world, ... below n.
          REQUIRE(int64_t(part.size()) == (n - rank + world - 1) / world);
          REQUIRE(s.num_samples() == int64_t(part.size()));
          for (int64_t i : part) ++seen[size_t(i)];
          if (!shuffle)
            for (size_t p = 0; p < part.size(); ++p) REQUIRE(part[p] == rank + int64_t(p) * world);
        }
        for (int64_t count : seen) REQUIRE(count == 1);
      }
    }
  }
}

TEST_CASE("sampler: PyTorch's order without shuffling", "[data][sampler]") {
  // torch DistributedSampler(range(5), num_replicas=2, shuffle=False): [0, 2, 4], [1, 3, 0].
  auto pad = shards(5, 2, false, 0, /*shuffle=*/false);
  REQUIRE(pad[0] == std::vector<int64_t>{0, 2, 4});
  REQUIRE(pad[1] == std::vector<int64_t>{1, 3, 0});
  auto drop = shards(5, 2, true, 0, false);
  REQUIRE(drop[0] == std::vector<int64_t>{0, 2});
  REQUIRE(drop[1] == std::vector<int64_t>{1, 3});
  // Padding wraps around more than once when the world exceeds the dataset.
  auto wrap = shards(3, 8, false, 0, false);
  std::vector<int64_t> ranks;
  for (auto& part : wrap) ranks.push_back(part.at(0));
  REQUIRE(ranks == std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1});
}

TEST_CASE("sampler: the order is a function of (seed, epoch)", "[data][sampler]") {
  DistributedSampler a(SamplerOptions{1000, 1, 4, 42, true, false});
  DistributedSampler b(SamplerOptions{1000, 1, 4, 42, true, false});
  DistributedSampler other_seed(SamplerOptions{1000, 1, 4, 43, true, false});
  REQUIRE(a.indices(5) == b.indices(5));
  REQUIRE(a.indices(5) != a.indices(6));
  REQUIRE(a.indices(5) != other_seed.indices(5));
  // The epoch's order is a permutation.
  std::vector<int64_t> order = a.epoch_order(2);
  std::sort(order.begin(), order.end());
  for (int64_t i = 0; i < 1000; ++i) REQUIRE(order[size_t(i)] == i);
}

TEST_CASE("sampler: resume continues exactly", "[data][sampler]") {
  for (int world : {1, 3, 8}) {
    DistributedSampler s(SamplerOptions{101, world - 1, world, 9, true, false});
    std::vector<int64_t> full = s.indices(4);
    for (int64_t position : {int64_t(0), int64_t(1), int64_t(7), s.num_samples()}) {
      std::vector<int64_t> tail = s.indices(4, position);
      REQUIRE(tail == std::vector<int64_t>(full.begin() + position, full.end()));
    }
    REQUIRE_THROWS_AS(s.indices(4, s.num_samples() + 1), Error);
  }
}

TEST_CASE("sampler: bad options are errors", "[data][sampler]") {
  REQUIRE_THROWS_AS(DistributedSampler(SamplerOptions{10, 2, 2}), Error);
  REQUIRE_THROWS_AS(DistributedSampler(SamplerOptions{0, 0, 1}), Error);
  REQUIRE_THROWS_WITH(DistributedSampler(SamplerOptions{3, 0, 4, 0, true, true}),
                      Catch::Contains("drop_last"));
}
