// CPU batch norm on oneDNN: training (batch statistics, or given ones from
// cpu::channel_mean_var), inference, backward, and backward through a fused
// relu whose mask is oneDNN's workspace. Other types than f32 run the
// reference kernels.
#include <unordered_map>

#include "core/cpu/bn_stats.h"
#include "core/cpu/cpu_backend.h"
#include "core/cpu/lowp.h"
#include "core/cpu/onednn.h"
#include "core/cpu/primitive_cache.h"
#include "core/ops_conv.h"

namespace trainer {

namespace {

using dnnl::memory;
using namespace cpu;  // bind, run, scratch, image_md, right_padding, the primitive cache

bool fast_dtype(std::initializer_list<const Tensor*> ts) { return all_of_dtype(ts, DType::f32); }

// Batch norm with gamma (scale) and beta (shift).
dnnl::normalization_flags affine() {
  return dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
}

// Training computes the batch statistics, or takes them when given
// (cpu::channel_mean_var computed them: one read of x instead of two).
enum class BnMode { inference, training, training_given_stats };

// relu (training only) fuses it into the normalisation; oneDNN then writes a
// relu mask to a workspace, the record its fused backward masks the gradient by.
dnnl::batch_normalization_forward::primitive_desc bn_forward_pd(const Tensor& x, double eps,
                                                                BnMode mode, bool relu) {
  auto flags =
      mode == BnMode::training ? affine() : affine() | dnnl::normalization_flags::use_global_stats;
  if (relu) flags = flags | dnnl::normalization_flags::fuse_norm_relu;
  auto kind = mode == BnMode::inference ? dnnl::prop_kind::forward_inference
                                        : dnnl::prop_kind::forward_training;
  auto desc =
      DNNL_CHECK(dnnl::batch_normalization_forward::desc(kind, image_md(x), float(eps), flags));
  return DNNL_CHECK(dnnl::batch_normalization_forward::primitive_desc(desc, cpu::dnnl_engine()));
}

using BnForward = Primed<dnnl::batch_normalization_forward>;
using BnBackward = Primed<dnnl::batch_normalization_backward>;

Key bn_key(const char* kind, const Tensor& x, double eps) {
  int64_t eps_bits;
  std::memcpy(&eps_bits, &eps, sizeof eps);
  return make_key(kind).add(x).add({eps_bits});
}

const BnForward& bn_forward(const Tensor& x, double eps, BnMode mode, bool relu) {
  static Cache<BnForward> cache;
  return cache.get(bn_key("bn_fwd", x, eps).add({int64_t(mode), relu}), [&] {
    auto pd = bn_forward_pd(x, eps, mode, relu);
    return BnForward{pd, dnnl::batch_normalization_forward(pd)};
  });
}

// Per-channel [C] operands: gamma, beta, mean, var and their gradients.
memory channel_mem(const Tensor& t) { return bind(vector_md(t.numel()), t); }

// The training forward; returns the relu workspace (u8) when relu is fused.
Tensor bn_train_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                        bool relu, const Tensor& out, const Tensor& mean, const Tensor& var) {
  bool given = is_channels_last(x);
  if (given) cpu::channel_mean_var(x, mean, var);
  const BnForward& e =
      bn_forward(x, eps, given ? BnMode::training_given_stats : BnMode::training, relu);
  std::unordered_map<int, memory> args = {
      {DNNL_ARG_SRC, bind(e.pd.src_desc(), x)}, {DNNL_ARG_DST, bind(e.pd.dst_desc(), out)},
      {DNNL_ARG_SCALE, channel_mem(gamma)},     {DNNL_ARG_SHIFT, channel_mem(beta)},
      {DNNL_ARG_MEAN, channel_mem(mean)},       {DNNL_ARG_VARIANCE, channel_mem(var)}};
  Tensor workspace;
  if (relu) args[DNNL_ARG_WORKSPACE] = scratch(e.pd.workspace_desc(), workspace);
  run(e.prim, args);
  return workspace;
}

// The backward; with a relu workspace, of the relu-fused forward (oneDNN
// masks grad_out by it).
void bn_backward(const Tensor& grad_out, const Tensor& relu_workspace, const Tensor& x,
                 const Tensor& gamma, const Tensor& mean, const Tensor& var, double eps,
                 const Tensor& grad_x, const Tensor& grad_gamma, const Tensor& grad_beta) {
  static Cache<BnBackward> cache;
  bool relu = relu_workspace.defined();
  Key key = bn_key(relu ? "bn_bwd_relu" : "bn_bwd", x, eps).add(grad_out).add(grad_x);
  const BnBackward& e = cache.get(key, [&] {
    auto hint = bn_forward_pd(x, eps, BnMode::training, relu);
    auto flags = relu ? affine() | dnnl::normalization_flags::fuse_norm_relu : affine();
    auto desc = DNNL_CHECK(dnnl::batch_normalization_backward::desc(
        dnnl::prop_kind::backward, image_md(grad_out), image_md(x), float(eps), flags));
    auto pd = DNNL_CHECK(
        dnnl::batch_normalization_backward::primitive_desc(desc, cpu::dnnl_engine(), hint));
    return BnBackward{pd, dnnl::batch_normalization_backward(pd)};
  });
  // oneDNN 2.6 asks for a shift operand whenever use_shift is set, though
  // its backward never reads it: gamma's buffer stands in.
  std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, bind(e.pd.src_desc(), x)},
                                          {DNNL_ARG_DIFF_DST, bind(e.pd.diff_dst_desc(), grad_out)},
                                          {DNNL_ARG_SCALE, channel_mem(gamma)},
                                          {DNNL_ARG_SHIFT, channel_mem(gamma)},
                                          {DNNL_ARG_MEAN, channel_mem(mean)},
                                          {DNNL_ARG_VARIANCE, channel_mem(var)},
                                          {DNNL_ARG_DIFF_SRC, bind(e.pd.diff_src_desc(), grad_x)},
                                          {DNNL_ARG_DIFF_SCALE, channel_mem(grad_gamma)},
                                          {DNNL_ARG_DIFF_SHIFT, channel_mem(grad_beta)}};
  if (relu) args[DNNL_ARG_WORKSPACE] = bind(e.pd.workspace_desc(), relu_workspace);
  run(e.prim, args);
}

}  // namespace

