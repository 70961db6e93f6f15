// The attention blocks of context parallelism (core/ops_transformer.h,
// "attention blocks"): a block at offsets against a plain-loop formula, the
// CPU kernels against the reference ones, a whole causal_attention split
// into blocks (sequence chunks, the load-balanced ring pairing, a subset of
// the heads) and merged, forward and backward, with and without dropout;
// attention_merge against its formula.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <utility>
#include <vector>

#include "core/ops_transformer.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The heads of one block call: NH query heads of HD reading KV kv heads.
struct Heads {
  int64_t NH, KV, HD;
};

// One block: q rows [q0, q0 + Tq) against key rows [k0, k0 + Tk).
struct BlockShape {
  int64_t B, Tq, Tk, q0, k0;
};

AttentionAttrs block_attrs(const Heads& h, int64_t q0, int64_t k0) {
  AttentionAttrs attrs;
  attrs.num_heads = h.NH;
  attrs.num_kv_heads = h.KV;
  attrs.scale = 1.0 / std::sqrt(double(h.HD));
  attrs.q_offset = q0;
  attrs.k_offset = k0;
  return attrs;
}

// Causal attention of one block with plain loops over contiguous f64
// q [B, Tq, NH HD], k, v [B, Tk, KV HD]: out [B, Tq, NH HD] and lse
// [B, NH, Tq], a row seeing no key out 0 and lse -inf.
std::pair<std::vector<double>, std::vector<double>> block_formula(const std::vector<double>& q,
                                                                  const std::vector<double>& k,
                                                                  const std::vector<double>& v,
                                                                  const BlockShape& s,
                                                                  const Heads& h) {
  std::vector<double> out(q.size(), 0.0), lse(size_t(s.B * h.NH * s.Tq), -kInf);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t head = 0; head < h.NH; ++head)
      for (int64_t t = 0; t < s.Tq; ++t) {
        const int64_t g = head / (h.NH / h.KV);
        auto qi = [&](int64_t c) { return size_t((b * s.Tq + t) * h.NH * h.HD + head * h.HD + c); };
        auto ki = [&](int64_t j, int64_t c) {
          return size_t((b * s.Tk + j) * h.KV * h.HD + g * h.HD + c);
        };
        std::vector<double> e;
        for (int64_t j = 0; j < s.Tk && s.k0 + j <= s.q0 + t; ++j) {
          double dot = 0.0;
          for (int64_t c = 0; c < h.HD; ++c) dot += q[qi(c)] * k[ki(j, c)];
          e.push_back(dot / std::sqrt(double(h.HD)));
        }
        if (e.empty()) continue;
        const double mx = *std::max_element(e.begin(), e.end());
        double z = 0.0;
        for (double& x : e) z += (x = std::exp(x - mx));
        lse[size_t((b * h.NH + head) * s.Tq + t)] = mx + std::log(z);
        for (size_t j = 0; j < e.size(); ++j)
          for (int64_t c = 0; c < h.HD; ++c) out[qi(c)] += e[j] / z * v[ki(int64_t(j), c)];
      }
  return {out, lse};
}

// q [B, Tq, NH HD], k, v [B, Tk, KV HD] as views into fused projections
// (unit last stride, wider rows), values in [-2, 2].
TensorList block_inputs(const BlockShape& s, const Heads& h, Generator& gen, DType dtype) {
  const int64_t Dq = h.NH * h.HD, Dkv = h.KV * h.HD;
  Tensor q = rand_tensor({s.B, s.Tq, Dq + 3}, gen, -2.0, 2.0, dtype).narrow(2, 1, Dq);
  Tensor kv = rand_tensor({s.B, s.Tk, 2 * Dkv}, gen, -2.0, 2.0, dtype);
  return {q, kv.narrow(2, 0, Dkv), kv.narrow(2, Dkv, Dkv)};
}

// Forward and backward of one block with its own out and lse:
// {out, lse, grad_q, grad_k, grad_v}.
TensorList run_block(const TensorList& in, const AttentionAttrs& attrs) {
  AttentionBlockResult r = attention_block_forward(in[0], in[1], in[2], attrs);
  TensorList g =
      attention_block_backward(probe_like(r.out), in[0], in[1], in[2], r.out, r.lse, attrs);
  return {r.out, r.lse, g[0], g[1], g[2]};
}

// A contiguous run of sequence rows [start, start + len).
struct Chunk {
  int64_t start, len;
};

