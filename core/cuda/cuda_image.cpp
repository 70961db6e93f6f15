// CudaBackend's batch norm and pooling. Batch norm: the channel statistics
// are keepdim reductions over (N, H, W) (host_rows.h: reduce_rows, two
// passes for the variance) in acc_t, then one elementwise kernel (norm.cu)
// with the per-channel values broadcast. Pooling: the kernels of pool.cu on
// the operands' own strides; the max-pool argmax record is the reference
// one (i64 y * W + x per output element, shaped like out).
#include "core/cuda/cuda_backend.h"
#include "core/cuda/host_rows.h"
#include "core/cuda/kernel_scope.h"

namespace trainer::cuda {

namespace {

constexpr uint64_t kChannelStats = 0b1101;  // reduce N, H, W; keep C

// A per-channel [C] tensor in acc dtype (a copy unless it already is one).
Tensor channel_acc(Backend& be, const Tensor& p, DType acc) {
  if (p.dtype() == acc && p.is_contiguous()) return p;
  Tensor out = empty(p.shape(), acc, p.device());
  be.copy(p, out);
  return out;
}

// A contiguous [C] (or [1, C, 1, 1]) tensor broadcast over an [N, C, H, W] launch.
Strided per_channel(const Tensor& p) { return strided_as(p, {0, 1, 0, 0}); }

void check_image_dtypes(const char* op, const Tensor& x, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    CHECK(t->dtype() == x.dtype())
        << op << ": operand of dtype " << t->dtype() << ", input " << x.dtype();
}

Image image(const Tensor& t) {
  CHECK_EQ(t.dim(), 4) << "pooling: operand " << t.shape_str() << " is not [N, C, H, W]";
  Image im;
  im.data = static_cast<char*>(t.data_ptr());
  im.n = t.size(0), im.c = t.size(1), im.h = t.size(2), im.w = t.size(3);
  for (int d = 0; d < 4; ++d) im.stride[d] = t.stride(d);
  return im;
}

PoolGeom geom(const Pool2dAttrs& a) {
  return {a.kernel[0],  a.kernel[1],  a.stride[0],        a.stride[1],
          a.padding[0], a.padding[1], a.count_include_pad};
}

// out = (x - mean) / sqrt(var + eps) * gamma + beta (then relu), statistics in acc dtype.
void apply_batch_norm(Backend& be, const Tensor& x, const Tensor& mean, const Tensor& var,
                      const Tensor& gamma, const Tensor& beta, double eps, bool relu,
                      const Tensor& out, cudaStream_t stream) {
  if (x.numel() == 0) return;
  const DType acc = acc_dtype(x.dtype());
  Tensor g = channel_acc(be, gamma, acc), b = channel_acc(be, beta, acc);
  Launch<6> l = plan_launch<6>(x.shape(), {strided(out), strided(x), per_channel(mean),
                                           per_channel(var), per_channel(g), per_channel(b)});
  launch_batch_norm_apply(l, x.dtype(), eps, relu, stream);
}

}  // namespace

void CudaBackend::batch_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                     double eps, bool fuse_relu, const Tensor& out,
                                     const Tensor& mean, const Tensor& var) {
  KernelScope scope("batch_norm", {&out, &x, &gamma, &beta, &mean, &var});
  check_image_dtypes("batch_norm", x, {&gamma, &beta, &out, &mean, &var});
  const int64_t C = x.size(1);
  const double m = double(x.size(0) * x.size(2) * x.size(3));
  const DType acc = acc_dtype(x.dtype());
  Tensor mean_a = empty({1, C, 1, 1}, acc, x.device()),
         var_a = empty({1, C, 1, 1}, acc, x.device());
  reduce_rows(ReduceOp::sum, RowMode::value, x, Tensor(), Tensor(), kChannelStats, mean_a, 1.0 / m,
              scope.stream());
  reduce_rows(ReduceOp::sum, RowMode::sq_dev, x, Tensor(), mean_a, kChannelStats, var_a, 1.0 / m,
              scope.stream());
  apply_batch_norm(*this, x, mean_a, var_a, gamma, beta, eps, fuse_relu, out, scope.stream());
  copy(mean_a.view({C}), mean);
  copy(var_a.view({C}), var);
}

void CudaBackend::batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                       const Tensor& running_mean, const Tensor& running_var,
                                       double eps, const Tensor& out) {
  KernelScope scope("batch_norm_inference", {&out, &x, &gamma, &beta, &running_mean, &running_var});
  check_image_dtypes("batch_norm_inference", x, {&gamma, &beta, &out, &running_mean, &running_var});
  const DType acc = acc_dtype(x.dtype());
  apply_batch_norm(*this, x, channel_acc(*this, running_mean, acc),
                   channel_acc(*this, running_var, acc), gamma, beta, eps, false, out,
                   scope.stream());
}

