// OpenMPI's MPI_Allreduce (f32 sum) timed the way bench/bench_allreduce.cpp
// times ours (bench/mpi/mpi_timing.h).
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 mpi_allreduce 1024 268435456
//   mpirun ... mpi_allreduce --serve DIR 268435456   # sizes on request
#include <vector>

#include "bench/mpi/mpi_timing.h"

int main(int argc, char** argv) {
  std::vector<float> send, recv;
  return mpi_timing::time_sizes(
      argc, argv, "mpi_allreduce", size_t(256) << 20,
      [&](size_t max_bytes) {
        send.assign(max_bytes / sizeof(float), 1.0f);
        recv.assign(max_bytes / sizeof(float), 0.0f);
      },
      [&](size_t bytes) {
        MPI_Allreduce(send.data(), recv.data(), int(bytes / sizeof(float)), MPI_FLOAT, MPI_SUM,
                      MPI_COMM_WORLD);
      });
}
