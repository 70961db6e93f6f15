// OpenMPI's MPI_Alltoallv timed the way bench/bench_alltoall.cpp times ours
// (same sizes, iteration counts and timing rule: the slowest rank's mean),
// printed as "bytes microseconds" lines for it to merge into its table.
// bytes is what each rank sends in all, bytes / n to each rank (itself included).
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 mpi_alltoall 1024 67108864
//   mpirun ... mpi_alltoall --serve DIR 67108864   # sizes on request (bench/mpi/mpi_server.h)
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {
// As in bench_alltoall: about 200 MB moved per size, 3 to 1000 iterations.
int iterations(size_t bytes) {
  return int(std::clamp<size_t>((size_t(200) << 20) / std::max<size_t>(bytes, 1), 3, 1000));
}
}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const bool serve = argc > 3 && std::strcmp(argv[1], "--serve") == 0;
  FILE* sizes = nullptr;
  if (serve) {
    const std::string fifo = std::string(argv[2]) + "/size." + std::to_string(rank);
    sizes = std::fopen(fifo.c_str(), "r");
    if (!sizes) {
      std::fprintf(stderr, "mpi_alltoall: cannot open %s\n", fifo.c_str());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  size_t min_bytes = serve ? 0 : argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  const int max_arg = serve ? 3 : 2;
  size_t max_bytes = argc > max_arg ? std::strtoull(argv[max_arg], nullptr, 10) : size_t(64) << 20;
  std::vector<char> send(max_bytes, 1), recv(max_bytes);
  std::vector<int> counts(static_cast<size_t>(n)), offsets(static_cast<size_t>(n));
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
    const int block = int(bytes / size_t(n)), iters = iterations(bytes);
    for (int r = 0; r < n; ++r) counts[size_t(r)] = block, offsets[size_t(r)] = r * block;
    auto exchange = [&] {
      MPI_Alltoallv(send.data(), counts.data(), offsets.data(), MPI_BYTE, recv.data(),
                    counts.data(), offsets.data(), MPI_BYTE, MPI_COMM_WORLD);
    };
    exchange();  // warm-up
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (int i = 0; i < iters; ++i) exchange();
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
