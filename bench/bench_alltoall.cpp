// All-to-all benchmark, nccl-tests style: for sizes from 1 KiB to 64 MiB
// sent by each rank in all (bytes / n to each rank, itself included), the
// time per all_to_all_v (the slowest rank's mean), algbw = bytes / time and
// busbw = algbw * (n-1)/n (the bytes that leave each rank), beside OpenMPI's
// MPI_Alltoallv on the same sizes when OpenMPI was found at configure time
// (bench/mpi/mpi_alltoall under mpirun, bench/mpi/mpi_server.h).
//
//   trainer launch --nproc-per-node 2 --program build/bench_alltoall -- [--min-bytes B]
//   [--max-bytes B] [--rounds R] [--no-shared-memory] [--staged-bytes B]
//
// Ranks on one host exchange through the communicator's shared-memory
// channel (comm/all_to_all.cpp: blocks up to --staged-bytes, default 1 MiB
// per rank, staged through the segment, larger ones read in place by
// cross-memory attach); --no-shared-memory (CommOptions::shared_memory)
// runs the pairwise exchange over UCX instead. As in bench_allreduce, the
// two sides run alternately: --rounds R (default 3) sweeps the sizes R
// times, each size timed by ours and then at once by OpenMPI's, each side's
// figure per size is its best round, and "won" counts the rounds where ours
// was faster. OpenMPI's ranks are bound the way ours are.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/mpi/mpi_server.h"
#include "comm/collectives.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"

using namespace trainer;
using namespace trainer::comm;

namespace {

using Seconds = std::chrono::duration<double>;

// About 200 MB moved per size, 3 to 1000 iterations (the MPI program uses the same rule).
int iterations(size_t bytes) {
  return int(std::clamp<size_t>((size_t(200) << 20) / std::max<size_t>(bytes, 1), 3, 1000));
}

// Mean seconds per all_to_all_v of `bytes` per rank in n equal blocks, the slowest rank's.
double time_all_to_all(Communicator& world, const char* input, char* output, size_t bytes,
                       const CollectiveOptions& options) {
  const size_t n = size_t(world.size()), block = bytes / n;
  const std::vector<size_t> sizes(n, block);
  std::vector<size_t> offsets(n);
  for (size_t r = 0; r < n; ++r) offsets[r] = r * block;
  auto exchange = [&] {
    all_to_all_v(world, input, sizes, offsets, output, sizes, offsets, options);
  };
  exchange();  // warm-up: connections, pages
  barrier(world);
  const int iters = iterations(bytes);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) exchange();
  double mean = Seconds(std::chrono::steady_clock::now() - start).count() / iters;
  allreduce(world, &mean, 1, DType::f64, {.op = ReduceOp::max});
  return mean;
}

bool bound_to_cores() {
  const size_t allowed = allowed_cores().size();
  return allowed > 0 && long(allowed) < ::sysconf(_SC_NPROCESSORS_ONLN);
}

size_t parse_number(int& i, int argc, char** argv) {
  if (i + 1 >= argc) throw Error(cat(argv[i], " needs a value"));
  return std::strtoull(argv[++i], nullptr, 10);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    size_t min_bytes = size_t(1) << 10, max_bytes = size_t(64) << 20;
    CommOptions comm_options;
    CollectiveOptions options;
    int rounds = 3;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--min-bytes")
        min_bytes = std::max<size_t>(1, parse_number(i, argc, argv));
      else if (a == "--max-bytes")
        max_bytes = parse_number(i, argc, argv);
      else if (a == "--rounds")
        rounds = std::max(1, int(parse_number(i, argc, argv)));
      else if (a == "--no-shared-memory")
        comm_options.shared_memory = false;
      else if (a == "--staged-bytes")
        options.staged_bytes = parse_number(i, argc, argv);
      else
        throw Error(cat("unknown argument ", a,
                        "; use --min-bytes B --max-bytes B --rounds R --no-shared-memory "
                        "--staged-bytes B"));
    }
    Bootstrap boot = detect_bootstrap();
    const int n = boot.world_size;
    const bool bound = bound_to_cores();
    std::map<size_t, double> ours, mpi;  // best seconds, best microseconds
    std::map<size_t, int> won;
    {
      auto world = init_world(boot, comm_options);
      std::vector<char> input(max_bytes, 1), output(max_bytes, 0);
#if defined(TRAINER_MPIEXEC) && defined(TRAINER_MPI_ALLTOALL)
      const char *mpiexec = TRAINER_MPIEXEC, *program = TRAINER_MPI_ALLTOALL;
#else
      const char *mpiexec = nullptr, *program = nullptr;
#endif
      std::unique_ptr<bench::MpiServer> server;
      if (boot.rank == 0)
        server = std::make_unique<bench::MpiServer>(mpiexec, program, n, max_bytes, bound);
      barrier(*world);
      for (int round = 0; round < rounds; ++round)
        for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
          const double seconds =
              time_all_to_all(*world, input.data(), output.data(), bytes, options);
          if (!ours.count(bytes) || seconds < ours[bytes]) ours[bytes] = seconds;
          barrier(*world);
          if (boot.rank == 0)
            if (const double us = server->time(bytes); us >= 0) {
              won[bytes] += seconds * 1e6 < us;
              if (!mpi.count(bytes) || us < mpi[bytes]) mpi[bytes] = us;
            }
          barrier(*world);
        }
      server.reset();
    }
    if (boot.rank != 0) return 0;
    auto bus = [&](double algbw) { return algbw * (n - 1) / n; };
    std::printf("# %s\n", cpu::describe_machine().c_str());
    std::printf(
        "# all_to_all_v, %d ranks, bytes = sent by each rank in all (bytes/%d to each); time = "
        "slowest rank's mean; busbw = bytes/time * (n-1)/n\n",
        n, n);
    std::printf("# %s; ranks %sbound to cores, OpenMPI's likewise (mpirun --bind-to %s)\n",
                comm_options.shared_memory
                    ? cat("shared-memory channel, staged up to ", options.staged_bytes,
                          " bytes, read in place above")
                          .c_str()
                    : "no shared-memory channel: pairwise over UCX",
                bound ? "" : "not ", bound ? "core" : "none");
    std::printf(
        "# best of %d rounds, each size timed by ours and then by OpenMPI's MPI_Alltoallv; won = "
        "rounds ours was faster\n",
        rounds);
    std::printf("# %12s | %10s %9s %9s | %10s %9s %9s | %7s %5s\n", "bytes", "time(us)", "algbw",
                "busbw", "mpi(us)", "algbw", "busbw", "speedup", "won");
    for (const auto& [bytes, seconds] : ours) {
      const double algbw = double(bytes) / seconds / 1e9;
      std::printf("  %12zu | %10.1f %9.3f %9.3f |", bytes, seconds * 1e6, algbw, bus(algbw));
      if (auto it = mpi.find(bytes); it != mpi.end()) {
        const double mpi_algbw = double(bytes) / (it->second * 1e-6) / 1e9;
        std::printf(" %10.1f %9.3f %9.3f | %6.2fx %3d/%d\n", it->second, mpi_algbw, bus(mpi_algbw),
                    it->second / (seconds * 1e6), won[bytes], rounds);
      } else {
        std::printf(" %10s %9s %9s | %7s\n", "-", "-", "-", "-");
      }
    }
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_alltoall: %s\n", e.what());
    return 1;
  }
}
