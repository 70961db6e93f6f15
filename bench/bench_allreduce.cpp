// Allreduce benchmark, nccl-tests style: for f32 sum from 1 KiB to 256 MiB,
// the time per allreduce (the slowest rank's mean), algbw = bytes / time and
// busbw = algbw * 2(n-1)/n (the per-rank traffic of a ring, comparable across
// world sizes), and the CPU time (user + system) per allreduce of the busiest
// rank: on a loaded machine, where ranks wait for a core, it shows what the
// work itself costs. When OpenMPI was found at configure time, rank 0 then runs
// bench/mpi/mpi_allreduce under mpirun with the same sizes and prints both
// side by side. The copy bound is this machine's single-thread memcpy
// bandwidth: on one node every byte of busbw costs at least one copy.
//
//   trainer launch --nproc-per-node 2 --program build/bench_allreduce -- [--min-bytes B]
//   [--max-bytes B] [--no-failure-detection] [--algorithm NAME|all] [--segment-bytes B]
//   [--cross-memory] [--no-shared-memory] [--shared-buffer] [--rounds R]
//
// --algorithm forces one of auto, ring, recursive-doubling, tree, butterfly,
// all-to-all, master-worker, round-robin or shm (comm/collectives.h). With
// --algorithm all the table instead has a row per size and algorithm (every
// point-to-point one, and shm where the ranks share a host), each the best of
// --rounds, beside the alpha-beta model's prediction (comm/alpha_beta.h,
// measured at start), the messages per allreduce and the bytes the busiest
// rank sends: master-worker's bottleneck, all-to-all's message count and
// the ring's bandwidth optimality in numbers. "auto" marks the model's choice
// among the point-to-point algorithms, "*" the fastest measured.
//
// Ranks on one host reduce through the communicator's shared-memory channel
// (comm/shm_channel.h: small messages staged, large ones pipelined through the
// segment, or with --cross-memory read from the peers' buffers by
// process_vm_readv; with --shared-buffer the buffer lies in a shared region,
// comm/shm_region.h, as data parallelism's buckets do, and large messages are
// reduced in place in the peers' buffers); --no-shared-memory (CommOptions::shared_memory) keeps
// them on UCX shared memory (posix fifos, cma), and --algorithm forces one.
// The VM's two vCPUs move between host cores over time, and how fast a cache
// line travels between them changes with it (1 KiB: 0.3 to 1.1 us, the same
// binary minutes apart), so the two sides run alternately: --rounds R (default
// 3) sweeps the sizes R times, each size timed by ours and then at once by
// OpenMPI's (bench/mpi/mpi_allreduce --serve, started once), so both see the
// same machine. Per size the table prints each side's best round, "won"
// (the rounds where ours was faster), each side's median round, and the
// median of the per-round speedups (OpenMPI's time / ours) with their range,
// e.g. "1.42x (1.31-1.55)": the figure that survives the VM's swings. "of
// copy" is our median algbw over the copy bound. OpenMPI's
// ranks are bound the way ours are: mpirun --bind-to core when this rank runs
// on fewer cores than the machine has (trainer launch --bind-to core;
// mpirun's own default for 2 ranks), --bind-to none otherwise.
// Local peers' processes are watched through pidfds (see comm/transport.h);
// --no-failure-detection turns the watching off (CommOptions::detect_peer_failure)
// to show what it costs.
#include <fcntl.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/mpi/mpi_server.h"
#include "comm/alpha_beta.h"
#include "comm/collectives.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"

using namespace trainer;
using namespace trainer::comm;
using trainer::bench::Spread;
using trainer::bench::spread_of;

namespace {

using Seconds = std::chrono::duration<double>;
using bench::MpiServer;

// OpenMPI's side (bench/mpi/mpi_server.h): bench/mpi/mpi_allreduce, when
// OpenMPI was found at configure time.
#if defined(TRAINER_MPIEXEC) && defined(TRAINER_MPI_ALLREDUCE)
const char* const kMpiExec = TRAINER_MPIEXEC;
const char* const kMpiAllreduce = TRAINER_MPI_ALLREDUCE;
#else
const char* const kMpiExec = nullptr;
const char* const kMpiAllreduce = nullptr;
#endif

// About 200 MB moved per size, 3 to 1000 iterations (the MPI program uses the same rule).
int iterations(size_t bytes, size_t most = 1000) {
  return int(std::clamp<size_t>((size_t(200) << 20) / std::max<size_t>(bytes, 1), 3, most));
}

// User + system CPU seconds of this process so far.
double cpu_seconds() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) * 1e-6;
}

