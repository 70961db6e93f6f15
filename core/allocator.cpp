#include "core/allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <vector>

#include "core/check.h"

namespace trainer {

void BlockDeleter::operator()(void* p) const {
  if (p && allocator) allocator->release(p, bytes);  // no allocator: external memory
}

namespace {

std::atomic<int64_t> g_cpu_limit{0};

std::string mib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", double(bytes) / (1 << 20));
  return text;
}

class CpuCachingAllocator final : public Allocator {
 public:
  DataPtr allocate(size_t bytes) override {
    size_t cls = size_class(bytes == 0 ? 1 : bytes, kCpuAlignment);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const int64_t limit = g_cpu_limit.load(std::memory_order_relaxed);
      if (limit > 0 && stats_.current_bytes + int64_t(cls) > limit)
        throw Error(cat("tensor memory: ", mib(int64_t(cls)), " MiB more with ",
                        mib(stats_.current_bytes), " MiB in use passes this rank's limit of ",
                        mib(limit),
                        " MiB (training.memory_limit_mb); shard more (parallel.shard: gradients or "
                        "parameters), recompute (parallel.recompute: blocks), lower the "
                        "micro-batch, or raise the limit"));
      ++stats_.allocations;
      auto it = free_.find(cls);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        stats_.cached_bytes -= int64_t(cls);
        ++stats_.cache_hits;
      }
      stats_.current_bytes += int64_t(cls);
      if (stats_.current_bytes > stats_.peak_bytes) stats_.peak_bytes = stats_.current_bytes;
    }
    if (!p) {
      p = std::aligned_alloc(kCpuAlignment, cls);
      if (!p) {
        empty_cache();
        p = std::aligned_alloc(kCpuAlignment, cls);
      }
      if (!p) throw std::bad_alloc();
    }
    return DataPtr(p, BlockDeleter{this, cls});
  }

  AllocatorStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void reset_peak() override {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak_bytes = stats_.current_bytes;
  }

  void empty_cache() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [cls, blocks] : free_)
      for (void* p : blocks) std::free(p);
    free_.clear();
    stats_.cached_bytes = 0;
  }

 protected:
  void release(void* p, size_t cls) override {
    std::lock_guard<std::mutex> lock(mu_);
    free_[cls].push_back(p);
    stats_.current_bytes -= int64_t(cls);
    stats_.cached_bytes += int64_t(cls);
  }

 private:
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;
  AllocatorStats stats_;
};

Allocator* g_allocators[kNumDeviceKinds] = {};

}  // namespace

void set_cpu_memory_limit(int64_t bytes) { g_cpu_limit = std::max<int64_t>(bytes, 0); }
int64_t cpu_memory_limit() { return g_cpu_limit.load(); }

void register_allocator(DeviceKind kind, Allocator* a) { g_allocators[int(kind)] = a; }

Allocator& allocator(Device device) {
  if (device.is_cpu()) {
    // Never destroyed: tensors in static objects may release blocks at exit.
    static Allocator* cpu = new CpuCachingAllocator();
    return *cpu;
  }
  Allocator* a = g_allocators[int(device.kind)];
  if (!a)
    throw Error(cat("device ", device, " requested but this build has no CUDA backend; ",
                    "rebuild with -DTRAINER_CUDA=ON on a machine with the CUDA toolkit"));
  return *a;
}

}  // namespace trainer
