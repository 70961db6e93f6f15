// Recursive doubling allreduce: in round k every rank exchanges its whole
// buffer with the rank whose index differs in bit k and reduces, so after
// log2(n) rounds all hold the result. Latency-optimal, for small messages.
//
// A world that is not a power of two is folded first (Thakur, Rabenseifner
// and Gropp): of the first 2*rem ranks (rem = n - 2^floor(log2 n)) each even
// one hands its buffer to the odd one after it and sits out; the odd ones
// send the result back at the end.
#include "comm/algorithms.h"

namespace trainer::comm {

void allreduce_recursive_doubling(OpChannel& ch, void* data, size_t count, DType dtype,
                                  ReduceOp op) {
  const int n = ch.size(), rank = ch.rank();
  if (n == 1) return;
  const size_t bytes = count * dtype_size(dtype);
  int pof2 = 1;
  while (pof2 * 2 <= n) pof2 *= 2;
  const int rem = n - pof2;
  char* received = thread_scratch(bytes);
  std::vector<Request> requests;

  // Fold: rank 2i hands its buffer to 2i+1 for i < rem.
  int vrank = rank < 2 * rem ? (rank % 2 ? rank / 2 : -1) : rank - rem;
  if (rank < 2 * rem && rank % 2 == 0) {
    requests.push_back(ch.isend(rank + 1, 0, data, bytes));
    ch.wait_all(requests);
  } else if (rank < 2 * rem) {
    requests.push_back(ch.irecv(rank - 1, 0, received, bytes));
    ch.wait_all(requests);
    reduce_into(data, received, count, dtype, op);
  }

  // Exchange with the partner across bit k; both compute a (op) b of the same two buffers.
  int round = 1;
  for (int mask = 1; vrank >= 0 && mask < pof2; mask <<= 1, ++round) {
    int vpeer = vrank ^ mask;
    int peer = vpeer < rem ? vpeer * 2 + 1 : vpeer + rem;
    requests.push_back(ch.irecv(peer, round, received, bytes));
    requests.push_back(ch.isend(peer, round, data, bytes));
    ch.wait_all(requests);  // the send must finish before data changes
    reduce_into(data, received, count, dtype, op);
  }

  // Unfold: the odd ranks return the result to their even partners.
  const uint32_t unfold = 64;  // past any round number (log2 of 2^20 ranks)
  if (rank < 2 * rem && rank % 2)
    requests.push_back(ch.isend(rank - 1, unfold, data, bytes));
  else if (rank < 2 * rem)
    requests.push_back(ch.irecv(rank + 1, unfold, data, bytes));
  ch.wait_all(requests);
  if (op == ReduceOp::avg) scale(data, count, dtype, 1.0 / n);
}

}  // namespace trainer::comm
