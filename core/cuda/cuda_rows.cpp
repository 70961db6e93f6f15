// CudaBackend's reductions, softmax, cross-entropy, indexing, layer norm and
// RMS norm:
// validate, describe the operands as row or elementwise launches
// (host_rows.h) and enqueue the kernels of reduce.cu, nn.cu, index.cu and
// norm.cu on the current stream.
#include <cmath>
#include <limits>

#include "core/cuda/cuda_backend.h"
#include "core/cuda/host_rows.h"
#include "core/cuda/kernel_scope.h"

namespace trainer::cuda {

namespace {

// Rows above this many elements are split across blocks when there are few of them.
constexpr int64_t kSplitGrain = 4096;
constexpr int64_t kMaxSplits = 1024;
// Fewer rows than this do not fill the GPU with one block each.
constexpr int64_t kFewRows = 256;
// Blocks the column kernel aims for (enough to fill any current GPU).
constexpr int64_t kTargetBlocks = 1024;

void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  CHECK(a.dtype() == b.dtype()) << op << ": operands of dtypes " << a.dtype() << " and "
                                << b.dtype();
}

int64_t reduced_count(const Tensor& x, uint64_t mask) {
  int64_t n = 1;
  for (int d = 0; d < x.dim(); ++d)
    if ((mask >> d) & 1) n *= x.size(d);
  return n;
}

}  // namespace

void reduce_rows(ReduceOp op, RowMode mode, const Tensor& x, const Tensor& y, const Tensor& center,
                 uint64_t mask, const Tensor& out, double scale, cudaStream_t stream) {
  const Tensor& yy = y.defined() ? y : x;
  CHECK(out.is_contiguous()) << "reduce: output must be contiguous";
  Rows<3> r = rows_of<3>(x.shape(), mask, {strided_per_row(out, mask), strided(x), strided(yy)});
  ReduceArgs a;
  a.op = op;
  a.mode = mode;
  a.center = center.defined() ? center.data_ptr() : nullptr;
  a.scale = scale;
  const int64_t rows = r.outer.numel, count = r.inner.numel;
  const DType acc = acc_dtype(x.dtype());
  // Stage 2 of the split paths: combine each row's partials (sums add,
  // extrema combine) and scale; partial is [parts, rows] or [rows, parts].
  auto finish = [&](const Tensor& partial, bool parts_first) {
    ReduceArgs b;
    b.op = op;
    b.scale = scale;
    Strided out_rows{static_cast<char*>(out.data_ptr()), parts_first ? Shape{0, 1} : Shape{1, 0}};
    launch_reduce(rows_of<3>(partial.shape(), parts_first ? 1 : 2,
                             {out_rows, strided(partial), strided(partial)}),
                  acc, out.dtype(), b, stream);
  };
  // Rows adjacent in memory (a channels-last batch-norm statistic, a bias
  // gradient): the coalesced column kernel, then the finish.
  const bool adjacent =
      r.outer.ndim == 1 && r.outer.strides[1][0] == 1 && r.outer.strides[2][0] == 1;
  if (adjacent && rows >= 32 && count > 1) {
    const int64_t tiles = (rows + 31) / 32;
    a.splits = std::clamp<int64_t>(
        std::min((count + 127) / 128, (kTargetBlocks + tiles - 1) / tiles), 1, 65535);
    Tensor partial = empty({a.splits, rows}, acc, out.device());
    launch_column_reduce(r, x.dtype(), a, partial.data_ptr(), stream);
    finish(partial, true);
    return;
  }
  if (rows >= kFewRows || count <= 2 * kSplitGrain) {
    launch_reduce(r, x.dtype(), out.dtype(), a, stream);
    return;
  }
  // Few long rows: block (row, part) reduces one part of a row into
  // partial [rows, parts] (the kernel addresses operand 0 as a contiguous row
  // array), then the finish.
  a.splits = std::min(kMaxSplits, (count + kSplitGrain - 1) / kSplitGrain);
  Tensor partial = empty({rows, a.splits}, acc, out.device());
  Strided slots{static_cast<char*>(partial.data_ptr()), contiguous_strides(out.shape())};
  for (size_t d = 0; d < slots.strides.size(); ++d)
    if ((mask >> d) & 1) slots.strides[d] = 0;
  launch_reduce(rows_of<3>(x.shape(), mask, {slots, strided(x), strided(yy)}), x.dtype(), acc, a,
                stream);
  finish(partial, false);
}

