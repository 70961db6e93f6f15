#include "layers/conv.h"

#include <cmath>

#include "layers/init.h"

namespace trainer {

Conv2d::Conv2d(const Conv2dOptions& o, Generator& gen) : options_(o) {
  CHECK(o.in_channels >= 1 && o.out_channels >= 1 && o.attrs.groups >= 1 &&
        o.in_channels % o.attrs.groups == 0 && o.out_channels % o.attrs.groups == 0)
      << "Conv2d: channels " << o.in_channels << " -> " << o.out_channels
      << " not divisible by groups " << o.attrs.groups;
  weight = register_parameter(
      "weight", empty({o.out_channels, o.in_channels / o.attrs.groups, o.kernel[0], o.kernel[1]}));
  if (o.init == ConvInit::torch_default)
    kaiming_uniform_(weight, std::sqrt(5.0), gen);
  else
    kaiming_normal_(weight, FanMode::fan_out, gen);
  if (o.bias) {
    bias = register_parameter("bias", empty({o.out_channels}));
    double bound = 1.0 / std::sqrt(double(fan_in(weight)));
    uniform_(bias, -bound, bound, gen);
  }
}

Tensor Conv2d::forward(const Tensor& x) { return conv2d(x, weight, bias, options_.attrs); }

BatchNorm2d::BatchNorm2d(int64_t channels, const BatchNormOptions& o) : options_(o) {
  CHECK_GE(channels, 1) << "BatchNorm2d channels";
  if (o.affine) {
    weight = register_parameter("weight", ones({channels}));
    bias = register_parameter("bias", zeros({channels}));
  } else {
    weight = ones({channels});
    bias = zeros({channels});
  }
  if (o.track_running_stats) {
    running_mean = register_buffer("running_mean", zeros({channels}));
    running_var = register_buffer("running_var", ones({channels}));
    num_batches_tracked = register_buffer("num_batches_tracked", zeros({}, DType::i64));
  }
}

Tensor BatchNorm2d::forward(const Tensor& x, bool relu) {
  if (uses_running_stats()) {
    Tensor y = batch_norm_eval(x, weight, bias, running_mean, running_var, options_.eps);
    return relu ? relu_channels_last(y) : y;
  }
  BatchStatsResult s = batch_stats_norm_
                           ? batch_stats_norm_(x, weight, bias, options_.eps, relu)
                           : BatchStatsResult{batch_norm_train(x, weight, bias, options_.eps, relu),
                                              x.size(0) * x.size(2) * x.size(3)};
  if (is_training() && options_.track_running_stats) update_running_stats(s.result, s.count);
  return s.result.out;
}

void BatchNorm2d::update_running_stats(const BatchNormResult& r, int64_t m) {
  autograd::NoGradGuard no_grad;
  double mom = options_.momentum;
  mul_(running_mean, 1.0 - mom);
  add_(running_mean, r.mean, mom);
  mul_(running_var, 1.0 - mom);
  add_(running_var, r.var, mom * double(m) / double(m - 1));
  num_batches_tracked.fill_(double(num_batches_tracked.item<int64_t>() + 1));
}

Tensor conv_bn(Conv2d& conv, BatchNorm2d& bn, const Tensor& x, bool relu) {
  if (bn.uses_running_stats()) {
    return conv2d_bn_eval(x, conv.weight, conv.bias, conv.options().attrs, bn.weight, bn.bias,
                          bn.running_mean, bn.running_var, bn.options().eps, relu);
  }
  return bn.forward(conv(x), relu);
}

}  // namespace trainer