// The whole causal attention and its autograd gradients under the probe
// cotangent: {out, grad_q, grad_k, grad_v}.
TensorList whole_attention(const TensorList& in, const Heads& h, double p, uint64_t seed) {
  TensorList leaves;
  for (const Tensor& t : in) leaves.push_back(t.detach().requires_grad_());
  Generator gen(seed, kStreamDropout);
  Tensor out = causal_attention(leaves[0], leaves[1], leaves[2], h.NH, p, p > 0.0, gen, h.KV);
  out.backward(probe_like(out));
  return {out.detach(), leaves[0].grad(), leaves[1].grad(), leaves[2].grad()};
}

// The same attention run as blocks, the way ring attention runs it: rank r
// of ranks.size() holds the query and key/value chunks ranks[r]; at ring step
// i it holds rank (r - i)'s key/value chunks and runs each of its query
// chunks against each of them that the chunk sees any key of, merging the
// results; the backward then runs every such block with the merged out and
// lse, summing grad_q over key blocks and grad_k, grad_v over query blocks.
// Returns {out, grad_q, grad_k, grad_v} over the whole sequence.
TensorList ring_attention(const TensorList& in, const Heads& h, double p, uint64_t seed,
                          const std::vector<std::vector<Chunk>>& ranks) {
  const int64_t B = in[0].size(0), T = in[0].size(1);
  Generator gen(seed, kStreamDropout);
  const AttentionAttrs base =
      attention_block_attrs(B, h.NH * h.HD, h.NH, h.KV, p, /*training=*/p > 0.0, gen, T);
  Tensor grad_out = probe_like(in[0].contiguous());
  auto rows = [](const Tensor& x, const Chunk& c) { return x.narrow(1, c.start, c.len); };
  Tensor out = zeros(in[0].shape(), in[0].dtype());
  Tensor grad_q = zeros(in[0].shape(), in[0].dtype());
  Tensor grad_k = zeros(in[1].shape(), in[1].dtype());
  Tensor grad_v = zeros(in[2].shape(), in[2].dtype());
  const int64_t N = int64_t(ranks.size());
  for (int64_t r = 0; r < N; ++r)
    for (const Chunk& qc : ranks[size_t(r)]) {
      AttentionAttrs attrs = base;
      attrs.q_offset = qc.start;
      std::vector<Chunk> seen;  // the key chunks in ring order
      for (int64_t step = 0; step < N; ++step)
        for (const Chunk& kc : ranks[size_t((r - step + N) % N)])
          if (kc.start <= qc.start + qc.len - 1) seen.push_back(kc);
      AttentionBlockResult acc;
      for (const Chunk& kc : seen) {
        attrs.k_offset = kc.start;
        AttentionBlockResult block =
            attention_block_forward(rows(in[0], qc), rows(in[1], kc), rows(in[2], kc), attrs);
        if (!acc.out.defined())
          acc = block;
        else
          attention_merge(acc.out, acc.lse, block.out, block.lse);
      }
      rows(out, qc).copy_(acc.out);
      for (const Chunk& kc : seen) {
        attrs.k_offset = kc.start;
        TensorList g =
            attention_block_backward(rows(grad_out, qc).contiguous(), rows(in[0], qc),
                                     rows(in[1], kc), rows(in[2], kc), acc.out, acc.lse, attrs);
        rows(grad_q, qc).copy_(rows(grad_q, qc) + g[0]);
        rows(grad_k, kc).copy_(rows(grad_k, kc) + g[1]);
        rows(grad_v, kc).copy_(rows(grad_v, kc) + g[2]);
      }
    }
  return {out, grad_q, grad_k, grad_v};
}

// Consecutive chunks of `len` rows over T (the last one shorter), one per rank.
std::vector<std::vector<Chunk>> sequential_chunks(int64_t T, int64_t len) {
  std::vector<std::vector<Chunk>> ranks;
  for (int64_t start = 0; start < T; start += len)
    ranks.push_back({{start, std::min(len, T - start)}});
  return ranks;
}

// The load-balanced pairing: T in 2N chunks (the last ones shorter when 2N
// does not divide T), rank r holding chunks r and 2N - 1 - r.
std::vector<std::vector<Chunk>> paired_chunks(int64_t T, int64_t N) {
  const int64_t len = (T + 2 * N - 1) / (2 * N);
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < 2 * N; ++i) {
    const int64_t start = std::min(i * len, T);
    chunks.push_back({start, std::min(len, T - start)});
  }
  std::vector<std::vector<Chunk>> ranks;
  for (int64_t r = 0; r < N; ++r)
    ranks.push_back({chunks[size_t(r)], chunks[size_t(2 * N - 1 - r)]});
  return ranks;
}

