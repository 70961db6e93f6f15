// CudaBackend's elementwise, random, rotary embedding and attention kernels:
// validate the operands, make their device current, describe them as
// Launch<N> (or RopeArgs, AttentionArgs, kernels.h) and enqueue the kernel of
// copy.cu, elementwise.cu, random.cu, rope.cu or attention.cu on the current
// stream.
#include "core/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device.h"
#include "core/cuda/kernel_scope.h"
#include "core/cuda/kernels.h"
#include "core/cuda/stream.h"

namespace trainer::cuda {

namespace {

void check_dtypes(const char* op, DType t, std::initializer_list<const Tensor*> ops) {
  for (const Tensor* x : ops)
    CHECK(x->dtype() == t) << op << ": operand of dtype " << x->dtype() << ", expected " << t;
}

// A contiguous copy of x in dtype t on x's device (x may be broadcast).
Tensor materialize(Backend& b, const Tensor& x, DType t) {
  Tensor out = empty(x.shape(), t, x.device());
  b.copy(x, out);
  return out;
}

}  // namespace

void CudaBackend::copy(const Tensor& src, const Tensor& dst) {
  KernelScope scope("copy", {&dst, &src});
  if (src.dtype() == dst.dtype() && src.shape() == dst.shape() && src.is_contiguous() &&
      dst.is_contiguous()) {
    CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes(),
                               cudaMemcpyDeviceToDevice, scope.stream()));
    return;
  }
  for_each_launch<2>(dst.shape(), {&dst, &src}, [&](const Launch<2>& g) {
    launch_copy(g, dst.dtype(), src.dtype(), scope.stream());
  });
}

void CudaBackend::fill(const Tensor& dst, double value) {
  KernelScope scope("fill", {&dst});
  if (value == 0.0 && !std::signbit(value) && dst.is_contiguous()) {  // all-zero bits
    CUDA_CHECK(cudaMemsetAsync(dst.data_ptr(), 0, dst.nbytes(), scope.stream()));
    return;
  }
  for_each_launch<1>(dst.shape(), {&dst}, [&](const Launch<1>& g) {
    launch_fill(g, dst.dtype(), value, scope.stream());
  });
}

void CudaBackend::unary(UnaryOp op, const Tensor& x, const Tensor& out) {
  KernelScope scope(unary_op_name(op), {&out, &x});
  check_dtypes(unary_op_name(op), out.dtype(), {&x});
  for_each_launch<2>(out.shape(), {&out, &x},
                     [&](const Launch<2>& g) { launch_unary(op, g, out.dtype(), scope.stream()); });
}

void CudaBackend::unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y,
                                 const Tensor& grad_x) {
  // y may be absent for ops whose derivative reads only x.
  const Tensor& yy = y.defined() ? y : x;
  KernelScope scope(unary_op_name(op), {&grad_x, &grad, &x, &yy});
  check_dtypes(unary_op_name(op), grad_x.dtype(), {&grad, &x, &yy});
  for_each_launch<4>(grad_x.shape(), {&grad_x, &x, &yy, &grad}, [&](const Launch<4>& g) {
    launch_unary_backward(op, g, grad_x.dtype(), scope.stream());
  });
}

void CudaBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  KernelScope scope(binary_op_name(op), {&out, &a, &b});
  check_dtypes(binary_op_name(op), out.dtype(), {&a, &b});
  for_each_launch<3>(out.shape(), {&out, &a, &b}, [&](const Launch<3>& g) {
    launch_binary(op, g, out.dtype(), scope.stream());
  });
}

void CudaBackend::binary_scalar(BinaryOp op, const Tensor& a, double s, bool scalar_first,
                                const Tensor& out) {
  KernelScope scope(binary_op_name(op), {&out, &a});
  check_dtypes(binary_op_name(op), out.dtype(), {&a});
  for_each_launch<2>(out.shape(), {&out, &a}, [&](const Launch<2>& g) {
    launch_binary_scalar(op, g, out.dtype(), s, scalar_first, scope.stream());
  });
}

void CudaBackend::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  KernelScope scope("where", {&out, &cond, &a, &b});
  check_dtypes("where", out.dtype(), {&a, &b});
  CHECK(cond.dtype() == DType::boolean) << "where: condition of dtype " << cond.dtype();
  for_each_launch<4>(out.shape(), {&out, &cond, &a, &b},
                     [&](const Launch<4>& g) { launch_where(g, out.dtype(), scope.stream()); });
}