void CpuBackend::batch_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                    double eps, bool fuse_relu, const Tensor& out,
                                    const Tensor& mean, const Tensor& var) {
  if (!fast_dtype({&x, &gamma, &beta, &out, &mean, &var}))
    return RefBackend::batch_norm_forward(x, gamma, beta, eps, fuse_relu, out, mean, var);
  bn_train_forward(x, gamma, beta, eps, fuse_relu, out, mean, var);
}

// The record is oneDNN's relu workspace (u8); the reference forward's is out.
Tensor CpuBackend::batch_norm_relu_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                           double eps, const Tensor& out, const Tensor& mean,
                                           const Tensor& var) {
  if (!fast_dtype({&x, &gamma, &beta, &out, &mean, &var}))
    return RefBackend::batch_norm_relu_forward(x, gamma, beta, eps, out, mean, var);
  return bn_train_forward(x, gamma, beta, eps, true, out, mean, var);
}

void CpuBackend::batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      const Tensor& running_mean, const Tensor& running_var,
                                      double eps, const Tensor& out) {
  if (!fast_dtype({&x, &gamma, &beta, &running_mean, &running_var, &out}))
    return RefBackend::batch_norm_inference(x, gamma, beta, running_mean, running_var, eps, out);
  const BnForward& e = bn_forward(x, eps, BnMode::inference, false);
  run(e.prim, {{DNNL_ARG_SRC, bind(e.pd.src_desc(), x)},
               {DNNL_ARG_DST, bind(e.pd.dst_desc(), out)},
               {DNNL_ARG_SCALE, channel_mem(gamma)},
               {DNNL_ARG_SHIFT, channel_mem(beta)},
               {DNNL_ARG_MEAN, channel_mem(running_mean)},
               {DNNL_ARG_VARIANCE, channel_mem(running_var)}});
}

// Forward: out = (x - mean) / sqrt(var + eps) * gamma + beta with batch statistics.
// Backward: grad_x, grad_gamma, grad_beta as in RefBackend::batch_norm_backward.
void CpuBackend::batch_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& gamma,
                                     const Tensor& mean, const Tensor& var, double eps,
                                     const Tensor& grad_x, const Tensor& grad_gamma,
                                     const Tensor& grad_beta) {
  if (!fast_dtype({&grad_out, &x, &gamma, &mean, &var, &grad_x, &grad_gamma, &grad_beta}))
    return RefBackend::batch_norm_backward(grad_out, x, gamma, mean, var, eps, grad_x, grad_gamma,
                                           grad_beta);
  bn_backward(grad_out, Tensor(), x, gamma, mean, var, eps, grad_x, grad_gamma, grad_beta);
}

// Backward of batch_norm_relu_forward: oneDNN masks by its workspace; a
// record from the reference forward (out itself) takes the reference path.
void CpuBackend::batch_norm_relu_backward(const Tensor& grad_out, const Tensor& record,
                                          const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                          const Tensor& var, double eps, const Tensor& grad_x,
                                          const Tensor& grad_gamma, const Tensor& grad_beta) {
  if (record.dtype() != DType::u8 ||
      !fast_dtype({&grad_out, &x, &gamma, &mean, &var, &grad_x, &grad_gamma, &grad_beta}))
    return RefBackend::batch_norm_relu_backward(grad_out, record, x, gamma, mean, var, eps, grad_x,
                                                grad_gamma, grad_beta);
  bn_backward(grad_out, record, x, gamma, mean, var, eps, grad_x, grad_gamma, grad_beta);
}

}  // namespace trainer
