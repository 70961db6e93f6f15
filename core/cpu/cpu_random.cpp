// CPU Philox draws. Element i takes the counter block and lane core/rng.h
// assigns it, and its value is computed exactly as the reference does (the
// same rng.h functions, uniform's lo + (hi - lo) * u in double, then the
// reference's rounding to the output dtype), so the CPU, the reference and a
// CUDA kernel agree bit for bit. Threads split the draw by counter blocks,
// so the numbers never depend on the thread count. Non-contiguous outputs
// and integer outputs of uniform/normal run the reference loops.
#include <algorithm>
#include <type_traits>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/loops.h"

namespace trainer {

namespace {

// Counter blocks below which a draw stays on one thread.
constexpr int64_t kBlockGrain = 4096;

// v rounded to T the way the reference's ref::set does.
template <class T>
T round_to(double v) {
  if constexpr (std::is_same_v<T, bool>)
    return v != 0.0;
  else
    return store_as<T>(acc_t<T>(v));
}

// Fills contiguous out block by block: fill(block, dst, count) writes the
// count (<= per_block) elements of counter block `block`, which start at dst.
template <class T, class Fill>
void fill_blocks(const Tensor& out, int64_t per_block, Fill fill) {
  T* o = out.data<T>();
  const int64_t n = out.numel();
  const int64_t blocks = (n + per_block - 1) / per_block;
  cpu::parallel_for(blocks, kBlockGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      fill(uint64_t(b), o + b * per_block, int(std::min(per_block, n - b * per_block)));
  });
}

}  // namespace

// out[i] = lo + (hi - lo) * u_i, u_i = lane i % 4 of block i / 4.
void CpuBackend::uniform(const Tensor& out, double lo, double hi, PhiloxKey key) {
  if (!out.is_contiguous() || !is_floating(out.dtype()))
    return RefBackend::uniform(out, lo, hi, key);
  dispatch_floating(out.dtype(), "uniform", [&](auto tag) {
    using T = typename decltype(tag)::type;
    fill_blocks<T>(out, 4, [=](uint64_t block, T* o, int count) {
      Philox4x32 r = philox_block(key, block);
      for (int l = 0; l < count; ++l)
        o[l] = round_to<T>(lo + (hi - lo) * double(uint_to_unit(r.v[l])));
    });
  });
}

// out[i] = mean + std * z_i, z_{2b}, z_{2b+1} the Box-Muller pair of block b.
void CpuBackend::normal(const Tensor& out, double mean, double std, PhiloxKey key) {
  if (!out.is_contiguous() || !is_floating(out.dtype()))
    return RefBackend::normal(out, mean, std, key);
  dispatch_floating(out.dtype(), "normal", [&](auto tag) {
    using T = typename decltype(tag)::type;
    fill_blocks<T>(out, 2, [=](uint64_t block, T* o, int count) {
      NormalPair z = philox_normal_pair(key, block);
      for (int l = 0; l < count; ++l) o[l] = round_to<T>(mean + std * double(z.v[l]));
    });
  });
}

// out[i] = u_i < p ? 1 : 0, u_i as in uniform.
void CpuBackend::bernoulli(const Tensor& out, double p, PhiloxKey key) {
  if (!out.is_contiguous()) return RefBackend::bernoulli(out, p, key);
  dispatch_all(out.dtype(), "bernoulli", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T one = round_to<T>(1.0), zero = round_to<T>(0.0);
    fill_blocks<T>(out, 4, [=](uint64_t block, T* o, int count) {
      Philox4x32 r = philox_block(key, block);
      for (int l = 0; l < count; ++l) o[l] = double(uint_to_unit(r.v[l])) < p ? one : zero;
    });
  });
}

}  // namespace trainer
