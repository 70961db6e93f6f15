// Choosing the GPU. A process normally drives one device (its LOCAL_RANK);
// the current device is per thread, as in the CUDA runtime, and new CUDA
// tensors are allocated on it.
//
//   cuda::set_device(local_rank);            // once, at start-up
//   { cuda::DeviceGuard g(1); ... }          // temporarily run on cuda:1
#pragma once

namespace trainer::cuda {

// Number of usable GPUs; 0 when the driver or a device is missing (the tests
// then report [cuda] cases as skipped).
int device_count();

// The current device of this thread.
int current_device();
// Makes device index current for this thread; throws Error when the machine
// has no such device.
void set_device(int index);

// Makes a device current for a scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
};

}  // namespace trainer::cuda