// Forward: xhat = (x - mean) invstd, out = gamma xhat + beta over m = N H W values per channel.
// Backward: grad_beta = sum g, grad_gamma = sum g xhat = invstd sum g (x - mean),
// grad_x = gamma invstd / m (m g - grad_beta - xhat grad_gamma).
void CudaBackend::batch_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& gamma,
                                      const Tensor& mean, const Tensor& var, double eps,
                                      const Tensor& grad_x, const Tensor& grad_gamma,
                                      const Tensor& grad_beta) {
  KernelScope scope("batch_norm_backward",
                    {&grad_x, &grad_gamma, &grad_beta, &grad_out, &x, &gamma, &mean, &var});
  check_image_dtypes("batch_norm_backward", x,
                     {&grad_out, &gamma, &mean, &var, &grad_x, &grad_gamma, &grad_beta});
  const int64_t C = x.size(1);
  const double m = double(x.size(0) * x.size(2) * x.size(3));
  const DType acc = acc_dtype(x.dtype());
  Tensor mean_a = channel_acc(*this, mean, acc);
  Tensor invstd = empty({C}, acc, x.device());
  binary_scalar(BinaryOp::add, channel_acc(*this, var, acc), eps, false, invstd);
  unary(UnaryOp::rsqrt, invstd, invstd);
  Tensor sum_g = empty({1, C, 1, 1}, acc, x.device());
  Tensor sum_g_dev = empty({1, C, 1, 1}, acc, x.device());
  reduce_rows(ReduceOp::sum, RowMode::value, grad_out, Tensor(), Tensor(), kChannelStats, sum_g,
              1.0, scope.stream());
  reduce_rows(ReduceOp::sum, RowMode::prod_dev, x, grad_out, mean_a, kChannelStats, sum_g_dev, 1.0,
              scope.stream());
  Tensor sum_g_xhat = empty({C}, acc, x.device());
  binary(BinaryOp::mul, sum_g_dev.view({C}), invstd, sum_g_xhat);
  Tensor gamma_a = channel_acc(*this, gamma, acc);
  if (x.numel() > 0) {
    Launch<8> l =
        plan_launch<8>(x.shape(), {strided(grad_x), strided(grad_out), strided(x),
                                   per_channel(mean_a), per_channel(invstd), per_channel(gamma_a),
                                   per_channel(sum_g), per_channel(sum_g_xhat)});
    launch_batch_norm_backward(l, x.dtype(), m, scope.stream());
  }
  copy(sum_g_xhat, grad_gamma);
  copy(sum_g.view({C}), grad_beta);
}

// ---- pooling ----

Tensor CudaBackend::max_pool2d(const Tensor& x, const Pool2dAttrs& a, const Tensor& out) {
  KernelScope scope("max_pool2d", {&out, &x});
  check_image_dtypes("max_pool2d", x, {&out});
  Tensor argmax = empty(out.shape(), DType::i64, out.device());
  launch_max_pool(image(out), image(x), image(argmax), geom(a), x.dtype(), scope.stream());
  return argmax;
}

void CudaBackend::max_pool2d_backward(const Tensor& grad_out, const Tensor& argmax,
                                      const Pool2dAttrs& a, const Tensor& grad_x) {
  KernelScope scope("max_pool2d_backward", {&grad_x, &grad_out, &argmax});
  check_image_dtypes("max_pool2d_backward", grad_x, {&grad_out});
  CHECK(argmax.dtype() == DType::i64 && argmax.shape() == grad_out.shape())
      << "max_pool2d_backward: argmax record " << argmax.shape_str() << " of " << argmax.dtype()
      << " is not the CUDA forward's";
  launch_max_pool_backward(image(grad_x), image(grad_out), image(argmax), geom(a), grad_x.dtype(),
                           scope.stream());
}

void CudaBackend::avg_pool2d(const Tensor& x, const Pool2dAttrs& a, const Tensor& out) {
  KernelScope scope("avg_pool2d", {&out, &x});
  check_image_dtypes("avg_pool2d", x, {&out});
  launch_avg_pool(image(out), image(x), geom(a), x.dtype(), scope.stream());
}

void CudaBackend::avg_pool2d_backward(const Tensor& grad_out, const Pool2dAttrs& a,
                                      const Tensor& grad_x) {
  KernelScope scope("avg_pool2d_backward", {&grad_x, &grad_out});
  check_image_dtypes("avg_pool2d_backward", grad_x, {&grad_out});
  launch_avg_pool_backward(image(grad_x), image(grad_out), geom(a), grad_x.dtype(), scope.stream());
}

void CudaBackend::adaptive_avg_pool2d(const Tensor& x, const Tensor& out) {
  KernelScope scope("adaptive_avg_pool2d", {&out, &x});
  check_image_dtypes("adaptive_avg_pool2d", x, {&out});
  launch_adaptive_avg_pool(image(out), image(x), x.dtype(), scope.stream());
}

void CudaBackend::adaptive_avg_pool2d_backward(const Tensor& grad_out, const Tensor& grad_x) {
  KernelScope scope("adaptive_avg_pool2d_backward", {&grad_x, &grad_out});
  check_image_dtypes("adaptive_avg_pool2d_backward", grad_x, {&grad_out});
  launch_adaptive_avg_pool_backward(image(grad_x), image(grad_out), grad_x.dtype(), scope.stream());
}

}  // namespace trainer::cuda
