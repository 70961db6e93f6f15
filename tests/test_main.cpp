#include <cstdio>
#include <cstdlib>

#define CATCH_CONFIG_MAIN
#include "tests/testing.h"

#ifdef TRAINER_HAVE_CUDA
namespace trainer::cuda {
int device_count();
}
#endif

namespace trainer::testing {

void require_gpu_or_skip() {
#ifdef TRAINER_HAVE_CUDA
  if (trainer::cuda::device_count() > 0) return;
  std::printf("SKIPPED: no CUDA device on this machine\n");
#else
  std::printf("SKIPPED: built without the CUDA backend\n");
#endif
  std::fflush(stdout);
  std::exit(77);
}

}  // namespace trainer::testing