void CudaBackend::reduce(ReduceOp op, const Tensor& x, uint64_t mask, const Tensor& out) {
  KernelScope scope("reduce", {&out, &x});
  check_same_dtype("reduce", x, out);
  if (op == ReduceOp::mean)
    return reduce_rows(ReduceOp::sum, RowMode::value, x, Tensor(), Tensor(), mask, out,
                       1.0 / double(reduced_count(x, mask)), scope.stream());
  reduce_rows(op, RowMode::value, x, Tensor(), Tensor(), mask, out, 1.0, scope.stream());
}

// Two passes: the mean of each row, then the sum of squared deviations from it.
void CudaBackend::var(const Tensor& x, uint64_t mask, int64_t correction, const Tensor& out) {
  KernelScope scope("var", {&out, &x});
  check_same_dtype("var", x, out);
  const double n = double(reduced_count(x, mask));
  Tensor mean = empty(out.shape(), acc_dtype(x.dtype()), out.device());
  reduce_rows(ReduceOp::sum, RowMode::value, x, Tensor(), Tensor(), mask, mean, 1.0 / n,
              scope.stream());
  const double denom = std::max(n - double(correction), 0.0);
  const double scale = denom > 0 ? 1.0 / denom : std::numeric_limits<double>::quiet_NaN();
  reduce_rows(ReduceOp::sum, RowMode::sq_dev, x, Tensor(), mean, mask, out, scale, scope.stream());
}

void CudaBackend::max_dim(const Tensor& x, int dim, const Tensor& values, const Tensor& indices) {
  KernelScope scope("max_dim", {&values, &indices, &x});
  check_same_dtype("max_dim", x, values);
  CHECK(indices.dtype() == DType::i64) << "max_dim: indices of dtype " << indices.dtype();
  const uint64_t mask = uint64_t(1) << dim;
  Rows<3> r = rows_of<3>(
      x.shape(), mask, {strided_per_row(values, mask), strided_per_row(indices, mask), strided(x)});
  launch_max_dim(r, x.dtype(), scope.stream());
}

void CudaBackend::softmax(const Tensor& x, int dim, bool log, const Tensor& out) {
  KernelScope scope("softmax", {&out, &x});
  check_same_dtype("softmax", x, out);
  launch_softmax(rows_of<2>(x.shape(), uint64_t(1) << dim, {strided(out), strided(x)}), x.dtype(),
                 log, scope.stream());
}

void CudaBackend::softmax_backward(const Tensor& grad, const Tensor& y, int dim, bool log,
                                   const Tensor& grad_x) {
  KernelScope scope("softmax_backward", {&grad_x, &grad, &y});
  check_same_dtype("softmax_backward", grad, y);
  check_same_dtype("softmax_backward", grad_x, y);
  Rows<3> r =
      rows_of<3>(y.shape(), uint64_t(1) << dim, {strided(grad_x), strided(grad), strided(y)});
  launch_softmax_backward(r, y.dtype(), log, scope.stream());
}

// logp = log_softmax(logits); loss[n] = -sum_c q_c logp[n, c] per row.
void CudaBackend::cross_entropy(const Tensor& logits, const Tensor& target, double eps,
                                int64_t ignore_index, const Tensor& loss, const Tensor& logp) {
  KernelScope scope("cross_entropy", {&loss, &logp, &logits, &target});
  CHECK(target.dtype() == DType::i64) << "cross_entropy: target of dtype " << target.dtype();
  softmax(logits, 1, /*log=*/true, logp);
  const int64_t C = logp.size(1);
  Rows<3> r = rows_of<3>(logp.shape(), 2,
                         {strided_as(loss, {loss.stride(0), 0}), strided(logp),
                          strided_as(target, {target.stride(0), 0})});
  launch_cross_entropy(r, logp.dtype(), eps, ignore_index, C, scope.stream());
}

void CudaBackend::cross_entropy_backward(const Tensor& grad_loss, const Tensor& logp,
                                         const Tensor& target, double eps, int64_t ignore_index,
                                         const Tensor& grad_logits) {
  KernelScope scope("cross_entropy_backward", {&grad_logits, &grad_loss, &logp, &target});
  check_same_dtype("cross_entropy_backward", grad_loss, logp);
  CHECK(target.dtype() == DType::i64) << "cross_entropy: target of dtype " << target.dtype();
  if (grad_logits.numel() == 0) return;
  Launch<4> g = plan_launch<4>(logp.shape(), {strided(grad_logits), strided(logp),
                                              strided_as(grad_loss, {grad_loss.stride(0), 0}),
                                              strided_as(target, {target.stride(0), 0})});
  launch_cross_entropy_backward(g, logp.dtype(), eps, ignore_index, logp.size(1), scope.stream());
}