struct Timing {
  double seconds;      // mean wall time per allreduce, the slowest rank's
  double cpu_seconds;  // mean CPU time per allreduce, the busiest rank's
};

Timing time_allreduce(Communicator& world, float* data, size_t bytes,
                      const AllreduceOptions& options, size_t most_iterations = 1000) {
  const size_t count = bytes / sizeof(float);
  allreduce(world, data, count, DType::f32, options);  // warm-up: connections, pages
  barrier(world);
  const int iters = iterations(bytes, most_iterations);
  auto start = std::chrono::steady_clock::now();
  double cpu_start = cpu_seconds();
  for (int i = 0; i < iters; ++i) allreduce(world, data, count, DType::f32, options);
  double mean[2] = {Seconds(std::chrono::steady_clock::now() - start).count() / iters,
                    (cpu_seconds() - cpu_start) / iters};
  allreduce(world, mean, 2, DType::f64, {.op = comm::ReduceOp::max});
  return {mean[0], mean[1]};
}

// Single-thread memcpy bandwidth in GB/s (bytes read, as busbw counts them).
double memcpy_bandwidth() {
  const size_t bytes = size_t(256) << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    auto start = std::chrono::steady_clock::now();
    std::memcpy(rep % 2 ? a.data() : b.data(), rep % 2 ? b.data() : a.data(), bytes);
    best = std::min(best, Seconds(std::chrono::steady_clock::now() - start).count());
  }
  return double(bytes) / best / 1e9;
}

// Whether this process may run on fewer cores than are online.
bool bound_to_cores() {
  const size_t allowed = allowed_cores().size();
  return allowed > 0 && long(allowed) < ::sysconf(_SC_NPROCESSORS_ONLN);
}

AllreduceAlgorithm parse_algorithm(const std::string& name) {
  if (std::optional<AllreduceAlgorithm> algorithm = parse_allreduce_algorithm(name))
    return *algorithm;
  throw Error(cat("--algorithm ", name,
                  ": use auto, ring, recursive-doubling, tree, butterfly, all-to-all, "
                  "master-worker, round-robin, shm or all"));
}

