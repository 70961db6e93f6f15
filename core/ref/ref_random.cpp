// Reference random draws: element i from its Philox counter (core/rng.h),
// in row-major order of out.
#include "core/ref/ref_backend.h"
#include "core/ref/ref_util.h"

namespace trainer {

namespace {
template <class Fn>
void for_each_flat(const Tensor& out, Fn&& fn) {
  int64_t flat = 0;
  ref::for_each_index(out.shape(), [&](const std::vector<int64_t>& i) { fn(i, uint64_t(flat++)); });
}
}  // namespace

void RefBackend::uniform(const Tensor& out, double lo, double hi, PhiloxKey key) {
  for_each_flat(out, [&](const auto& i, uint64_t k) {
    ref::set(out, i, lo + (hi - lo) * double(philox_uniform(key, k)));
  });
}

void RefBackend::normal(const Tensor& out, double mean, double std, PhiloxKey key) {
  for_each_flat(out, [&](const auto& i, uint64_t k) {
    ref::set(out, i, mean + std * double(philox_normal(key, k)));
  });
}

void RefBackend::bernoulli(const Tensor& out, double p, PhiloxKey key) {
  for_each_flat(out, [&](const auto& i, uint64_t k) {
    ref::set(out, i, double(philox_uniform(key, k)) < p ? 1.0 : 0.0);
  });
}

}  // namespace trainer
