// copy_across: moving tensors between the host and a GPU (and between GPUs).
//
// Both sides are first made contiguous on their own device (the contiguous
// fast path skips this), then the bytes move:
//   pinned host memory   one cudaMemcpyAsync, then wait for it;
//   pageable memory      in chunks through two pinned staging buffers per
//                        device: the host fills (or drains) one buffer while
//                        the DMA engine moves the other.
// Uploads return once the host source has been read (the device side stays
// ordered on the current stream); downloads return once the data is on the
// host. Pageable transfers of a process take turns on the staging buffers.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include "core/cuda/cuda_backend.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/kernel_scope.h"
#include "core/cuda/stream.h"

namespace trainer::cuda {

namespace {

// Two pinned buffers of one device, each with the event of the last copy
// that used it.
class Staging {
 public:
  // Buffer k (0 or 1) holding at least bytes, once its last copy has finished.
  char* acquire(int k, size_t bytes) {
    Buffer& b = buffers_[k];
    if (b.done) CUDA_CHECK(cudaEventSynchronize(b.done));
    if (b.bytes < bytes) {
      if (b.host) CUDA_CHECK(cudaFreeHost(b.host));
      b.host = nullptr;
      CUDA_CHECK(cudaHostAlloc(&b.host, bytes, cudaHostAllocPortable));
      b.bytes = bytes;
    }
    return static_cast<char*>(b.host);
  }
  // Marks buffer k as used by the work queued on stream so far.
  void record(int k, cudaStream_t stream) {
    Buffer& b = buffers_[k];
    if (!b.done) CUDA_CHECK(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(b.done, stream));
  }
  void wait(int k) const { CUDA_CHECK(cudaEventSynchronize(buffers_[k].done)); }
  char* data(int k) const { return static_cast<char*>(buffers_[k].host); }

 private:
  struct Buffer {
    void* host = nullptr;
    size_t bytes = 0;
    cudaEvent_t done = nullptr;
  };
  Buffer buffers_[2];
};

std::mutex g_mu;  // guards everything below
TransferOptions g_options;
std::map<int, Staging>* g_staging = new std::map<int, Staging>();  // by device; never freed

bool is_pinned(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

// host -> dev (bytes), ordered on stream of the current device.
void upload_bytes(const char* host, char* dev, size_t bytes, int device, cudaStream_t stream) {
  if (is_pinned(host)) {
    CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));  // the source may be reused on return
    return;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  Staging& staging = (*g_staging)[device];
  const size_t chunk = g_options.staging_bytes;
  int k = 0;
  for (size_t off = 0; off < bytes; off += chunk, k ^= 1) {
    size_t n = std::min(chunk, bytes - off);
    char* buf = staging.acquire(k, chunk);
    std::memcpy(buf, host + off, n);
    CUDA_CHECK(cudaMemcpyAsync(dev + off, buf, n, cudaMemcpyHostToDevice, stream));
    staging.record(k, stream);
  }
}

// dev -> host (bytes); returns when the data is on the host.
void download_bytes(const char* dev, char* host, size_t bytes, int device, cudaStream_t stream) {
  if (is_pinned(host)) {
    CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  Staging& staging = (*g_staging)[device];
  const size_t chunk = g_options.staging_bytes;
  const size_t chunks = (bytes + chunk - 1) / chunk;
  auto issue = [&](size_t c) {
    int k = int(c % 2);
    size_t off = c * chunk, n = std::min(chunk, bytes - off);
    CUDA_CHECK(
        cudaMemcpyAsync(staging.acquire(k, chunk), dev + off, n, cudaMemcpyDeviceToHost, stream));
    staging.record(k, stream);
  };
  if (chunks > 0) issue(0);
  for (size_t c = 0; c < chunks; ++c) {
    if (c + 1 < chunks) issue(c + 1);  // in flight while chunk c is drained
    int k = int(c % 2);
    staging.wait(k);
    size_t off = c * chunk, n = std::min(chunk, bytes - off);
    std::memcpy(host + off, staging.data(k), n);
  }
}

// A contiguous tensor with x's values on x's device (x itself when it is).
Tensor contiguous_on_device(const Tensor& x) {
  if (x.is_contiguous()) return x;
  Tensor out = empty(x.shape(), x.dtype(), x.device());
  backend(x.device()).copy(x, out);
  return out;
}

void upload(const Tensor& src, const Tensor& dst) {
  KernelScope scope("copy_across", {&dst});
  Tensor host = contiguous_on_device(src);
  Tensor dev = dst.is_contiguous() ? dst : empty(dst.shape(), dst.dtype(), dst.device());
  upload_bytes(static_cast<const char*>(host.data_ptr()), static_cast<char*>(dev.data_ptr()),
               dst.nbytes(), dst.device().index, scope.stream());
  if (!dst.is_contiguous()) backend(dst.device()).copy(dev, dst);
}

void download(const Tensor& src, const Tensor& dst) {
  KernelScope scope("copy_across", {&src});
  Tensor dev = contiguous_on_device(src);
  Tensor host = dst.is_contiguous() ? dst : empty(dst.shape(), dst.dtype(), dst.device());
  download_bytes(static_cast<const char*>(dev.data_ptr()), static_cast<char*>(host.data_ptr()),
                 dst.nbytes(), src.device().index, scope.stream());
  if (!dst.is_contiguous()) backend(dst.device()).copy(host, dst);
}

// GPU a -> GPU b: a peer copy on b's stream, ordered after a's work so far;
// a's stream then waits for it so the source is not reused too early.
void peer_copy(const Tensor& src, const Tensor& dst) {
  Tensor from;
  cudaStream_t stream_a = nullptr;
  std::optional<Event> src_ready;
  {
    KernelScope scope("copy_across", {&src});
    stream_a = scope.stream();
    from = contiguous_on_device(src);
    src_ready.emplace();
    src_ready->record(stream_a);
  }
  KernelScope scope("copy_across", {&dst});
  Tensor to = dst.is_contiguous() ? dst : empty(dst.shape(), dst.dtype(), dst.device());
  src_ready->wait(scope.stream());
  CUDA_CHECK(cudaMemcpyPeerAsync(to.data_ptr(), dst.device().index, from.data_ptr(),
                                 src.device().index, dst.nbytes(), scope.stream()));
  Event copied;
  copied.record(scope.stream());
  copied.wait(stream_a);
  if (!dst.is_contiguous()) backend(dst.device()).copy(to, dst);
}

}  // namespace

void CudaBackend::copy_across(const Tensor& src, const Tensor& dst) {
  CHECK(src.dtype() == dst.dtype())
      << "copy_across: dtypes " << src.dtype() << " and " << dst.dtype();
  CHECK(src.shape() == dst.shape())
      << "copy_across: shapes " << src.shape_str() << " and " << dst.shape_str();
  if (dst.numel() == 0) return;
  if (src.device().is_cpu())
    upload(src, dst);
  else if (dst.device().is_cpu())
    download(src, dst);
  else
    peer_copy(src, dst);
}

void set_transfer_options(const TransferOptions& options) {
  CHECK_GE(options.staging_bytes, size_t(1)) << "staging buffers need at least one byte";
  std::lock_guard<std::mutex> lock(g_mu);
  g_options = options;
}

TransferOptions transfer_options() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_options;
}

}  // namespace trainer::cuda
