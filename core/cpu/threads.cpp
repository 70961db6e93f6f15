#include "core/cpu/threads.h"

#include <omp.h>
#include <sched.h>

#include "core/check.h"

namespace trainer {

void set_num_threads(int n) {
  CHECK_GE(n, 1) << "thread count";
  omp_set_num_threads(n);
}

int num_threads() { return omp_get_max_threads(); }

void use_one_kernel_thread() { set_num_threads(1); }

std::vector<int> allowed_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cores;
  if (::sched_getaffinity(0, sizeof set, &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cores.push_back(c);
  return cores;
}

}  // namespace trainer
