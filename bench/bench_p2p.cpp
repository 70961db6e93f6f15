// Point-to-point benchmark between two ranks of one host: the one-way time
// of a message of 4 KiB to 64 MiB (half a ping-pong's round trip, the best
// of --rounds sweeps) and its bandwidth, for
//   ucx   Communicator::send / recv (comm/p2p.h): UCX's shared-memory
//         transports (posix fifos for small messages, cross-memory attach
//         rendezvous for large ones)
//   shm   the alternative the communicator's shared-memory channel offers
//         (comm/shm_channel.h): the sender posts its buffer and the receiver
//         copies it with process_vm_readv, one copy, one stage handshake each
//         way, as a point-to-point path through the channel would
// and the copy bound (single-thread memcpy). It decides whether
// point-to-point messages between local ranks should go through the channel:
// only if shm beats ucx for the activations of a pipeline (a few MB).
//
//   trainer launch --nproc-per-node 2 --program build/bench_p2p -- [--rounds R] [--max-bytes B]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "comm/shm_channel.h"
#include "core/cpu/isa.h"

using namespace trainer;
using namespace trainer::comm;

namespace {

using Seconds = std::chrono::duration<double>;

// About 256 MB moved per size and path, 4 to 2000 round trips.
int round_trips(size_t bytes) {
  return int(std::clamp<size_t>((size_t(128) << 20) / std::max<size_t>(bytes, 1), 4, 2000));
}

// Mean one-way seconds of fn(i) (one message, direction i % 2) over a round
// trip count for bytes, after a warm-up, the slower rank's.
template <class Fn>
double one_way_seconds(Communicator& world, size_t bytes, Fn&& fn) {
  fn(0);
  fn(1);
  barrier(world);
  const int trips = round_trips(bytes);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 2 * trips; ++i) fn(i);
  double mean = Seconds(std::chrono::steady_clock::now() - start).count() / (2 * trips);
  allreduce(world, &mean, 1, DType::f64, {.op = ReduceOp::max});
  return mean;
}

// Message i goes from rank i % 2 to the other.
double time_ucx(Communicator& world, Tensor& mine, Tensor& theirs, size_t bytes) {
  const int me = world.rank(), other = 1 - me;
  return one_way_seconds(world, bytes, [&](int i) {
    const P2PTag tag{.micro_batch = i % 2};
    if (i % 2 == me)
      world.send(mine, other, tag).wait();
    else
      world.recv(theirs, other, tag).wait();
  });
}

// Message i: rank i % 2 posts its buffer, the other reads it by cross-memory
// attach and tells it is done (phase 2), so the sender may reuse its buffer.
double time_shm(Communicator& world, ShmChannel& shm, Tensor& mine, Tensor& theirs, size_t bytes) {
  const int me = world.rank();
  return one_way_seconds(world, bytes, [&](int i) {
    ShmChannel::Turn turn(shm, shm.take_ticket(), "p2p(shm)", world.options().timeout);
    turn.post(i % 2 == me ? mine.data_ptr() : theirs.data_ptr(), bytes);
    turn.publish(1);
    turn.wait_all(1);
    if (i % 2 != me) turn.read_peer(1 - me, 0, theirs.data_ptr(), bytes);
    turn.publish(2);
    turn.wait_all(2);
  });
}

double memcpy_seconds(size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  double best = 1e30;
  for (int rep = 0; rep < std::max(4, round_trips(bytes) / 4); ++rep) {
    auto start = std::chrono::steady_clock::now();
    std::memcpy(rep % 2 ? a.data() : b.data(), rep % 2 ? b.data() : a.data(), bytes);
    best = std::min(best, Seconds(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int rounds = 3;
    size_t max_bytes = size_t(64) << 20;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--rounds" && i + 1 < argc)
        rounds = std::max(1, std::atoi(argv[++i]));
      else if (a == "--max-bytes" && i + 1 < argc)
        max_bytes = std::strtoull(argv[++i], nullptr, 10);
      else
        throw Error(cat("unknown argument ", a, "; usage: bench_p2p [--rounds R] [--max-bytes B]"));
    }
    auto world = init_world(detect_bootstrap());
    if (world->size() != 2) throw Error("bench_p2p runs on 2 ranks (--nproc-per-node 2)");
    ShmChannel* shm = world->shm();
    std::vector<size_t> sizes;
    for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) sizes.push_back(bytes);
    std::vector<double> ucx(sizes.size(), 1e30), channel(sizes.size(), 1e30);
    for (int round = 0; round < rounds; ++round)
      for (size_t k = 0; k < sizes.size(); ++k) {
        const int64_t count = int64_t(sizes[k] / 4);
        Tensor mine = full({count}, double(world->rank())), theirs = zeros({count});
        ucx[k] = std::min(ucx[k], time_ucx(*world, mine, theirs, sizes[k]));
        if (shm) channel[k] = std::min(channel[k], time_shm(*world, *shm, mine, theirs, sizes[k]));
      }
    if (world->rank() == 0) {
      std::printf("# %s\n", cpu::describe_machine().c_str());
      std::printf(
          "# point-to-point, 2 ranks on one host, one-way time (half a ping-pong), best "
          "of %d rounds\n",
          rounds);
      std::printf("# %10s | %9s %8s | %9s %8s | %9s %8s | %8s\n", "bytes", "ucx us", "GB/s",
                  "shm us", "GB/s", "memcpy us", "GB/s", "shm/ucx");
      for (size_t k = 0; k < sizes.size(); ++k) {
        const double copy = memcpy_seconds(sizes[k]), b = double(sizes[k]) / 1e9;
        std::printf("  %10zu | %9.1f %8.2f | ", sizes[k], ucx[k] * 1e6, b / ucx[k]);
        if (shm)
          std::printf("%9.1f %8.2f | ", channel[k] * 1e6, b / channel[k]);
        else
          std::printf("%9s %8s | ", "-", "-");
        std::printf("%9.1f %8.2f | %8.2f\n", copy * 1e6, b / copy, shm ? channel[k] / ucx[k] : 0);
      }
    }
    barrier(*world);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_p2p: %s\n", e.what());
    return 1;
  }
}