// ---- indexing ----

namespace {

// index (1-d) broadcast over a tensor of rank `rank` along dim.
Strided index_along(const Tensor& index, int rank, int dim) {
  Shape strides(size_t(rank), 0);
  strides[size_t(dim)] = index.stride(0);
  return strided_as(index, strides);
}

}  // namespace

// out[..., j, ...] = x[..., index[j], ...]
void CudaBackend::index_select(const Tensor& x, int dim, const Tensor& index, const Tensor& out) {
  KernelScope scope("index_select", {&out, &x, &index});
  check_same_dtype("index_select", x, out);
  if (out.numel() == 0) return;
  Launch<3> g = plan_launch<3>(
      out.shape(), {strided(out), strided_without(x, dim), index_along(index, out.dim(), dim)});
  launch_gather(g, x.dtype(), index.dtype(), x.stride(dim), x.size(dim), scope.stream());
}

// dst[..., index[j], ...] += src[..., j, ...]
void CudaBackend::index_add(const Tensor& dst, int dim, const Tensor& index, const Tensor& src) {
  KernelScope scope("index_add", {&dst, &index, &src});
  check_same_dtype("index_add", dst, src);
  if (src.numel() == 0) return;
  Launch<3> g = plan_launch<3>(
      src.shape(), {strided(src), strided_without(dst, dim), index_along(index, src.dim(), dim)});
  launch_scatter_add(g, dst.dtype(), index.dtype(), dst.stride(dim), dst.size(dim), scope.stream());
}

// out[i] = x[i with i[dim] = index[i]]
void CudaBackend::gather(const Tensor& x, int dim, const Tensor& index, const Tensor& out) {
  KernelScope scope("gather", {&out, &x, &index});
  check_same_dtype("gather", x, out);
  if (out.numel() == 0) return;
  Launch<3> g =
      plan_launch<3>(out.shape(), {strided(out), strided_without(x, dim), strided(index)});
  launch_gather(g, x.dtype(), index.dtype(), x.stride(dim), x.size(dim), scope.stream());
}

// dst[i with i[dim] = index[i]] += src[i]
void CudaBackend::scatter_add(const Tensor& dst, int dim, const Tensor& index, const Tensor& src) {
  KernelScope scope("scatter_add", {&dst, &index, &src});
  check_same_dtype("scatter_add", dst, src);
  if (index.numel() == 0) return;
  Launch<3> g = plan_launch<3>(
      index.shape(), {strided_as(src, src.strides()), strided_without(dst, dim), strided(index)});
  launch_scatter_add(g, dst.dtype(), index.dtype(), dst.stride(dim), dst.size(dim), scope.stream());
}

void CudaBackend::concat(const TensorList& inputs, int dim, const Tensor& out) {
  int64_t base = 0;
  for (const Tensor& in : inputs) {
    const int64_t n = in.size(dim);
    if (n > 0) copy(in, out.narrow(dim, base, n));
    base += n;
  }
}

// ---- layer norm ----

void CudaBackend::layer_norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                     double eps, const Tensor& out, const Tensor& mean,
                                     const Tensor& rstd) {
  KernelScope scope("layer_norm", {&out, &x, &weight, &bias, &mean, &rstd});
  for (const Tensor* t : {&x, &weight, &bias, &out, &mean, &rstd})
    CHECK(t->is_contiguous()) << "layer_norm: operands must be contiguous";
  check_same_dtype("layer_norm", x, weight);
  check_same_dtype("layer_norm", x, bias);
  CHECK(mean.dtype() == acc_dtype(x.dtype()) && rstd.dtype() == mean.dtype())
      << "layer_norm: statistics of dtype " << mean.dtype();
  LayerNormPtrs p{};
  p.x = x.data_ptr(), p.weight = weight.data_ptr(), p.bias = bias.data_ptr();
  p.out = out.data_ptr(), p.mean_out = mean.data_ptr(), p.rstd_out = rstd.data_ptr();
  launch_layer_norm_forward(p, x.size(0), x.size(1), eps, x.dtype(), scope.stream());
}