// q [B, T, NH HD], k, v [B, T, KV HD] as views into one fused projection.
TensorList whole_inputs(int64_t B, int64_t T, const Heads& h, Generator& gen, DType dtype) {
  const int64_t Dq = h.NH * h.HD, Dkv = h.KV * h.HD;
  Tensor qkv = rand_tensor({B, T, Dq + 2 * Dkv}, gen, -2.0, 2.0, dtype);
  return {qkv.narrow(2, 0, Dq), qkv.narrow(2, Dq, Dkv), qkv.narrow(2, Dq + Dkv, Dkv)};
}

}  // namespace

TEST_CASE("attention blocks: the reference equals the plain-loop formula", "[attention_blocks]") {
  Generator gen(1);
  const Heads heads[] = {{2, 2, 3}, {4, 2, 3}, {3, 1, 4}};
  const BlockShape shapes[] = {{2, 7, 5, 3, 0},   // partly visible
                               {1, 6, 9, 0, 4},   // rows 0 to 3 see no key
                               {2, 5, 8, 10, 0},  // wholly visible: no mask
                               {1, 4, 3, 0, 4},   // wholly after q: every row sees nothing
                               {2, 6, 6, 0, 0}};  // the one-block case
  for (const Heads& h : heads)
    for (const BlockShape& s : shapes) {
      INFO("NH " << h.NH << " KV " << h.KV << " Tq " << s.Tq << " Tk " << s.Tk << " q0 " << s.q0
                 << " k0 " << s.k0);
      TensorList in = block_inputs(s, h, gen, DType::f64);
      auto [out, lse] = block_formula(in[0].contiguous().to_vector<double>(),
                                      in[1].contiguous().to_vector<double>(),
                                      in[2].contiguous().to_vector<double>(), s, h);
      ReferenceKernelsGuard reference;
      AttentionBlockResult r =
          attention_block_forward(in[0], in[1], in[2], block_attrs(h, s.q0, s.k0));
      require_close(r.out, from_vector(out, {s.B, s.Tq, h.NH * h.HD}), 1e-12, 1e-12, "out");
      require_close(r.lse, from_vector(lse, {s.B, h.NH, s.Tq}), 1e-12, 1e-12, "lse");
    }
}

TEST_CASE("attention blocks: CPU kernels match the reference", "[attention_blocks]") {
  Generator gen(2);
  const Heads heads[] = {{2, 2, 8}, {4, 1, 5}};
  const BlockShape shapes[] = {
      {2, 37, 45, 50, 20},  // partly visible, ragged tiles
      {1, 70, 33, 40, 0},   // three query tiles, the first rows all visible
      {2, 40, 10, 0, 30},   // the first tile sees nothing, the second partly
      {1, 33, 29, 100, 0},  // wholly visible
      {1, 9, 12, 0, 20},    // wholly after q
      {2, 37, 37, 0, 0}};
  for (const Heads& h : heads)
    for (const BlockShape& s : shapes)
      for (DType dtype : {DType::f32, DType::f64, DType::bf16})
        for (double p : {0.0, 0.25}) {
          INFO("NH " << h.NH << " KV " << h.KV << " Tq " << s.Tq << " Tk " << s.Tk << " q0 " << s.q0
                     << " k0 " << s.k0 << " " << dtype << " dropout " << p);
          TensorList in = block_inputs(s, h, gen, dtype);
          AttentionAttrs attrs = block_attrs(h, s.q0, s.k0);
          if (p > 0.0) {
            attrs.dropout_p = p;
            attrs.dropout_key = gen.next(1);
            attrs.seq_len = std::max(s.q0 + s.Tq, s.k0 + s.Tk) + 3;
            attrs.total_heads = h.NH + 2;
            attrs.head_offset = 1;
          }
          TensorList fast = run_block(in, attrs);
          TensorList ref;
          {
            ReferenceKernelsGuard reference;
            ref = run_block(in, attrs);
          }
          const int64_t n = std::max(s.Tk, h.HD) * (h.NH / h.KV);
          const Tolerance tol =
              tolerance(dtype, {.length = n, .scale = 8 * std::sqrt(double(n)), .roundings = 2});
          const char* what[] = {"out", "lse", "grad q", "grad k", "grad v"};
          for (size_t i = 0; i < fast.size(); ++i)
            require_close(fast[i], ref[i], tol.rtol, tol.atol, what[i]);
          for (size_t i = 0; i < fast.size(); ++i) {
            const std::vector<double> values = fast[i].to_vector<double>();
            REQUIRE(
                std::none_of(values.begin(), values.end(), [](double x) { return std::isnan(x); }));
          }
        }
}

