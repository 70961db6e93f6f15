// The driver of bench/mpi/mpi_allreduce.cpp and mpi_alltoall.cpp: OpenMPI's
// collective timed the way bench_allreduce and bench_alltoall time ours (same
// sizes, iteration counts and timing rule: the slowest rank's mean), printed
// as "bytes microseconds" lines for them to merge into their tables.
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 PROGRAM MIN MAX  # MIN, 2 MIN, ... MAX
//   mpirun ... PROGRAM --serve DIR MAX                                 # sizes on request
//
// With --serve each rank r reads sizes, one per line, from the FIFO DIR/size.r
// (the benchmark writes them, alternating OpenMPI's measurements with its
// own) and times each as it arrives; a 0 or the end of the FIFO ends it.
// Waiting in read() sleeps, so the idle ranks leave the cores to the other side.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace mpi_timing {

// As in our benchmarks: about 200 MB moved per size, 3 to 1000 iterations.
inline int iterations(size_t bytes) {
  return int(std::clamp<size_t>((size_t(200) << 20) / std::max<size_t>(bytes, 1), 3, 1000));
}

// Times run(bytes) (one collective of that size on MPI_COMM_WORLD) at every
// size asked for; setup(max_bytes) first allocates its buffers. Returns the
// exit code.
template <class Setup, class Run>
int time_sizes(int argc, char** argv, const char* name, size_t default_max, Setup&& setup,
               Run&& run) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const bool serve = argc > 3 && std::strcmp(argv[1], "--serve") == 0;
  FILE* sizes = nullptr;
  if (serve) {
    const std::string fifo = std::string(argv[2]) + "/size." + std::to_string(rank);
    sizes = std::fopen(fifo.c_str(), "r");
    if (!sizes) {
      std::fprintf(stderr, "%s: cannot open %s\n", name, fifo.c_str());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  const size_t min_bytes = serve ? 0 : argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  const int max_arg = serve ? 3 : 2;
  const size_t max_bytes = argc > max_arg ? std::strtoull(argv[max_arg], nullptr, 10) : default_max;
  setup(max_bytes);
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
    const int iters = iterations(bytes);
    run(bytes);  // warm-up
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    for (int i = 0; i < iters; ++i) run(bytes);
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

}  // namespace mpi_timing
