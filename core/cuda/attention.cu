// Fused causal attention on CUDA, flash-attention style (Dao et al. 2022,
// with FlashAttention-2's split of the backward into a key-side and a
// query-side pass): no [T, T] matrix ever reaches global memory.
//
// Forward: a block owns kBlockRows query rows of one (batch, head), kept in
// shared memory, and streams the keys and values those rows may see (those
// of its last row, a prefix of k) through shared memory in tiles of kTile
// rows. A warp owns kRowsPerWarp query rows: lane j scores key s0 + j, the warp folds
// the tile into the row's online softmax (core/attention_math.h), and each
// lane accumulates the output columns lane, lane + 32, ... in registers.
// The row's lse is written for the backward.
//
// Backward, with p recomputed from q, k and lse:
//   delta_t = grad_out_t . out_t                                (a warp per row)
//   key side (a block owns kBlockRows keys, streams the rows t >= s):
//     grad_v_s = sum_t p m grad_out_t,  grad_k_s = scale sum_t ds q_t
//   query side (as the forward):  grad_q_t = scale sum_s ds k_s
// with dp = m (grad_out_t . v_s) and ds = p (dp - delta_t). Every gradient
// row is written by one block summing in a fixed order: the result is
// deterministic (no atomics).
//
// Blocks (context parallelism): q's Tq rows and k's Tk rows sit at global
// offsets, key s visible to query t iff k_offset + s <= q_offset + t, so a
// row's keys are a prefix of k (math::attention_visible_keys): the query
// side streams the keys up to its block's last visible one, the key side
// the query rows from the first that sees its block's first key. A row
// seeing no key gets out 0 and lse -inf, and no gradient.
//
// Grouped-query attention: query head h reads kv head h / (NH / KV); the
// key-side pass runs a block per (batch, kv head, key block) over the query
// heads of the group one after the other, so grad_k and grad_v stay one
// block's fixed-order sums.
//
// The dropout multiplier m of (b, h, t, s) (h the query head) is drawn as
// the CPU draws it (core/attention_math.h), so one key gives one mask on
// every device.
// Computation in acc_t<T>: float for f32, bf16 and f16, double for f64.
#include <math.h>

#include <type_traits>

#include "core/attention_math.h"
#include "core/cuda/elementwise.cuh"
#include "core/cuda/kernels.h"

namespace trainer::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kBlockThreads = kWarps * 32;
constexpr int kRowsPerWarp = 4;
constexpr int kBlockRows = kWarps * kRowsPerWarp;  // rows a block owns
constexpr int kTile = 32;                          // streamed rows per tile: one per lane
constexpr unsigned kFullMask = 0xffffffffu;
// Shared memory a kernel may use without opting in (cudaFuncSetAttribute).
constexpr size_t kDefaultSharedBytes = size_t(48) << 10;

