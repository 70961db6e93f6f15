#include <cuda_runtime.h>

namespace trainer::cuda {

// Number of usable GPUs; 0 when the driver or a device is missing (the tests
// then report [cuda] cases as skipped).
int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

}  // namespace trainer::cuda
