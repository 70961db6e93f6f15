#include "core/cpu/cpu_backend.h"

#include <omp.h>

namespace trainer {

Backend& cpu_backend() {
  static Backend* cpu = new CpuBackend();
  return *cpu;
}

void set_num_threads(int n) {
  CHECK_GE(n, 1) << "thread count";
  omp_set_num_threads(n);
}

int num_threads() { return omp_get_max_threads(); }

}  // namespace trainer
