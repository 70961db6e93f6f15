// Context parallelism, the layers' side: a sequence of T tokens split over
// the N ranks of a group, every rank holding T / N of each sequence's
// tokens for the whole model. Everything but attention works on the local
// tokens alone (embeddings, norms, MLP, loss; positions stay global);
// attention needs every earlier token and comes in two algorithms:
//
//   ring        the key/value rows travel around the ring of ranks, one
//               block per step, the next block's message overlapped with
//               the current block's attention; partial results merge by
//               their row log-sum-exp (attention_merge). The backward is a
//               second ring whose key/value gradients travel with their
//               block and end at its owner. Blocks above the diagonal are
//               skipped.
//   all_to_all  (DeepSpeed-Ulysses) an all-to-all turns "my tokens, all
//               heads" into "all tokens, my heads", attention runs on the
//               whole sequence for NH / N heads, and a second all-to-all
//               turns the result back. Needs NH and KV divisible by N.
//
// With causal load balancing (ContextLayout::load_balance) the sequence is
// cut into 2N chunks and rank r holds chunks r and 2N - 1 - r, so every rank
// does the same attention work; without it rank r holds chunk r of N.
//
//   ContextLayout layout = g->layout(T);               // this rank's rows
//   Tensor pos = layout.positions_tensor();            // i64 [T / N], global
//   Tensor y = context_parallel_attention(q, k, v, NH, KV, 0.0, training, gen, *g);
//
// The group is an interface so that layers need no communication library:
// parallel/context_parallel.h implements it over a comm::Communicator.
#pragma once

#include <functional>
#include <vector>

#include "core/ops.h"
#include "core/rng.h"

namespace trainer {

enum class ContextAttention { ring, all_to_all };

// Which rows of a sequence a rank holds.
struct ContextLayout {
  struct Chunk {
    int64_t start = 0;   // global position of its first row
    int64_t length = 0;  // rows
  };
  int64_t seq_len = 0;  // T, the whole sequence
  int rank = 0;
  int size = 1;  // N
  bool load_balance = true;

  // This rank's chunks in local order (their rows side by side).
  std::vector<Chunk> chunks() const { return chunks_of(rank); }
  std::vector<Chunk> chunks_of(int r) const;
  int64_t local_len() const { return seq_len / size; }
  // The global position of each local row.
  std::vector<int64_t> positions() const;
  Tensor positions_tensor(Device device = {}) const;  // i64 [local_len()]
  // This rank's rows (dim `dim`) of a tensor that holds the whole sequence.
  Tensor local(const Tensor& whole, int dim = 1) const;
};

// The layout of seq_len tokens over size ranks; an Error naming the
// lengths and the fix when seq_len does not split into equal chunks (2N of
// them with load balancing, N without).
ContextLayout context_layout(int64_t seq_len, int rank, int size, bool load_balance);

// The ranks a sequence is split over (CPU tensors). Every rank of a group
// runs the same ops in the same order, so messages and collectives pair up.
class ContextParallelGroup {
 public:
  virtual ~ContextParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual ContextAttention attention() const = 0;
  virtual bool load_balance() const = 0;
  ContextLayout layout(int64_t seq_len) const {
    return context_layout(seq_len, rank(), size(), load_balance());
  }
  // Posts a send of t (contiguous) to rank + 1 (mod size) and returns a
  // function that waits for it; t must stay untouched until then. Messages
  // of one stream arrive in the order they were sent.
  virtual std::function<void()> send_next(const Tensor& t, int stream) = 0;
  // Posts a receive into t (contiguous, the byte count the peer sends) from
  // rank - 1 (mod size) and returns a function that waits for it.
  virtual std::function<void()> recv_prev(const Tensor& t, int stream) = 0;
  // [size() * k, ...] -> [size() * k, ...]: block r of dim 0 goes to rank r,
  // block r of the result came from rank r.
  virtual Tensor all_to_all(const Tensor& t) = 0;
};

// Causal attention over a sequence split along dim 1 over g: q [B, Tl, NH
// HD], k and v [B, Tl, KV HD] (any views with a unit last stride) hold this
// rank's rows of g.layout(Tl * N). Returns this rank's rows of
// causal_attention(q, k, v, num_heads, dropout_p, training, gen,
// num_kv_heads) on the whole sequence, the dropout mask drawn as that call
// draws it (every rank's gen in the same state), so the result does not
// depend on N. Gradients flow back to q, k, v through g's messages.
Tensor context_parallel_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                  int64_t num_heads, int64_t num_kv_heads, double dropout_p,
                                  bool training, Generator& gen, ContextParallelGroup& g);

// all_to_all over g with its inverse as the backward (autograd).
Tensor context_all_to_all(const Tensor& x, ContextParallelGroup& g);

}  // namespace trainer
