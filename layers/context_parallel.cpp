#include "layers/context_parallel.h"

#include <utility>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/ops_transformer.h"

namespace trainer {

std::vector<ContextLayout::Chunk> ContextLayout::chunks_of(int r) const {
  if (!load_balance) {
    const int64_t n = seq_len / size;
    return {{r * n, n}};
  }
  const int64_t c = seq_len / (2 * int64_t(size));
  return {{r * c, c}, {(2 * int64_t(size) - 1 - r) * c, c}};
}

std::vector<int64_t> ContextLayout::positions() const {
  std::vector<int64_t> p;
  p.reserve(size_t(local_len()));
  for (const Chunk& c : chunks())
    for (int64_t i = 0; i < c.length; ++i) p.push_back(c.start + i);
  return p;
}

Tensor ContextLayout::positions_tensor(Device device) const {
  const std::vector<int64_t> p = positions();
  return from_vector(p, {int64_t(p.size())}).to(device);
}

Tensor ContextLayout::local(const Tensor& whole, int dim) const {
  CHECK(whole.size(dim) == seq_len) << "ContextLayout::local: dim " << dim << " of "
                                    << whole.shape_str() << " is not the sequence of " << seq_len;
  TensorList parts;
  for (const Chunk& c : chunks()) parts.push_back(whole.narrow(dim, c.start, c.length));
  return parts.size() == 1 ? parts[0] : concat(parts, dim);
}

ContextLayout context_layout(int64_t seq_len, int rank, int size, bool load_balance) {
  CHECK(size >= 1 && rank >= 0 && rank < size)
      << "context parallelism: rank " << rank << " of " << size;
  const int64_t chunks = load_balance ? 2 * int64_t(size) : size;
  if (seq_len <= 0 || seq_len % chunks != 0)
    throw Error(
        cat("context parallelism: a sequence of ", seq_len, " tokens does not split into ", chunks,
            " equal chunks over ", size, " ranks",
            load_balance ? " (causal load balancing gives rank r chunks r and 2N-1-r of 2N)" : "",
            "; use a sequence length that is a multiple of ", chunks,
            load_balance ? cat(", or turn load balancing off (a multiple of ", size, ")")
                         : std::string()));
  return ContextLayout{seq_len, rank, size, load_balance};
}

namespace {

// A chunk of some rank with the local row where it starts on that rank.
struct LocalChunk {
  ContextLayout::Chunk global;
  int64_t local_start = 0;
};

std::vector<LocalChunk> local_chunks(const ContextLayout& layout, int r) {
  std::vector<LocalChunk> out;
  int64_t at = 0;
  for (const ContextLayout::Chunk& c : layout.chunks_of(r)) {
    out.push_back({c, at});
    at += c.length;
  }
  return out;
}

// Whether any key of chunk k is at or before a query of chunk q.
bool visible(const ContextLayout::Chunk& q, const ContextLayout::Chunk& k) {
  return k.start <= q.start + q.length - 1;
}

AttentionAttrs block_attrs(const AttentionAttrs& whole, const LocalChunk& q, const LocalChunk& k) {
  AttentionAttrs a = whole;
  a.q_offset = q.global.start;
  a.k_offset = k.global.start;
  return a;
}

// One rank's keys and values packed [2, B, Tl, KV HD], so one message
// carries both around the ring.
Tensor pack_kv(const Tensor& k, const Tensor& v) {
  Tensor kv = empty({2, k.size(0), k.size(1), k.size(2)}, k.dtype(), k.device());
  kv.select(0, 0).copy_(k);
  kv.select(0, 1).copy_(v);
  return kv;
}

Tensor rows(const Tensor& kv, int part, const LocalChunk& c) {
  return kv.select(0, part).narrow(1, c.local_start, c.global.length);
}

struct RingArgs {
  ContextParallelGroup* g = nullptr;
  ContextLayout layout;
  AttentionAttrs attrs;  // of the whole sequence; offsets set per block
};

// Ring attention: step i attends this rank's query chunks to the key/value
// block of rank r - i while that block moves on to rank r + 1. Saves the
// merged out and lse: the backward's probabilities are then the global ones
// and each block's gradient is exact on its own.
struct RingAttentionFn {
  struct Saved {
    Tensor q, k, v, out, lse;
    RingArgs args;
  };
  static constexpr const char* name = "ring_attention";

