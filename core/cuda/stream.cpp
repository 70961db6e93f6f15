#include "core/cuda/stream.h"

#include <atomic>
#include <mutex>
#include <utility>

#include "core/cuda/cuda_allocator.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/device.h"

namespace trainer::cuda {

namespace {

// Device indices above this are rejected (more than any node has).
constexpr int kMaxDevices = 64;

int checked_device(int device) {
  if (device < 0) device = current_device();
  CHECK(device < kMaxDevices) << "device index " << device << " above " << kMaxDevices;
  return device;
}

std::atomic<cudaStream_t> g_compute[kMaxDevices];
std::mutex g_compute_mu;
// Streams a thread made current with a StreamGuard; nullptr: the compute stream.
thread_local cudaStream_t t_current[kMaxDevices] = {};

}  // namespace

// ---- Stream ----

Stream::Stream(int device, int priority) : device_(checked_device(device)) {
  DeviceGuard g(device_);
  CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority));
}

Stream::~Stream() { destroy(); }

Stream::Stream(Stream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)), device_(other.device_) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    destroy();
    stream_ = std::exchange(other.stream_, nullptr);
    device_ = other.device_;
  }
  return *this;
}

void Stream::destroy() {
  if (!stream_) return;
  // Blocks freed on this stream become free for every stream once it is idle.
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  forget_stream(device_, stream_);
  CUDA_CHECK(cudaStreamDestroy(stream_));
  stream_ = nullptr;
}

void Stream::synchronize() const { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

bool Stream::query() const {
  cudaError_t err = cudaStreamQuery(stream_);
  if (err == cudaErrorNotReady) return false;
  CUDA_CHECK(err);
  return true;
}

// ---- Event ----

Event::Event(bool timing) {
  CUDA_CHECK(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
}

Event::~Event() {
  if (event_) cudaEventDestroy(event_);
}

void Event::record(cudaStream_t stream) { CUDA_CHECK(cudaEventRecord(event_, stream)); }

void Event::wait(cudaStream_t stream) const { CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0)); }

void Event::synchronize() const { CUDA_CHECK(cudaEventSynchronize(event_)); }

bool Event::query() const {
  cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) return false;
  CUDA_CHECK(err);
  return true;
}

float elapsed_ms(const Event& start, const Event& end) {
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, start.handle(), end.handle()));
  return ms;
}

// ---- current streams ----

cudaStream_t compute_stream(int device) {
  device = checked_device(device);
  cudaStream_t s = g_compute[device].load(std::memory_order_acquire);
  if (s) return s;
  std::lock_guard<std::mutex> lock(g_compute_mu);
  s = g_compute[device].load(std::memory_order_relaxed);
  if (!s) {
    // Never destroyed: tensors released at exit still name it.
    DeviceGuard g(device);
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    g_compute[device].store(s, std::memory_order_release);
  }
  return s;
}

cudaStream_t current_stream(int device) {
  device = checked_device(device);
  cudaStream_t s = t_current[device];
  return s ? s : compute_stream(device);
}

StreamGuard::StreamGuard(const Stream& stream)
    : device_(stream.device()),
      previous_device_(current_device()),
      previous_stream_(t_current[stream.device()]) {
  if (device_ != previous_device_) set_device(device_);
  t_current[device_] = stream.handle();
}

StreamGuard::~StreamGuard() {
  t_current[device_] = previous_stream_;
  if (device_ != previous_device_) cudaSetDevice(previous_device_);
}

}  // namespace trainer::cuda
