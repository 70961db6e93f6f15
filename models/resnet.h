// ResNet-18/34/50/101/152 exactly as torchvision builds them (v1.5: the
// bottleneck's stride sits on its 3x3 conv), with torchvision's parameter
// names and shapes, so its checkpoints load by name:
//
//   conv1.weight [64, 3, 7, 7]   bn1.{weight, bias, running_mean, running_var, num_batches_tracked}
//   layer{1..4}.{i}.conv{1,2[,3]}.weight, .bn{1,2[,3]}.*, .downsample.{0 (conv), 1 (bn)}.*
//   fc.weight [num_classes, 512 * expansion], fc.bias
//
// Parameter counts at 1000 classes: 18: 11,689,512; 34: 21,797,672;
// 50: 25,557,032; 101: 44,549,160; 152: 60,192,808.
//
// Initialisation as torchvision: convs kaiming_normal(fan_out, relu), batch
// norm weight 1 and bias 0, fc as nn.Linear; zero_init_residual sets the
// last batch-norm gamma of every block to 0 (each block starts as identity).
//
// The small-image variant (for 28x28 / 32x32 inputs, e.g. Fashion-MNIST or
// CIFAR) replaces the stem with a 3x3 stride-1 conv and drops the max-pool;
// names are unchanged (conv1.weight is then [width, in_channels, 3, 3]).
//
//   auto net = resnet({.depth = 50, .num_classes = 1000});
//   Tensor logits = (*net)(images);     // [N, 3, 224, 224] -> [N, 1000]
//
// Blocks (layers/block_list.h), each x -> x but the last: "stem" (conv1, bn1,
// relu, max-pool), one per residual block ("layer1.0" ... "layer4.<n-1>"),
// "head" (average pool, flatten, fc: x -> logits).
//
// Tensor parallelism (shard_tensor_parallel) is the classic model-parallel
// split of a CNN by channels, inside each residual block only: the block's
// first conv over output channels, its batch norm on that shard, the next
// conv over input channels, whose partial sums one allreduce adds up (and
// one allreduce of the block input's gradient backward). Everything
// between blocks is whole on every rank: the stem, the downsample
// branches, the closing batch norm and the residual sum, and fc (the
// logits are whole, so the loss is the plain cross-entropy; fc holds 4% of
// ResNet-18's weights at 1000 classes, and a split would need the class
// count to divide).
#pragma once

#include <memory>

#include "layers/block_list.h"
#include "layers/conv.h"
#include "layers/linear.h"
#include "layers/pooling.h"

namespace trainer {

struct ResNetOptions {
  int depth = 50;  // 18, 34, 50, 101 or 152
  int64_t num_classes = 1000;
  int64_t in_channels = 3;
  bool small_input = false;
  bool zero_init_residual = false;
  // Channels of the stem and layer1 (torchvision: 64); the layers double it.
  // Tests shrink it to build tiny ResNets.
  int64_t width = 64;
  uint64_t seed = 0;
};

// conv3x3 -> bn -> relu -> conv3x3 -> bn, plus the (downsampled) input, -> relu.
class BasicBlock : public Module {
 public:
  static constexpr int64_t kExpansion = 1;
  BasicBlock(int64_t in_planes, int64_t planes, int64_t stride, Generator& gen);
  Tensor forward(const Tensor& x) override;
  // conv1 over output channels, bn1 on its shard, conv2 over input
  // channels (summed over g); bn2 and downsample whole.
  void shard(const std::shared_ptr<TensorParallelGroup>& g);

  std::shared_ptr<Conv2d> conv1, conv2;
  std::shared_ptr<BatchNorm2d> bn1, bn2;
  std::shared_ptr<Sequential> downsample;  // null when the shapes already match
};

// conv1x1 -> bn -> relu -> conv3x3 (stride) -> bn -> relu -> conv1x1 (x4) -> bn,
// plus the (downsampled) input, -> relu.
class Bottleneck : public Module {
 public:
  static constexpr int64_t kExpansion = 4;
  Bottleneck(int64_t in_planes, int64_t planes, int64_t stride, Generator& gen);
  Tensor forward(const Tensor& x) override;
  // conv1 over output channels, bn1 on its shard, conv2 over input
  // channels (summed over g); conv3, bn2, bn3 and downsample whole (why:
  // resnet.cpp).
  void shard(const std::shared_ptr<TensorParallelGroup>& g);

  std::shared_ptr<Conv2d> conv1, conv2, conv3;
  std::shared_ptr<BatchNorm2d> bn1, bn2, bn3;
  std::shared_ptr<Sequential> downsample;
};

// forward: [N, in_channels, H, W] (any layout) -> logits [N, num_classes].
class ResNet : public Model {
 public:
  explicit ResNet(const ResNetOptions& options);
  const ResNetOptions& options() const { return options_; }
  // Splits every residual block over g (BasicBlock::shard,
  // Bottleneck::shard). Needs width divisible by g's size: every split
  // channel count is a multiple of it.
  void shard_tensor_parallel(std::shared_ptr<TensorParallelGroup> g) override;

 private:
  template <class Block>
  std::shared_ptr<Sequential> make_layer(int64_t& in_planes, int64_t planes, int blocks,
                                         int64_t stride, Generator& gen);
  ResNetOptions options_;
  std::shared_ptr<Conv2d> conv1_;
  std::shared_ptr<BatchNorm2d> bn1_;
  std::shared_ptr<MaxPool2d> maxpool_;
  std::shared_ptr<Sequential> layers_[4];
  std::shared_ptr<AdaptiveAvgPool2d> avgpool_;
  std::shared_ptr<Linear> fc_;
  std::shared_ptr<TensorParallelGroup> tp_;
};

std::shared_ptr<ResNet> resnet(const ResNetOptions& options);

}  // namespace trainer
