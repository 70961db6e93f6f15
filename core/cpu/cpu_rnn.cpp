// CPU LSTM and GRU layers (f32): one GEMM projects the inputs of all steps,
// then per step one GEMM applies the recurrent weights and a fused,
// vectorised loop computes the gates and the new state. Backward walks the
// steps back with one GEMM per step for the recurrent gradient, then three
// whole-sequence GEMMs give grad_x, grad_weight_ih and grad_weight_hh. The
// step loops split the batch rows among the threads, each thread running all
// steps of its rows without synchronising (class Recurrence).
// The whole-sequence GEMMs are oneDNN matmul primitives, built once per shape
// and cached. The per-step recurrent GEMM multiplies by weights packed once
// per call: where the project's loops run AVX2 into panels for the kernel of
// core/cpu/rnn_gemm_avx2.h (class Recurrence says why), otherwise into a
// oneDNN primitive's preferred layout. The oneDNN operands are dense (oneDNN
// 2.6 runs its brgemm kernels on packed weights only for dense operands, and
// a generic sgemm that repacks the weights every call otherwise): the states
// it reads are kept time-major in hs [T + 1, B, H], its output goes to a
// per-step buffer [B, 4H] (backward: [B, H] from a per-step copy of the gate
// gradients).
//
// Why not oneDNN 2.6's lstm_forward/lstm_backward primitives: on this
// machine (one LSTM layer, B 32, T 128, I = H = 512, one thread, CPU time)
// they took 0.31-0.39 s forward and 0.66-0.79 s backward, this path
// 0.20-0.24 s and 0.37-0.43 s (PyTorch 2.15's nn.LSTM: 0.24-0.27 s and
// 0.41-0.48 s). GRU takes the same path; oneDNN's lbr_gru (the same RNN
// framework in oneDNN) was not measured separately.
//
// The record handed from forward to backward is one flat f32 tensor:
//   LSTM: activated gates [B, T, 4H] (i, f, g, o), then c_t [B, T, H]
//   GRU:  r, z, n and gh_n = h_{t-1} W_hn^T + b_hn, [B, T, 4H]
// A backward without a record (the forward ran on the reference kernels)
// falls back to the reference, which recomputes the forward.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/isa.h"
#include "core/cpu/loops.h"
#include "core/cpu/lowp.h"
#include "core/cpu/onednn.h"
#include "core/cpu/primitive_cache.h"
#include "core/cpu/rnn_gemm_avx2.h"

namespace trainer {

namespace {

// A matrix operand: rows x cols floats at p, element (r, c) at p[r rs + c cs].
struct Mat {
  const float* p;
  int64_t rows, cols, rs, cs;
  Mat t() const { return {p, cols, rows, cs, rs}; }
};

// A row-major matrix of rows x cols with leading dim ld.
Mat rows_of(const float* p, int64_t rows, int64_t cols, int64_t ld) {
  return {p, rows, cols, ld, 1};
}

// One cached matmul: c [M, N] (ld ldc) = a [M, K] b [K, N] (+ c when
// accumulate), b either as strided (its user layout) or packed.
// The scratchpad is the caller's (scratch_md): workers running one primitive
// at once each pass their own.
struct GemmPlan {
  std::optional<dnnl::matmul> prim;
  dnnl::memory::desc a_md, b_md, c_md, b_user_md, scratch_md;
};

// A buffer of at least `bytes` for a scratchpad (an f32 tensor).
Tensor scratch_buffer(size_t bytes) {
  return empty({int64_t(bytes / sizeof(float)) + 1}, DType::f32);
}

struct GemmKeyHash {
  size_t operator()(const std::vector<int64_t>& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t w : k) h = (h ^ size_t(w)) * 1099511628211ull;
    return h;
  }
};

const GemmPlan& gemm_plan(const Mat& a, const Mat& b, int64_t ldc, bool accumulate, bool packed) {
  static std::mutex mutex;
  static std::unordered_map<std::vector<int64_t>, std::unique_ptr<GemmPlan>, GemmKeyHash> cache;
  std::vector<int64_t> key = {a.rows,
                              a.cols,
                              a.rs,
                              a.cs,
                              b.cols,
                              b.rs,
                              b.cs,
                              ldc,
                              accumulate,
                              packed,
                              omp_get_max_threads(),
                              cpu::thread_slot()};  // core/cpu/primitive_cache.h
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  using dt = dnnl::memory::data_type;
  auto plan = std::make_unique<GemmPlan>();
  plan->a_md = DNNL_CHECK(dnnl::memory::desc({a.rows, a.cols}, dt::f32, {a.rs, a.cs}));
  plan->b_user_md = DNNL_CHECK(dnnl::memory::desc({b.rows, b.cols}, dt::f32, {b.rs, b.cs}));
  plan->c_md = DNNL_CHECK(dnnl::memory::desc({a.rows, b.cols}, dt::f32, {ldc, 1}));
  dnnl::memory::desc b_req =
      packed
          ? DNNL_CHECK(dnnl::memory::desc({b.rows, b.cols}, dt::f32, dnnl::memory::format_tag::any))
          : plan->b_user_md;
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  dnnl::matmul::desc desc = DNNL_CHECK(dnnl::matmul::desc(plan->a_md, b_req, plan->c_md));
  auto pd = DNNL_CHECK(dnnl::matmul::primitive_desc(desc, attr, cpu::dnnl_engine()));
  plan->b_md = pd.weights_desc();
  plan->scratch_md = pd.scratchpad_desc();
  plan->prim = DNNL_CHECK(dnnl::matmul(pd));
  return *cache.emplace(key, std::move(plan)).first->second;
}

// scratch: plan.scratch_md.get_size() bytes.
void run_gemm(const GemmPlan& plan, const float* a, const void* b, float* c, void* scratch,
              dnnl::stream& stream = cpu::dnnl_stream()) {
  dnnl::engine& engine = cpu::dnnl_engine();
  dnnl::memory ma = DNNL_CHECK(dnnl::memory(plan.a_md, engine, const_cast<float*>(a)));
  dnnl::memory mb = DNNL_CHECK(dnnl::memory(plan.b_md, engine, const_cast<void*>(b)));
  dnnl::memory mc = DNNL_CHECK(dnnl::memory(plan.c_md, engine, c));
  dnnl::memory ms = DNNL_CHECK(dnnl::memory(plan.scratch_md, engine, scratch));
  DNNL_CHECK(plan.prim->execute(
      stream,
      {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}, {DNNL_ARG_SCRATCHPAD, ms}}));
}

