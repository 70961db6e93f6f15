#include "core/cpu/cpu_backend.h"

namespace trainer {

Backend& cpu_backend() {
  static Backend* cpu = new CpuBackend();
  return *cpu;
}

}  // namespace trainer
