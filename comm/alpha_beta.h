// The alpha-beta-gamma cost model of the allreduce algorithms, with its
// constants measured on the machine, and the choice of AllreduceAlgorithm::automatic
// made from it (for ranks that are not all on one host; those use the
// shared-memory channel).
//
// A message of m bytes costs alpha + m * beta; reducing m bytes costs m * gamma.
// The model of each algorithm (n ranks, m bytes, textbook one-port model):
//
//   ring                2(n-1) alpha + 2(n-1)/n m beta + (n-1)/n m gamma
//   recursive doubling  log2(p) (alpha + m beta + m gamma)             p = 2^floor(log2 n)
//   butterfly           2 log2(p) alpha + 2(p-1)/p m beta + (p-1)/p m gamma
//                       (both + 2 (alpha + m beta) + m gamma when n != p: the fold)
//   tree                2 (h + S - 1)(alpha + c s beta) + (h + S - 1) c s gamma
//                       h = floor(log2 n) levels, S segments of s bytes, c = 2 children
//   all-to-all          (n-1)(alpha + m beta + m gamma)
//   master-worker       2(n-1)(alpha + m beta) + (n-1) m gamma         all on rank 0's link
//   round-robin         (n-1)(alpha + m/n beta) + (n-1)/n m gamma + n (n-1)(alpha + m/n beta)
//                       gathers overlap, the n turns of broadcasts do not
//
// alpha and beta come from a ping-pong between pairs of ranks (small messages
// for alpha, 1 MiB ones for beta), gamma from timing reduce_into on this
// rank; every rank then takes the largest over the communicator, so all
// agree on the model and on every choice made from it.
//
//   const LinkModel& model = link_model(comm);   // collective on first call
//   double us = predict_allreduce(AllreduceAlgorithm::tree, comm.size(), bytes,
//                                 1 << 20, model) * 1e6;
#pragma once

#include <map>
#include <string>
#include <vector>

#include "comm/collectives.h"

namespace trainer::comm {

struct LinkModel {
  double alpha = 0;            // seconds per message
  double beta = 0;             // seconds per byte sent
  double gamma = 0;            // seconds per byte reduced (f32 sum)
  double measure_seconds = 0;  // what measuring it cost
  std::string str() const;     // "alpha 12.3 us, beta 4.56 GB/s, gamma 7.89 GB/s"
};

// Collective on the first call for a set of members (every rank of comm
// calls it at the same point of its issue order): measures the model and
// caches it for every communicator with the same members. Later calls return
// the cached one. Logged when measured (rank 0 at info level, the others at debug).
const LinkModel& link_model(Communicator& comm);
// Measures afresh (collective), caching nothing.
LinkModel measure_link_model(Communicator& comm);

// Where a communicator's model comes from, first found first:
//   1. a preset one (preset_link_model: a resumed run's, from its checkpoint),
//      so that a resumed run makes the choices it made before being stopped;
//   2. TRAINER_LINK_MODEL=ALPHA_US,BETA_GBPS,GAMMA_GBPS (e.g. "2,1.5,12"):
//      the same constants for every communicator, nothing measured, so that
//      two runs choose alike;
//   3. measured (above), on the first call.
// The model of each set of members (their world ranks) found so far.
std::map<std::vector<int>, LinkModel> link_models();
// Makes link_model() of a communicator over `members` (world ranks) return
// `model`, measured or not before. Every member presets the same, at the same
// point of its issue order, or none does.
void preset_link_model(const std::vector<int>& members, const LinkModel& model);
// TRAINER_LINK_MODEL's model (text as above); Error naming the variable
// when it is not three positive numbers.
LinkModel parse_link_model(const std::string& text);

// The model's time for one allreduce of bytes over n ranks; segment_bytes is
// the tree's pipeline unit. Negative for algorithms it does not model
// (automatic, shm).
double predict_allreduce(AllreduceAlgorithm algorithm, int n, size_t bytes, size_t segment_bytes,
                         const LinkModel& model);

// The algorithm with the smallest prediction (ties: the earlier of
// recursive doubling, ring, butterfly, tree, round-robin, all-to-all, master-worker).
AllreduceAlgorithm choose_allreduce(int n, size_t bytes, size_t segment_bytes,
                                    const LinkModel& model);

// The algorithms over point-to-point messages, in the order above.
const std::vector<AllreduceAlgorithm>& modelled_algorithms();

// What one allreduce of bytes over n ranks puts on the wire, counted from
// the algorithm's structure: messages and bytes summed over all ranks, and
// the bytes the busiest rank sends (master-worker's master: (n-1) buffers;
// the ring: 2(n-1)/n of one). Where ranks share cores (one host, more ranks
// than cores) every byte is a copy some core makes, so the total, not the
// busiest rank, sets the time.
struct AllreduceTraffic {
  double messages = 0;
  double busiest_rank_bytes = 0;
  double total_bytes = 0;
};
AllreduceTraffic allreduce_traffic(AllreduceAlgorithm algorithm, int n, size_t bytes,
                                   size_t segment_bytes);

}  // namespace trainer::comm