// --algorithm all: every algorithm at every size, best of `rounds`, beside
// the model. Rank 0 prints the table.
void compare_algorithms(Communicator& world, float* data, size_t min_bytes, size_t max_bytes,
                        int rounds, AllreduceOptions options) {
  const int n = world.size();
  std::vector<AllreduceAlgorithm> algorithms = modelled_algorithms();
  const bool shm = n > 1 && world.shm() != nullptr;
  if (shm) algorithms.push_back(AllreduceAlgorithm::shm);
  const LinkModel& model = link_model(world);
  std::map<std::pair<size_t, AllreduceAlgorithm>, double> best;  // seconds
  for (int round = 0; round < rounds; ++round)
    for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2)
      for (AllreduceAlgorithm algorithm : algorithms) {
        options.algorithm = algorithm;
        // At most 200 iterations: the slow algorithms' large sizes take seconds each.
        const double seconds = time_allreduce(world, data, bytes, options, 200).seconds;
        auto [it, fresh] = best.try_emplace({bytes, algorithm}, seconds);
        if (!fresh) it->second = std::min(it->second, seconds);
      }
  if (world.rank() != 0) return;
  std::printf("# %s\n", cpu::describe_machine().c_str());
  std::printf(
      "# allreduce f32 sum, %d ranks, in place, every algorithm; time = slowest rank's mean, best "
      "of %d rounds\n",
      n, rounds);
  std::printf(
      "# alpha-beta model (measured at start in %.0f ms, the largest over rank pairs): %s; "
      "segment %zu bytes\n",
      model.measure_seconds * 1e3, model.str().c_str(), options.segment_bytes);
  std::printf(
      "# busbw = bytes/time * 2(n-1)/n; msgs = messages per allreduce over all ranks; busiest = "
      "bytes sent by the busiest rank / bytes; total = bytes sent by all ranks / bytes; auto = the "
      "model's choice, * = fastest measured%s\n",
      shm ? "; shm = the shared-memory channel (not modelled)" : "");
  std::printf("# %12s %-19s %10s %9s %10s %7s %8s %8s %6s\n", "bytes", "algorithm", "time(us)",
              "busbw", "model(us)", "model/t", "msgs", "busiest", "total");
  for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    const AllreduceAlgorithm chosen = choose_allreduce(n, bytes, options.segment_bytes, model);
    AllreduceAlgorithm fastest = algorithms.front();
    for (AllreduceAlgorithm algorithm : algorithms)
      if (best[{bytes, algorithm}] < best[{bytes, fastest}]) fastest = algorithm;
    for (AllreduceAlgorithm algorithm : algorithms) {
      const double seconds = best[{bytes, algorithm}];
      const double busbw = double(bytes) / seconds / 1e9 * 2.0 * (n - 1) / n;
      const double predicted = predict_allreduce(algorithm, n, bytes, options.segment_bytes, model);
      const AllreduceTraffic traffic =
          allreduce_traffic(algorithm, n, bytes, options.segment_bytes);
      const std::string mark =
          cat(algorithm == chosen ? " auto" : "", algorithm == fastest ? " *" : "");
      if (predicted >= 0)
        std::printf("  %12zu %-19s %10.1f %9.3f %10.1f %7.2f %8.0f %8.2f %6.2f%s\n", bytes,
                    std::string(algorithm_name(algorithm)).c_str(), seconds * 1e6, busbw,
                    predicted * 1e6, predicted / seconds, traffic.messages,
                    traffic.busiest_rank_bytes / double(bytes), traffic.total_bytes / double(bytes),
                    mark.c_str());
      else
        std::printf("  %12zu %-19s %10.1f %9.3f %10s %7s %8s %8s %6s%s\n", bytes,
                    std::string(algorithm_name(algorithm)).c_str(), seconds * 1e6, busbw, "-", "-",
                    "-", "-", "-", mark.c_str());
    }
  }
}

// One size's figures, round by round: ours (the slowest rank's mean per
// allreduce) and OpenMPI's seconds (negative where it did not answer).
struct SizeRounds {
  size_t bytes = 0;
  std::vector<Timing> ours;
  std::vector<double> mpi_seconds;
};

// Per round that measured both sides, OpenMPI's time / ours (> 1: ours is faster).
std::vector<double> speedups(const SizeRounds& size) {
  std::vector<double> out;
  for (size_t k = 0; k < size.ours.size(); ++k)
    if (size.mpi_seconds[k] > 0) out.push_back(size.mpi_seconds[k] / size.ours[k].seconds);
  return out;
}

// Both sides time each size in turn (ours, then OpenMPI's while our ranks
// sleep in a barrier); the sweep repeats `rounds` times. `server` is null on
// ranks other than 0, which only take part in ours.
std::vector<SizeRounds> sweep_sizes(Communicator& world, float* data, size_t min_bytes,
                                    size_t max_bytes, int rounds, const AllreduceOptions& options,
                                    MpiServer* server) {
  std::vector<SizeRounds> sizes;
  for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) sizes.push_back({bytes, {}, {}});
  for (int round = 0; round < rounds; ++round)
    for (SizeRounds& size : sizes) {
      size.ours.push_back(time_allreduce(world, data, size.bytes, options));
      barrier(world);
      const double us = server ? server->time(size.bytes) : -1.0;
      size.mpi_seconds.push_back(us >= 0 ? us * 1e-6 : -1.0);
      barrier(world);
    }
  return sizes;
}