void CudaBackend::clamp(const Tensor& x, double lo, double hi, const Tensor& out) {
  KernelScope scope("clamp", {&out, &x});
  check_dtypes("clamp", out.dtype(), {&x});
  for_each_launch<2>(out.shape(), {&out, &x}, [&](const Launch<2>& g) {
    launch_clamp(g, out.dtype(), lo, hi, scope.stream());
  });
}

void CudaBackend::clamp_backward(const Tensor& grad, const Tensor& x, double lo, double hi,
                                 const Tensor& grad_x) {
  KernelScope scope("clamp_backward", {&grad_x, &grad, &x});
  check_dtypes("clamp_backward", grad_x.dtype(), {&grad, &x});
  for_each_launch<3>(grad_x.shape(), {&grad_x, &grad, &x}, [&](const Launch<3>& g) {
    launch_clamp_backward(g, grad_x.dtype(), lo, hi, scope.stream());
  });
}

void CudaBackend::compare(CompareOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  KernelScope scope("compare", {&out, &a, &b});
  CHECK(out.dtype() == DType::boolean) << "compare: output of dtype " << out.dtype();
  if (a.dtype() != b.dtype()) {
    // Mixed dtypes compare in double, as the reference kernels do.
    return compare(op, materialize(*this, a, DType::f64), materialize(*this, b, DType::f64), out);
  }
  for_each_launch<3>(out.shape(), {&out, &a, &b},
                     [&](const Launch<3>& g) { launch_compare(op, g, a.dtype(), scope.stream()); });
}

void CudaBackend::uniform(const Tensor& out, double lo, double hi, PhiloxKey key) {
  KernelScope scope("uniform", {&out});
  for_each_launch<1>(out.shape(), {&out}, [&](const Launch<1>& g) {
    launch_uniform(g, out.dtype(), lo, hi, key, scope.stream());
  });
}

void CudaBackend::normal(const Tensor& out, double mean, double std, PhiloxKey key) {
  KernelScope scope("normal", {&out});
  for_each_launch<1>(out.shape(), {&out}, [&](const Launch<1>& g) {
    launch_normal(g, out.dtype(), mean, std, key, scope.stream());
  });
}

void CudaBackend::bernoulli(const Tensor& out, double p, PhiloxKey key) {
  KernelScope scope("bernoulli", {&out});
  for_each_launch<1>(out.shape(), {&out}, [&](const Launch<1>& g) {
    launch_bernoulli(g, out.dtype(), p, key, scope.stream());
  });
}

// ---- rotary embedding (kernels: rope.cu) ----

namespace {

// x (unit last stride) turned by sign times the angles into out (contiguous).
void rope(const char* op, const Tensor& x, const Tensor& positions, const RopeAttrs& attrs,
          float sign, const Tensor& out) {
  KernelScope scope(op, {&out, &x, &positions});
  check_dtypes(op, x.dtype(), {&out});
  CHECK(x.stride(2) == 1 && out.is_contiguous() && positions.dtype() == DType::i64)
      << op << ": x needs a unit last stride, out contiguous, positions i64";
  RopeArgs a;
  a.x = x.data_ptr(), a.out = out.data_ptr(), a.positions = positions.data<int64_t>();
  a.sb = x.stride(0), a.st = x.stride(1), a.pos_stride = positions.stride(0);
  a.B = x.size(0), a.T = x.size(1), a.NH = attrs.num_heads, a.HD = x.size(2) / attrs.num_heads;
  a.sign = sign;
  CHECK(int64_t(attrs.inv_freq.size()) == a.HD / 2 && a.HD / 2 <= kMaxRopePairs)
      << op << ": " << attrs.inv_freq.size() << " frequencies for heads of " << a.HD << " (at most "
      << 2 * kMaxRopePairs << ")";
  std::copy(attrs.inv_freq.begin(), attrs.inv_freq.end(), a.inv_freq);
  launch_rope(a, x.dtype(), scope.stream());
}

}  // namespace

void CudaBackend::rope_forward(const Tensor& x, const Tensor& positions, const RopeAttrs& attrs,
                               const Tensor& out) {
  rope("rotary_embedding", x, positions, attrs, 1.0f, out);
}

void CudaBackend::rope_backward(const Tensor& grad_out, const Tensor& positions,
                                const RopeAttrs& attrs, const Tensor& grad_x) {
  rope("rotary_embedding_backward", grad_out, positions, attrs, -1.0f, grad_x);
}

// ---- attention (kernels: attention.cu) ----