template <class A>
__device__ A warp_sum(A v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

template <class A>
__device__ A warp_max(A v) {
  for (int o = 16; o > 0; o /= 2) {
    A w = __shfl_xor_sync(kFullMask, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// Element (t, c) of head h of batch b is at head_of(...)[t st + c sc].
template <class T>
__device__ T* head_of(const AttentionOperand& o, int64_t b, int64_t h, int64_t HD) {
  return reinterpret_cast<T*>(o.data) + b * o.sb + h * HD * o.sc;
}

// dst[r ld + c] = element (t0 + r, c) of a head in acc_t<T>, 0 past T_;
// the whole block cooperates.
template <class T, class A>
__device__ void load_rows(A* dst, int64_t ld, const T* src, const AttentionOperand& o, int64_t t0,
                          int rows, int64_t T_, int64_t HD) {
  for (int64_t i = threadIdx.x; i < rows * HD; i += blockDim.x) {
    const int64_t r = i / HD, c = i - r * HD, t = t0 + r;
    dst[r * ld + c] = t < T_ ? load(src[t * o.st + c * o.sc]) : A(0);
  }
}

template <class A>
__device__ A dot(const A* a, const A* b, int64_t HD) {
  A s = 0;
  for (int64_t c = 0; c < HD; ++c) s += a[c] * b[c];
  return s;
}

// The dropout multiplier of (b, h, t, s): 1 without dropout.
template <class A>
__device__ A dropout_multiplier(const AttentionArgs& a, int64_t b, int64_t h, int64_t t,
                                int64_t s) {
  if (a.dropout_p <= 0.0) return A(1);
  const double keep = 1.0 - a.dropout_p;
  return math::attention_dropout(a.dropout_key,
                                 math::attention_dropout_index(a.dropout_grid, b, h, t, s), keep,
                                 A(1.0 / keep));
}

// The keys query row t sees: the prefix [0, n) of k.
__device__ int64_t visible_keys(const AttentionArgs& a, int64_t t) {
  return math::attention_visible_keys(t, a.q_offset, a.k_offset, a.Tk);
}

// Shared memory of every kernel: two blocks of owned rows [kBlockRows, HD]
// (read by the whole warp at once: broadcast) and two tiles [kTile, HD + 1]
// (lane j reads row j; the padding keeps the lanes on distinct banks).
template <class A>
struct Shared {
  A *own0, *own1, *tile0, *tile1;
  int64_t ld;
  __device__ Shared(unsigned char* raw, int64_t HD) : ld(HD + 1) {
    own0 = reinterpret_cast<A*>(raw);
    own1 = own0 + kBlockRows * HD;
    tile0 = own1 + kBlockRows * HD;
    tile1 = tile0 + kTile * ld;
  }
};

size_t shared_bytes(int64_t HD, size_t acc_size) {
  return size_t(2 * kBlockRows * HD + 2 * kTile * (HD + 1)) * acc_size;
}

// out_t = sum_{s < n_t} softmax_s(scale q_t . k_s) m[t, s] v_s; lse_t
// (n_t = visible_keys(t); 0: out 0, lse -inf). Q owned (own0), K and V
// streamed (tile0, tile1).
template <class T, int LC>
__global__ void __launch_bounds__(kBlockThreads) attention_forward_kernel(AttentionArgs a) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char raw[];
  const int64_t HD = a.HD, Tq = a.Tq, Tk = a.Tk;
  const Shared<A> sh(raw, HD);
  const int64_t bh = blockIdx.x, b = bh / a.NH, h = bh % a.NH, kvh = h / (a.NH / a.KV);
  const int64_t t0 = int64_t(blockIdx.y) * kBlockRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const A scale = A(a.scale);
  load_rows(sh.own0, HD, head_of<const T>(a.q, b, h, HD), a.q, t0, kBlockRows, Tq, HD);
  math::OnlineSoftmax<A> st[kRowsPerWarp];
  A acc[kRowsPerWarp][LC];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    st[r] = {A(-INFINITY), A(0)};
#pragma unroll
    for (int i = 0; i < LC; ++i) acc[r][i] = A(0);
  }
  const int64_t t_last = (t0 + kBlockRows < Tq ? t0 + kBlockRows : Tq) - 1;
  const int64_t s_end = visible_keys(a, t_last);
  for (int64_t s0 = 0; s0 < s_end; s0 += kTile) {
    __syncthreads();  // the previous tile's readers are done
    load_rows(sh.tile0, sh.ld, head_of<const T>(a.k, b, kvh, HD), a.k, s0, kTile, Tk, HD);
    load_rows(sh.tile1, sh.ld, head_of<const T>(a.v, b, kvh, HD), a.v, s0, kTile, Tk, HD);
    __syncthreads();
    const int64_t s = s0 + lane;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int row = warp * kRowsPerWarp + r;
      const int64_t t = t0 + row;
      if (t >= Tq) continue;
      const int64_t n_t = visible_keys(a, t);
      if (s0 >= n_t) continue;  // warp-uniform: no key of this tile is seen
      const bool seen = s < n_t;
      const A score =
          seen ? scale * dot(sh.own0 + row * HD, sh.tile0 + lane * sh.ld, HD) : A(-INFINITY);
      const A corr = st[r].rescale(warp_max(score));
      A p = seen ? math::m_exp(score - st[r].m) : A(0);
      st[r].l += warp_sum(p);
      if (seen) p *= dropout_multiplier<A>(a, b, h, t, s);
#pragma unroll
      for (int i = 0; i < LC; ++i) acc[r][i] *= corr;
      const int n = n_t - s0 < kTile ? int(n_t - s0) : kTile;
      for (int j = 0; j < n; ++j) {
        const A pj = __shfl_sync(kFullMask, p, j);
        const A* vj = sh.tile1 + j * sh.ld;
#pragma unroll
        for (int i = 0; i < LC; ++i) {
          const int64_t c = lane + 32 * i;
          if (c < HD) acc[r][i] += pj * vj[c];
        }
      }
    }
  }
  T* out = head_of<T>(a.out, b, h, HD);
  A* lse = static_cast<A*>(a.lse) + bh * Tq;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t t = t0 + warp * kRowsPerWarp + r;
    if (t >= Tq) continue;
    const bool seen = st[r].l > A(0);  // else no key: out 0, lse -inf
    const A inv_l = seen ? A(1) / st[r].l : A(0);
#pragma unroll
    for (int i = 0; i < LC; ++i) {
      const int64_t c = lane + 32 * i;
      if (c < HD) out[t * a.out.st + c * a.out.sc] = store_as<T>(acc[r][i] * inv_l);
    }
    if (lane == 0) lse[t] = seen ? st[r].m + math::m_log(st[r].l) : A(-INFINITY);
  }
}

