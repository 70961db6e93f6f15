// How many bytes this process's communication moved since it started, per
// kind, for logs and benchmarks (the trainer's comm_mib metric). Counted
// when an operation is issued, with relaxed atomic additions: no locks, and
// an operation that later fails still counts.
//
// The collectives count "bus bytes", the convention of NCCL's benchmarks
// (nccl-tests): what each rank moves whatever the algorithm or the channel
// (UCX, the shared-memory channel, in place in a shared region). For a
// communicator of n ranks and an operation on S bytes in all:
//   allreduce       2 (n - 1) / n x S   (S: the buffer; reduce-scatter then all-gather)
//   reduce_scatter  (n - 1) / n x S     (S: the input, every rank's block together)
//   allgather       (n - 1) / n x S     (S: the output, every rank's block together)
//   broadcast       S on every rank, the root included (what each other rank receives)
//   all_to_all      the bytes of the blocks for the other ranks (S: the input,
//                   n equal blocks: (n - 1) / n x S; all_to_all_v: its own sizes)
// rounded down to whole bytes; n == 1 counts 0, and so does barrier. p2p is
// the bytes of Communicator::send (receives count nothing: the sender counts
// them). The blocking, the _async and the tensor forms count alike.
//
// transport and network are another view of the same traffic, not added to
// total(): the bytes handed to the UCX transport's isend, by collectives,
// point-to-point messages and the cost model's measurements alike (the
// shared-memory channel's collectives hand it nothing), and the part of
// them addressed to ranks on other hosts (what crosses the network).
//
//   const comm::Traffic before = comm::traffic();
//   comm::allreduce(*world, grad);
//   uint64_t moved = (comm::traffic() - before).total();   // 2 (n - 1) / n x grad.nbytes()
#pragma once

#include <atomic>
#include <cstdint>

namespace trainer::comm {

struct Traffic {
  uint64_t allreduce = 0, reduce_scatter = 0, allgather = 0, broadcast = 0, p2p = 0;
  uint64_t transport = 0, network = 0;
  uint64_t all_to_all = 0;

  // The collectives' bus bytes plus p2p (transport and network left out).
  uint64_t total() const {
    return allreduce + reduce_scatter + allgather + broadcast + p2p + all_to_all;
  }
  // Field by field: the traffic between two readings.
  Traffic operator-(const Traffic& earlier) const {
    return {allreduce - earlier.allreduce,
            reduce_scatter - earlier.reduce_scatter,
            allgather - earlier.allgather,
            broadcast - earlier.broadcast,
            p2p - earlier.p2p,
            transport - earlier.transport,
            network - earlier.network,
            all_to_all - earlier.all_to_all};
  }
};

// The totals since the process started (each field read on its own).
Traffic traffic();

// ---- used by the collectives, point-to-point messages and the transport ----
enum class TrafficKind {
  allreduce,
  reduce_scatter,
  allgather,
  broadcast,
  p2p,
  transport,
  network,
  all_to_all
};
constexpr int kTrafficKinds = 8;

namespace detail {
inline std::atomic<uint64_t> traffic_bytes[kTrafficKinds]{};
}  // namespace detail

inline void count_traffic(TrafficKind kind, uint64_t bytes) {
  detail::traffic_bytes[int(kind)].fetch_add(bytes, std::memory_order_relaxed);
}

// Bus bytes of a collective over n ranks (see above) on S bytes.
inline uint64_t allreduce_bus_bytes(int n, uint64_t s) {
  return n > 1 ? 2 * uint64_t(n - 1) * s / uint64_t(n) : 0;
}
inline uint64_t scatter_gather_bus_bytes(int n, uint64_t s) {
  return n > 1 ? uint64_t(n - 1) * s / uint64_t(n) : 0;
}

}  // namespace trainer::comm
