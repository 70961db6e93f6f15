// CUDA convolution on cuDNN's convolution API (cudnn_cnn.h): forward,
// backward data and backward filter, on channels-last images (the layout
// the ops pass, and the one cuDNN's tensor-core kernels want) with the
// filter in the matching KRSC layout (a copy of the [O, I/groups, kH, kW]
// weight). f64 runs in NCHW (copies), where cuDNN's double kernels live.
//
// Algorithms: cudnnFind*AlgorithmEx benchmarks every algorithm once per
// (device, direction, dtype, shapes, strides, attrs) on the call's own
// buffers, with a workspace from the caching allocator; the fastest that
// succeeded is cached with its math type and workspace size. f32 may use
// TF32 tensor cores (cuDNN's default math), as the cuBLASLt matmul does.
// Bias and the fused relu run as elementwise kernels after the convolution;
// grad_bias is a channel reduction (host_rows.h).
//
// One cuDNN handle per device; its stream is set per call under a mutex
// held for the call (Find is synchronous; the rest only enqueues).
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "core/cuda/cuda_backend.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/host_rows.h"
#include "core/cuda/kernel_scope.h"
#include "core/ops_conv.h"

namespace trainer::cuda {

namespace {

// The largest workspace an algorithm search may use.
constexpr size_t kMaxWorkspace = size_t(256) << 20;

enum class Direction { forward, backward_data, backward_filter };

struct Choice {
  int algo = 0;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  size_t workspace = 0;
};

struct CudnnState {
  std::mutex mu;
  std::map<int, cudnnHandle_t> handles;
  std::map<std::vector<int64_t>, Choice> choices;
};

CudnnState& state() {
  static CudnnState* s = new CudnnState();  // leaked: used until exit
  return *s;
}

cudnnDataType_t cudnn_type(DType t) {
  switch (t) {
    case DType::f32:
      return CUDNN_DATA_FLOAT;
    case DType::f64:
      return CUDNN_DATA_DOUBLE;
    case DType::bf16:
      return CUDNN_DATA_BFLOAT16;
    case DType::f16:
      return CUDNN_DATA_HALF;
    default:
      throw Error(cat("conv2d: cuDNN does not take ", t));
  }
}

int as_int(int64_t v) {
  CHECK(v >= 0 && v <= INT32_MAX) << "conv2d: size or stride " << v << " exceeds cuDNN's int";
  return int(v);
}

struct TensorDesc {
  cudnnTensorDescriptor_t d = nullptr;
  explicit TensorDesc(const Tensor& t) {
    CUDNN_CHECK(cudnnCreateTensorDescriptor(&d));
    CUDNN_CHECK(cudnnSetTensor4dDescriptorEx(
        d, cudnn_type(t.dtype()), as_int(t.size(0)), as_int(t.size(1)), as_int(t.size(2)),
        as_int(t.size(3)), as_int(t.stride(0)), as_int(t.stride(1)), as_int(t.stride(2)),
        as_int(t.stride(3))));
  }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(d); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
};

// The filter [O, I/groups, kH, kW] in KRSC (nhwc) or KCRS memory.
struct FilterDesc {
  cudnnFilterDescriptor_t d = nullptr;
  FilterDesc(const Tensor& w, bool nhwc) {
    CUDNN_CHECK(cudnnCreateFilterDescriptor(&d));
    CUDNN_CHECK(cudnnSetFilter4dDescriptor(
        d, cudnn_type(w.dtype()), nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW, as_int(w.size(0)),
        as_int(w.size(1)), as_int(w.size(2)), as_int(w.size(3))));
  }
  ~FilterDesc() { cudnnDestroyFilterDescriptor(d); }
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
};

struct ConvDesc {
  cudnnConvolutionDescriptor_t d = nullptr;
  ConvDesc(const Conv2dAttrs& a, DType t) {
    CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&d));
    CUDNN_CHECK(cudnnSetConvolution2dDescriptor(
        d, as_int(a.padding[0]), as_int(a.padding[1]), as_int(a.stride[0]), as_int(a.stride[1]),
        as_int(a.dilation[0]), as_int(a.dilation[1]), CUDNN_CROSS_CORRELATION,
        t == DType::f64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT));
    CUDNN_CHECK(cudnnSetConvolutionGroupCount(d, as_int(a.groups)));
    CUDNN_CHECK(cudnnSetConvolutionMathType(
        d, t == DType::bf16 || t == DType::f16 ? CUDNN_TENSOR_OP_MATH : CUDNN_DEFAULT_MATH));
  }
  ~ConvDesc() { cudnnDestroyConvolutionDescriptor(d); }
  ConvDesc(const ConvDesc&) = delete;
  ConvDesc& operator=(const ConvDesc&) = delete;
};