// c [M, N] (leading dim ldc) = a b, or += a b when accumulate.
void gemm(const Mat& a, const Mat& b, float* c, int64_t ldc, bool accumulate = false) {
  const GemmPlan& plan = gemm_plan(a, b, ldc, accumulate, /*packed=*/false);
  Tensor scratch = scratch_buffer(plan.scratch_md.get_size());
  run_gemm(plan, a.p, b.p, c, scratch.data<float>());
}

// The recurrent weights of one call reordered into the layout a packed
// plan's primitive wants: one copy per call, reordered with all threads and
// shared by every worker whose plan wants that layout.
Tensor pack_weights(const GemmPlan& plan, const Mat& b) {
  Tensor storage = empty({int64_t(plan.b_md.get_size() / sizeof(float)) + 1}, DType::f32);
  dnnl::engine& engine = cpu::dnnl_engine();
  dnnl::memory src = DNNL_CHECK(dnnl::memory(plan.b_user_md, engine, const_cast<float*>(b.p)));
  dnnl::memory dst = DNNL_CHECK(dnnl::memory(plan.b_md, engine, storage.data<float>()));
  DNNL_CHECK(dnnl::reorder(src, dst).execute(cpu::dnnl_stream(), src, dst));
  return storage;
}

// One worker's per-step GEMM c (ldc) = a b (+ c) on packed weights: its
// primitive, scratchpad and memory objects are made once per call, and each
// step only binds its a and c.
class PackedGemm {
 public:
  PackedGemm(const GemmPlan& plan, const Tensor& weights) : plan_(plan), weights_(weights) {
    dnnl::engine& engine = cpu::dnnl_engine();
    scratch_ = scratch_buffer(plan.scratch_md.get_size());
    a_ = DNNL_CHECK(dnnl::memory(plan.a_md, engine, DNNL_MEMORY_NONE));
    b_ = DNNL_CHECK(dnnl::memory(plan.b_md, engine, weights_.data<float>()));
    c_ = DNNL_CHECK(dnnl::memory(plan.c_md, engine, DNNL_MEMORY_NONE));
    scratch_mem_ = DNNL_CHECK(dnnl::memory(plan.scratch_md, engine, scratch_.data<float>()));
  }
  // Not thread-safe: one worker runs it.
  void run(const float* a, float* c, dnnl::stream& stream) {
    a_.set_data_handle(const_cast<float*>(a));
    c_.set_data_handle(c);
    DNNL_CHECK(plan_.prim->execute(stream, {{DNNL_ARG_SRC, a_},
                                            {DNNL_ARG_WEIGHTS, b_},
                                            {DNNL_ARG_DST, c_},
                                            {DNNL_ARG_SCRATCHPAD, scratch_mem_}}));
  }

 private:
  const GemmPlan& plan_;
  Tensor weights_, scratch_;  // shared packed weights; this worker's scratchpad
  dnnl::memory a_, b_, c_, scratch_mem_;
};