// delta[bh, t] = grad_out_t . out_t over the head's columns; a warp per row.
template <class T>
__global__ void __launch_bounds__(kBlockThreads) attention_delta_kernel(AttentionArgs a) {
  using A = acc_t<T>;
  const int64_t rows = a.B * a.NH * a.Tq, HD = a.HD;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  for (int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; row < rows;
       row += warps) {
    const int64_t bh = row / a.Tq, t = row % a.Tq, b = bh / a.NH, h = bh % a.NH;
    const T* go = head_of<const T>(a.grad_out, b, h, HD) + t * a.grad_out.st;
    const T* o = head_of<const T>(a.out, b, h, HD) + t * a.out.st;
    A sum = 0;
    for (int64_t c = lane; c < HD; c += 32)
      sum += load(go[c * a.grad_out.sc]) * load(o[c * a.out.sc]);
    sum = warp_sum(sum);
    if (lane == 0) static_cast<A*>(a.delta)[row] = sum;
  }
}

// grad_q_t = scale sum_{s < n_t} ds k_s (none where lse_t = -inf). Q and
// grad_out owned (own0, own1), K and V streamed (tile0, tile1).
template <class T, int LC>
__global__ void __launch_bounds__(kBlockThreads) attention_grad_q_kernel(AttentionArgs a) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char raw[];
  const int64_t HD = a.HD, Tq = a.Tq, Tk = a.Tk;
  const Shared<A> sh(raw, HD);
  const int64_t bh = blockIdx.x, b = bh / a.NH, h = bh % a.NH, kvh = h / (a.NH / a.KV);
  const int64_t t0 = int64_t(blockIdx.y) * kBlockRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const A scale = A(a.scale);
  const A* lse = static_cast<const A*>(a.lse) + bh * Tq;
  const A* delta = static_cast<const A*>(a.delta) + bh * Tq;
  load_rows(sh.own0, HD, head_of<const T>(a.q, b, h, HD), a.q, t0, kBlockRows, Tq, HD);
  load_rows(sh.own1, HD, head_of<const T>(a.grad_out, b, h, HD), a.grad_out, t0, kBlockRows, Tq,
            HD);
  A acc[kRowsPerWarp][LC];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int i = 0; i < LC; ++i) acc[r][i] = A(0);
  const int64_t t_last = (t0 + kBlockRows < Tq ? t0 + kBlockRows : Tq) - 1;
  const int64_t s_end = visible_keys(a, t_last);
  for (int64_t s0 = 0; s0 < s_end; s0 += kTile) {
    __syncthreads();
    load_rows(sh.tile0, sh.ld, head_of<const T>(a.k, b, kvh, HD), a.k, s0, kTile, Tk, HD);
    load_rows(sh.tile1, sh.ld, head_of<const T>(a.v, b, kvh, HD), a.v, s0, kTile, Tk, HD);
    __syncthreads();
    const int64_t s = s0 + lane;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int row = warp * kRowsPerWarp + r;
      const int64_t t = t0 + row;
      if (t >= Tq) continue;
      const int64_t n_t = lse[t] == A(-INFINITY) ? 0 : visible_keys(a, t);
      if (s0 >= n_t) continue;  // warp-uniform
      A ds = 0;
      if (s < n_t) {
        const A p =
            math::m_exp(scale * dot(sh.own0 + row * HD, sh.tile0 + lane * sh.ld, HD) - lse[t]);
        const A dp = dropout_multiplier<A>(a, b, h, t, s) *
                     dot(sh.own1 + row * HD, sh.tile1 + lane * sh.ld, HD);
        ds = math::attention_grad_score(p, dp, delta[t]);
      }
      const int n = n_t - s0 < kTile ? int(n_t - s0) : kTile;
      for (int j = 0; j < n; ++j) {
        const A dsj = __shfl_sync(kFullMask, ds, j);
        const A* kj = sh.tile0 + j * sh.ld;
#pragma unroll
        for (int i = 0; i < LC; ++i) {
          const int64_t c = lane + 32 * i;
          if (c < HD) acc[r][i] += dsj * kj[c];
        }
      }
    }
  }
  T* grad_q = head_of<T>(a.grad_q, b, h, HD);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t t = t0 + warp * kRowsPerWarp + r;
    if (t >= Tq) continue;
