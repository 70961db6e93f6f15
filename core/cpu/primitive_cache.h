// The cache of oneDNN primitives the CPU kernels build once per shape
// (docs/architecture.md "Set up once, run many"): a Key of everything a primitive
// depends on (kind, thread count, calling thread, shapes, strides,
// attributes) and a thread-safe map from keys to entries that live for the
// process.
//
//   static Cache<Forward> cache;
//   const Forward& e = cache.get(make_key("conv_fwd").add(x).add(w).add(attrs), [&] {
//     return Forward{...};   // built on the first call with this key
//   });
#pragma once

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/conv_attrs.h"
#include "core/tensor.h"

namespace trainer::cpu {

// A primitive and its descriptor, for the cache entries that need nothing
// else: Primed<dnnl::pooling_forward>{pd, dnnl::pooling_forward(pd)}.
template <class Primitive>
struct Primed {
  typename Primitive::primitive_desc pd;
  Primitive prim;
};

// Everything a primitive depends on, as a flat list of integers.
struct Key {
  std::vector<int64_t> words;
  bool operator==(const Key& o) const { return words == o.words; }
  Key& add(std::initializer_list<int64_t> ws) {
    words.insert(words.end(), ws.begin(), ws.end());
    return *this;
  }
  Key& add(const Tensor& t) {
    if (!t.defined()) return add({-1});
    add({t.dim()});
    words.insert(words.end(), t.shape().begin(), t.shape().end());
    words.insert(words.end(), t.strides().begin(), t.strides().end());
    return *this;
  }
  Key& add(const Conv2dAttrs& a) {
    return add({a.stride[0], a.stride[1], a.padding[0], a.padding[1], a.dilation[0], a.dilation[1],
                a.groups});
  }
  Key& add(const Pool2dAttrs& a) {
    return add({a.kernel[0], a.kernel[1], a.stride[0], a.stride[1], a.padding[0], a.padding[1],
                int64_t(a.count_include_pad)});
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t w : k.words) h = (h ^ size_t(w)) * 1099511628211ull;
    return h;
  }
};

// The calling thread's number, part of every key. oneDNN as Debian builds it
// (without DNNL_ENABLE_CONCURRENT_EXEC) shares one scratchpad per thread
// among its primitives, so a primitive may run only on the thread that
// created it, and an entry may hold buffers a call writes: each thread gets
// its own entries. A training process runs its kernels on one thread (and
// its communicators' progress threads); ranks run as threads of one test
// process get one set each.
inline int64_t thread_slot() {
  static std::atomic<int64_t> next{0};
  thread_local const int64_t slot = next++;
  return slot;
}

inline Key make_key(const char* kind) {
  Key k;
  k.add({int64_t(std::hash<std::string_view>()(kind)), omp_get_max_threads(), thread_slot()});
  return k;
}

// One cache per primitive kind; entries live for the process.
template <class Entry>
class Cache {
 public:
  template <class Make>
  const Entry& get(const Key& key, Make&& make) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = map_.find(key);
    if (it == map_.end()) it = map_.emplace(key, std::make_unique<Entry>(make())).first;
    return *it->second;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<Key, std::unique_ptr<Entry>, KeyHash> map_;
};

}  // namespace trainer::cpu