// The three operands of one convolution in the layout cuDNN runs on:
// x [N, C, H, W], w [O, I/groups, kH, kW] and y [N, O, OH, OW].
struct Problem {
  Direction dir;
  Tensor x, w, y;
  bool nhwc;
  Conv2dAttrs attrs;
};

std::vector<int64_t> problem_key(const Problem& p, int device) {
  std::vector<int64_t> k = {device, int64_t(p.dir), int64_t(p.x.dtype()), p.nhwc};
  for (const Tensor* t : {&p.x, &p.w, &p.y}) {
    k.insert(k.end(), t->shape().begin(), t->shape().end());
    k.insert(k.end(), t->strides().begin(), t->strides().end());
  }
  const Conv2dAttrs& a = p.attrs;
  k.insert(k.end(), {a.stride[0], a.stride[1], a.padding[0], a.padding[1], a.dilation[0],
                     a.dilation[1], a.groups});
  return k;
}

void* data(const Tensor& t) { return t.data_ptr(); }

// A workspace of `bytes` from the caching allocator (undefined when 0).
Tensor workspace(size_t bytes, Device device) {
  return bytes == 0 ? Tensor() : empty({int64_t(bytes)}, DType::u8, device);
}

// Benchmarks the algorithms of p's direction (writing p's output) and
// returns the fastest that ran.
template <class Perf>
Choice pick(const Perf* perfs, int returned, const char* what) {
  for (int i = 0; i < returned; ++i)
    if (perfs[i].status == CUDNN_STATUS_SUCCESS)
      return {int(perfs[i].algo), perfs[i].mathType, perfs[i].memory};
  throw Error(cat("conv2d ", what, ": cuDNN found no algorithm for this convolution"));
}

Choice find(cudnnHandle_t h, const Problem& p, const TensorDesc& xd, const FilterDesc& wd,
            const ConvDesc& cd, const TensorDesc& yd) {
  size_t free_bytes = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  const size_t limit = std::min(kMaxWorkspace, free_bytes / 2);
  Tensor ws = workspace(limit, p.x.device());
  void* wsp = ws.defined() ? ws.data_ptr() : nullptr;
  int returned = 0;
  switch (p.dir) {
    case Direction::forward: {
      cudnnConvolutionFwdAlgoPerf_t perfs[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
      CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(
          h, xd.d, data(p.x), wd.d, data(p.w), cd.d, yd.d, data(p.y),
          CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &returned, perfs, wsp, limit));
      return pick(perfs, returned, "forward");
    }
    case Direction::backward_data: {
      cudnnConvolutionBwdDataAlgoPerf_t perfs[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
      CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(
          h, wd.d, data(p.w), yd.d, data(p.y), cd.d, xd.d, data(p.x),
          CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &returned, perfs, wsp, limit));
      return pick(perfs, returned, "backward data");
    }
    case Direction::backward_filter: {
      cudnnConvolutionBwdFilterAlgoPerf_t perfs[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
      CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(
          h, xd.d, data(p.x), yd.d, data(p.y), cd.d, wd.d, data(p.w),
          CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &returned, perfs, wsp, limit));
      return pick(perfs, returned, "backward filter");
    }
  }
  throw Error("conv2d: unknown direction");
}