#pragma unroll
    for (int i = 0; i < LC; ++i) {
      const int64_t c = lane + 32 * i;
      if (c < HD) grad_q[t * a.grad_q.st + c * a.grad_q.sc] = store_as<T>(scale * acc[r][i]);
    }
  }
}

// Adds query head h's terms (bh = b NH + h) of grad_v_s = sum_t p m
// grad_out_t and grad_k_s / scale = sum_t ds q_t, over the rows t that see
// s (k_offset + s <= q_offset + t, lse_t finite), to the rows s of the
// block's keys (gk, gv). K and V owned (own0, own1), Q and grad_out of head
// h streamed (tile0, tile1) from the first row that sees the block's first key.
template <class T, int LC, class A>
__device__ __forceinline__ void grad_kv_of_head(const AttentionArgs& a, const Shared<A>& sh,
                                                int64_t b, int64_t h, int64_t s_begin,
                                                A (&gk)[kRowsPerWarp][LC],
                                                A (&gv)[kRowsPerWarp][LC]) {
  const int64_t HD = a.HD, Tq = a.Tq, Tk = a.Tk, bh = b * a.NH + h;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const A scale = A(a.scale);
  const A* lse = static_cast<const A*>(a.lse) + bh * Tq;
  const A* delta = static_cast<const A*>(a.delta) + bh * Tq;
  const int64_t t_first = a.k_offset + s_begin - a.q_offset;
  for (int64_t t0 = t_first > 0 ? t_first : 0; t0 < Tq; t0 += kTile) {
    __syncthreads();
    load_rows(sh.tile0, sh.ld, head_of<const T>(a.q, b, h, HD), a.q, t0, kTile, Tq, HD);
    load_rows(sh.tile1, sh.ld, head_of<const T>(a.grad_out, b, h, HD), a.grad_out, t0, kTile, Tq,
              HD);
    __syncthreads();
    const int64_t t = t0 + lane;
    const A lse_t = t < Tq ? lse[t] : A(0), delta_t = t < Tq ? delta[t] : A(0);
    const int n = Tq - t0 < kTile ? int(Tq - t0) : kTile;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int row = warp * kRowsPerWarp + r;
      const int64_t s = s_begin + row;
      if (s >= Tk) continue;
      A pm = 0, ds = 0;
      if (t < Tq && a.k_offset + s <= a.q_offset + t && lse_t != A(-INFINITY)) {
        const A p =
            math::m_exp(scale * dot(sh.tile0 + lane * sh.ld, sh.own0 + row * HD, HD) - lse_t);
        const A m = dropout_multiplier<A>(a, b, h, t, s);
        const A dp = m * dot(sh.tile1 + lane * sh.ld, sh.own1 + row * HD, HD);
        pm = p * m;
        ds = math::attention_grad_score(p, dp, delta_t);
      }
      for (int j = 0; j < n; ++j) {
        const A pmj = __shfl_sync(kFullMask, pm, j), dsj = __shfl_sync(kFullMask, ds, j);
        const A* qj = sh.tile0 + j * sh.ld;
        const A* goj = sh.tile1 + j * sh.ld;
#pragma unroll
        for (int i = 0; i < LC; ++i) {
          const int64_t c = lane + 32 * i;
          if (c < HD) {
            gv[r][i] += pmj * goj[c];
            gk[r][i] += dsj * qj[c];
          }
        }
      }
    }
  }
}

