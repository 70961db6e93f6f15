// All-to-all allreduce: every rank sends its whole buffer to every other
// rank and reduces the n copies itself. One round of latency, but n(n-1)
// messages and (n-1) buffers sent and received per rank: the textbook's
// example of what not to do with large buffers.
//
// The buffer moves in segments of at most segment_bytes, the next segment's
// messages in flight while the current one is reduced, so the scratch holds
// two segments per peer rather than n-1 buffers. Every rank folds the copies
// in rank order, so all end with the same bits.
#include <cstring>
#include <vector>

#include "comm/algorithms.h"

namespace trainer::comm {

void allreduce_all_to_all(OpChannel& ch, void* data, size_t count, DType dtype, ReduceOp op,
                          size_t segment_bytes) {
  const int n = ch.size(), rank = ch.rank();
  if (n == 1 || count == 0) return;
  const size_t element_bytes = dtype_size(dtype);
  const Segments parts(data, count, element_bytes, segment_bytes);
  const int segments = parts.n;

  // Peer p's copy of segment j lands in slot (j % 2, p); this rank's slot is unused.
  const size_t slot_bytes = parts.bytes(parts.range(0));
  char* scratch = thread_scratch(2 * size_t(n) * slot_bytes);
  auto slot = [&](int j, int p) {
    return scratch + (size_t(j % 2) * size_t(n) + size_t(p)) * slot_bytes;
  };
  std::vector<Request> receives[2], sends[2];
  // Posts segment j's receives and sends, to peers rank+1, rank+2, ... so
  // that not everyone sends to rank 0 first.
  auto start = [&](int j) {
    const Range seg = parts.range(j);
    for (int k = 1; k < n; ++k) {
      const int p = (rank + k) % n;
      receives[j % 2].push_back(ch.irecv(p, uint32_t(j), slot(j, p), parts.bytes(seg)));
      sends[j % 2].push_back(ch.isend(p, uint32_t(j), parts.at(seg), parts.bytes(seg)));
    }
  };

  start(0);
  for (int j = 0; j < segments; ++j) {
    if (j + 1 < segments) start(j + 1);
    ch.wait_all(receives[j % 2]);
    ch.wait_all(sends[j % 2]);  // our copy is about to be overwritten
    const Range seg = parts.range(j);
    // copy 0 (op) copy 1 (op) ... (op) copy n-1, ours at position `rank`.
    char* sum = rank == 0 ? parts.at(seg) : slot(j, 0);
    for (int p = 1; p < n; ++p)
      reduce_into(sum, p == rank ? parts.at(seg) : slot(j, p), seg.count, dtype, op);
    if (sum != parts.at(seg)) std::memcpy(parts.at(seg), sum, parts.bytes(seg));
    if (op == ReduceOp::avg) scale(parts.at(seg), seg.count, dtype, 1.0 / n);
  }
}

}  // namespace trainer::comm
