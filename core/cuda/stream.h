// Streams and events. Every CUDA kernel and copy of the backend runs on the
// current stream of its device. By default that is the device's compute
// stream, created once per process as a non-blocking stream (so it never
// serialises with the legacy default stream that some libraries use); a
// StreamGuard switches it for the calling thread, e.g. for communication or
// prefetching on a side stream. The caching allocator (cuda_allocator.h) tags
// freed blocks with the current stream, so memory follows stream order.
//
//   cuda::Stream side;                          // on the current device
//   cuda::Event ready;
//   ready.record(cuda::current_stream());
//   {
//     cuda::StreamGuard g(side);                // ops now run on `side`
//     ready.wait(side);                         // ... after the compute stream's work so far
//     y = x * 2.0;
//   }
//   side.synchronize();
#pragma once

#include <cuda_runtime.h>

namespace trainer::cuda {

// An owned stream on one device. Destroying it waits for its work.
class Stream {
 public:
  // A new non-blocking stream on device (default: the current device);
  // lower priority numbers run first (cudaDeviceGetStreamPriorityRange).
  explicit Stream(int device = -1, int priority = 0);
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t handle() const { return stream_; }
  int device() const { return device_; }
  // Blocks the host until all work queued so far has finished.
  void synchronize() const;
  // True when all work queued so far has finished.
  bool query() const;

 private:
  void destroy();
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

// An owned event. Timing events measure elapsed time; the others are cheaper
// to record and exist only for ordering.
class Event {
 public:
  explicit Event(bool timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Captures the work queued on stream so far.
  void record(cudaStream_t stream);
  void record(const Stream& stream) { record(stream.handle()); }
  // Makes stream wait (on the device, without blocking the host) until the
  // recorded work has finished.
  void wait(cudaStream_t stream) const;
  void wait(const Stream& stream) const { wait(stream.handle()); }
  // Blocks the host until the recorded work has finished.
  void synchronize() const;
  bool query() const;
  cudaEvent_t handle() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Milliseconds between two recorded timing events (end after start).
float elapsed_ms(const Event& start, const Event& end);

// The compute stream of a device, shared by all threads of the process.
cudaStream_t compute_stream(int device);
// The current stream of device (default: the current device) on this thread.
cudaStream_t current_stream(int device = -1);

// Makes stream the current stream of its device (and that device current)
// for this thread for a scope, then restores both.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  int device_;
  int previous_device_;
  cudaStream_t previous_stream_;
};

}  // namespace trainer::cuda
