// Round-robin allreduce: the buffer is cut into n blocks and block t belongs
// to rank t. Every rank sends each block to its owner at the start; then, in
// turn t = 0, 1, ..., n-1, rank t reduces the n copies of its block and sends
// the result to every rank, which waits for it before the next turn. Each
// rank moves 2(n-1)/n of the buffer, as in the ring, but the turns put one
// rank's link at a time to work for the broadcasts: a master-worker whose
// master changes with the block.
#include <vector>

#include "comm/algorithms.h"

namespace trainer::comm {

void allreduce_round_robin(OpChannel& ch, void* data, size_t count, DType dtype, ReduceOp op) {
  const int n = ch.size(), rank = ch.rank();
  if (n == 1 || count == 0) return;
  const size_t element_bytes = dtype_size(dtype);
  auto block = [&](int t) { return part_of({0, count}, n, t); };
  char* base = static_cast<char*>(data);
  auto at = [&](Range r) { return base + r.begin * element_bytes; };
  auto bytes = [&](Range r) { return r.count * element_bytes; };
  const uint32_t gather = 0, result = 1;

  // Peer p's copy of our block lands in slot p (ours unused).
  const Range own = block(rank);
  char* scratch = thread_scratch(std::max<size_t>(1, size_t(n) * bytes(own)));
  auto slot = [&](int p) { return scratch + size_t(p) * bytes(own); };
  std::vector<Request> copies, results;
  std::vector<Request> to_owner(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) {
    if (p == rank) continue;
    if (own.count) copies.push_back(ch.irecv(p, gather, slot(p), bytes(own)));
    if (block(p).count) to_owner[size_t(p)] = ch.isend(p, gather, at(block(p)), bytes(block(p)));
  }

  for (int turn = 0; turn < n; ++turn) {
    const Range b = block(turn);
    if (b.count == 0) continue;  // count < n: the last blocks are empty
    if (turn == rank) {
      ch.wait_all(copies);
      for (int p = 0; p < n; ++p)
        if (p != rank) reduce_into(at(b), slot(p), b.count, dtype, op);
      if (op == ReduceOp::avg) scale(at(b), b.count, dtype, 1.0 / n);
      for (int p = 0; p < n; ++p)
        if (p != rank) results.push_back(ch.isend(p, result, at(b), bytes(b)));
    } else {
      ch.wait(to_owner[size_t(turn)]);  // our copy has left; the result lands on it
      Request reduced = ch.irecv(turn, result, at(b), bytes(b));
      ch.wait(reduced);
    }
  }
  ch.wait_all(results);
}

}  // namespace trainer::comm
