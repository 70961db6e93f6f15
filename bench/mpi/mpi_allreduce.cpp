// OpenMPI's MPI_Allreduce timed the way bench/bench_allreduce.cpp times ours
// (same sizes, iteration counts and timing rule: the slowest rank's mean),
// printed as "bytes microseconds" lines for it to merge into its table.
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 mpi_allreduce 1024 268435456
//   mpirun ... mpi_allreduce --serve DIR 268435456   # sizes on request
//
// With --serve each rank r reads sizes, one per line, from the FIFO DIR/size.r
// (bench_allreduce writes them, alternating OpenMPI's measurements with its
// own) and times each as it arrives; a 0 or the end of the FIFO ends it.
// Waiting in read() sleeps, so the idle ranks leave the cores to the other side.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
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
  const bool serve = argc > 3 && std::strcmp(argv[1], "--serve") == 0;
  FILE* sizes = nullptr;
  if (serve) {
    const std::string fifo = std::string(argv[2]) + "/size." + std::to_string(rank);
    sizes = std::fopen(fifo.c_str(), "r");
    if (!sizes) {
      std::fprintf(stderr, "mpi_allreduce: cannot open %s\n", fifo.c_str());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  size_t min_bytes = serve ? 0 : argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  const int max_arg = serve ? 3 : 2;
  size_t max_bytes = argc > max_arg ? std::strtoull(argv[max_arg], nullptr, 10) : size_t(256) << 20;
  std::vector<float> send(max_bytes / sizeof(float), 1.0f), recv(max_bytes / sizeof(float));
  size_t bytes = min_bytes;
  for (;;) {
    if (serve) {
      unsigned long long requested = 0;
      if (std::fscanf(sizes, "%llu", &requested) != 1 || requested == 0 || requested > max_bytes)
        break;
      bytes = requested;
    } else if (bytes > max_bytes) {
      break;
    }
    int count = int(bytes / sizeof(float)), iters = iterations(bytes);
    MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);  // warm-up
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (int i = 0; i < iters; ++i)
      MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double mean = (MPI_Wtime() - start) / iters, slowest = 0;
    MPI_Reduce(&mean, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      std::printf("%zu %.3f\n", bytes, slowest * 1e6);
      std::fflush(stdout);
    }
    if (!serve) bytes *= 2;
  }
  if (sizes) std::fclose(sizes);
  MPI_Finalize();
  return 0;
}
