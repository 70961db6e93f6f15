// Threads and cores of this process: how many threads the CPU kernels use
// (OpenMP and oneDNN, which follows OpenMP) and which cores the process may
// run on. The training loop sets the thread count from the recipe;
// `trainer launch` and the benchmarks bind ranks to cores with allowed_cores().
//
//   set_num_threads(4);
//   std::vector<int> cores = allowed_cores();   // e.g. {0, 1}
#pragma once

#include <vector>

namespace trainer {

// Threads used by CPU kernels (OpenMP and oneDNN); n >= 1.
void set_num_threads(int n);
int num_threads();

// The cores this process may run on (its affinity mask), in increasing order.
std::vector<int> allowed_cores();

}  // namespace trainer
