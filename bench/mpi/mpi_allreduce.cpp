// OpenMPI's MPI_Allreduce timed the way bench/bench_allreduce.cpp times ours
// (same sizes, iteration counts and timing rule: the slowest rank's mean),
// printed as "bytes microseconds" lines for it to merge into its table.
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 mpi_allreduce 1024 268435456
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {
// As in bench_allreduce: about 200 MB moved per size, 3 to 1000 iterations.
int iterations(size_t bytes) {
  return int(std::clamp<size_t>((size_t(200) << 20) / std::max<size_t>(bytes, 1), 3, 1000));
}
}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  size_t min_bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  size_t max_bytes = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : size_t(256) << 20;
  std::vector<float> send(max_bytes / sizeof(float), 1.0f), recv(max_bytes / sizeof(float));
  for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    int count = int(bytes / sizeof(float)), iters = iterations(bytes);
    MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);  // warm-up
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (int i = 0; i < iters; ++i)
      MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double mean = (MPI_Wtime() - start) / iters, slowest = 0;
    MPI_Reduce(&mean, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) std::printf("%zu %.3f\n", bytes, slowest * 1e6);
  }
  MPI_Finalize();
  return 0;
}
