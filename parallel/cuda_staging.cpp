#include "parallel/cuda_staging.h"

#if TRAINER_HAVE_CUDA
#include <algorithm>

#include "core/autograd.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/device.h"
#include "core/cuda/stream.h"
#include "core/ops.h"

namespace trainer::parallel {

namespace {

class CudaBucketCopier final : public BucketCopier {
 public:
  explicit CudaBucketCopier(int device) : device_(device), stream_(device) {}

  // On the backward thread, whose current stream is the compute stream.
  std::shared_ptr<void> ready(const Tensor& flat) override {
    CHECK(flat.device() == (Device{kCUDA, device_})) << "a bucket on " << flat.device();
    auto event = std::make_shared<cuda::Event>();
    event->record(cuda::current_stream(device_));
    return event;
  }
  void to_host(const Tensor& flat, const std::shared_ptr<void>& ready, void* host) override {
    cuda::DeviceGuard guard(device_);
    static_cast<const cuda::Event*>(ready.get())->wait(stream_);
    CUDA_CHECK(cudaMemcpyAsync(host, flat.data_ptr(), flat.nbytes(), cudaMemcpyDeviceToHost,
                               stream_.handle()));
    stream_.synchronize();
  }
  // Synchronised before the bucket's Work finishes, so the optimizer, queued
  // on the compute stream after DataParallel::finish(), reads the result.
  void from_host(const void* host, const Tensor& flat) override {
    cuda::DeviceGuard guard(device_);
    CUDA_CHECK(cudaMemcpyAsync(flat.data_ptr(), host, flat.nbytes(), cudaMemcpyHostToDevice,
                               stream_.handle()));
    stream_.synchronize();
  }
  std::shared_ptr<void> host_buffer(size_t bytes) override {
    void* p = nullptr;
    CUDA_CHECK(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable));
    return std::shared_ptr<void>(p, [](void* q) { cudaFreeHost(q); });
  }

 private:
  int device_;
  cuda::Stream stream_;  // the comm stream
};

}  // namespace

std::shared_ptr<BucketCopier> cuda_bucket_copier(Device device) {
  CHECK(device.is_cuda()) << "cuda_bucket_copier for " << device;
  cuda::DeviceGuard guard(device.index);
  return std::make_shared<CudaBucketCopier>(device.index);
}

std::shared_ptr<const comm::Reducer> cuda_reducer(Device device) {
  CHECK(device.is_cuda()) << "cuda_reducer for " << device;
  auto r = std::make_shared<comm::Reducer>();
  // On the communicator's progress thread: its current stream of the device.
  r->reduce = [device](void* dst, const void* src, size_t count, DType dtype, comm::ReduceOp op) {
    cuda::DeviceGuard guard(device.index);
    autograd::NoGradGuard no_grad;
    Tensor d = from_external(dst, {int64_t(count)}, dtype, device, nullptr);
    Tensor s = from_external(const_cast<void*>(src), {int64_t(count)}, dtype, device, nullptr);
    if (op == comm::ReduceOp::max)
      d.copy_(maximum(d, s));
    else
      add_(d, s);
    CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream(device.index)));
  };
  r->scale = [device](void* data, size_t count, DType dtype, double factor) {
    cuda::DeviceGuard guard(device.index);
    autograd::NoGradGuard no_grad;
    mul_(from_external(data, {int64_t(count)}, dtype, device, nullptr), factor);
    CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream(device.index)));
  };
  r->scratch = [device](size_t bytes) -> std::shared_ptr<void> {
    cuda::DeviceGuard guard(device.index);
    Tensor t = empty({int64_t(std::max<size_t>(bytes, 1))}, DType::u8, device);
    return std::shared_ptr<void>(t.data_ptr(), [t](void*) {});
  };
  return r;
}

BucketReduceFn gpu_direct_reduce(Device device) {
  CHECK(device.is_cuda()) << "gpu_direct_reduce for " << device;
  // The bucket is complete in the compute stream's order: wait for it there.
  return direct_reduce(cuda_reducer(device), [device](const Tensor&) {
    CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream(device.index)));
  });
}
}  // namespace trainer::parallel
#endif
