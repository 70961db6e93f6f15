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
// For a thread of the program's own that runs tensor operations (the
// checkpoint writer, a communicator's progress thread): its kernels run on
// it alone. A new thread starts with OpenMP's default team (every core),
// whose spinning workers would take the cores training runs on.
void use_one_kernel_thread();

// The cores this process may run on (its affinity mask), in increasing order.
std::vector<int> allowed_cores();

}  // namespace trainer