  static Tensor forward(Saved& s, const Tensor& q, const Tensor& k, const Tensor& v,
                        const RingArgs& a) {
    ContextParallelGroup& g = *a.g;
    const int N = g.size(), r = g.rank();
    const std::vector<LocalChunk> mine = local_chunks(a.layout, r);
    std::vector<Tensor> outs(mine.size()), lses(mine.size());
    Tensor cur = pack_kv(k, v), next = empty_like(cur);
    for (int step = 0; step < N; ++step) {
      std::function<void()> received, sent;
      if (step + 1 < N) {
        received = g.recv_prev(next, 0);
        sent = g.send_next(cur, 0);
      }
      for (const LocalChunk& kc : local_chunks(a.layout, (r - step + N) % N)) {
        for (size_t i = 0; i < mine.size(); ++i) {
          if (!visible(mine[i].global, kc.global)) continue;
          AttentionBlockResult b = attention_block_forward(
              q.narrow(1, mine[i].local_start, mine[i].global.length), rows(cur, 0, kc),
              rows(cur, 1, kc), block_attrs(a.attrs, mine[i], kc));
          if (!outs[i].defined()) {
            outs[i] = b.out;
            lses[i] = b.lse;
          } else {
            attention_merge(outs[i], lses[i], b.out, b.lse);
          }
        }
      }
      if (step + 1 < N) {
        received();
        sent();
        std::swap(cur, next);
      }
    }
    Tensor out = outs.size() == 1 ? outs[0] : concat(outs, 1);
    Tensor lse = lses.size() == 1 ? lses[0] : concat(lses, 2);
    s = Saved{q, k, v, out, lse, a};
    return out;
  }

