// Dissemination barrier (Hensgen, Finkel and Manber): in round k every rank
// signals rank + 2^k and waits for rank - 2^k; after ceil(log2 n) rounds each
// rank has heard, directly or not, from every other one.
#include "comm/algorithms.h"

namespace trainer::comm {

void barrier_dissemination(OpChannel& ch) {
  const int n = ch.size(), rank = ch.rank();
  std::vector<Request> requests;
  uint32_t round = 0;
  for (int distance = 1; distance < n; distance <<= 1, ++round) {
    requests.push_back(ch.irecv((rank - distance + n) % n, round, nullptr, 0));
    requests.push_back(ch.isend((rank + distance) % n, round, nullptr, 0));
    ch.wait_all(requests);
  }
}

}  // namespace trainer::comm
