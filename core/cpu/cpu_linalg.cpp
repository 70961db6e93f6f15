// CPU matmul on oneDNN. Operands keep their strides: a transposed view is
// described to oneDNN as a column-major matrix, a broadcast (stride-0) batch
// dim as a batch dim of size 1, which oneDNN broadcasts. Batch dims that step
// as one in every operand are folded together first.
//
// A primitive is built once per (dtype, thread count, dims and strides of the
// three operands) and cached; each call binds pointers and runs it. When
// oneDNN only offers its reference implementation for a strided layout, the
// plan copies the operands to a dense layout first. bf16 runs oneDNN's AMX /
// AVX512-BF16 kernels; f16 (none in oneDNN 2.6) the f32 ones on converted
// copies (core/cpu/lowp.h); f64 the reference kernel (RefBackend::matmul).
#include <omp.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/lowp.h"
#include "core/cpu/onednn.h"
#include "core/cpu/primitive_cache.h"

namespace trainer {

namespace {

using dims = dnnl::memory::dims;

// oneDNN's limit on tensor rank (DNNL_MAX_NDIMS) minus the two matrix dims.
constexpr size_t kMaxBatchDims = 10;

// Dims and strides (elements) of one operand as described to oneDNN.
struct Layout {
  dims shape, strides;
};

// The batch dims of out with size > 1, grouped into runs that every operand
// steps through as one dim: group g covers dims [first[g], last[g]] (with any
// size-1 dims between them).
struct BatchGroups {
  std::vector<int> first, last;
};

BatchGroups fold_batch(const Tensor& a, const Tensor& b, const Tensor& out) {
  BatchGroups g;
  int nb = out.dim() - 2;
  for (int d = 0; d < nb; ++d) {
    if (out.shape()[d] == 1) continue;
    bool merge = !g.last.empty();
    for (const Tensor* t : {&a, &b, &out}) {
      if (!merge) break;
      int prev = g.last.back();
      // Dims prev and d fold when stepping prev equals stepping all of d
      // (also true when both are broadcast: 0 == 0 * size).
      merge = t->strides()[prev] == t->strides()[d] * t->shape()[d];
    }
    if (merge) {
      g.last.back() = d;
    } else {
      g.first.push_back(d);
      g.last.push_back(d);
    }
  }
  return g;
}

// t ([..., R, C], batch dims as out's or of size 1 where broadcast) as a
// oneDNN layout over the folded batch groups. Broadcast groups get size 1.
// Strides of size-1 dims are free; they are set so the matrix reads as plain
// row-major (or column-major) and the batch as dense, which oneDNN's fast
// implementations ask for.
Layout describe(const Tensor& t, const BatchGroups& g) {
  int nd = t.dim();
  int64_t rows = t.shape()[nd - 2], cols = t.shape()[nd - 1];
  int64_t sr = t.strides()[nd - 2], sc = t.strides()[nd - 1];
  if (cols == 1) sc = 1;
  if (rows == 1) sr = sc == 1 ? cols : 1;
  Layout l;
  int64_t extent = std::max(rows * sr, cols * sc);  // a dense step past one matrix
  for (size_t k = g.first.size(); k-- > 0;) {
    int64_t size = 1;
    for (int d = g.first[k]; d <= g.last[k]; ++d) size *= t.shape()[d];
    int64_t stride = t.strides()[g.last[k]];
    if (stride == 0 || size == 1) {
      size = 1;
      stride = extent;
    }
    l.shape.insert(l.shape.begin(), size);
    l.strides.insert(l.strides.begin(), stride);
    extent = std::max(extent, size * stride);
  }
  l.shape.insert(l.shape.end(), {rows, cols});
  l.strides.insert(l.strides.end(), {sr, sc});
  return l;
}

// t without its broadcast batch dims (size 1 there), copied to a dense layout.
Tensor dense_compact(const Tensor& t) {
  Shape shape = t.shape();
  for (int d = 0; d < t.dim() - 2; ++d)
    if (t.strides()[d] == 0) shape[d] = 1;
  return make_view(t, shape, t.strides(), t.offset()).contiguous();
}

struct MatmulKey {
  std::vector<int64_t> words;
  bool operator==(const MatmulKey& o) const { return words == o.words; }
};
struct MatmulKeyHash {
  size_t operator()(const MatmulKey& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t w : k.words) h = (h ^ size_t(w)) * 1099511628211ull;
    return h;
  }
};

MatmulKey make_key(DType dtype, const Layout& a, const Layout& b, const Layout& out) {
  MatmulKey k;
  // The calling thread too: a primitive runs on the thread that made it
  // (core/cpu/primitive_cache.h).
  k.words = {int64_t(dtype), omp_get_max_threads(), cpu::thread_slot(), int64_t(a.shape.size())};
  for (const Layout* l : {&a, &b, &out}) {
    k.words.insert(k.words.end(), l->shape.begin(), l->shape.end());
    k.words.insert(k.words.end(), l->strides.begin(), l->strides.end());
  }
  return k;
}

// What one call runs: the primitive, its operand descriptors, and whether
// the operands are first copied to a dense layout. Null prim: use the
// reference kernel.
struct MatmulPlan {
  std::optional<dnnl::matmul> prim;
  dnnl::memory::desc a_md, b_md, out_md;
  bool copy_a = false, copy_b = false;
};

dnnl::memory::desc to_md(const Layout& l, dnnl::memory::data_type dt) {
  return DNNL_CHECK(dnnl::memory::desc(l.shape, dt, l.strides));
}

// A primitive for these descriptors unless oneDNN offers only its reference
// implementation (a slow loop nest we do better by copying first).
std::optional<dnnl::matmul> fast_matmul(const dnnl::memory::desc& a, const dnnl::memory::desc& b,
                                        const dnnl::memory::desc& out) {
  dnnl::matmul::desc desc = DNNL_CHECK(dnnl::matmul::desc(a, b, out));
  auto pd = cpu::try_primitive_desc<dnnl::matmul::primitive_desc>("matmul::primitive_desc", desc,
                                                                  cpu::dnnl_engine());
  if (!pd || std::strncmp(pd->impl_info_str(), "ref", 3) == 0) return std::nullopt;
  return DNNL_CHECK(dnnl::matmul(*pd));
}

// Whether oneDNN can read the matrix of l in place: a stride-0 (expanded)
// row or column dim cannot be described, so such an operand is copied.
bool describable(const Layout& l) {
  size_t nd = l.shape.size();
  return l.strides[nd - 2] > 0 && l.strides[nd - 1] > 0;
}

MatmulPlan make_plan(const Tensor& a, const Tensor& b, const BatchGroups& g, const Layout& la,
                     const Layout& lb, const Layout& lo, dnnl::memory::data_type dt) {
  MatmulPlan p;
  p.out_md = to_md(lo, dt);
  // Strided operands as they are, then dense copies of whichever is not already dense.
  for (int attempt = 0; attempt < 2 && !p.prim; ++attempt) {
    if (attempt == 0 && !(describable(la) && describable(lb))) continue;
    p.copy_a = attempt == 1 && !a.is_contiguous();
    p.copy_b = attempt == 1 && !b.is_contiguous();
    if (attempt == 1 && !p.copy_a && !p.copy_b) break;
    p.a_md = to_md(p.copy_a ? describe(dense_compact(a), g) : la, dt);
    p.b_md = to_md(p.copy_b ? describe(dense_compact(b), g) : lb, dt);
    p.prim = fast_matmul(p.a_md, p.b_md, p.out_md);
  }
  return p;
}

const MatmulPlan& plan_for(const Tensor& a, const Tensor& b, const Tensor& out,
                           dnnl::memory::data_type dt) {
  static std::mutex mutex;
  static std::unordered_map<MatmulKey, std::unique_ptr<MatmulPlan>, MatmulKeyHash> cache;
  BatchGroups g = fold_batch(a, b, out);
  Layout la = describe(a, g), lb = describe(b, g), lo = describe(out, g);
  MatmulKey key = make_key(a.dtype(), la, lb, lo);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it == cache.end())
    it = cache.emplace(key, std::make_unique<MatmulPlan>(make_plan(a, b, g, la, lb, lo, dt))).first;
  return *it->second;
}

}  // namespace