  static TensorList backward(Saved& s, const TensorList& grads, const autograd::GradMask&);
};

// The backward ring: the key/value block of rank r - i visits at step i
// with the sum of the gradients the ranks before this one gave it; this
// rank adds its own and sends the sum on, so after N steps each block's
// gradient is back at its owner. The sums travel in f32 (f64 for f64).
TensorList RingAttentionFn::backward(Saved& s, const TensorList& grads, const autograd::GradMask&) {
  const RingArgs& a = s.args;
  ContextParallelGroup& g = *a.g;
  const int N = g.size(), r = g.rank();
  const DType acc = s.q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const Tensor grad = grads[0].defined() ? grads[0].contiguous() : zeros_like(s.out);
  const std::vector<LocalChunk> mine = local_chunks(a.layout, r);
  struct QueryChunk {
    Tensor q, grad, out, lse;
  };
  std::vector<QueryChunk> qc;
  for (const LocalChunk& c : mine) {
    const int64_t at = c.local_start, n = c.global.length;
    qc.push_back({s.q.narrow(1, at, n), grad.narrow(1, at, n).contiguous(),
                  s.out.narrow(1, at, n).contiguous(), s.lse.narrow(2, at, n).contiguous()});
  }
  const Shape kv_shape{2, s.k.size(0), s.k.size(1), s.k.size(2)};
  Tensor dq = zeros(s.q.shape(), acc, s.q.device());
  Tensor cur = pack_kv(s.k, s.v), next = empty_like(cur);
  // The last sum sent: its tensor kept until the send is waited for, one
  // step later, so at most two sums live at once.
  std::pair<Tensor, std::function<void()>> sent;
  for (int step = 0; step < N; ++step) {
    std::function<void()> kv_received, kv_sent, sum_received;
    if (step + 1 < N) {
      kv_received = g.recv_prev(next, 0);
      kv_sent = g.send_next(cur, 0);
    }
    Tensor incoming;
    if (step > 0) {
      incoming = empty(kv_shape, acc, s.q.device());
      sum_received = g.recv_prev(incoming, 1);
    }
    Tensor dkv = zeros(kv_shape, acc, s.q.device());
    for (const LocalChunk& kc : local_chunks(a.layout, (r - step + N) % N)) {
      for (size_t i = 0; i < mine.size(); ++i) {
        if (!visible(mine[i].global, kc.global)) continue;
        TensorList gr =
            attention_block_backward(qc[i].grad, qc[i].q, rows(cur, 0, kc), rows(cur, 1, kc),
                                     qc[i].out, qc[i].lse, block_attrs(a.attrs, mine[i], kc));
        add_(dq.narrow(1, mine[i].local_start, mine[i].global.length), gr[0].to(acc));
        add_(rows(dkv, 0, kc), gr[1].to(acc));
        add_(rows(dkv, 1, kc), gr[2].to(acc));
      }
    }
    if (step > 0) {
      sum_received();
      add_(dkv, incoming);
    }
    if (sent.second) sent.second();
    sent = {dkv, N > 1 ? g.send_next(dkv, 1) : std::function<void()>([] {})};
    if (step + 1 < N) {
      kv_received();
      kv_sent();
      std::swap(cur, next);
    }
  }
  Tensor own = sent.first;  // N == 1: this rank's block never left
  if (N > 1) {
    own = empty(kv_shape, acc, s.q.device());
    g.recv_prev(own, 1)();
  }
  sent.second();
  return {dq.to(s.q.dtype()), own.select(0, 0).to(s.k.dtype()), own.select(0, 1).to(s.v.dtype())};
}

struct AllToAllFn {
  struct Saved {
    ContextParallelGroup* g = nullptr;
    Shape shape;
    DType dtype = DType::f32;
  };
  static constexpr const char* name = "context_all_to_all";
  static Tensor forward(Saved& s, const Tensor& x, ContextParallelGroup* g) {
    s = Saved{g, x.shape(), x.dtype()};
    return g->all_to_all(x.contiguous());
  }
  // The exchange is its own inverse: block r went to rank r, so block r of
  // the gradient goes back to it. Every rank sends, gradient or not, so the
  // collective pairs up.
  static TensorList backward(Saved& s, const TensorList& grads, const autograd::GradMask&) {
    Tensor g = grads[0].defined() ? grads[0].contiguous() : zeros(s.shape, s.dtype);
    return {s.g->all_to_all(g)};
  }
};

// One attention block with fixed attributes, as an autograd op.
struct AttentionBlockFn {
  struct Saved {
    Tensor q, k, v, out, lse;
    AttentionAttrs attrs;
  };
  static constexpr const char* name = "attention_block";
  static Tensor forward(Saved& s, const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttentionAttrs& attrs) {
    AttentionBlockResult r = attention_block_forward(q, k, v, attrs);
    s = Saved{q, k, v, r.out, r.lse, attrs};
    return r.out;
  }
  static TensorList backward(Saved& s, const TensorList& grads, const autograd::GradMask&) {
    Tensor g = grads[0].defined() ? grads[0].contiguous() : zeros_like(s.out);
    return attention_block_backward(g, s.q, s.k, s.v, s.out, s.lse, s.attrs);
  }
};

// Where each row of the rank-major order (rank 0's local rows, then rank
// 1's, ...) sits in the sequence, and the inverse.
std::pair<Tensor, Tensor> rank_major_order(const ContextLayout& layout) {
  const int64_t T = layout.seq_len;
  std::vector<int64_t> to_seq, to_rank_major(size_t(T), 0);
  for (int j = 0; j < layout.size; ++j)
    for (const ContextLayout::Chunk& c : layout.chunks_of(j))
      for (int64_t i = 0; i < c.length; ++i) to_seq.push_back(c.start + i);
  for (int64_t i = 0; i < T; ++i) to_rank_major[size_t(to_seq[size_t(i)])] = i;
  return {from_vector(to_rank_major, {T}), from_vector(to_seq, {T})};
}

// Ulysses: [B, Tl, W] (my tokens, all heads) <-> [B, T, W / N] (all
// tokens, my heads), by one all-to-all each way.
Tensor tokens_to_heads(const Tensor& x, ContextParallelGroup& g, const Tensor& gather) {
  const int64_t B = x.size(0), Tl = x.size(1), W = x.size(2), N = g.size();
  Tensor blocks = x.reshape({B, Tl, N, W / N}).permute({2, 0, 1, 3}).contiguous();
  Tensor seq = context_all_to_all(blocks, g).permute({1, 0, 2, 3}).reshape({B, N * Tl, W / N});
  return gather.defined() ? index_select(seq, 1, gather) : seq;
}

Tensor heads_to_tokens(const Tensor& y, ContextParallelGroup& g, const Tensor& scatter) {
  const int64_t B = y.size(0), T = y.size(1), Wn = y.size(2), N = g.size();
  Tensor rm = scatter.defined() ? index_select(y, 1, scatter) : y;
  Tensor blocks = rm.reshape({B, N, T / N, Wn}).permute({1, 0, 2, 3}).contiguous();
  return context_all_to_all(blocks, g).permute({1, 2, 0, 3}).reshape({B, T / N, N * Wn});
}

Tensor ulysses_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t num_heads,
                         int64_t kv_heads, double dropout_p, bool training, Generator& gen,
                         ContextParallelGroup& g) {
  const int N = g.size();
  if (num_heads % N != 0 || kv_heads % N != 0)
    throw Error(cat("context parallelism (all_to_all attention): ", num_heads, " heads and ",
                    kv_heads, " key/value heads must both be multiples of the ", N,
                    " ranks of the context-parallel group; use ring attention"));
  const ContextLayout layout = g.layout(q.size(1) * N);
  Tensor gather, scatter;
  if (layout.load_balance) std::tie(gather, scatter) = rank_major_order(layout);
  const int64_t B = q.size(0), Dn = q.size(2) / N;
  AttentionAttrs attrs = attention_block_attrs(B, Dn, num_heads / N, kv_heads / N, dropout_p,
                                               training, gen, layout.seq_len, num_heads);
  attrs.head_offset = g.rank() * (num_heads / N);
  Tensor y = autograd::apply<AttentionBlockFn>(tokens_to_heads(q, g, gather),
                                               tokens_to_heads(k, g, gather),
                                               tokens_to_heads(v, g, gather), attrs);
  return heads_to_tokens(y, g, scatter);
}

}  // namespace