// One worker's per-step GEMM c = a b (+ c) over its rows: the AVX2 kernel on
// panels shared by all workers, or the worker's own oneDNN primitive.
class StepGemm {
 public:
  struct Avx2 {
    const float* panels;
    int64_t rows, K, lda, N, ldc;
    bool accumulate;
  };
  explicit StepGemm(const Avx2& avx2) : avx2_(avx2) {}
  StepGemm(PackedGemm& onednn, dnnl::stream& stream) : onednn_(&onednn), stream_(&stream) {}
  void run(const float* a, float* c) const {
    if (onednn_ != nullptr)
      onednn_->run(a, c, *stream_);
    else
      cpu::rnn_gemm_avx2(a, avx2_.rows, avx2_.K, avx2_.lda, avx2_.panels, avx2_.N, c, avx2_.ldc,
                         avx2_.accumulate);
  }

 private:
  Avx2 avx2_{};
  PackedGemm* onednn_ = nullptr;
  dnnl::stream* stream_ = nullptr;
};

// The per-step loop of one layer. Each batch row's recurrence is independent
// of the others', so with n workers (threads) worker k runs every step of the
// rows [B k / n, B (k + 1) / n) alone: no barrier between steps, the gate math
// right after the GEMM that feeds it, on data still in the worker's cache.
// Where the project's loops run AVX2 (cpu::use_avx512() false) the per-step
// GEMM is core/cpu/rnn_gemm_avx2.h's kernel on weights packed once for all
// workers: oneDNN 2.6's AVX2 sgemm ran it at 40-47 GFLOP/s on a Zen 3 core,
// the kernel at 80-90, and its rows come out the same however the batch is
// split (the oneDNN primitives' do not: their row count is the worker's).
// Otherwise each worker runs a single-threaded oneDNN primitive (one built
// for n threads splits its work n ways, so it must not run inside a parallel
// region) on one copy of the packed weights that all workers share.
class Recurrence {
 public:
  // a_like(b0, rows): the per-step GEMM's left operand for rows [b0, b0 + rows)
  // (any step: every step has its shape and strides); c = a b (+ c), ldc.
  template <class ALike>
  Recurrence(int64_t B, const ALike& a_like, const Mat& b, int64_t ldc, bool accumulate)
      : B_(B), workers_(int(std::min<int64_t>(omp_get_max_threads(), B))) {
    if (!cpu::use_avx512()) {
      const Mat a = a_like(0, B);
      CHECK_EQ(a.cs, 1) << "the AVX2 recurrent GEMM reads rows of unit stride";
      panels_ = empty({cpu::rnn_packed_size(b.rows, b.cols)}, DType::f32);
      cpu::pack_rnn_panels(b.p, b.rows, b.cols, b.rs, b.cs, panels_.data<float>());
      avx2_ = {.panels = panels_.data<float>(),
               .rows = 0,
               .K = b.rows,
               .lda = a.rs,
               .N = b.cols,
               .ldc = ldc,
               .accumulate = accumulate};
      return;
    }
    // Single-threaded primitives (a plan is cached per thread count); the
    // weights are reordered with all threads, once per layout.
    std::vector<const GemmPlan*> plans;
    int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    for (int k = 0; k < workers_; ++k)
      plans.push_back(&gemm_plan(a_like(first_row(k), first_row(k + 1) - first_row(k)), b, ldc,
                                 accumulate, /*packed=*/true));
    omp_set_num_threads(threads);
    std::vector<Tensor> packed;
    gemms_.reserve(size_t(workers_));
    for (size_t k = 0; k < plans.size(); ++k) {
      size_t same = 0;
      while (same < k && plans[same]->b_md != plans[k]->b_md) ++same;
      packed.push_back(same < k ? packed[same] : pack_weights(*plans[k], b));
      gemms_.emplace_back(*plans[k], packed.back());
    }
  }

  // Runs body(b0, b1, gemm) for every worker's rows [b0, b1), the workers in
  // parallel; gemm.run(a, c) is the worker's per-step GEMM.
  template <class Body>
  void run(const Body& body) {
#pragma omp parallel num_threads(workers_) if (workers_ > 1)
    {
      std::optional<dnnl::stream> stream;
      if (!gemms_.empty()) stream.emplace(DNNL_CHECK(dnnl::stream(cpu::dnnl_engine())));
      for (int k = omp_get_thread_num(); k < workers_; k += omp_get_num_threads()) {
        const int64_t b0 = first_row(k), b1 = first_row(k + 1);
        StepGemm::Avx2 avx2 = avx2_;
        avx2.rows = b1 - b0;
        body(b0, b1, gemms_.empty() ? StepGemm(avx2) : StepGemm(gemms_[size_t(k)], *stream));
      }
    }
  }

