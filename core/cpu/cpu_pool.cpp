// CPU max and average pooling on oneDNN (images channels-last, as
// core/cpu/cpu_conv.cpp describes them). Max pooling's argmax record is
// oneDNN's workspace. Other types than f32, and adaptive pooling whose
// windows do not tile the input (the op sends tiling ones to avg_pool2d),
// run the reference kernels.
#include <unordered_map>

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

dnnl::algorithm pool_algorithm(bool max, const Pool2dAttrs& a) {
  if (max) return dnnl::algorithm::pooling_max;
  return a.count_include_pad ? dnnl::algorithm::pooling_avg_include_padding
                             : dnnl::algorithm::pooling_avg_exclude_padding;
}

dnnl::pooling_forward::primitive_desc pool_forward_pd(bool max, const Tensor& x, const Tensor& out,
                                                      const Pool2dAttrs& a) {
  memory::dims pad_r = right_padding(x.size(2), x.size(3), out.size(2), out.size(3), a.kernel[0],
                                     a.kernel[1], a.stride, a.padding, {1, 1});
  auto desc = DNNL_CHECK(dnnl::pooling_forward::desc(
      dnnl::prop_kind::forward_training, pool_algorithm(max, a), image_md(x), image_md(out),
      {a.stride[0], a.stride[1]}, {a.kernel[0], a.kernel[1]}, {a.padding[0], a.padding[1]}, pad_r));
  return DNNL_CHECK(dnnl::pooling_forward::primitive_desc(desc, cpu::dnnl_engine()));
}

using PoolForward = Primed<dnnl::pooling_forward>;
using PoolBackward = Primed<dnnl::pooling_backward>;

const PoolForward& pool_forward(bool max, const Tensor& x, const Tensor& out,
                                const Pool2dAttrs& a) {
  static Cache<PoolForward> cache;
  Key key = make_key("pool_fwd").add({max}).add(x).add(out).add(a);
  return cache.get(key, [&] {
    auto pd = pool_forward_pd(max, x, out, a);
    return PoolForward{pd, dnnl::pooling_forward(pd)};
  });
}

const PoolBackward& pool_backward(bool max, const Tensor& grad_out, const Tensor& grad_x,
                                  const Pool2dAttrs& a) {
  static Cache<PoolBackward> cache;
  Key key = make_key("pool_bwd").add({max}).add(grad_out).add(grad_x).add(a);
  return cache.get(key, [&] {
    auto hint = pool_forward_pd(max, grad_x, grad_out, a);
    memory::dims pad_r =
        right_padding(grad_x.size(2), grad_x.size(3), grad_out.size(2), grad_out.size(3),
                      a.kernel[0], a.kernel[1], a.stride, a.padding, {1, 1});
    auto desc = DNNL_CHECK(dnnl::pooling_backward::desc(
        pool_algorithm(max, a), image_md(grad_x), image_md(grad_out), {a.stride[0], a.stride[1]},
        {a.kernel[0], a.kernel[1]}, {a.padding[0], a.padding[1]}, pad_r));
    auto pd = DNNL_CHECK(dnnl::pooling_backward::primitive_desc(desc, cpu::dnnl_engine(), hint));
    return PoolBackward{pd, dnnl::pooling_backward(pd)};
  });
}

}  // namespace

Tensor CpuBackend::max_pool2d(const Tensor& x, const Pool2dAttrs& a, const Tensor& out) {
  if (!fast_dtype({&x, &out})) return RefBackend::max_pool2d(x, a, out);
  const PoolForward& e = pool_forward(true, x, out, a);
  Tensor workspace;
  memory ws = scratch(e.pd.workspace_desc(), workspace);
  run(e.prim, {{DNNL_ARG_SRC, bind(e.pd.src_desc(), x)},
               {DNNL_ARG_DST, bind(e.pd.dst_desc(), out)},
               {DNNL_ARG_WORKSPACE, ws}});
  return workspace;
}

// Forward: out = x[argmax of the window]. Backward: grad_x[argmax] += grad_out.
void CpuBackend::max_pool2d_backward(const Tensor& grad_out, const Tensor& argmax,
                                     const Pool2dAttrs& a, const Tensor& grad_x) {
  if (argmax.dtype() == DType::i64)  // the reference forward ran (non-f32 types)
    return RefBackend::max_pool2d_backward(grad_out, argmax, a, grad_x);
  const PoolBackward& e = pool_backward(true, grad_out, grad_x, a);
  run(e.prim, {{DNNL_ARG_DIFF_DST, bind(e.pd.diff_dst_desc(), grad_out)},
               {DNNL_ARG_WORKSPACE, bind(e.pd.workspace_desc(), argmax)},
               {DNNL_ARG_DIFF_SRC, bind(e.pd.diff_src_desc(), grad_x)}});
}

void CpuBackend::avg_pool2d(const Tensor& x, const Pool2dAttrs& a, const Tensor& out) {
  if (!fast_dtype({&x, &out})) return RefBackend::avg_pool2d(x, a, out);
  const PoolForward& e = pool_forward(false, x, out, a);
  run(e.prim,
      {{DNNL_ARG_SRC, bind(e.pd.src_desc(), x)}, {DNNL_ARG_DST, bind(e.pd.dst_desc(), out)}});
}

// Forward: out = window sum / divisor. Backward: window inputs += grad_out / divisor.
void CpuBackend::avg_pool2d_backward(const Tensor& grad_out, const Pool2dAttrs& a,
                                     const Tensor& grad_x) {
  if (!fast_dtype({&grad_out, &grad_x}))
    return RefBackend::avg_pool2d_backward(grad_out, a, grad_x);
  const PoolBackward& e = pool_backward(false, grad_out, grad_x, a);
  run(e.prim, {{DNNL_ARG_DIFF_DST, bind(e.pd.diff_dst_desc(), grad_out)},
               {DNNL_ARG_DIFF_SRC, bind(e.pd.diff_src_desc(), grad_x)}});
}

}  // namespace trainer
