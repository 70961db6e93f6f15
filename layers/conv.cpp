#include "layers/conv.h"

#include <cmath>

#include "core/autograd.h"
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

namespace {

// A channels-last [N, C, H, W] activation as the [N, H, W, C] view of its
// NHWC buffer (contiguous: the collectives move it without a copy into
// another layout), and back.
Tensor nhwc_view(const Tensor& x) { return to_channels_last(x).permute({0, 2, 3, 1}); }
Tensor nchw_view(const Tensor& y) { return y.permute({0, 3, 1, 2}); }

}  // namespace

Tensor Conv2d::region_input(const Tensor& x) const {
  if (split_ != ConvSplit::output_channels) return x;
  return nchw_view(copy_to_region(nhwc_view(x), *group_));
}

Tensor Conv2d::forward(const Tensor& x) {
  if (split_ != ConvSplit::input_channels)
    return conv2d(region_input(x), weight, bias, options_.attrs);
  // This rank's input channels' share of every output, summed over the
  // group; then the whole bias, added once.
  Tensor y = reduce_from_region(nhwc_view(conv2d(x, weight, Tensor(), options_.attrs)), *group_);
  return nchw_view(bias.defined() ? y + bias : y);
}

void Conv2d::shard(std::shared_ptr<TensorParallelGroup> g, ConvSplit split) {
  CHECK(split_ == ConvSplit::none && split != ConvSplit::none && g)
      << "Conv2d::shard: already split, or no split";
  CHECK(options_.attrs.groups == 1) << "Conv2d::shard: a grouped convolution (groups "
                                    << options_.attrs.groups << ") is not split";
  const int n = g->size();
  const int dim = split == ConvSplit::output_channels ? 0 : 1;
  CHECK(weight.size(dim) % n == 0)
      << "Conv2d::shard: " << weight.size(dim) << (dim == 0 ? " output" : " input")
      << " channels do not split over " << n << " ranks";
  const ParameterSplit s{
      .kind = ParameterSplit::Kind::sharded, .dim = dim, .rank = g->rank(), .size = n};
  {
    autograd::NoGradGuard no_grad;
    weight = replace_parameter("weight", shard_of(weight.detach(), s), s);
    // An input-channel split adds the whole bias after the sum: replicated.
    if (bias.defined() && split == ConvSplit::output_channels)
      bias = replace_parameter("bias", shard_of(bias.detach(), s), s);
  }
  group_ = std::move(g);
  split_ = split;
}

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

void BatchNorm2d::shard(const TensorParallelGroup& g) {
  const int n = g.size();
  CHECK(weight.size(0) % n == 0) << "BatchNorm2d::shard: " << weight.size(0)
                                 << " channels do not split over " << n << " ranks";
  const ParameterSplit s{
      .kind = ParameterSplit::Kind::sharded, .dim = 0, .rank = g.rank(), .size = n};
  autograd::NoGradGuard no_grad;
  if (options_.affine) {
    weight = replace_parameter("weight", shard_of(weight.detach(), s), s);
    bias = replace_parameter("bias", shard_of(bias.detach(), s), s);
  } else {
    weight = shard_of(weight, s);
    bias = shard_of(bias, s);
  }
  if (options_.track_running_stats) {
    running_mean = replace_buffer("running_mean", shard_of(running_mean, s), s);
    running_var = replace_buffer("running_var", shard_of(running_var, s), s);
  }
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
  if (bn.uses_running_stats() && conv.split() != ConvSplit::input_channels) {
    return conv2d_bn_eval(conv.region_input(x), conv.weight, conv.bias, conv.options().attrs,
                          bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.options().eps,
                          relu);
  }
  return bn.forward(conv(x), relu);
}

}  // namespace trainer