 private:
  int64_t first_row(int k) const { return B_ * k / workers_; }
  int64_t B_;
  int workers_;
  std::vector<PackedGemm> gemms_;  // oneDNN: one per worker
  Tensor panels_;                  // AVX2: the packed weights
  StepGemm::Avx2 avx2_{};
};

// exp(x) to about 2 ulp (Cephes' expf): x = k ln2 + r, exp(r) by a
// polynomial, 2^k through the exponent bits. Plain arithmetic, so the gate
// loops vectorise.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  // k = round(x / ln2) by the 1.5 * 2^23 trick (floorf does not vectorise
  // without -fno-trapping-math).
  float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float e = p * r * r + r + 1.0f;
  return e * std::bit_cast<float>((int32_t(k) + 127) << 23);
}
inline float sigmoid_approx(float x) { return 1.0f / (1.0f + exp_approx(-x)); }
// tanh(x) = 1 - 2 / (1 + exp(2x)): absolute error ~1e-7 near 0.
inline float tanh_approx(float x) { return 1.0f - 2.0f / (1.0f + exp_approx(2.0f * x)); }

// The cell loops of one batch row and step, over j < H; their arguments are
// locals, so the compiler knows no store reloads them and vectorises. The
// LSTM's are inlined into an AVX2 and an AVX-512 instance (core/cpu/isa.h):
// the same arithmetic on 8 or 16 lanes.

// a: input projection [4H] (less bias), replaced by the activated i, f, g,
// o of the pre-activations a + gh + bias (gh [4H]: the recurrent projection);
// c = f c_prev + i g; h = hn = o tanh(c).
[[gnu::always_inline]] inline void lstm_cell_forward(float* a, const float* gh, const float* bias,
                                                     const float* c_prev, float* c, float* h,
                                                     float* hn, int64_t H) {
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    float i = sigmoid_approx(a[j] + gh[j] + bias[j]);
    float f = sigmoid_approx(a[H + j] + gh[H + j] + bias[H + j]);
    float g = tanh_approx(a[2 * H + j] + gh[2 * H + j] + bias[2 * H + j]);
    float o = sigmoid_approx(a[3 * H + j] + gh[3 * H + j] + bias[3 * H + j]);
    a[j] = i;
    a[H + j] = f;
    a[2 * H + j] = g;
    a[3 * H + j] = o;
    c[j] = f * c_prev[j] + i * g;
    float hj = o * tanh_approx(c[j]);
    h[j] = hj;
    hn[j] = hj;
  }
}

// From the activated gates a [4H], c and c_prev: d [4H] the pre-activation
// gradients; dh_next (in: from step t + 1) is read, dc_next updated to dc f.
[[gnu::always_inline]] inline void lstm_cell_backward(const float* a, const float* c,
                                                      const float* c_prev, const float* grad_y,
                                                      const float* dh_next, float* dc_next,
                                                      float* d, int64_t H) {
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    float i = a[j], f = a[H + j], g = a[2 * H + j], o = a[3 * H + j];
    float tc = tanh_approx(c[j]);
    float dh = grad_y[j] + dh_next[j];
    float dc = dc_next[j] + dh * o * (1.0f - tc * tc);
    d[j] = dc * g * i * (1.0f - i);
    d[H + j] = dc * c_prev[j] * f * (1.0f - f);
    d[2 * H + j] = dc * i * (1.0f - g * g);
    d[3 * H + j] = dh * tc * o * (1.0f - o);
    dc_next[j] = dc * f;
  }
}

TRAINER_AVX512 void lstm_cell_forward_avx512(float* a, const float* gh, const float* bias,
                                             const float* c_prev, float* c, float* h, float* hn,
                                             int64_t H) {
  lstm_cell_forward(a, gh, bias, c_prev, c, h, hn, H);
}
void lstm_cell_forward_avx2(float* a, const float* gh, const float* bias, const float* c_prev,
                            float* c, float* h, float* hn, int64_t H) {
  lstm_cell_forward(a, gh, bias, c_prev, c, h, hn, H);
}
TRAINER_AVX512 void lstm_cell_backward_avx512(const float* a, const float* c, const float* c_prev,
                                              const float* grad_y, const float* dh_next,
                                              float* dc_next, float* d, int64_t H) {
  lstm_cell_backward(a, c, c_prev, grad_y, dh_next, dc_next, d, H);
}
void lstm_cell_backward_avx2(const float* a, const float* c, const float* c_prev,
                             const float* grad_y, const float* dh_next, float* dc_next, float* d,
                             int64_t H) {
  lstm_cell_backward(a, c, c_prev, grad_y, dh_next, dc_next, d, H);
}

