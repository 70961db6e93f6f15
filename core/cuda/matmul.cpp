// CUDA matmul: cuBLASLt for f32 (TF32 tensor cores, fp32 accumulation), bf16
// and f16 (tensor cores, fp32 accumulation); cuBLAS's Dgemm for f64, which
// exists for the gradient checks and the CPU comparisons.
//
// cuBLAS is column-major, our matrices row-major, so the product is computed
// transposed: out^T [N, M] = b^T [N, K] a^T [K, M]. A row-major operand read
// as column-major is already the transpose cuBLAS wants (op N); a
// column-major one (a transposed view) is passed with op T. Operands with
// neither unit stride are copied to a dense layout first.
//
// Batch dims: dims that every operand steps through as one are folded; the
// innermost folded group is cuBLAS's strided batch (a broadcast operand has
// batch stride 0), outer groups are looped on the host. When b is broadcast
// over the whole batch and a and out step through it by whole matrices, the
// batch folds into M instead: one [batch * M, K] x [K, N] GEMM (a Linear layer).
//
// The cuBLASLt algorithm is chosen by its heuristic once per (device, dtype,
// geometry, pointer alignment) and cached; the workspace comes from the
// caching allocator.
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "core/cuda/cuda_backend.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/kernel_scope.h"

namespace trainer::cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;

// A row-major [rows, cols] matrix with element strides (sr, sc) as a cuBLAS
// operand whose op() is its transpose: stored (column-major) dims and leading
// dimension, and whether cuBLAS must transpose the stored matrix.
struct Operand {
  bool valid = false;
  bool trans = false;
  int64_t rows = 0, cols = 0, ld = 0;  // stored, column-major
};

Operand describe(int64_t rows, int64_t cols, int64_t sr, int64_t sc) {
  Operand o;
  // Row-major in memory: column-major [cols, rows], which is the transpose already.
  if ((sc == 1 || cols == 1) && (rows == 1 || sr >= std::max<int64_t>(cols, 1))) {
    o = {true, false, cols, rows, rows == 1 ? std::max<int64_t>(cols, 1) : sr};
  } else if ((sr == 1 || rows == 1) && (cols == 1 || sc >= std::max<int64_t>(rows, 1))) {
    // Column-major in memory: cuBLAS transposes it.
    o = {true, true, rows, cols, cols == 1 ? std::max<int64_t>(rows, 1) : sc};
  }
  return o;
}

// One batch group: size and per-operand stride (a, b, out).
struct Group {
  int64_t size;
  int64_t stride[3];
};

std::vector<Group> fold_batch(const Tensor& a, const Tensor& b, const Tensor& out) {
  std::vector<Group> groups;
  const Tensor* ops[3] = {&a, &b, &out};
  for (int d = 0; d < out.dim() - 2; ++d) {
    int64_t size = out.shape()[d];
    if (size == 1) continue;
    bool merge = !groups.empty();
    for (int k = 0; k < 3 && merge; ++k)
      merge = groups.back().stride[k] == ops[k]->strides()[d] * size;
    if (merge) {
      groups.back().size *= size;
      for (int k = 0; k < 3; ++k) groups.back().stride[k] = ops[k]->strides()[d];
    } else {
      groups.push_back({size, {a.strides()[d], b.strides()[d], out.strides()[d]}});
    }
  }
  return groups;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      throw Error(cat("matmul: cuBLASLt path does not take ", t));
  }
}

// Largest power of two (<= 256) dividing the address: cuBLASLt's alignment preference.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

// One strided-batched GEMM in cuBLAS terms: D[m, n] = op(A)[m, k] op(B)[k, n].
struct Gemm {
  DType dtype;
  Operand A, B, C;
  int64_t m, n, k;
  int64_t batch;
  int64_t stride_a, stride_b, stride_c;
};

using AlgoKey =
    std::tuple<int, int, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
               int64_t, int64_t, int64_t, uint32_t, uint32_t, uint32_t>;

struct LtHandles {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> lt;
  std::map<int, cublasHandle_t> blas;
  std::map<AlgoKey, cublasLtMatmulHeuristicResult_t> algos;
};

LtHandles& handles() {
  static LtHandles* h = new LtHandles();  // leaked: used until exit
  return *h;
}

