// The counter-based RNG: Philox4x32-10 against Random123's known answers,
// the element -> (counter, lane) mapping, the CPU kernels bit for bit against
// the reference at any thread count, the statistics of large draws, generator
// offsets and streams, and randperm.
#include <algorithm>
#include <cstring>

#include "core/cpu/threads.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// Restores the OpenMP thread count on scope exit.
struct ThreadCountGuard {
  int previous = num_threads();
  ~ThreadCountGuard() { set_num_threads(previous); }
};

// The three draws, each from a fresh generator at (seed, stream, offset).
enum class Draw { uniform, normal, bernoulli };
Tensor draw(Draw kind, const Shape& shape, DType dtype, uint64_t offset = 5) {
  Generator gen(1234, kStreamDropout, offset);
  switch (kind) {
    case Draw::uniform:
      return uniform(shape, -2.0, 3.0, gen, dtype);
    case Draw::normal:
      return normal(shape, 0.5, 2.0, gen, dtype);
    case Draw::bernoulli:
      return bernoulli(shape, 0.3, gen, dtype);
  }
  return Tensor();
}

double mean_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / double(v.size());
}
double var_of(const std::vector<double>& v) {
  double m = mean_of(v), s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return s / double(v.size() - 1);
}

}  // namespace

TEST_CASE("philox: Random123 known-answer vectors", "[random]") {
  struct Kat {
    Philox4x32 ctr;
    uint32_t k0, k1;
    Philox4x32 expected;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}}},
      {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}},
       0xffffffff,
       0xffffffff,
       {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}}},
      {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}},
       0xa4093822,
       0x299f31d0,
       {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}},
  };
  for (const Kat& k : kats) {
    Philox4x32 r = philox4x32_10(k.ctr, k.k0, k.k1);
    for (int i = 0; i < 4; ++i) {
      INFO("counter " << std::hex << k.ctr.v[0] << " lane " << i);
      REQUIRE(r.v[i] == k.expected.v[i]);
    }
  }
}

TEST_CASE("philox: element i uses block offset + i/4 (normal: i/2) and its lane", "[random]") {
  const uint64_t seed = 0x123456789abcdefULL, stream = 0xfedcba987ULL, offset = (1ULL << 32) + 7;
  auto block = [&](uint64_t b) {
    uint64_t c = offset + b;
    return philox4x32_10(
        Philox4x32{{uint32_t(c), uint32_t(c >> 32), uint32_t(stream), uint32_t(stream >> 32)}},
        uint32_t(seed), uint32_t(seed >> 32));
  };
  Generator gen(seed, stream, offset);
  std::vector<float> u = uniform({9}, 0.0, 1.0, gen).to_vector<float>();
  REQUIRE(gen.offset() == offset + 3);
  for (int i = 0; i < 9; ++i) REQUIRE(u[i] == float(block(i / 4).v[i % 4] >> 8) / 16777216.0f);
  // Box-Muller on lanes 0, 1 of block i/2: cosine for even i, sine for odd i.
  Generator gen2(seed, stream, offset);
  std::vector<double> z = normal({4}, 0.0, 1.0, gen2, DType::f64).to_vector<double>();
  REQUIRE(gen2.offset() == offset + 2);
  for (int i = 0; i < 4; ++i) {
    Philox4x32 r = block(i / 2);
    double u1 = double((r.v[0] >> 8) + 1) / 16777216.0, u2 = double(r.v[1] >> 8) / 16777216.0;
    double radius = std::sqrt(-2.0 * std::log(u1)), theta = 6.283185307179586476925 * u2;
    double expected = i % 2 == 0 ? radius * std::cos(theta) : radius * std::sin(theta);
    REQUIRE(z[i] == double(float(expected)));
  }
}

TEST_CASE("random: CPU kernels reproduce the reference bit for bit", "[random]") {
  ThreadCountGuard restore;
  const Shape shape{100003};  // odd, and above the threaded grain
  struct Case {
    Draw kind;
    DType dtype;
  };
  const Case cases[] = {{Draw::uniform, DType::f32},  {Draw::uniform, DType::f64},
                        {Draw::uniform, DType::bf16}, {Draw::uniform, DType::f16},
                        {Draw::normal, DType::f32},   {Draw::normal, DType::f64},
                        {Draw::normal, DType::bf16},  {Draw::bernoulli, DType::f32},
                        {Draw::bernoulli, DType::u8}, {Draw::bernoulli, DType::boolean},
                        {Draw::bernoulli, DType::f64}};
  for (const Case& c : cases) {
    INFO("draw " << int(c.kind) << " dtype " << c.dtype);
    Tensor ref;
    {
      ReferenceKernelsGuard guard;
      ref = draw(c.kind, shape, c.dtype);
    }
    set_num_threads(2);
    Tensor two = draw(c.kind, shape, c.dtype);
    set_num_threads(1);
    Tensor one = draw(c.kind, shape, c.dtype);
    REQUIRE(same_bits(two, ref));
    REQUIRE(same_bits(one, ref));
    // Odd small sizes end on a partial counter block.
    for (int64_t n : {1, 2, 3, 5, 7}) {
      Tensor fast = draw(c.kind, {n}, c.dtype, 9);
      ReferenceKernelsGuard guard;
      REQUIRE(same_bits(fast, draw(c.kind, {n}, c.dtype, 9)));
    }
  }
}