Tensor context_all_to_all(const Tensor& x, ContextParallelGroup& g) {
  return autograd::apply<AllToAllFn>(x, &g);
}

Tensor context_parallel_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                  int64_t num_heads, int64_t num_kv_heads, double dropout_p,
                                  bool training, Generator& gen, ContextParallelGroup& g) {
  Tensor q = autocast_lower(q_in), k = autocast_lower(k_in), v = autocast_lower(v_in);
  const int64_t kv_heads = num_kv_heads > 0 ? num_kv_heads : num_heads;
  CHECK(q.dim() == 3 && k.dim() == 3 && v.shape() == k.shape() && k.size(0) == q.size(0) &&
        k.size(1) == q.size(1) && q.size(2) % num_heads == 0 &&
        k.size(2) == kv_heads * (q.size(2) / num_heads))
      << "context_parallel_attention: q " << q.shape_str() << ", k " << k.shape_str() << ", v "
      << v.shape_str() << " must be [B, Tl, D], [B, Tl, KV HD] and [B, Tl, KV HD] with "
      << num_heads << " heads and " << kv_heads << " key/value heads";
  if (g.size() == 1)
    return causal_attention(q, k, v, num_heads, dropout_p, training, gen, kv_heads);
  if (g.attention() == ContextAttention::all_to_all)
    return ulysses_attention(q, k, v, num_heads, kv_heads, dropout_p, training, gen, g);
  RingArgs a;
  a.g = &g;
  a.layout = g.layout(q.size(1) * g.size());
  a.attrs = attention_block_attrs(q.size(0), q.size(2), num_heads, kv_heads, dropout_p, training,
                                  gen, a.layout.seq_len);
  return autograd::apply<RingAttentionFn>(q, k, v, a);
}

}  // namespace trainer