TEST_CASE("attention blocks: a causal attention split into chunks and merged is the whole one",
          "[attention_blocks]") {
  Generator gen(3);
  const int64_t B = 2, T = 37;
  struct Split {
    const char* name;
    std::vector<std::vector<Chunk>> ranks;
  };
  const Split splits[] = {{"chunks 10, 10, 10, 7", sequential_chunks(T, 10)},
                          {"pairs of 4 chunks over 2 ranks", paired_chunks(T, 2)},
                          {"pairs of 6 chunks over 3 ranks", paired_chunks(T, 3)}};
  for (const Heads& h : {Heads{3, 3, 4}, Heads{4, 2, 5}})
    for (DType dtype : {DType::f32, DType::f64})
      for (double p : {0.0, 0.2})
        for (const Split& split : splits) {
          INFO(split.name << ", NH " << h.NH << " KV " << h.KV << " " << dtype << " dropout " << p);
          TensorList in = whole_inputs(B, T, h, gen, dtype);
          TensorList whole = whole_attention(in, h, p, 7);
          TensorList ring = ring_attention(in, h, p, 7, split.ranks);
          const double tol = dtype == DType::f64 ? 1e-12 : 2e-5;
          const char* what[] = {"out", "grad q", "grad k", "grad v"};
          for (size_t i = 0; i < whole.size(); ++i)
            require_close(ring[i], whole[i], tol, tol, what[i]);
        }
}

TEST_CASE("attention blocks: a subset of the heads is those columns of the whole attention",
          "[attention_blocks]") {
  Generator gen(4);
  const int64_t B = 2, T = 37;
  for (const Heads& h : {Heads{6, 6, 4}, Heads{6, 2, 4}})
    for (DType dtype : {DType::f32, DType::f64}) {
      const int64_t group = h.NH / h.KV;
      TensorList in = whole_inputs(B, T, h, gen, dtype);
      const double p = 0.2;
      TensorList whole = whole_attention(in, h, p, 9);
      // Query heads [h0, h0 + n) and their kv heads, whole groups.
      for (auto [h0, n] : {std::pair<int64_t, int64_t>{0, 3}, {3, 3}, {0, 6}}) {
        if (h0 % group != 0 || n % group != 0) continue;
        INFO("heads [" << h0 << ", " << h0 + n << ") of NH " << h.NH << " KV " << h.KV << " "
                       << dtype);
        Generator g(9, kStreamDropout);
        AttentionAttrs attrs = attention_block_attrs(B, n * h.HD, n, n / group, p,
                                                     /*training=*/true, g, T, h.NH);
        attrs.head_offset = h0;
        const Tensor q = in[0].narrow(2, h0 * h.HD, n * h.HD);
        const Tensor k = in[1].narrow(2, h0 / group * h.HD, n / group * h.HD);
        const Tensor v = in[2].narrow(2, h0 / group * h.HD, n / group * h.HD);
        AttentionBlockResult r = attention_block_forward(q, k, v, attrs);
        const Tensor grad_out = probe_like(whole[0]).narrow(2, h0 * h.HD, n * h.HD).contiguous();
        TensorList g_block = attention_block_backward(grad_out, q, k, v, r.out, r.lse, attrs);
        require_close(r.out, whole[0].narrow(2, h0 * h.HD, n * h.HD), 0.0, 0.0, "out");
        require_close(g_block[0], whole[1].narrow(2, h0 * h.HD, n * h.HD), 0.0, 0.0, "grad q");
        require_close(g_block[1], whole[2].narrow(2, h0 / group * h.HD, n / group * h.HD), 0.0, 0.0,
                      "grad k");
        require_close(g_block[2], whole[3].narrow(2, h0 / group * h.HD, n / group * h.HD), 0.0, 0.0,
                      "grad v");
      }
    }
}

