// The distributed sampler: an epoch permutation, made a multiple of the
// world size, strided over the ranks.
#include "data/sampler.h"

#include "core/check.h"
#include "core/ops.h"

namespace trainer::data {

DistributedSampler::DistributedSampler(const SamplerOptions& options) : options_(options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size)
    throw Error(cat("sampler: rank ", options.rank, " is outside world size ", options.world_size));
  if (options.dataset_size <= 0) throw Error("sampler: the dataset is empty");
  const int64_t n = options.dataset_size, world = options.world_size;
  CHECK(!(options.exact && options.drop_last)) << "sampler: exact and drop_last both set";
  // PyTorch's counts: drop_last floors, padding rounds up; exact: the
  // positions r, r + world, ... below n.
  if (options.exact)
    num_samples_ = (n - options.rank + world - 1) / world;
  else
    num_samples_ = options.drop_last ? n / world : (n + world - 1) / world;
  if (num_samples_ == 0 && !options.exact)
    throw Error(cat("sampler: ", n, " samples cannot give each of ", world,
                    " ranks one sample with drop_last; use fewer ranks or pad"));
}

std::vector<int64_t> DistributedSampler::epoch_order(int64_t epoch) const {
  CHECK_GE(epoch, 0) << "sampler epoch";
  const int64_t n = options_.dataset_size;
  std::vector<int64_t> order;
  if (options_.shuffle) {
    Generator gen(options_.seed, kStreamShuffle + (uint64_t(epoch) << 8));
    order = randperm(n, gen).to_vector<int64_t>();
  } else {
    order.resize(size_t(n));
    for (int64_t i = 0; i < n; ++i) order[size_t(i)] = i;
  }
  const int64_t total = total_size();
  if (total <= n) {
    order.resize(size_t(total));
  } else {
    order.reserve(size_t(total));
    for (int64_t i = n; i < total; ++i) order.push_back(order[size_t(i % n)]);
  }
  return order;
}

std::vector<int64_t> DistributedSampler::indices(int64_t epoch, int64_t position) const {
  if (position < 0 || position > num_samples_)
    throw Error(cat("sampler: resume position ", position, " is outside this rank's epoch of ",
                    num_samples_,
                    " samples; was the checkpoint written with another dataset "
                    "size, world size or drop_last?"));
  std::vector<int64_t> order = epoch_order(epoch);
  std::vector<int64_t> mine;
  mine.reserve(size_t(num_samples_ - position));
  for (int64_t p = position; p < num_samples_; ++p)
    mine.push_back(order[size_t(p * options_.world_size + options_.rank)]);
  return mine;
}

}  // namespace trainer::data
