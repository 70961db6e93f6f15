// OpenMPI's MPI_Alltoallv timed the way bench/bench_alltoall.cpp times ours
// (bench/mpi/mpi_timing.h). bytes is what each rank sends in all, bytes / n
// to each rank (itself included).
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 mpi_alltoall 1024 67108864
//   mpirun ... mpi_alltoall --serve DIR 67108864   # sizes on request (bench/mpi/mpi_server.h)
#include <vector>

#include "bench/mpi/mpi_timing.h"

int main(int argc, char** argv) {
  std::vector<char> send, recv;
  std::vector<int> counts, offsets;
  int n = 1;
  return mpi_timing::time_sizes(
      argc, argv, "mpi_alltoall", size_t(64) << 20,
      [&](size_t max_bytes) {
        MPI_Comm_size(MPI_COMM_WORLD, &n);
        send.assign(max_bytes, 1);
        recv.assign(max_bytes, 0);
        counts.resize(size_t(n));
        offsets.resize(size_t(n));
      },
      [&](size_t bytes) {
        const int block = int(bytes / size_t(n));
        for (int r = 0; r < n; ++r) counts[size_t(r)] = block, offsets[size_t(r)] = r * block;
        MPI_Alltoallv(send.data(), counts.data(), offsets.data(), MPI_BYTE, recv.data(),
                      counts.data(), offsets.data(), MPI_BYTE, MPI_COMM_WORLD);
      });
}