TEST_CASE("attention blocks: attention_merge is logaddexp and the weighted sum",
          "[attention_blocks]") {
  Generator gen(5);
  const int64_t B = 2, Tq = 5, NH = 3, HD = 4, D = NH * HD;
  for (DType dtype : {DType::f32, DType::f64}) {
    INFO(dtype);
    const DType stat = dtype == DType::f64 ? DType::f64 : DType::f32;
    std::vector<double> lse = rand_f64({B, NH, Tq}, gen, -3.0, 3.0).to_vector<double>();
    std::vector<double> block_lse = rand_f64({B, NH, Tq}, gen, -3.0, 3.0).to_vector<double>();
    std::vector<double> out = rand_f64({B, Tq, D}, gen).to_vector<double>();
    std::vector<double> block_out = rand_f64({B, Tq, D}, gen).to_vector<double>();
    // Rows whose running side, block side or both see nothing yet.
    auto none = [&](std::vector<double>& l, std::vector<double>& o, int64_t b, int64_t h,
                    int64_t t) {
      l[size_t((b * NH + h) * Tq + t)] = -kInf;
      for (int64_t c = 0; c < HD; ++c) o[size_t((b * Tq + t) * D + h * HD + c)] = 0.0;
    };
    none(lse, out, 0, 1, 2);
    none(block_lse, block_out, 1, 2, 4);
    none(lse, out, 1, 0, 0);
    none(block_lse, block_out, 1, 0, 0);
    std::vector<double> want_out = out, want_lse = lse;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t t = 0; t < Tq; ++t) {
          const size_t row = size_t((b * NH + h) * Tq + t);
          const double l = lse[row], bl = block_lse[row];
          if (bl == -kInf) continue;
          const double merged =
              l == -kInf ? bl : std::max(l, bl) + std::log1p(std::exp(-std::fabs(l - bl)));
          want_lse[row] = merged;
          for (int64_t c = 0; c < HD; ++c) {
            const size_t i = size_t((b * Tq + t) * D + h * HD + c);
            want_out[i] = out[i] * std::exp(l - merged) + block_out[i] * std::exp(bl - merged);
          }
        }
    auto run = [&]() {
      Tensor o = from_vector(out, {B, Tq, D}).to(dtype), l = from_vector(lse, {B, NH, Tq}).to(stat);
      attention_merge(o, l, from_vector(block_out, {B, Tq, D}).to(dtype),
                      from_vector(block_lse, {B, NH, Tq}).to(stat));
      return std::pair{o, l};
    };
    const double tol = dtype == DType::f64 ? 1e-14 : 1e-6;
    auto [fast_out, fast_lse] = run();
    require_close(fast_out, from_vector(want_out, {B, Tq, D}), tol, tol, "out");
    require_close(fast_lse, from_vector(want_lse, {B, NH, Tq}), tol, tol, "lse");
    ReferenceKernelsGuard reference;
    auto [ref_out, ref_lse] = run();
    require_close(ref_out, from_vector(want_out, {B, Tq, D}), tol, tol, "reference out");
    require_close(ref_lse, from_vector(want_lse, {B, NH, Tq}), tol, tol, "reference lse");
  }
}

TEST_CASE("attention blocks: blocks draw the whole attention's dropout key", "[attention_blocks]") {
  Generator a(11, kStreamDropout), b(11, kStreamDropout);
  const int64_t B = 2, T = 37, NH = 6;
  const AttentionAttrs attrs = attention_block_attrs(B, 24, 2, 0, 0.1, true, a, T, NH);
  const PhiloxKey whole = b.next(philox_uniform_blocks(uint64_t(B * NH * T * T)));
  REQUIRE(attrs.dropout_key.seed == whole.seed);
  REQUIRE(attrs.dropout_key.offset == whole.offset);
  REQUIRE(a.next(1).offset == b.next(1).offset);
  REQUIRE(attrs.seq_len == T);
  REQUIRE(attrs.total_heads == NH);
  REQUIRE(attrs.num_kv_heads == 2);
}

TEST_CASE("attention blocks check their operands", "[attention_blocks]") {
  Tensor q = zeros({2, 5, 24}), k = zeros({2, 7, 8});
  AttentionAttrs attrs;
  attrs.num_heads = 6;
  attrs.num_kv_heads = 2;
  CHECK_THAT(check_failure_of([&] {
               attention_block_forward(q, k, zeros({2, 7, 4}), attrs);
             }),
             Catch::Contains("must be [B, Tq, D], [B, Tk, KV HD] and [B, Tk, KV HD]"));
  attrs.dropout_p = 0.1;
  CHECK_THAT(check_failure_of([&] { attention_block_forward(q, k, k, attrs); }),
             Catch::Contains("need attrs.seq_len"));
  attrs.seq_len = 6;
  CHECK_THAT(check_failure_of([&] { attention_block_forward(q, k, k, attrs); }),
             Catch::Contains("k rows [0, 7) outside seq_len 6"));
  CHECK_THAT(check_failure_of([&] {
               attention_merge(zeros({2, 5, 24}), zeros({2, 6, 5}), zeros({2, 5, 24}),
                               zeros({2, 6, 5}, DType::f64));
             }),
             Catch::Contains("block_lse [2, 6, 5] f64 must be contiguous [2, 6, 5] f32"));
}
