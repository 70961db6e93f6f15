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
//
// Tensor parallelism (layers/tensor_parallel.h) splits a conv by channels,
// as Linear is split by features (layers/linear.h): over output channels
// (column: each rank holds O/n filters and produces that shard of the
// channels) or over input channels (row: it reads that shard of the
// channels and the partial sums are added over the group). A batch norm
// after a column-split conv keeps the same shard of its channels:
//
//   conv1.shard(g, ConvSplit::output_channels);   // [N, I, H, W] -> [N, O/n, H, W]
//   bn1.shard(*g);                                 // its channels' gamma, beta, statistics
//   conv2.shard(g, ConvSplit::input_channels);    // [N, O/n, H, W] -> [N, O2, H, W], summed
//
// In memory a channels-last activation is an NHWC buffer, so its channels
// are the last memory dim: the collectives run on that [N, H, W, C] view.
#pragma once

#include <functional>
#include <memory>

#include "core/ops_conv.h"
#include "layers/module.h"
#include "layers/tensor_parallel.h"

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

// How a Conv2d is split over a tensor-parallel group. output_channels
// (Linear's column): this rank holds O/n filters (dim 0 of weight, and of
// bias) and its output is that shard of the channels; its input enters the
// region (copy_to_region: the input's gradient is summed over the group).
// input_channels (Linear's row): it holds I/n input channels of every
// filter (dim 1 of weight) and reads that shard of its input's channels;
// the partial sums are added over the group (reduce_from_region), then the
// whole bias.
enum class ConvSplit { none, output_channels, input_channels };

// y = conv2d(x, weight) + bias. Weight initialised as options.init says,
// bias (either way) uniform(+-1/sqrt(fan_in)) as nn.Conv2d.
class Conv2d : public Module {
 public:
  Conv2d(const Conv2dOptions& options, Generator& gen);
  Tensor forward(const Tensor& x) override;
  const Conv2dOptions& options() const { return options_; }

  // Keeps this rank's part of weight and bias (split over g as `split`
  // says); options() keeps describing the whole layer. Needs groups = 1 and
  // the split channels divisible by g's size.
  void shard(std::shared_ptr<TensorParallelGroup> g, ConvSplit split);
  ConvSplit split() const { return split_; }
  // x as the convolution reads it: entered into the tensor-parallel region
  // (copy_to_region) for an output-channel split, else x itself.
  Tensor region_input(const Tensor& x) const;

  Tensor weight, bias;  // bias undefined without options.bias

 private:
  Conv2dOptions options_;
  std::shared_ptr<TensorParallelGroup> group_;
  ConvSplit split_ = ConvSplit::none;
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
  // Keeps this rank's shard of the channels (after an output-channel split
  // conv): gamma, beta, running_mean and running_var, recorded as split so
  // checkpoints hold them whole. Batch statistics are per channel, so the
  // shard normalises as the whole layer would, with no communication.
  void shard(const TensorParallelGroup& g);

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
// with relu fused into it. A conv split over input channels is not folded:
// its partial sums are added over the group before bn.
Tensor conv_bn(Conv2d& conv, BatchNorm2d& bn, const Tensor& x, bool relu);

}  // namespace trainer