// out[..., M, N] = a[..., M, K] @ b[..., K, N]
void CpuBackend::matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  // f16, and bf16 where oneDNN's bf16 kernels are not used: on the f32 kernels (core/cpu/lowp.h).
  const bool native_bf16 =
      cpu::all_of_dtype({&a, &b, &out}, DType::bf16) && cpu::use_bf16_kernels();
  if (cpu::any_half({&a, &b, &out}) && !native_bf16)
    return cpu::run_in_f32(
        {a, b}, {out}, [&](const TensorList& i, const TensorList& o) { matmul(i[0], i[1], o[0]); });
  std::optional<dnnl::memory::data_type> dt = cpu::dnnl_dtype(out.dtype());
  bool dtypes_match = a.dtype() == out.dtype() && b.dtype() == out.dtype();
  if (!dt || !dtypes_match || out.dim() - 2 > int(kMaxBatchDims) || !out.is_contiguous())
    return RefBackend::matmul(a, b, out);
  if (out.numel() == 0) return;
  if (a.shape().back() == 0) return fill(out, 0.0);  // K == 0: empty sums
  const MatmulPlan& p = plan_for(a, b, out, *dt);
  if (!p.prim) return RefBackend::matmul(a, b, out);
  Tensor da = p.copy_a ? dense_compact(a) : a;
  Tensor db = p.copy_b ? dense_compact(b) : b;
  dnnl::engine& engine = cpu::dnnl_engine();
  dnnl::memory ma = DNNL_CHECK(dnnl::memory(p.a_md, engine, da.data_ptr()));
  dnnl::memory mb = DNNL_CHECK(dnnl::memory(p.b_md, engine, db.data_ptr()));
  dnnl::memory mo = DNNL_CHECK(dnnl::memory(p.out_md, engine, out.data_ptr()));
  DNNL_CHECK(p.prim->execute(cpu::dnnl_stream(),
                             {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mo}}));
}

}  // namespace trainer