// grad_x per row; grad_weight = sum_R g xhat and grad_bias = sum_R g as
// per-part column sums (norm.cu), then a reduction over the parts.
void CudaBackend::layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                      const Tensor& mean, const Tensor& rstd, const Tensor& grad_x,
                                      const Tensor& grad_weight, const Tensor& grad_bias) {
  KernelScope scope("layer_norm_backward",
                    {&grad_x, &grad_weight, &grad_bias, &grad_out, &x, &weight, &mean, &rstd});
  for (const Tensor* t : {&grad_out, &x, &weight, &mean, &rstd, &grad_x, &grad_weight, &grad_bias})
    CHECK(t->is_contiguous()) << "layer_norm_backward: operands must be contiguous";
  check_same_dtype("layer_norm_backward", x, grad_out);
  const int64_t R = x.size(0), D = x.size(1);
  const int64_t splits = std::clamp<int64_t>((R + 127) / 128, 1, kMaxSplits);
  const DType acc = acc_dtype(x.dtype());
  Tensor pw = empty({splits, D}, acc, x.device()), pb = empty({splits, D}, acc, x.device());
  LayerNormPtrs p{};
  p.x = x.data_ptr(), p.weight = weight.data_ptr(), p.grad_out = grad_out.data_ptr();
  p.mean = mean.data_ptr(), p.rstd = rstd.data_ptr(), p.grad_x = grad_x.data_ptr();
  p.partial_weight = pw.data_ptr(), p.partial_bias = pb.data_ptr();
  launch_layer_norm_backward(p, R, D, splits, x.dtype(), scope.stream());
  reduce_rows(ReduceOp::sum, RowMode::value, pw, Tensor(), Tensor(), 1, grad_weight.view({1, D}),
              1.0, scope.stream());
  reduce_rows(ReduceOp::sum, RowMode::value, pb, Tensor(), Tensor(), 1, grad_bias.view({1, D}), 1.0,
              scope.stream());
}

// ---- RMS norm ----

void CudaBackend::rms_norm_forward(const Tensor& x, const Tensor& weight, double eps,
                                   const Tensor& out, const Tensor& rstd) {
  KernelScope scope("rms_norm", {&out, &x, &weight, &rstd});
  for (const Tensor* t : {&x, &weight, &out, &rstd})
    CHECK(t->is_contiguous()) << "rms_norm: operands must be contiguous";
  check_same_dtype("rms_norm", x, weight);
  CHECK(rstd.dtype() == acc_dtype(x.dtype())) << "rms_norm: statistic of dtype " << rstd.dtype();
  RmsNormPtrs p{};
  p.x = x.data_ptr(), p.weight = weight.data_ptr();
  p.out = out.data_ptr(), p.rstd_out = rstd.data_ptr();
  launch_rms_norm_forward(p, x.size(0), x.size(1), eps, x.dtype(), scope.stream());
}

// grad_x per row; grad_weight = sum_R g xhat as per-part column sums
// (norm.cu), then a reduction over the parts.
void CudaBackend::rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                    const Tensor& rstd, const Tensor& grad_x,
                                    const Tensor& grad_weight) {
  KernelScope scope("rms_norm_backward", {&grad_x, &grad_weight, &grad_out, &x, &weight, &rstd});
  for (const Tensor* t : {&grad_out, &x, &weight, &rstd, &grad_x, &grad_weight})
    CHECK(t->is_contiguous()) << "rms_norm_backward: operands must be contiguous";
  check_same_dtype("rms_norm_backward", x, grad_out);
  check_same_dtype("rms_norm_backward", x, weight);
  const int64_t R = x.size(0), D = x.size(1);
  const int64_t splits = std::clamp<int64_t>((R + 127) / 128, 1, kMaxSplits);
  Tensor pw = empty({splits, D}, acc_dtype(x.dtype()), x.device());
  RmsNormPtrs p{};
  p.x = x.data_ptr(), p.weight = weight.data_ptr(), p.grad_out = grad_out.data_ptr();
  p.rstd = rstd.data_ptr(), p.grad_x = grad_x.data_ptr(), p.partial_weight = pw.data_ptr();
  launch_rms_norm_backward(p, R, D, splits, x.dtype(), scope.stream());
  reduce_rows(ReduceOp::sum, RowMode::value, pw, Tensor(), Tensor(), 1, grad_weight.view({1, D}),
              1.0, scope.stream());
}

}  // namespace trainer::cuda
