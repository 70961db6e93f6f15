// Butterfly allreduce (Rabenseifner): over p = 2^k ranks the buffer is cut
// into p blocks. Recursive halving: in round i every rank exchanges half of
// the blocks it still owns with the rank whose index differs in bit k-1-i,
// keeps the half its bit selects and reduces the partner's copy of it into
// its own; after log2(p) rounds rank v owns block v, reduced over all ranks
// (a reduce-scatter). Recursive doubling then runs it backwards, each round
// swapping the owned blocks with the partner's so that every rank ends with
// every block (an all-gather). Each rank moves 2(p-1)/p of the buffer, like
// the ring, in 2 log2(p) messages instead of 2(p-1).
//
// Other world sizes are folded onto a power of two first (PowerOfTwoFold,
// comm/algorithms.h); the ranks that sat out get the result at the end.
#include <vector>

#include "comm/algorithms.h"

namespace trainer::comm {

void PowerOfTwoFold::fold(OpChannel& ch, uint32_t message, void* data, void* received, size_t count,
                          DType dtype, ReduceOp op) const {
  if (rank >= 2 * rem) return;
  std::vector<Request> requests;
  const size_t bytes = count * dtype_size(dtype);
  if (rank % 2 == 0) {
    requests.push_back(ch.isend(rank + 1, message, data, bytes));
    ch.wait_all(requests);
    return;
  }
  requests.push_back(ch.irecv(rank - 1, message, received, bytes));
  ch.wait_all(requests);
  reduce_into(data, received, count, dtype, op);
}

void PowerOfTwoFold::unfold(OpChannel& ch, uint32_t message, void* data, size_t bytes) const {
  if (rank >= 2 * rem) return;
  std::vector<Request> requests;
  if (rank % 2)
    requests.push_back(ch.isend(rank - 1, message, data, bytes));
  else
    requests.push_back(ch.irecv(rank + 1, message, data, bytes));
  ch.wait_all(requests);
}

namespace {

// The blocks [first, last) of the buffer as one element range.
class Blocks {
 public:
  Blocks(size_t count, int blocks) : count_(count), blocks_(blocks) {}
  Range range(int first, int last) const {
    const size_t begin = part_of({0, count_}, blocks_, first).begin;
    const size_t end = last < blocks_ ? part_of({0, count_}, blocks_, last).begin : count_;
    return {begin, end - begin};
  }

 private:
  size_t count_;
  int blocks_;
};

}  // namespace

void allreduce_butterfly(OpChannel& ch, void* data, size_t count, DType dtype, ReduceOp op) {
  const int n = ch.size();
  if (n == 1 || count == 0) return;
  const size_t element_bytes = dtype_size(dtype);
  char* base = static_cast<char*>(data);
  char* received = thread_scratch(count * element_bytes);
  const PowerOfTwoFold fold(n, ch.rank());
  fold.fold(ch, 0, data, received, count, dtype, op);

  if (!fold.sits_out()) {
    const int v = fold.vrank, p = fold.pof2;
    const Blocks blocks(count, p);
    auto at = [&](Range r) { return base + r.begin * element_bytes; };
    // Exchanges range `send` for the partner's `receive` (into `into`) as message `round`.
    auto exchange = [&](int vpeer, uint32_t round, Range send, Range receive, char* into) {
      std::vector<Request> requests;
      const int peer = fold.real(vpeer);
      if (receive.count)
        requests.push_back(ch.irecv(peer, round, into, receive.count * element_bytes));
      if (send.count)
        requests.push_back(ch.isend(peer, round, at(send), send.count * element_bytes));
      ch.wait_all(requests);
    };
    int first = 0, last = p;  // the blocks this rank owns
    uint32_t round = 1;

    // Reduce-scatter by recursive halving: the bit of v picks the half kept.
    for (int mask = p / 2; mask > 0; mask /= 2, ++round) {
      const int middle = (first + last) / 2;
      const bool upper = v & mask;
      const Range keep = upper ? blocks.range(middle, last) : blocks.range(first, middle);
      const Range give = upper ? blocks.range(first, middle) : blocks.range(middle, last);
      exchange(v ^ mask, round, give, keep, received);
      reduce_into(at(keep), received, keep.count, dtype, op);
      (upper ? first : last) = middle;
    }
    const Range mine = blocks.range(v, v + 1);
    if (op == ReduceOp::avg) scale(at(mine), mine.count, dtype, 1.0 / n);

    // All-gather by recursive doubling: the partner owns the neighbouring run of blocks.
    for (int mask = 1; mask < p; mask *= 2, ++round) {
      const int width = last - first;
      const int other_first = (v & mask) ? first - width : last;
      const Range other = blocks.range(other_first, other_first + width);
      exchange(v ^ mask, round, blocks.range(first, last), other, at(other));
      first = std::min(first, other_first);
      last = first + 2 * width;
    }
  }

  const uint32_t unfold_message = 64;  // past any round number (2 log2 of 2^20 ranks)
  fold.unfold(ch, unfold_message, data, count * element_bytes);
}

}  // namespace trainer::comm