// gi [3H] input projection, gh [3H] recurrent projection (both less bias);
// writes r, z, n, gh_n to rec [4H] and h = hn = (1 - z) n + z h_prev.
void gru_cell_forward(const float* gi, const float* gh, const float* bias_ih, const float* bias_hh,
                      const float* h_prev, float* rec, float* h, float* hn, int64_t H) {
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    float r = sigmoid_approx(gi[j] + bias_ih[j] + gh[j] + bias_hh[j]);
    float z = sigmoid_approx(gi[H + j] + bias_ih[H + j] + gh[H + j] + bias_hh[H + j]);
    float ghn = gh[2 * H + j] + bias_hh[2 * H + j];
    float n = tanh_approx(gi[2 * H + j] + bias_ih[2 * H + j] + r * ghn);
    rec[j] = r;
    rec[H + j] = z;
    rec[2 * H + j] = n;
    rec[3 * H + j] = ghn;
    float hj = (1.0f - z) * n + z * h_prev[j];
    h[j] = hj;
    hn[j] = hj;
  }
}

// From rec [4H] (r, z, n, gh_n): dgi, dgh [3H]; dh (in: from step t + 1,
// out: its direct part dh z) updated in place.
void gru_cell_backward(const float* rec, const float* h_prev, const float* grad_y, float* dh_next,
                       float* dgi, float* dgh, int64_t H) {
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    float r = rec[j], z = rec[H + j], n = rec[2 * H + j], ghn = rec[3 * H + j];
    float dh = grad_y[j] + dh_next[j];
    float dn = dh * (1.0f - z) * (1.0f - n * n);
    float dz = dh * (h_prev[j] - n) * z * (1.0f - z);
    float dr = dn * ghn * r * (1.0f - r);
    dgi[j] = dr;
    dgh[j] = dr;
    dgi[H + j] = dz;
    dgh[H + j] = dz;
    dgi[2 * H + j] = dn;
    dgh[2 * H + j] = dn * r;
    dh_next[j] = dh * z;
  }
}

bool all_f32(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->dtype() != DType::f32) return false;
  return true;
}

// Hprev [B, T, H]: h_{t-1} of every step (h0 at t = 0), from y.
void shifted_states(const float* h0, const float* y, int64_t B, int64_t T, int64_t H,
                    float* hprev) {
#pragma omp parallel for schedule(static) if (B * T * H >= cpu::kParallelGrain)
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(hprev + b * T * H, h0 + b * H, size_t(H) * sizeof(float));
    std::memcpy(hprev + (b * T + 1) * H, y + b * T * H, size_t((T - 1) * H) * sizeof(float));
  }
}

// out[n] = sum over rows of a [R, N].
void column_sums(const float* a, int64_t R, int64_t N, float* out) {
#pragma omp parallel for schedule(static) if (R * N >= cpu::kParallelGrain)
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    int64_t n1 = std::min(N, n0 + 64);
    float acc[64] = {};
    for (int64_t r = 0; r < R; ++r)
#pragma omp simd
      for (int64_t n = n0; n < n1; ++n) acc[n - n0] += a[r * N + n];
    for (int64_t n = n0; n < n1; ++n) out[n] = acc[n - n0];
  }
}

// hs [T + 1, B, H] with hs[0] = h0: the states the recurrent GEMM reads.
Tensor states_buffer(const Tensor& h0, int64_t T) {
  Tensor hs = empty({(T + 1) * h0.numel()}, DType::f32);
  std::memcpy(hs.data<float>(), h0.data<float>(), size_t(h0.numel()) * sizeof(float));
  return hs;
}

}  // namespace