// Runs p's direction: forward writes y, backward_data x, backward_filter w.
void run(const Problem& p, cudaStream_t stream) {
  const int device = p.x.device().index;
  TensorDesc xd(p.x), yd(p.y);
  FilterDesc wd(p.w, p.nhwc);
  ConvDesc cd(p.attrs, p.x.dtype());
  CudnnState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto hit = s.handles.find(device);
  if (hit == s.handles.end()) {
    cudnnHandle_t h;
    CUDNN_CHECK(cudnnCreate(&h));
    hit = s.handles.emplace(device, h).first;
  }
  cudnnHandle_t h = hit->second;
  CUDNN_CHECK(cudnnSetStream(h, stream));
  std::vector<int64_t> key = problem_key(p, device);
  auto it = s.choices.find(key);
  if (it == s.choices.end()) it = s.choices.emplace(key, find(h, p, xd, wd, cd, yd)).first;
  const Choice c = it->second;
  CUDNN_CHECK(cudnnSetConvolutionMathType(cd.d, c.math));
  Tensor ws = workspace(c.workspace, p.x.device());
  void* wsp = ws.defined() ? ws.data_ptr() : nullptr;
  const float one_f = 1.0f, zero_f = 0.0f;
  const double one_d = 1.0, zero_d = 0.0;
  const bool f64 = p.x.dtype() == DType::f64;
  const void* one = f64 ? static_cast<const void*>(&one_d) : &one_f;
  const void* zero = f64 ? static_cast<const void*>(&zero_d) : &zero_f;
  switch (p.dir) {
    case Direction::forward:
      CUDNN_CHECK(cudnnConvolutionForward(h, one, xd.d, data(p.x), wd.d, data(p.w), cd.d,
                                          cudnnConvolutionFwdAlgo_t(c.algo), wsp, c.workspace, zero,
                                          yd.d, data(p.y)));
      break;
    case Direction::backward_data:
      CUDNN_CHECK(cudnnConvolutionBackwardData(h, one, wd.d, data(p.w), yd.d, data(p.y), cd.d,
                                               cudnnConvolutionBwdDataAlgo_t(c.algo), wsp,
                                               c.workspace, zero, xd.d, data(p.x)));
      break;
    case Direction::backward_filter:
      CUDNN_CHECK(cudnnConvolutionBackwardFilter(h, one, xd.d, data(p.x), yd.d, data(p.y), cd.d,
                                                 cudnnConvolutionBwdFilterAlgo_t(c.algo), wsp,
                                                 c.workspace, zero, wd.d, data(p.w)));
      break;
  }
}

// Images run channels-last, except f64 (NCHW).
bool use_nhwc(DType t) { return t != DType::f64; }

bool has_layout(const Tensor& t, bool nhwc) {
  return nhwc ? is_channels_last(t) && t.stride(1) == 1 : t.is_contiguous();
}

Tensor empty_image(const Shape& shape, DType t, Device device, bool nhwc) {
  return nhwc ? empty_channels_last(shape, t, device) : empty(shape, t, device);
}

// t in the layout cuDNN runs on (itself when it already is).
Tensor image_operand(Backend& be, const Tensor& t, bool nhwc) {
  if (has_layout(t, nhwc)) return t;
  Tensor out = empty_image(t.shape(), t.dtype(), t.device(), nhwc);
  be.copy(t, out);
  return out;
}

// An uninitialised weight [O, I/groups, kH, kW] whose memory is KRSC (nhwc) or KCRS.
Tensor empty_filter(const Shape& s, DType t, Device device, bool nhwc) {
  if (!nhwc) return empty(s, t, device);
  Tensor krsc = empty({s[0], s[2], s[3], s[1]}, t, device);
  return make_view(krsc, s, {s[2] * s[3] * s[1], 1, s[3] * s[1], s[1]}, krsc.offset());
}

Tensor filter_operand(Backend& be, const Tensor& w, bool nhwc) {
  if (!nhwc) return image_operand(be, w, false);
  Tensor out = empty_filter(w.shape(), w.dtype(), w.device(), true);
  be.copy(w, out);
  return out;
}