// A row per size: each side's best round (and the rounds ours won), then
// each side's median round, our median algbw against the copy bound and
// the median speedup with its range.
void print_sizes(const std::vector<SizeRounds>& sizes, int n, double copy) {
  auto bus = [&](double algbw) { return algbw * 2.0 * (n - 1) / n; };
  std::printf("# %12s %11s | %10s %9s %9s %10s | %10s %9s %9s | %7s %5s | %10s %10s %7s | %s\n",
              "bytes", "count", "time(us)", "algbw", "busbw", "cpu(us)", "mpi(us)", "algbw",
              "busbw", "speedup", "won", "med(us)", "mpi med", "of copy", "median speedup (range)");
  for (const SizeRounds& size : sizes) {
    const Timing best =
        *std::min_element(size.ours.begin(), size.ours.end(),
                          [](const Timing& a, const Timing& b) { return a.seconds < b.seconds; });
    std::vector<double> ours_seconds, mpi_seconds;
    int won = 0;
    for (size_t k = 0; k < size.ours.size(); ++k) {
      ours_seconds.push_back(size.ours[k].seconds);
      if (size.mpi_seconds[k] < 0) continue;
      mpi_seconds.push_back(size.mpi_seconds[k]);
      won += size.ours[k].seconds < size.mpi_seconds[k];
    }
    const double bytes = double(size.bytes), algbw = bytes / best.seconds / 1e9;
    const double median_seconds = spread_of(ours_seconds).median;
    std::printf("  %12zu %11zu | %10.1f %9.3f %9.3f %10.1f |", size.bytes,
                size.bytes / sizeof(float), best.seconds * 1e6, algbw, bus(algbw),
                best.cpu_seconds * 1e6);
    const double of_copy = bytes / median_seconds / 1e9 / copy;
    if (mpi_seconds.empty()) {
      std::printf(" %10s %9s %9s | %7s %5s | %10.1f %10s %7.3f | -\n", "-", "-", "-", "-", "-",
                  median_seconds * 1e6, "-", of_copy);
      continue;
    }
    const double mpi_best = *std::min_element(mpi_seconds.begin(), mpi_seconds.end());
    const double mpi_algbw = bytes / mpi_best / 1e9;
    const Spread speedup = spread_of(speedups(size));
    std::printf(" %10.1f %9.3f %9.3f | %6.2fx %3d/%zu | %10.1f %10.1f %7.3f | %.2fx (%.2f-%.2f)\n",
                mpi_best * 1e6, mpi_algbw, bus(mpi_algbw), mpi_best / best.seconds, won,
                size.ours.size(), median_seconds * 1e6, spread_of(mpi_seconds).median * 1e6,
                of_copy, speedup.median, speedup.low, speedup.high);
  }
}

// Rank 0's table: the machine, the settings, the copy bound (measured now,
// after the sweep, when the other ranks and OpenMPI's have finished) and a
// row per size.
void print_report(const std::vector<SizeRounds>& sizes, int n, int rounds, bool bound,
                  const CommOptions& options, const AllreduceOptions& allreduce_options,
                  bool shared_buffer) {
  const double copy = memcpy_bandwidth();
  std::printf("# %s\n", cpu::describe_machine().c_str());
  std::printf("# allreduce f32 sum, %d ranks, in place; time = slowest rank's mean; %s\n", n,
              options.detect_peer_failure
                  ? "peer failure detection on (local peers: shared memory + pidfd)"
                  : "peer failure detection off (--no-failure-detection)");
  std::printf("# algorithm %s%s%s%s\n",
              std::string(algorithm_name(allreduce_options.algorithm)).c_str(),
              options.shared_memory ? "" : ", no shared-memory channel",
              allreduce_options.cross_memory ? ", shm large messages by cross-memory attach" : "",
              shared_buffer ? ", buffer in a shared region (large messages reduced in place)" : "");
  std::printf("# %s\n", bound ? "ranks bound to cores (trainer launch --bind-to core); OpenMPI's "
                                "too (mpirun --bind-to core)"
                              : "ranks not bound to cores; OpenMPI's neither (mpirun --bind-to "
                                "none); trainer launch --bind-to core binds them");
  std::printf(
      "# %d rounds, each size timed by ours and then by OpenMPI's; time, algbw, busbw, cpu, "
      "mpi: each side's best round; speedup = OpenMPI's best / ours; won = rounds ours was "
      "faster\n",
      rounds);
  std::printf(
      "# med = each side's median round; of copy = our median algbw / the copy bound; median "
      "speedup = the median of the rounds' OpenMPI time / ours (lowest-highest)\n");
  std::printf(
      "# copy bound: single-thread memcpy %.2f GB/s (256 MiB, best of 5, after the sweep)\n", copy);
  print_sizes(sizes, n, copy);
  // The largest size against the copy bound: best round, median round, and
  // per CPU second of the busiest rank (the figure a loaded machine, whose
  // ranks wait for a core, does not change).
  const SizeRounds& largest = sizes.back();
  const double bytes = double(largest.bytes);
  double best_seconds = largest.ours[0].seconds;
  std::vector<double> seconds, cpu_seconds;
  for (const Timing& t : largest.ours) {
    best_seconds = std::min(best_seconds, t.seconds);
    seconds.push_back(t.seconds);
    cpu_seconds.push_back(t.cpu_seconds);
  }
  const double largest_busbw = bytes / best_seconds / 1e9 * 2.0 * (n - 1) / n;
  const double median_algbw = bytes / spread_of(seconds).median / 1e9;
  const double cpu_algbw = bytes / spread_of(cpu_seconds).median / 1e9;
  std::printf(
      "# largest size: busbw %.2f GB/s = %.2f of the copy bound (best round); median algbw "
      "%.2f GB/s = %.2f of it; per CPU second %.2f GB/s = %.2f of it\n",
      largest_busbw, largest_busbw / copy, median_algbw, median_algbw / copy, cpu_algbw,
      cpu_algbw / copy);
}

