// Binomial-tree broadcast: relative to the root, rank v receives from
// v - 2^k (its lowest set bit k) and then sends to v + 2^j for every j < k,
// so the data reaches all n ranks in ceil(log2 n) rounds.
#include "comm/algorithms.h"

namespace trainer::comm {

void broadcast_binomial(OpChannel& ch, void* data, size_t bytes, int root) {
  const int n = ch.size();
  const int v = (ch.rank() - root + n) % n;  // rank relative to the root
  auto real = [&](int relative) { return (relative + root) % n; };
  std::vector<Request> requests;
  int mask = 1;
  for (; mask < n; mask <<= 1) {
    if (v & mask) {
      requests.push_back(ch.irecv(real(v - mask), 0, data, bytes));
      ch.wait_all(requests);
      break;
    }
  }
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (v + mask < n) requests.push_back(ch.isend(real(v + mask), 0, data, bytes));
  ch.wait_all(requests);
}

}  // namespace trainer::comm