TEST_CASE("random: statistics of a million draws", "[random]") {
  const int64_t n = 1000000;
  Generator gen(2024, kStreamInit);
  // Tolerances are about 6 standard errors of each estimate.
  std::vector<double> u = uniform({n}, 0.0, 1.0, gen, DType::f64).to_vector<double>();
  REQUIRE(*std::min_element(u.begin(), u.end()) >= 0.0);
  REQUIRE(*std::max_element(u.begin(), u.end()) < 1.0);
  REQUIRE(std::fabs(mean_of(u) - 0.5) < 2e-3);
  REQUIRE(std::fabs(var_of(u) - 1.0 / 12.0) < 5e-4);

  std::vector<double> w = uniform({n}, -3.0, 5.0, gen).to_vector<double>();
  REQUIRE(*std::min_element(w.begin(), w.end()) >= -3.0);
  REQUIRE(*std::max_element(w.begin(), w.end()) < 5.0);
  REQUIRE(std::fabs(mean_of(w) - 1.0) < 1.5e-2);

  std::vector<double> z = normal({n}, 2.0, 3.0, gen).to_vector<double>();
  REQUIRE(std::fabs(mean_of(z) - 2.0) < 2e-2);
  REQUIRE(std::fabs(std::sqrt(var_of(z)) - 3.0) < 1.5e-2);
  // Both Box-Muller branches: the fraction within one sigma, per parity, and
  // no correlation between the cosine and sine of one block.
  int64_t inside[2] = {0, 0};
  double cross = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::fabs(z[i] - 2.0) < 3.0) ++inside[i % 2];
    if (i % 2 == 1) cross += (z[i - 1] - 2.0) * (z[i] - 2.0) / 9.0;
  }
  for (int parity = 0; parity < 2; ++parity)
    REQUIRE(std::fabs(double(inside[parity]) / double(n / 2) - 0.682689) < 4e-3);
  REQUIRE(std::fabs(cross / double(n / 2)) < 1e-2);

  std::vector<double> b = bernoulli({n}, 0.3, gen).to_vector<double>();
  REQUIRE(std::all_of(b.begin(), b.end(), [](double v) { return v == 0.0 || v == 1.0; }));
  REQUIRE(std::fabs(mean_of(b) - 0.3) < 3e-3);
  REQUIRE(bernoulli({1000}, 0.0, gen).to_vector<double>() == std::vector<double>(1000, 0.0));
  REQUIRE(bernoulli({1000}, 1.0, gen).to_vector<double>() == std::vector<double>(1000, 1.0));
}

TEST_CASE("random: offsets advance and restore, streams and seeds differ", "[random]") {
  Generator gen(7, kStreamDropout);
  Tensor a = uniform({10}, 0.0, 1.0, gen);
  REQUIRE(gen.offset() == 3);  // ceil(10 / 4) blocks
  uint64_t before_b = gen.offset();
  Tensor b = uniform({10}, 0.0, 1.0, gen);
  REQUIRE(!same_bits(a, b));
  Tensor c = normal({5}, 0.0, 1.0, gen);
  REQUIRE(gen.offset() == 6 + 3);  // ceil(5 / 2) blocks
  Tensor d = bernoulli({9}, 0.5, gen);
  REQUIRE(gen.offset() == 9 + 3);

  // A generator restored to an offset reproduces the draw made there.
  Generator restored(7, kStreamDropout, before_b);
  REQUIRE(same_bits(uniform({10}, 0.0, 1.0, restored), b));
  restored.set_offset(6);
  REQUIRE(same_bits(normal({5}, 0.0, 1.0, restored), c));

  // Consecutive draws do not overlap: b continues a's counters.
  Generator whole(7, kStreamDropout);
  std::vector<float> ab = uniform({24}, 0.0, 1.0, whole).to_vector<float>();
  std::vector<float> bv = b.to_vector<float>();
  for (int i = 0; i < 10; ++i) REQUIRE(ab[12 + i] == bv[i]);

  Generator other_stream(7, kStreamInit), other_seed(8, kStreamDropout);
  Tensor e = uniform({10}, 0.0, 1.0, other_stream), f = uniform({10}, 0.0, 1.0, other_seed);
  REQUIRE(!same_bits(a, e));
  REQUIRE(!same_bits(a, f));
  REQUIRE(!same_bits(e, f));
}

TEST_CASE("randperm: a deterministic, roughly uniform permutation", "[random]") {
  Generator gen(99, kStreamShuffle);
  Tensor p = randperm(1000, gen);
  std::vector<int64_t> v = p.to_vector<int64_t>();
  std::vector<int64_t> sorted = v;
  std::sort(sorted.begin(), sorted.end());
  REQUIRE(sorted == arange(1000).to_vector<int64_t>());
  REQUIRE(v != sorted);
  Generator again(99, kStreamShuffle);
  REQUIRE(randperm(1000, again).to_vector<int64_t>() == v);
  REQUIRE(randperm(1000, gen).to_vector<int64_t>() != v);  // the offset moved on
  REQUIRE(randperm(0, gen).numel() == 0);
  REQUIRE(randperm(1, gen).to_vector<int64_t>() == std::vector<int64_t>{0});

  // Where element 0 lands over 4000 seeds: chi-square over 10 positions
  // (9 degrees of freedom; 33.7 is the 0.9999 quantile).
  const int n = 10, seeds = 4000;
  std::vector<int> count(n, 0);
  for (int s = 0; s < seeds; ++s) {
    Generator g(uint64_t(s), kStreamShuffle);
    std::vector<int64_t> perm = randperm(n, g).to_vector<int64_t>();
    ++count[std::find(perm.begin(), perm.end(), 0) - perm.begin()];
  }
  double chi2 = 0, expected = double(seeds) / n;
  for (int c : count) chi2 += (c - expected) * (c - expected) / expected;
  INFO("chi-square " << chi2);
  REQUIRE(chi2 < 33.7);
}