namespace {

AttentionOperand attention_operand(const Tensor& t) {
  return {static_cast<char*>(t.data_ptr()), t.stride(0), t.stride(1), t.stride(2)};
}

// The launch arguments of q [B, Tq, D], k, v [B, Tk, KV HD] and lse
// [B, NH, Tq]; checks dtypes.
AttentionArgs attention_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& lse, const AttentionAttrs& attrs) {
  check_dtypes(op, q.dtype(), {&k, &v});
  const DType stat = q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  CHECK(lse.dtype() == stat && lse.is_contiguous())
      << op << ": lse must be contiguous " << stat << ", got " << lse.dtype();
  AttentionArgs a;
  a.q = attention_operand(q), a.k = attention_operand(k), a.v = attention_operand(v);
  a.lse = lse.data_ptr();
  a.B = q.size(0), a.Tq = q.size(1), a.Tk = k.size(1);
  a.NH = attrs.num_heads, a.HD = q.size(2) / attrs.num_heads, a.KV = attrs.kv_heads();
  a.q_offset = attrs.q_offset, a.k_offset = attrs.k_offset;
  a.scale = attrs.scale, a.dropout_p = attrs.dropout_p, a.dropout_key = attrs.dropout_key;
  a.dropout_grid = attrs.dropout_grid(a.Tq);
  return a;
}

}  // namespace

void CudaBackend::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionAttrs& attrs, const Tensor& out,
                                    const Tensor& lse) {
  KernelScope scope("causal_attention", {&out, &lse, &q, &k, &v});
  AttentionArgs a = attention_args("causal_attention", q, k, v, lse, attrs);
  check_dtypes("causal_attention", q.dtype(), {&out});
  a.out = attention_operand(out);
  launch_attention_forward(a, q.dtype(), scope.stream());
}

// Forward: out_t = sum_s p[t, s] m[t, s] v_s over the keys t sees,
// p = exp(scale q k^T - lse). With dp = m (grad_out_t . v_s) and
// delta_t = grad_out_t . out_t: grad_v_s = sum_t p m grad_out_t,
// ds = p (dp - delta_t), grad_q_t = scale sum_s ds k_s, grad_k_s = scale sum_t ds q_t.
void CudaBackend::attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& out, const Tensor& lse,
                                     const AttentionAttrs& attrs, const Tensor& grad_q,
                                     const Tensor& grad_k, const Tensor& grad_v) {
  KernelScope scope("causal_attention_backward",
                    {&grad_q, &grad_k, &grad_v, &grad_out, &q, &k, &v, &out, &lse});
  AttentionArgs a = attention_args("causal_attention_backward", q, k, v, lse, attrs);
  check_dtypes("causal_attention_backward", q.dtype(),
               {&grad_out, &out, &grad_q, &grad_k, &grad_v});
  Tensor delta = empty(lse.shape(), lse.dtype(), lse.device());
  a.out = attention_operand(out), a.grad_out = attention_operand(grad_out);
  a.grad_q = attention_operand(grad_q), a.grad_k = attention_operand(grad_k);
  a.grad_v = attention_operand(grad_v);
  a.delta = delta.data_ptr();
  launch_attention_backward(a, q.dtype(), scope.stream());
}

// lse' = logaddexp(lse, block_lse), out' = out exp(lse - lse') + block_out
// exp(block_lse - lse') per (b, h, t).
void CudaBackend::attention_merge(const Tensor& out, const Tensor& lse, const Tensor& block_out,
                                  const Tensor& block_lse) {
  KernelScope scope("attention_merge", {&out, &lse, &block_out, &block_lse});
  check_dtypes("attention_merge", out.dtype(), {&block_out});
  const DType stat = out.dtype() == DType::f64 ? DType::f64 : DType::f32;
  check_dtypes("attention_merge", stat, {&lse, &block_lse});
  CHECK(out.is_contiguous() && block_out.is_contiguous() && lse.is_contiguous() &&
        block_lse.is_contiguous())
      << "attention_merge: operands must be contiguous";
  AttentionMergeArgs a;
  a.out = out.data_ptr(), a.block_out = block_out.data_ptr();
  a.lse = lse.data_ptr(), a.block_lse = block_lse.data_ptr();
  a.B = out.size(0), a.Tq = out.size(1), a.NH = lse.size(1), a.HD = out.size(2) / lse.size(1);
  launch_attention_merge(a, out.dtype(), scope.stream());
}

int CudaBackend::device_count() const { return cuda::device_count(); }

namespace {
[[maybe_unused]] const bool g_registered = [] {
  register_backend(kCUDA, new CudaBackend());
  return true;
}();
}  // namespace

}  // namespace trainer::cuda