cublasLtHandle_t lt_handle(int device) {
  LtHandles& h = handles();
  std::lock_guard<std::mutex> lock(h.mu);
  auto it = h.lt.find(device);
  if (it != h.lt.end()) return it->second;
  cublasLtHandle_t handle;
  CUBLAS_CHECK(cublasLtCreate(&handle));
  h.lt.emplace(device, handle);
  return handle;
}

// RAII holders of the cuBLASLt descriptors of one call.
struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtDescs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

void make_layout(cublasLtMatrixLayout_t* layout, cudaDataType_t type, const Operand& o,
                 int64_t batch, int64_t stride) {
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(layout, type, uint64_t(o.rows), uint64_t(o.cols), o.ld));
  if (batch == 1) return;
  int32_t count = int32_t(batch);
  CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(*layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                sizeof(count)));
  CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
      *layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
}

void run_lt(const Gemm& g, const void* a, const void* b, void* c, int device, cudaStream_t stream) {
  const cudaDataType_t type = cuda_type(g.dtype);
  const cublasComputeType_t compute =
      g.dtype == DType::f32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  LtDescs d;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, compute, CUDA_R_32F));
  cublasOperation_t ta = g.A.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t tb = g.B.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  make_layout(&d.a, type, g.A, g.batch, g.stride_a);
  make_layout(&d.b, type, g.B, g.batch, g.stride_b);
  make_layout(&d.c, type, g.C, g.batch, g.stride_c);

  const uint32_t align_a = alignment(a), align_b = alignment(b), align_c = alignment(c);
  AlgoKey key{device,     int(g.dtype), g.A.trans, g.B.trans, g.m,     g.n,
              g.k,        g.A.ld,       g.B.ld,    g.C.ld,    g.batch, g.stride_a,
              g.stride_b, g.stride_c,   align_a,   align_b,   align_c};
  cublasLtHandle_t handle = lt_handle(device);
  cublasLtMatmulHeuristicResult_t algo;
  {
    LtHandles& h = handles();
    std::lock_guard<std::mutex> lock(h.mu);
    auto it = h.algos.find(key);
    if (it != h.algos.end()) {
      algo = it->second;
    } else {
      CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.pref));
      uint64_t ws = kWorkspaceBytes;
      CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
      const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c}};
      for (const auto& [attr, value] : aligns)
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, attr, &value, sizeof(value)));
      int found = 0;
      CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.c, d.c, d.pref, 1,
                                                  &algo, &found));
      if (found == 0)
        throw Error(cat("matmul: cuBLASLt has no algorithm for ", g.dtype, " m=", g.m, " n=", g.n,
                        " k=", g.k, " batch=", g.batch));
      h.algos.emplace(key, algo);
    }
  }
  Tensor workspace;
  if (algo.workspaceSize > 0)
    workspace = empty({int64_t(algo.workspaceSize)}, DType::u8, Device{kCUDA, device});
  const float alpha = 1.0f, beta = 0.0f;
  // D = C (beta = 0, so C is never read).
  CUBLAS_CHECK(cublasLtMatmul(handle, d.op, &alpha, a, d.a, b, d.b, &beta, c, d.c, c, d.c,
                              &algo.algo, workspace.defined() ? workspace.data_ptr() : nullptr,
                              algo.workspaceSize, stream));
}

void run_dgemm(const Gemm& g, const double* a, const double* b, double* c, int device,
               cudaStream_t stream) {
  for (int64_t v : {g.m, g.n, g.k, g.A.ld, g.B.ld, g.C.ld, g.batch})
    CHECK(v <= INT32_MAX) << "matmul f64: dimension " << v << " exceeds cuBLAS's int range";
  LtHandles& h = handles();
  // The handle's stream is per handle: one caller at a time.
  std::lock_guard<std::mutex> lock(h.mu);
  auto it = h.blas.find(device);
  if (it == h.blas.end()) {
    cublasHandle_t handle;
    CUBLAS_CHECK(cublasCreate(&handle));
    it = h.blas.emplace(device, handle).first;
  }
  CUBLAS_CHECK(cublasSetStream(it->second, stream));
  const double alpha = 1.0, beta = 0.0;
  CUBLAS_CHECK(cublasDgemmStridedBatched(
      it->second, g.A.trans ? CUBLAS_OP_T : CUBLAS_OP_N, g.B.trans ? CUBLAS_OP_T : CUBLAS_OP_N,
      int(g.m), int(g.n), int(g.k), &alpha, a, int(g.A.ld), g.stride_a, b, int(g.B.ld), g.stride_b,
      &beta, c, int(g.C.ld), g.stride_c, int(g.batch)));
}

