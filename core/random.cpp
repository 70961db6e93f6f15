// Random tensors from the counter-based generator (core/rng.h). Each draw
// takes the generator's next key and advances it by the blocks it used, so
// the numbers depend only on (seed, stream, offset), never on the device or
// the thread count.
#include <algorithm>

#include "core/ops.h"

namespace trainer {

Tensor uniform(const Shape& shape, double lo, double hi, Generator& gen, DType dtype,
               Device device) {
  CHECK(lo <= hi) << "uniform: lo " << lo << " > hi " << hi;
  Tensor out = empty(shape, dtype, device);
  backend(device).uniform(out, lo, hi, gen.next(philox_uniform_blocks(uint64_t(out.numel()))));
  return out;
}

Tensor normal(const Shape& shape, double mean, double std, Generator& gen, DType dtype,
              Device device) {
  CHECK(std >= 0) << "normal: negative std " << std;
  Tensor out = empty(shape, dtype, device);
  backend(device).normal(out, mean, std, gen.next(philox_normal_blocks(uint64_t(out.numel()))));
  return out;
}

Tensor bernoulli(const Shape& shape, double p, Generator& gen, DType dtype, Device device) {
  CHECK(p >= 0 && p <= 1) << "bernoulli: p " << p << " outside [0, 1]";
  Tensor out = empty(shape, dtype, device);
  backend(device).bernoulli(out, p, gen.next(philox_uniform_blocks(uint64_t(out.numel()))));
  return out;
}

// Fisher-Yates from the back; swap partner j of position i < n uses the
// 64-bit number from lanes (0, 1) of block i, reduced to [0, i] (the modulo
// bias is below 2^-32 for any n < 2^32).
Tensor randperm(int64_t n, Generator& gen) {
  CHECK_GE(n, 0) << "randperm";
  Tensor out = arange(n, DType::i64);
  int64_t* p = out.data<int64_t>();
  PhiloxKey key = gen.next(uint64_t(n));
  for (int64_t i = n - 1; i > 0; --i) {
    Philox4x32 r = philox_block(key, uint64_t(i));
    uint64_t x = (uint64_t(r.v[1]) << 32) | r.v[0];
    std::swap(p[i], p[int64_t(x % uint64_t(i + 1))]);
  }
  return out;
}

}  // namespace trainer
