// Memory for tensors. Each device kind has one Allocator; the CPU one is a
// caching allocator: blocks are 64-byte aligned (a cache line, the widest
// vector load) and kept in size-class free lists when released, so the
// steady-state training step never calls the system allocator. CUDA's
// allocator (core/cuda) has the same interface and is stream-ordered.
//
//   DataPtr p = allocator(Device{kCPU}).allocate(1024);
//   AllocatorStats s = allocator(Device{kCPU}).stats();   // current and peak bytes
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/device.h"

namespace trainer {

struct AllocatorStats {
  int64_t current_bytes = 0;  // handed out and not yet released
  int64_t peak_bytes = 0;     // max of current_bytes since the last reset_peak()
  int64_t cached_bytes = 0;   // held in free lists
  int64_t allocations = 0;    // allocate() calls
  int64_t cache_hits = 0;     // of which served from the cache
};

class Allocator;

// An owning pointer to a block; releases it to its allocator.
struct BlockDeleter {
  Allocator* allocator = nullptr;
  size_t bytes = 0;
  void operator()(void* p) const;
};
using DataPtr = std::unique_ptr<void, BlockDeleter>;

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual DataPtr allocate(size_t bytes) = 0;
  virtual AllocatorStats stats() const = 0;
  virtual void reset_peak() = 0;
  // Returns cached blocks to the system.
  virtual void empty_cache() = 0;

 protected:
  friend struct BlockDeleter;
  virtual void release(void* p, size_t bytes) = 0;
};

// A cap on the CPU allocator's tensor bytes in use (0: none): an
// allocation that would pass it throws Error saying so and changes nothing
// (training.memory_limit_mb). Memory mapped outside the allocator (the
// regions shared with other ranks) is not counted.
void set_cpu_memory_limit(int64_t bytes);
int64_t cpu_memory_limit();

// The allocator of a device. CUDA's is registered by the CUDA backend.
Allocator& allocator(Device device);
void register_allocator(DeviceKind kind, Allocator* allocator);

inline constexpr size_t kCpuAlignment = 64;

// The size class a caching allocator rounds a request up to: multiples of
// `granule` up to 4 KiB, then 8 steps per power of two (at most 12.5%
// waste), so a cached block serves nearby sizes.
inline size_t size_class(size_t bytes, size_t granule) {
  if (bytes <= 4096) return (bytes + granule - 1) / granule * granule;
  size_t pow2 = size_t(1) << (63 - __builtin_clzll(bytes - 1));  // largest power of two < bytes
  size_t step = pow2 / 8;
  return (bytes + step - 1) / step * step;
}

}  // namespace trainer
