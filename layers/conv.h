// The convolutional building blocks: Conv2d, BatchNorm2d, ReLU, and
// conv_bn(), which runs conv -> batch norm (-> relu) as one folded
// convolution in evaluation and as the three ops in training.
//
// Activations are channels-last [N, C, H, W] (core/ops_conv.h); parameter
// names and shapes are PyTorch's:
//   Conv2d       weight [O, I/groups, kH, kW], bias [O]
//   BatchNorm2d  weight (gamma) [C], bias (beta) [C]; buffers running_mean,
//                running_var [C] and num_batches_tracked (0-d i64)
//
//   Conv2d conv({.in_channels = 3, .out_channels = 64, .kernel = {7, 7},
//                .attrs = {.stride = {2, 2}, .padding = {3, 3}}, .bias = false}, gen);
//   BatchNorm2d bn(64);
//   Tensor y = conv_bn(conv, bn, x, /*relu=*/true);
#pragma once

#include <functional>

#include "core/ops_conv.h"
#include "layers/module.h"

namespace trainer {

enum class ConvInit {
  torch_default,           // nn.Conv2d: weight kaiming_uniform(a = sqrt(5))
  kaiming_normal_fan_out,  // torchvision's ResNet: kaiming_normal(fan_out, relu)
};

struct Conv2dOptions {
  int64_t in_channels = 1;
  int64_t out_channels = 1;
  Pair kernel{3, 3};
  Conv2dAttrs attrs{};
  bool bias = true;
  ConvInit init = ConvInit::torch_default;
};

// y = conv2d(x, weight) + bias. Weight initialised as options.init says,
// bias (either way) uniform(+-1/sqrt(fan_in)) as nn.Conv2d.
class Conv2d : public Module {
 public:
  Conv2d(const Conv2dOptions& options, Generator& gen);
  Tensor forward(const Tensor& x) override;
  const Conv2dOptions& options() const { return options_; }

  Tensor weight, bias;  // bias undefined without options.bias

 private:
  Conv2dOptions options_;
};

struct BatchNormOptions {
  double eps = 1e-5;
  // running = (1 - momentum) * running + momentum * batch statistic.
  double momentum = 0.1;
  bool affine = true;
  bool track_running_stats = true;
};

// The batch-statistics normalisation of a BatchNorm2d and the number of
// values per channel its statistics cover (M = N*H*W for one rank's batch).
// SyncBatchNorm (parallel/sync_batchnorm.h) replaces batch_norm_train with one
// whose statistics cover the whole data-parallel batch.
struct BatchStatsResult {
  BatchNormResult result;
  int64_t count = 0;
};
using BatchStatsNorm = std::function<BatchStatsResult(const Tensor& x, const Tensor& gamma,
                                                      const Tensor& beta, double eps, bool relu)>;

// Training (or no running statistics): normalise by the batch statistics and
// update running_mean with the batch mean and running_var with the unbiased
// batch variance (M / (M - 1) times the biased one), as PyTorch; count the
// step in num_batches_tracked. Evaluation: normalise by the running statistics.
class BatchNorm2d : public Module {
 public:
  explicit BatchNorm2d(int64_t channels, const BatchNormOptions& options = {});
  Tensor forward(const Tensor& x) override { return forward(x, false); }
  // relu(bn(x)), fused into the normalisation when it uses batch statistics.
  Tensor forward(const Tensor& x, bool relu);
  const BatchNormOptions& options() const { return options_; }
  // Whether forward normalises by the running statistics (eval with tracking).
  bool uses_running_stats() const { return !is_training() && options_.track_running_stats; }
  // Replaces the batch-statistics normalisation (empty: batch_norm_train again).
  void set_batch_stats_norm(BatchStatsNorm norm) { batch_stats_norm_ = std::move(norm); }
  bool has_batch_stats_norm() const { return bool(batch_stats_norm_); }

  // gamma and beta are constants 1 and 0 (not parameters) without affine.
  Tensor weight, bias;
  Tensor running_mean, running_var, num_batches_tracked;

 private:
  void update_running_stats(const BatchNormResult& r, int64_t m);
  BatchNormOptions options_;
  BatchStatsNorm batch_stats_norm_;
};

class ReLU : public Module {
 public:
  Tensor forward(const Tensor& x) override { return relu_channels_last(x); }
};

// bn(conv(x)), then relu when asked. When bn uses running statistics the
// three run as one convolution with bn folded into its weights and relu as a
// post-op (conv2d_bn_eval); in training as a convolution and a batch norm
// with relu fused into it.
Tensor conv_bn(Conv2d& conv, BatchNorm2d& bn, const Tensor& x, bool relu);

}  // namespace trainer