Tensor CpuBackend::lstm_forward(const Tensor& x, const Tensor& h0, const Tensor& c0,
                                const Tensor& weight_ih, const Tensor& weight_hh,
                                const Tensor& bias, bool training, const Tensor& y,
                                const Tensor& h_n, const Tensor& c_n) {
  if (cpu::any_half({&x, &h0, &c0, &weight_ih, &weight_hh, &bias})) {
    // bf16/f16: the f32 kernel on copies (core/cpu/lowp.h); its record is f32.
    Tensor record;
    cpu::run_in_f32({x, h0, c0, weight_ih, weight_hh, bias}, {y, h_n, c_n},
                    [&](const TensorList& i, const TensorList& o) {
                      record = lstm_forward(i[0], i[1], i[2], i[3], i[4], i[5], training, o[0],
                                            o[1], o[2]);
                    });
    return record;
  }
  if (!all_f32({&x, &h0, &c0, &weight_ih, &weight_hh, &bias}))
    return RefBackend::lstm_forward(x, h0, c0, weight_ih, weight_hh, bias, training, y, h_n, c_n);
  int64_t B = x.size(0), T = x.size(1), I = x.size(2), H = h0.size(1), G = 4 * H;
  Tensor record = empty({B * T * 5 * H}, DType::f32);
  float* gates = record.data<float>();  // [B, T, 4H]
  float* cs = gates + B * T * G;        // [B, T, H]
  Tensor hs_t = states_buffer(h0, T), gh_t = empty({B * G}, DType::f32);
  float *hs = hs_t.data<float>(), *gh = gh_t.data<float>();
  const float* bs = bias.data<float>();
  float* yp = y.data<float>();
  gemm(rows_of(x.data<float>(), B * T, I, I), rows_of(weight_ih.data<float>(), G, I, I).t(), gates,
       G);
  const bool avx512 = cpu::use_avx512();
  Recurrence recurrence(
      B, [&](int64_t b0, int64_t rows) { return rows_of(hs + b0 * H, rows, H, H); },
      rows_of(weight_hh.data<float>(), G, H, H).t(), G, /*accumulate=*/false);
  recurrence.run([&](int64_t b0, int64_t b1, const StepGemm& gemm) {
    for (int64_t t = 0; t < T; ++t) {
      gemm.run(hs + (t * B + b0) * H, gh + b0 * G);
      for (int64_t b = b0; b < b1; ++b) {
        float* a = gates + (b * T + t) * G;
        const float* cp = t == 0 ? c0.data<float>() + b * H : cs + (b * T + t - 1) * H;
        float* c = cs + (b * T + t) * H;
        float* h = yp + (b * T + t) * H;
        float* hn = hs + ((t + 1) * B + b) * H;
        (avx512 ? lstm_cell_forward_avx512 : lstm_cell_forward_avx2)(a, gh + b * G, bs, cp, c, h,
                                                                     hn, H);
      }
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(h_n.data<float>() + b * H, yp + (b * T + T - 1) * H, size_t(H) * sizeof(float));
    std::memcpy(c_n.data<float>() + b * H, cs + (b * T + T - 1) * H, size_t(H) * sizeof(float));
  }
  return training ? record : Tensor();
}

// Per step, last first, with dh = grad_y_t + dh_next and tc = tanh(c_t):
//   dc = dc_next + dh o (1 - tc^2)
//   di = dc g i (1 - i), df = dc c_{t-1} f (1 - f), dg = dc i (1 - g^2),
//   do = dh tc o (1 - o);  dc_next = dc f;  dh_next = [di df dg do] W_hh
// then grad_x = dG W_ih, grad_weight_ih = dG^T x, grad_weight_hh = dG^T Hprev,
// grad_bias = sum_rows dG over all steps.
void CpuBackend::lstm_backward(const Tensor& grad_y, const Tensor& grad_h_n, const Tensor& grad_c_n,
                               const Tensor& x, const Tensor& h0, const Tensor& c0,
                               const Tensor& weight_ih, const Tensor& weight_hh, const Tensor& bias,
                               const Tensor& y, const Tensor& record, const Tensor& grad_x,
                               const Tensor& grad_h0, const Tensor& grad_c0,
                               const Tensor& grad_weight_ih, const Tensor& grad_weight_hh,
                               const Tensor& grad_bias) {
  if (record.defined() && cpu::any_half({&grad_y, &x, &h0, &c0, &weight_ih, &weight_hh, &y}))
    return cpu::run_in_f32({grad_y, grad_h_n, grad_c_n, x, h0, c0, weight_ih, weight_hh, bias, y},
                           {grad_x, grad_h0, grad_c0, grad_weight_ih, grad_weight_hh, grad_bias},
                           [&](const TensorList& i, const TensorList& o) {
                             lstm_backward(i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8],
                                           i[9], record, o[0], o[1], o[2], o[3], o[4], o[5]);
                           });
  if (!record.defined() || !all_f32({&grad_y, &x, &h0, &c0, &weight_ih, &weight_hh, &y}))
    return RefBackend::lstm_backward(grad_y, grad_h_n, grad_c_n, x, h0, c0, weight_ih, weight_hh,
                                     bias, y, record, grad_x, grad_h0, grad_c0, grad_weight_ih,
                                     grad_weight_hh, grad_bias);
  int64_t B = x.size(0), T = x.size(1), I = x.size(2), H = h0.size(1), G = 4 * H;
  const float* gates = record.data<float>();
  const float* cs = gates + B * T * G;
  const float* gy = grad_y.data<float>();
  Tensor dgates_t = empty({B * T * G}, DType::f32), dstep_t = empty({B * G}, DType::f32);
  float *dg = dgates_t.data<float>(), *dstep = dstep_t.data<float>();
  float* dh_next = grad_h0.data<float>();  // carried in place; ends as grad_h0
  float* dc_next = grad_c0.data<float>();
  std::memcpy(dh_next, grad_h_n.data<float>(), size_t(B * H) * sizeof(float));
  std::memcpy(dc_next, grad_c_n.data<float>(), size_t(B * H) * sizeof(float));
  const float* c0p = c0.data<float>();
  const bool avx512 = cpu::use_avx512();
  Recurrence recurrence(
      B, [&](int64_t b0, int64_t rows) { return rows_of(dstep + b0 * G, rows, G, G); },
      rows_of(weight_hh.data<float>(), G, H, H), H, /*accumulate=*/false);
  recurrence.run([&](int64_t b0, int64_t b1, const StepGemm& gemm) {
    for (int64_t t = T - 1; t >= 0; --t) {
      for (int64_t b = b0; b < b1; ++b) {
        const float* a = gates + (b * T + t) * G;
        const float* c = cs + (b * T + t) * H;
        const float* cp = t == 0 ? c0p + b * H : cs + (b * T + t - 1) * H;
        const float* gyt = gy + (b * T + t) * H;
        float* d = dstep + b * G;
        float* dhn = dh_next + b * H;
        float* dcn = dc_next + b * H;
        (avx512 ? lstm_cell_backward_avx512 : lstm_cell_backward_avx2)(a, c, cp, gyt, dhn, dcn, d,
                                                                       H);
        std::memcpy(dg + (b * T + t) * G, d, size_t(G) * sizeof(float));
      }
      gemm.run(dstep + b0 * G, dh_next + b0 * H);
    }
  });
  Mat dG = rows_of(dg, B * T, G, G);
  gemm(dG, rows_of(weight_ih.data<float>(), G, I, I), grad_x.data<float>(), I);
  gemm(dG.t(), rows_of(x.data<float>(), B * T, I, I), grad_weight_ih.data<float>(), I);
  Tensor hprev = empty({B * T * H}, DType::f32);
  shifted_states(h0.data<float>(), y.data<float>(), B, T, H, hprev.data<float>());
  gemm(dG.t(), rows_of(hprev.data<float>(), B * T, H, H), grad_weight_hh.data<float>(), H);
  column_sums(dg, B * T, G, grad_bias.data<float>());
}

Tensor CpuBackend::gru_forward(const Tensor& x, const Tensor& h0, const Tensor& weight_ih,
                               const Tensor& weight_hh, const Tensor& bias_ih,
                               const Tensor& bias_hh, bool training, const Tensor& y,
                               const Tensor& h_n) {
  if (cpu::any_half({&x, &h0, &weight_ih, &weight_hh, &bias_ih, &bias_hh})) {
    Tensor record;
    cpu::run_in_f32({x, h0, weight_ih, weight_hh, bias_ih, bias_hh}, {y, h_n},
                    [&](const TensorList& i, const TensorList& o) {
                      record =
                          gru_forward(i[0], i[1], i[2], i[3], i[4], i[5], training, o[0], o[1]);
                    });
    return record;
  }
  if (!all_f32({&x, &h0, &weight_ih, &weight_hh, &bias_ih, &bias_hh}))
    return RefBackend::gru_forward(x, h0, weight_ih, weight_hh, bias_ih, bias_hh, training, y, h_n);
  int64_t B = x.size(0), T = x.size(1), I = x.size(2), H = h0.size(1), G = 3 * H;
  Tensor gi_t = empty({B * T * G}, DType::f32), gh_t = empty({B * G}, DType::f32);
  Tensor record = empty({B * T * 4 * H}, DType::f32);
  Tensor hs_t = states_buffer(h0, T);
  float *gi = gi_t.data<float>(), *gh = gh_t.data<float>(), *rec = record.data<float>();
  float* hs = hs_t.data<float>();
  const float *bi = bias_ih.data<float>(), *bh = bias_hh.data<float>();
  float* yp = y.data<float>();
  gemm(rows_of(x.data<float>(), B * T, I, I), rows_of(weight_ih.data<float>(), G, I, I).t(), gi, G);
  Recurrence recurrence(
      B, [&](int64_t b0, int64_t rows) { return rows_of(hs + b0 * H, rows, H, H); },
      rows_of(weight_hh.data<float>(), G, H, H).t(), G, /*accumulate=*/false);
  recurrence.run([&](int64_t b0, int64_t b1, const StepGemm& gemm) {
    for (int64_t t = 0; t < T; ++t) {
      gemm.run(hs + (t * B + b0) * H, gh + b0 * G);
      for (int64_t b = b0; b < b1; ++b) {
        const float* a = gi + (b * T + t) * G;
        const float* e = gh + b * G;
        const float* hpb = hs + (t * B + b) * H;
        float* hn = hs + ((t + 1) * B + b) * H;
        float* r4 = rec + (b * T + t) * 4 * H;
        float* h = yp + (b * T + t) * H;
        gru_cell_forward(a, e, bi, bh, hpb, r4, h, hn, H);
      }
    }
  });
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(h_n.data<float>() + b * H, yp + (b * T + T - 1) * H, size_t(H) * sizeof(float));
  return training ? record : Tensor();
}

// Per step, last first, with dh = grad_y_t + dh_next:
//   dn = dh (1 - z) (1 - n^2),  dz = dh (h_{t-1} - n) z (1 - z),
//   dr = dn gh_n r (1 - r);  d(gi) = [dr dz dn], d(gh) = [dr dz dn r];
//   dh_next = dh z + d(gh) W_hh
// then grad_x = d(gi) W_ih, grad_weight_ih = d(gi)^T x,
// grad_weight_hh = d(gh)^T Hprev, grad_bias_* = sum_rows d(g*).
void CpuBackend::gru_backward(const Tensor& grad_y, const Tensor& grad_h_n, const Tensor& x,
                              const Tensor& h0, const Tensor& weight_ih, const Tensor& weight_hh,
                              const Tensor& bias_ih, const Tensor& bias_hh, const Tensor& y,
                              const Tensor& record, const Tensor& grad_x, const Tensor& grad_h0,
                              const Tensor& grad_weight_ih, const Tensor& grad_weight_hh,
                              const Tensor& grad_bias_ih, const Tensor& grad_bias_hh) {
  if (record.defined() && cpu::any_half({&grad_y, &x, &h0, &weight_ih, &weight_hh, &y}))
    return cpu::run_in_f32(
        {grad_y, grad_h_n, x, h0, weight_ih, weight_hh, bias_ih, bias_hh, y},
        {grad_x, grad_h0, grad_weight_ih, grad_weight_hh, grad_bias_ih, grad_bias_hh},
        [&](const TensorList& i, const TensorList& o) {
          gru_backward(i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8], record, o[0], o[1],
                       o[2], o[3], o[4], o[5]);
        });
  if (!record.defined() || !all_f32({&grad_y, &x, &h0, &weight_ih, &weight_hh, &y}))
    return RefBackend::gru_backward(grad_y, grad_h_n, x, h0, weight_ih, weight_hh, bias_ih, bias_hh,
                                    y, record, grad_x, grad_h0, grad_weight_ih, grad_weight_hh,
                                    grad_bias_ih, grad_bias_hh);
  int64_t B = x.size(0), T = x.size(1), I = x.size(2), H = h0.size(1), G = 3 * H;
  const float* rec = record.data<float>();
  const float* gy = grad_y.data<float>();
  const float* yp = y.data<float>();
  const float* h0p = h0.data<float>();
  Tensor dgi_t = empty({B * T * G}, DType::f32), dgh_t = empty({B * T * G}, DType::f32);
  Tensor dstep_t = empty({B * G}, DType::f32);
  float *dgi = dgi_t.data<float>(), *dgh = dgh_t.data<float>(), *dstep = dstep_t.data<float>();
  float* dh_next = grad_h0.data<float>();  // carried in place; ends as grad_h0
  std::memcpy(dh_next, grad_h_n.data<float>(), size_t(B * H) * sizeof(float));
  Recurrence recurrence(
      B, [&](int64_t b0, int64_t rows) { return rows_of(dstep + b0 * G, rows, G, G); },
      rows_of(weight_hh.data<float>(), G, H, H), H, /*accumulate=*/true);
  recurrence.run([&](int64_t b0, int64_t b1, const StepGemm& gemm) {
    for (int64_t t = T - 1; t >= 0; --t) {
      for (int64_t b = b0; b < b1; ++b) {
        const float* r4 = rec + (b * T + t) * 4 * H;
        const float* hp = t == 0 ? h0p + b * H : yp + (b * T + t - 1) * H;
        const float* gyt = gy + (b * T + t) * H;
        float* di = dgi + (b * T + t) * G;
        float* dh_ = dstep + b * G;
        float* dhn = dh_next + b * H;
        gru_cell_backward(r4, hp, gyt, dhn, di, dh_, H);
        std::memcpy(dgh + (b * T + t) * G, dh_, size_t(G) * sizeof(float));
      }
      gemm.run(dstep + b0 * G, dh_next + b0 * H);
    }
  });
  Mat dGi = rows_of(dgi, B * T, G, G), dGh = rows_of(dgh, B * T, G, G);
  gemm(dGi, rows_of(weight_ih.data<float>(), G, I, I), grad_x.data<float>(), I);
  gemm(dGi.t(), rows_of(x.data<float>(), B * T, I, I), grad_weight_ih.data<float>(), I);
  Tensor hprev = empty({B * T * H}, DType::f32);
  shifted_states(h0p, yp, B, T, H, hprev.data<float>());
  gemm(dGh.t(), rows_of(hprev.data<float>(), B * T, H, H), grad_weight_hh.data<float>(), H);
  column_sums(dgi, B * T, G, grad_bias_ih.data<float>());
  column_sums(dgh, B * T, G, grad_bias_hh.data<float>());
}

}  // namespace trainer