// A dense (row-major, contiguous) copy of a matrix operand t.
Tensor dense(Backend& be, const Tensor& t) {
  Tensor out = empty(t.shape(), t.dtype(), t.device());
  be.copy(t, out);
  return out;
}

}  // namespace

// out[..., m, n] = sum_k a[..., m, k] b[..., k, n]
void CudaBackend::matmul(const Tensor& a_in, const Tensor& b_in, const Tensor& out) {
  KernelScope scope("matmul", {&out, &a_in, &b_in});
  CHECK(a_in.dtype() == out.dtype() && b_in.dtype() == out.dtype())
      << "matmul: operands of dtypes " << a_in.dtype() << " and " << b_in.dtype() << ", output "
      << out.dtype();
  CHECK(out.is_contiguous()) << "matmul: output must be contiguous";
  const DType t = out.dtype();
  if (t != DType::f64) cuda_type(t);  // throws for a dtype cuBLASLt does not take
  const int nd = out.dim();
  const int64_t M = out.size(nd - 2), N = out.size(nd - 1), K = a_in.size(nd - 1);
  if (out.numel() == 0) return;
  if (K == 0) return fill(out, 0.0);

  // Operands whose matrices have no unit stride become dense copies.
  Tensor a = a_in, b = b_in;
  auto usable = [&](const Tensor& x, int64_t r, int64_t c) {
    return describe(r, c, x.stride(nd - 2), x.stride(nd - 1)).valid;
  };
  if (!usable(a, M, K)) a = dense(*this, a);
  if (!usable(b, K, N)) b = dense(*this, b);

  std::vector<Group> groups = fold_batch(a, b, out);
  int64_t rows = M;  // rows of the GEMM (batch folded into M when b is broadcast)
  const int64_t sam = a.stride(nd - 2), som = out.stride(nd - 2);
  if (groups.size() == 1 && groups[0].stride[1] == 0 && a.stride(nd - 1) == 1 &&
      groups[0].stride[0] == M * sam && groups[0].stride[2] == M * som) {
    rows = M * groups[0].size;
    groups.clear();
  }
  Gemm g;
  g.dtype = t;
  g.A = describe(K, N, b.stride(nd - 2), b.stride(nd - 1));  // b^T [N, K]
  g.B = describe(rows, K, sam, a.stride(nd - 1));            // a^T [K, rows]
  g.C = describe(rows, N, som, out.stride(nd - 1));          // out^T [N, rows]
  CHECK(g.A.valid && g.B.valid && g.C.valid && !g.C.trans) << "matmul: unsupported layout";
  g.m = N, g.n = rows, g.k = K;
  g.batch = 1;
  g.stride_a = g.stride_b = g.stride_c = 0;
  if (!groups.empty()) {
    const Group& inner = groups.back();
    g.batch = inner.size;
    g.stride_a = inner.stride[1], g.stride_b = inner.stride[0], g.stride_c = inner.stride[2];
    groups.pop_back();
  }

  const int device = out.device().index;
  const size_t es = dtype_size(t);
  std::vector<int64_t> idx(groups.size(), 0);
  int64_t outer = 1;
  for (const Group& gr : groups) outer *= gr.size;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t off[3] = {0, 0, 0};
    for (size_t d = 0; d < groups.size(); ++d)
      for (int k = 0; k < 3; ++k) off[k] += idx[d] * groups[d].stride[k];
    const char* pa = static_cast<const char*>(a.data_ptr()) + off[0] * int64_t(es);
    const char* pb = static_cast<const char*>(b.data_ptr()) + off[1] * int64_t(es);
    char* pc = static_cast<char*>(out.data_ptr()) + off[2] * int64_t(es);
    // cuBLAS's A is our b, its B our a.
    if (t == DType::f64)
      run_dgemm(g, reinterpret_cast<const double*>(pb), reinterpret_cast<const double*>(pa),
                reinterpret_cast<double*>(pc), device, scope.stream());
    else
      run_lt(g, pb, pa, pc, device, scope.stream());
    for (int d = int(groups.size()) - 1; d >= 0 && ++idx[size_t(d)] == groups[size_t(d)].size; --d)
      idx[size_t(d)] = 0;
  }
}

}  // namespace trainer::cuda