void check_dtypes(const char* op, std::initializer_list<const Tensor*> ts) {
  const DType t = (*ts.begin())->dtype();
  for (const Tensor* x : ts)
    if (x->defined())
      CHECK(x->dtype() == t) << op << ": operands of dtypes " << x->dtype() << " and " << t;
  cudnn_type(t);  // throws for a dtype cuDNN does not take
}

}  // namespace

// out = conv(x, w) + bias, then relu when fused.
void CudaBackend::conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
                         const Conv2dAttrs& attrs, bool fuse_relu, const Tensor& out) {
  KernelScope scope("conv2d", {&out, &x, &weight, &bias});
  check_dtypes("conv2d", {&x, &weight, &bias, &out});
  if (out.numel() == 0) return;
  const bool nhwc = use_nhwc(x.dtype());
  Tensor y =
      has_layout(out, nhwc) ? out : empty_image(out.shape(), out.dtype(), out.device(), nhwc);
  if (x.numel() == 0) {
    fill(y, 0.0);
  } else {
    run({Direction::forward, image_operand(*this, x, nhwc), filter_operand(*this, weight, nhwc), y,
         nhwc, attrs},
        scope.stream());
  }
  if (bias.defined())
    binary(BinaryOp::add, y, bias.view({1, bias.numel(), 1, 1}).expand(y.shape()), y);
  if (fuse_relu) unary(UnaryOp::relu, y, y);
  if (y.impl() != out.impl()) copy(y, out);
}

// grad_x = conv_transpose(grad_out, w)
void CudaBackend::conv2d_backward_data(const Tensor& grad_out, const Tensor& weight,
                                       const Conv2dAttrs& attrs, const Tensor& grad_x) {
  KernelScope scope("conv2d_backward_data", {&grad_x, &grad_out, &weight});
  check_dtypes("conv2d_backward_data", {&grad_out, &weight, &grad_x});
  if (grad_x.numel() == 0) return;
  const bool nhwc = use_nhwc(grad_x.dtype());
  Tensor gx = has_layout(grad_x, nhwc)
                  ? grad_x
                  : empty_image(grad_x.shape(), grad_x.dtype(), grad_x.device(), nhwc);
  if (grad_out.numel() == 0) {
    fill(gx, 0.0);
  } else {
    run({Direction::backward_data, gx, filter_operand(*this, weight, nhwc),
         image_operand(*this, grad_out, nhwc), nhwc, attrs},
        scope.stream());
  }
  if (gx.impl() != grad_x.impl()) copy(gx, grad_x);
}

// grad_w = correlate(grad_out, x); grad_bias = sum of grad_out over N, OH, OW.
void CudaBackend::conv2d_backward_weights(const Tensor& grad_out, const Tensor& x,
                                          const Conv2dAttrs& attrs, const Tensor& grad_weight,
                                          const Tensor& grad_bias) {
  KernelScope scope("conv2d_backward_weights", {&grad_weight, &grad_bias, &grad_out, &x});
  check_dtypes("conv2d_backward_weights", {&grad_out, &x, &grad_weight, &grad_bias});
  const bool nhwc = use_nhwc(x.dtype());
  if (grad_out.numel() == 0 || x.numel() == 0) {
    fill(grad_weight, 0.0);
  } else {
    Tensor gw = empty_filter(grad_weight.shape(), grad_weight.dtype(), grad_weight.device(), nhwc);
    run({Direction::backward_filter, image_operand(*this, x, nhwc), gw,
         image_operand(*this, grad_out, nhwc), nhwc, attrs},
        scope.stream());
    copy(gw, grad_weight);
  }
  if (grad_bias.defined()) {
    const int64_t O = grad_bias.numel();
    reduce_rows(ReduceOp::sum, RowMode::value, grad_out, Tensor(), Tensor(), 0b1101,
                grad_bias.view({1, O, 1, 1}), 1.0, scope.stream());
  }
}

}  // namespace trainer::cuda
