#include "core/backend.h"

#include "core/ref/ref_backend.h"

namespace trainer {

const char* unary_op_name(UnaryOp op) {
  static const char* names[] = {"neg",  "exp",     "log",  "sqrt",      "rsqrt",    "abs",
                                "tanh", "sigmoid", "relu", "gelu_tanh", "gelu_erf", "silu"};
  return names[int(op)];
}

const char* binary_op_name(BinaryOp op) {
  static const char* names[] = {"add", "sub", "mul", "div", "pow", "maximum", "minimum"};
  return names[int(op)];
}

void Backend::unsupported(const char* op) const {
  throw UnsupportedOp(cat("op '", op, "' is not available on the ", name(), " backend"));
}

void Backend::copy(const Tensor&, const Tensor&) { unsupported("copy"); }
void Backend::fill(const Tensor&, double) { unsupported("fill"); }
void Backend::copy_across(const Tensor&, const Tensor&) { unsupported("copy_across"); }
void Backend::unary(UnaryOp op, const Tensor&, const Tensor&) { unsupported(unary_op_name(op)); }
void Backend::unary_backward(UnaryOp op, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&) {
  unsupported(unary_op_name(op));
}
void Backend::binary(BinaryOp op, const Tensor&, const Tensor&, const Tensor&) {
  unsupported(binary_op_name(op));
}
void Backend::binary_scalar(BinaryOp op, const Tensor&, double, bool, const Tensor&) {
  unsupported(binary_op_name(op));
}
void Backend::where(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  unsupported("where");
}
void Backend::clamp(const Tensor&, double, double, const Tensor&) { unsupported("clamp"); }
void Backend::clamp_backward(const Tensor&, const Tensor&, double, double, const Tensor&) {
  unsupported("clamp_backward");
}
void Backend::compare(CompareOp, const Tensor&, const Tensor&, const Tensor&) {
  unsupported("compare");
}
void Backend::reduce(ReduceOp, const Tensor&, uint64_t, const Tensor&) { unsupported("reduce"); }
void Backend::var(const Tensor&, uint64_t, int64_t, const Tensor&) { unsupported("var"); }
void Backend::max_dim(const Tensor&, int, const Tensor&, const Tensor&) { unsupported("max_dim"); }
void Backend::matmul(const Tensor&, const Tensor&, const Tensor&) { unsupported("matmul"); }
void Backend::softmax(const Tensor&, int, bool, const Tensor&) { unsupported("softmax"); }
void Backend::softmax_backward(const Tensor&, const Tensor&, int, bool, const Tensor&) {
  unsupported("softmax_backward");
}
void Backend::cross_entropy(const Tensor&, const Tensor&, double, int64_t, const Tensor&,
                            const Tensor&) {
  unsupported("cross_entropy");
}
void Backend::cross_entropy_backward(const Tensor&, const Tensor&, const Tensor&, double, int64_t,
                                     const Tensor&) {
  unsupported("cross_entropy_backward");
}
void Backend::index_select(const Tensor&, int, const Tensor&, const Tensor&) {
  unsupported("index_select");
}
void Backend::index_add(const Tensor&, int, const Tensor&, const Tensor&) {
  unsupported("index_add");
}
void Backend::gather(const Tensor&, int, const Tensor&, const Tensor&) { unsupported("gather"); }
void Backend::scatter_add(const Tensor&, int, const Tensor&, const Tensor&) {
  unsupported("scatter_add");
}
void Backend::concat(const TensorList&, int, const Tensor&) { unsupported("concat"); }
void Backend::uniform(const Tensor&, double, double, PhiloxKey) { unsupported("uniform"); }
void Backend::normal(const Tensor&, double, double, PhiloxKey) { unsupported("normal"); }
void Backend::bernoulli(const Tensor&, double, PhiloxKey) { unsupported("bernoulli"); }
void Backend::conv2d(const Tensor&, const Tensor&, const Tensor&, const Conv2dAttrs&, bool,
                     const Tensor&) {
  unsupported("conv2d");
}
void Backend::conv2d_backward_data(const Tensor&, const Tensor&, const Conv2dAttrs&,
                                   const Tensor&) {
  unsupported("conv2d_backward_data");
}
void Backend::conv2d_backward_weights(const Tensor&, const Tensor&, const Conv2dAttrs&,
                                      const Tensor&, const Tensor&) {
  unsupported("conv2d_backward_weights");
}
Tensor Backend::max_pool2d(const Tensor&, const Pool2dAttrs&, const Tensor&) {
  unsupported("max_pool2d");
}
void Backend::max_pool2d_backward(const Tensor&, const Tensor&, const Pool2dAttrs&, const Tensor&) {
  unsupported("max_pool2d_backward");
}
void Backend::avg_pool2d(const Tensor&, const Pool2dAttrs&, const Tensor&) {
  unsupported("avg_pool2d");
}
void Backend::avg_pool2d_backward(const Tensor&, const Pool2dAttrs&, const Tensor&) {
  unsupported("avg_pool2d_backward");
}
void Backend::adaptive_avg_pool2d(const Tensor&, const Tensor&) {
  unsupported("adaptive_avg_pool2d");
}
void Backend::adaptive_avg_pool2d_backward(const Tensor&, const Tensor&) {
  unsupported("adaptive_avg_pool2d_backward");
}
void Backend::batch_norm_forward(const Tensor&, const Tensor&, const Tensor&, double, bool,
                                 const Tensor&, const Tensor&, const Tensor&) {
  unsupported("batch_norm_forward");
}
void Backend::batch_norm_inference(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   const Tensor&, double, const Tensor&) {
  unsupported("batch_norm_inference");
}
void Backend::batch_norm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, double, const Tensor&, const Tensor&,
                                  const Tensor&) {
  unsupported("batch_norm_backward");
}
Tensor Backend::batch_norm_relu_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                        double eps, const Tensor& out, const Tensor& mean,
                                        const Tensor& var) {
  batch_norm_forward(x, gamma, beta, eps, /*fuse_relu=*/true, out, mean, var);
  return out;
}
void Backend::batch_norm_relu_backward(const Tensor& grad_out, const Tensor& record,
                                       const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                       const Tensor& var, double eps, const Tensor& grad_x,
                                       const Tensor& grad_gamma, const Tensor& grad_beta) {
  // The mask runs on [N, H, W, C] views: unit-stride loops for channels-last images.
  auto nhwc = [](const Tensor& t) {
    const Shape& s = t.strides();
    return make_view(t, {t.size(0), t.size(2), t.size(3), t.size(1)}, {s[0], s[2], s[3], s[1]},
                     t.offset());
  };
  Tensor masked = empty(nhwc(grad_out).shape(), grad_out.dtype(), grad_out.device());
  unary_backward(UnaryOp::relu, nhwc(grad_out), nhwc(record), nhwc(record), masked);
  int64_t C = x.size(1), H = x.size(2), W = x.size(3);
  batch_norm_backward(make_view(masked, x.shape(), {H * W * C, 1, W * C, C}, 0), x, gamma, mean,
                      var, eps, grad_x, grad_gamma, grad_beta);
}
void Backend::layer_norm_forward(const Tensor&, const Tensor&, const Tensor&, double, const Tensor&,
                                 const Tensor&, const Tensor&) {
  unsupported("layer_norm_forward");
}
void Backend::layer_norm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  unsupported("layer_norm_backward");
}
void Backend::rms_norm_forward(const Tensor&, const Tensor&, double, const Tensor&, const Tensor&) {
  unsupported("rms_norm_forward");
}
void Backend::rms_norm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&) {
  unsupported("rms_norm_backward");
}
void Backend::rope_forward(const Tensor&, const Tensor&, const RopeAttrs&, const Tensor&) {
  unsupported("rope_forward");
}
void Backend::rope_backward(const Tensor&, const Tensor&, const RopeAttrs&, const Tensor&) {
  unsupported("rope_backward");
}
void Backend::attention_forward(const Tensor&, const Tensor&, const Tensor&, const AttentionAttrs&,
                                const Tensor&, const Tensor&) {
  unsupported("attention_forward");
}
void Backend::attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, const Tensor&, const AttentionAttrs&, const Tensor&,
                                 const Tensor&, const Tensor&) {
  unsupported("attention_backward");
}
void Backend::attention_merge(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  unsupported("attention_merge");
}
Tensor Backend::lstm_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, bool, const Tensor&, const Tensor&,
                             const Tensor&) {
  unsupported("lstm_forward");
}
void Backend::lstm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&) {
  unsupported("lstm_backward");
}
Tensor Backend::gru_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, bool, const Tensor&, const Tensor&) {
  unsupported("gru_forward");
}
void Backend::gru_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  unsupported("gru_backward");
}