// grad_v_s = sum_h sum_t p m grad_out_t, grad_k_s = scale sum_h sum_t ds q_t
// over the query heads h of kv head kvh, in order, and the rows t that see
// s. A block per (b KV + kvh, block of kBlockRows keys).
template <class T, int LC>
__global__ void __launch_bounds__(kBlockThreads) attention_grad_kv_kernel(AttentionArgs a) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char raw[];
  const int64_t HD = a.HD, Tk = a.Tk, group = a.NH / a.KV;
  const Shared<A> sh(raw, HD);
  const int64_t bk = blockIdx.x, b = bk / a.KV, kvh = bk % a.KV;
  const int64_t s_begin = int64_t(blockIdx.y) * kBlockRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  load_rows(sh.own0, HD, head_of<const T>(a.k, b, kvh, HD), a.k, s_begin, kBlockRows, Tk, HD);
  load_rows(sh.own1, HD, head_of<const T>(a.v, b, kvh, HD), a.v, s_begin, kBlockRows, Tk, HD);
  A gk[kRowsPerWarp][LC], gv[kRowsPerWarp][LC];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int i = 0; i < LC; ++i) gk[r][i] = gv[r][i] = A(0);
  for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
    grad_kv_of_head<T, LC>(a, sh, b, h, s_begin, gk, gv);
  const A scale = A(a.scale);
  T* grad_k = head_of<T>(a.grad_k, b, kvh, HD);
  T* grad_v = head_of<T>(a.grad_v, b, kvh, HD);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t s = s_begin + warp * kRowsPerWarp + r;
    if (s >= Tk) continue;
#pragma unroll
    for (int i = 0; i < LC; ++i) {
      const int64_t c = lane + 32 * i;
      if (c >= HD) continue;
      grad_k[s * a.grad_k.st + c * a.grad_k.sc] = store_as<T>(scale * gk[r][i]);
      grad_v[s * a.grad_v.st + c * a.grad_v.sc] = store_as<T>(gv[r][i]);
    }
  }
}

// lse' = logaddexp(lse, block_lse), out' = out exp(lse - lse') + block_out
// exp(block_lse - lse') per (b, h, t); a warp per row, lane c the columns
// c, c + 32, ... A side with lse -inf adds nothing.
template <class T>
__global__ void __launch_bounds__(kBlockThreads) attention_merge_kernel(AttentionMergeArgs a) {
  using A = acc_t<T>;
  const int64_t rows = a.B * a.NH * a.Tq, D = a.NH * a.HD;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  for (int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; row < rows;
       row += warps) {
    const int64_t bh = row / a.Tq, t = row % a.Tq, b = bh / a.NH, h = bh % a.NH;
    A* lse = static_cast<A*>(a.lse) + row;
    const A l = *lse, bl = static_cast<const A*>(a.block_lse)[row];
    // Every lane has read lse before lane 0 rewrites it.
    __syncwarp();
    if (bl == A(-INFINITY)) continue;  // warp-uniform: the block adds nothing
    const A mx = l > bl ? l : bl;
    const A merged = mx + math::m_log(math::m_exp(l - mx) + math::m_exp(bl - mx));
    const A w = math::m_exp(l - merged), bw = math::m_exp(bl - merged);
    T* out = static_cast<T*>(a.out) + (b * a.Tq + t) * D + h * a.HD;
    const T* block_out = static_cast<const T*>(a.block_out) + (b * a.Tq + t) * D + h * a.HD;
    for (int64_t c = lane; c < a.HD; c += 32) {
      const A kept = w > A(0) ? load(out[c]) * w : A(0);  // lse -inf: out holds nothing yet
      out[c] = store_as<T>(kept + load(block_out[c]) * bw);
    }
    if (lane == 0) *lse = merged;
  }
}

