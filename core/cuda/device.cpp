#include "core/cuda/device.h"

#include "core/cuda/cuda_check.h"

namespace trainer::cuda {

int device_count() {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no driver" error
      return 0;
    }
    return n;
  }();
  return count;
}

int current_device() {
  int index = 0;
  CUDA_CHECK(cudaGetDevice(&index));
  return index;
}

void set_device(int index) {
  int n = device_count();
  if (index < 0 || index >= n)
    throw Error(cat("cuda:", index, " requested but this machine has ", n, " visible GPU",
                    n == 1 ? "" : "s", "; check CUDA_VISIBLE_DEVICES and the launcher's ",
                    "--nproc-per-node"));
  CUDA_CHECK(cudaSetDevice(index));
}

DeviceGuard::DeviceGuard(int index) : previous_(current_device()) {
  if (index != previous_) set_device(index);
}

DeviceGuard::~DeviceGuard() {
  int now = 0;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
}

}  // namespace trainer::cuda