namespace {
Backend* g_backends[kNumDeviceKinds] = {};
thread_local bool t_use_reference = false;
}  // namespace

void register_backend(DeviceKind kind, Backend* b) { g_backends[int(kind)] = b; }

std::vector<DeviceKind> registered_device_kinds() {
  std::vector<DeviceKind> kinds{kCPU};
  for (int k = 0; k < kNumDeviceKinds; ++k)
    if (DeviceKind(k) != kCPU && g_backends[k]) kinds.push_back(DeviceKind(k));
  return kinds;
}

Backend& reference_backend() {
  static Backend* ref = new RefBackend();
  return *ref;
}

Backend& cpu_backend();  // core/cpu/cpu_backend.cpp

Backend& backend(Device device) {
  if (device.is_cpu()) return t_use_reference ? reference_backend() : cpu_backend();
  Backend* b = g_backends[int(device.kind)];
  if (!b)
    throw Error(cat("device ", device, " requested but this build has no CUDA backend; ",
                    "rebuild with -DTRAINER_CUDA=ON on a machine with the CUDA toolkit"));
  return *b;
}

ReferenceKernelsGuard::ReferenceKernelsGuard() : previous_(t_use_reference) {
  t_use_reference = true;
}
ReferenceKernelsGuard::~ReferenceKernelsGuard() { t_use_reference = previous_; }

}  // namespace trainer