// Calls fn with the output columns per lane the head dim needs (LC): the
// register arrays are sized at compile time.
template <class Fn>
void with_lane_columns(int64_t HD, Fn&& fn) {
  if (HD <= 64)
    fn(std::integral_constant<int, 2>{});
  else if (HD <= 128)
    fn(std::integral_constant<int, 4>{});
  else
    fn(std::integral_constant<int, int(kMaxAttentionHeadDim / 32)>{});
}

// Launches kernel over (batch x heads, blocks of kBlockRows of `rows`) with
// the shared memory of the head dim, opting in beyond 48 KiB where the GPU allows.
template <class Kernel>
void launch_tiled(Kernel kernel, const AttentionArgs& a, int64_t heads, int64_t rows,
                  size_t acc_size, const char* op, cudaStream_t stream) {
  const size_t bytes = shared_bytes(a.HD, acc_size);
  if (bytes > kDefaultSharedBytes) {
    int device = 0, optin = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (bytes > size_t(optin))
      throw Error(cat(op, ": head dim ", a.HD, " needs ", bytes, " bytes of shared memory, GPU ",
                      device, " has ", optin, "; use fewer, wider heads or f32"));
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  }
  const dim3 grid(unsigned(a.B * heads), unsigned((rows + kBlockRows - 1) / kBlockRows));
  kernel<<<grid, kBlockThreads, bytes, stream>>>(a);
  CUDA_CHECK(cudaGetLastError());
}

void check_args(const AttentionArgs& a, const char* op) {
  CHECK(a.HD >= 1 && a.HD <= kMaxAttentionHeadDim)
      << op << ": head dim " << a.HD << " outside [1, " << kMaxAttentionHeadDim << "]";
  const int64_t rows = a.Tq > a.Tk ? a.Tq : a.Tk;
  CHECK(a.B * a.NH <= INT32_MAX && (rows + kBlockRows - 1) / kBlockRows <= 65535)
      << op << ": " << a.B << " x " << a.NH << " heads of " << rows << " steps exceed the grid";
  CHECK(a.KV >= 1 && a.NH % a.KV == 0)
      << op << ": " << a.KV << " key/value heads do not divide " << a.NH << " heads";
}

}  // namespace

void launch_attention_forward(const AttentionArgs& a, DType t, cudaStream_t stream) {
  if (a.B * a.Tq * a.NH == 0) return;
  check_args(a, "causal_attention");
  dispatch_floating(t, "causal_attention", [&](auto tag) {
    using T = typename decltype(tag)::type;
    with_lane_columns(a.HD, [&](auto lc) {
      launch_tiled(attention_forward_kernel<T, decltype(lc)::value>, a, a.NH, a.Tq,
                   sizeof(acc_t<T>), "causal_attention", stream);
    });
  });
}

void launch_attention_backward(const AttentionArgs& a, DType t, cudaStream_t stream) {
  if (a.B * a.Tq * a.Tk * a.NH == 0) return;
  check_args(a, "causal_attention_backward");
  dispatch_floating(t, "causal_attention_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t rows = a.B * a.NH * a.Tq;
    const int64_t blocks = std::min<int64_t>((rows + kWarps - 1) / kWarps, kMaxBlocks);
    attention_delta_kernel<T><<<unsigned(blocks), kBlockThreads, 0, stream>>>(a);
    CUDA_CHECK(cudaGetLastError());
    with_lane_columns(a.HD, [&](auto lc) {
      constexpr int LC = decltype(lc)::value;
      launch_tiled(attention_grad_kv_kernel<T, LC>, a, a.KV, a.Tk, sizeof(acc_t<T>),
                   "causal_attention_backward", stream);
      launch_tiled(attention_grad_q_kernel<T, LC>, a, a.NH, a.Tq, sizeof(acc_t<T>),
                   "causal_attention_backward", stream);
    });
  });
}

void launch_attention_merge(const AttentionMergeArgs& a, DType t, cudaStream_t stream) {
  const int64_t rows = a.B * a.NH * a.Tq;
  if (rows * a.HD == 0) return;
  dispatch_floating(t, "attention_merge", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t blocks = std::min<int64_t>((rows + kWarps - 1) / kWarps, kMaxBlocks);
    attention_merge_kernel<T><<<unsigned(blocks), kBlockThreads, 0, stream>>>(a);
    CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace trainer::cuda