size_t parse_number(int& i, int argc, char** argv) {
  if (i + 1 >= argc) throw Error(cat(argv[i], " needs a value"));
  return std::strtoull(argv[++i], nullptr, 10);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    size_t min_bytes = 1024, max_bytes = size_t(256) << 20;
    CommOptions options;
    AllreduceOptions allreduce_options;
    bool shared_buffer = false, every_algorithm = false;
    int rounds = 3;
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--min-bytes")
        min_bytes = parse_number(i, argc, argv);
      else if (a == "--max-bytes")
        max_bytes = parse_number(i, argc, argv);
      else if (a == "--no-failure-detection")
        options.detect_peer_failure = false;
      else if (a == "--no-shared-memory")
        options.shared_memory = false;
      else if (a == "--cross-memory")
        allreduce_options.cross_memory = true;
      else if (a == "--shared-buffer")
        shared_buffer = true;
      else if (a == "--rounds")
        rounds = std::max(1, int(parse_number(i, argc, argv)));
      else if (a == "--algorithm" && i + 1 < argc && std::string(argv[i + 1]) == "all")
        every_algorithm = true, ++i;
      else if (a == "--algorithm" && i + 1 < argc)
        allreduce_options.algorithm = parse_algorithm(argv[++i]);
      else if (a == "--segment-bytes")
        allreduce_options.segment_bytes = std::max<size_t>(1, parse_number(i, argc, argv));
      else
        throw Error(
            cat("unknown argument ", a,
                "; use --min-bytes B --max-bytes B --no-failure-detection --algorithm "
                "NAME|all --segment-bytes B --cross-memory --no-shared-memory --shared-buffer "
                "--rounds R"));
    }
    if (min_bytes == 0 || min_bytes > max_bytes)
      throw Error(
          cat("--min-bytes ", min_bytes, " --max-bytes ", max_bytes, ": need 0 < min <= max"));
    Bootstrap boot = detect_bootstrap();
    const int n = boot.world_size;
    const bool bound = bound_to_cores();
    std::vector<SizeRounds> sizes;
    {
      auto world = init_world(boot, options);
      std::vector<float> private_data(shared_buffer ? 0 : max_bytes / sizeof(float), 1.0f);
      std::shared_ptr<ShmRegion> region = shared_buffer ? world->share_memory(max_bytes) : nullptr;
      if (shared_buffer && !region)
        throw Error("--shared-buffer: no shared region (ranks on several hosts, or no channel)");
      float* data = region ? reinterpret_cast<float*>(region->local()) : private_data.data();
      std::fill(data, data + max_bytes / sizeof(float), 1.0f);
      if (every_algorithm) {
        compare_algorithms(*world, data, min_bytes, max_bytes, rounds, allreduce_options);
        return 0;
      }
      std::unique_ptr<MpiServer> server;
      if (boot.rank == 0)
        server = std::make_unique<MpiServer>(kMpiExec, kMpiAllreduce, n, max_bytes, bound);
      barrier(*world);
      sizes =
          sweep_sizes(*world, data, min_bytes, max_bytes, rounds, allreduce_options, server.get());
      server.reset();
    }
    if (boot.rank != 0) return 0;
    print_report(sizes, n, rounds, bound, options, allreduce_options, shared_buffer);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_allreduce: %s\n", e.what());
    return 1;
  }
}
