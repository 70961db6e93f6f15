#include "core/cuda/cuda_allocator.h"

#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device.h"
#include "core/cuda/stream.h"

namespace trainer::cuda {

namespace {

// Size classes in multiples of 512 B (cudaMalloc aligns to 256 B).
constexpr size_t kCudaGranule = 512;

std::string gib(int64_t bytes) { return cat(double(bytes) / double(1 << 30), " GiB"); }

class CudaCachingAllocator final : public Allocator {
 public:
  DataPtr allocate(size_t bytes) override {
    if (device_count() == 0)
      throw Error(
          "a CUDA tensor was requested but no GPU is visible to this process (no driver, "
          "or CUDA_VISIBLE_DEVICES is empty); run on the CPU instead");
    int device = current_device();
    cudaStream_t stream = current_stream(device);
    size_t cls = size_class(bytes == 0 ? 1 : bytes, kCudaGranule);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Pool& pool = pools_[device];
      ++pool.stats.allocations;
      p = take_cached(pool, cls, stream);
      if (p) {
        ++pool.stats.cache_hits;
        pool.stats.cached_bytes -= int64_t(cls);
      }
    }
    if (!p) p = malloc_or_throw(device, cls, bytes);
    std::lock_guard<std::mutex> lock(mu_);
    Pool& pool = pools_[device];
    pool.stats.current_bytes += int64_t(cls);
    pool.stats.peak_bytes = std::max(pool.stats.peak_bytes, pool.stats.current_bytes);
    owner_[p] = device;
    return DataPtr(p, BlockDeleter{this, cls});
  }

  AllocatorStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    AllocatorStats sum;
    for (const auto& [device, pool] : pools_) {
      sum.current_bytes += pool.stats.current_bytes;
      sum.peak_bytes += pool.stats.peak_bytes;
      sum.cached_bytes += pool.stats.cached_bytes;
      sum.allocations += pool.stats.allocations;
      sum.cache_hits += pool.stats.cache_hits;
    }
    return sum;
  }

  AllocatorStats device_stats(int device) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(device);
    return it == pools_.end() ? AllocatorStats{} : it->second.stats;
  }

  void reset_peak() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [device, pool] : pools_) pool.stats.peak_bytes = pool.stats.current_bytes;
  }

  void empty_cache() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [device, pool] : pools_) free_cached(device, pool);
  }

  void forget_stream(int device, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(device);
    if (it == pools_.end()) return;
    for (auto& [cls, blocks] : it->second.free)
      for (FreeBlock& b : blocks)
        if (!b.idle && b.stream == stream) b.idle = true;
  }

 protected:
  void release(void* p, size_t cls) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = owner_.find(p);
    CHECK(it != owner_.end()) << "release of a pointer the CUDA allocator does not own";
    int device = it->second;
    owner_.erase(it);
    Pool& pool = pools_[device];
    pool.free[cls].push_back(FreeBlock{p, current_stream(device)});
    pool.stats.current_bytes -= int64_t(cls);
    pool.stats.cached_bytes += int64_t(cls);
  }

 private:
  struct FreeBlock {
    void* ptr = nullptr;
    cudaStream_t stream = nullptr;  // the stream current when it was released
    bool idle = false;              // that stream was synchronised: any stream may take it
    cudaEvent_t fence = nullptr;    // recorded on `stream` once another stream wanted it
  };
  struct Pool {                                     // one device
    std::map<size_t, std::vector<FreeBlock>> free;  // by size class
    std::vector<cudaEvent_t> spare_events;
    AllocatorStats stats;
  };

  // A cached block of class cls usable on stream without waiting, or null.
  // Called with mu_ held, on the pool's device.
  void* take_cached(Pool& pool, size_t cls, cudaStream_t stream) {
    auto it = pool.free.find(cls);
    if (it == pool.free.end()) return nullptr;
    std::vector<FreeBlock>& blocks = it->second;
    for (size_t i = blocks.size(); i-- > 0;)
      if (blocks[i].idle || blocks[i].stream == stream) return pop(pool, blocks, i);
    for (size_t i = blocks.size(); i-- > 0;) {
      FreeBlock& b = blocks[i];
      if (!b.fence) {
        b.fence = spare_event(pool);
        CUDA_CHECK(cudaEventRecord(b.fence, b.stream));
      }
      cudaError_t st = cudaEventQuery(b.fence);
      if (st == cudaSuccess) return pop(pool, blocks, i);
      if (st != cudaErrorNotReady) CUDA_CHECK(st);
    }
    return nullptr;
  }

  static void* pop(Pool& pool, std::vector<FreeBlock>& blocks, size_t i) {
    void* p = blocks[i].ptr;
    if (blocks[i].fence) pool.spare_events.push_back(blocks[i].fence);
    blocks[i] = blocks.back();
    blocks.pop_back();
    return p;
  }

  static cudaEvent_t spare_event(Pool& pool) {
    cudaEvent_t e = nullptr;
    if (!pool.spare_events.empty()) {
      e = pool.spare_events.back();
      pool.spare_events.pop_back();
      return e;
    }
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  // Returns every cached block of a device to the driver. Called with mu_ held.
  static void free_cached(int device, Pool& pool) {
    if (pool.free.empty()) return;
    DeviceGuard g(device);
    CUDA_CHECK(cudaDeviceSynchronize());  // no stream still uses a cached block
    for (auto& [cls, blocks] : pool.free) {
      for (FreeBlock& b : blocks) {
        if (b.fence) pool.spare_events.push_back(b.fence);
        CUDA_CHECK(cudaFree(b.ptr));
      }
    }
    pool.free.clear();
    pool.stats.cached_bytes = 0;
  }

  // cudaMalloc, retried once after emptying the device's cache; an Error
  // when the memory is really exhausted.
  void* malloc_or_throw(int device, size_t cls, size_t requested) {
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, cls);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear it
      {
        std::lock_guard<std::mutex> lock(mu_);
        free_cached(device, pools_[device]);
      }
      err = cudaMalloc(&p, cls);
    }
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      AllocatorStats s = device_stats(device);
      throw Error(cat("CUDA out of memory: cannot allocate ", requested, " bytes on cuda:", device,
                      " (tensors hold ", gib(s.current_bytes), ", the device has ",
                      gib(int64_t(free_bytes)), " free of ", gib(int64_t(total_bytes)),
                      "); reduce the batch or micro-batch size, or the model size"));
    }
    CUDA_CHECK(err);
    return p;
  }

  mutable std::mutex mu_;
  std::map<int, Pool> pools_;             // by device
  std::unordered_map<void*, int> owner_;  // live block -> device
};

// Never destroyed: tensors in static objects may release blocks at exit.
CudaCachingAllocator& cuda_allocator() {
  static CudaCachingAllocator* a = new CudaCachingAllocator();
  return *a;
}

[[maybe_unused]] const bool g_registered = [] {
  register_allocator(kCUDA, &cuda_allocator());
  return true;
}();

}  // namespace

AllocatorStats memory_stats(int device) { return cuda_allocator().device_stats(device); }

void forget_stream(int device, cudaStream_t stream) {
  cuda_allocator().forget_stream(device, stream);
}

}  // namespace trainer::cuda
