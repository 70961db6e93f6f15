// Small models for Fashion-MNIST (1x28x28 images, 10 classes).
//
// SmallCNN, [N, 1, 28, 28] -> [N, 10], 421,834 parameters:
//   conv1  Conv2d(1, 32, 3x3, padding 1) -> bn1 BatchNorm2d(32) -> relu -> max-pool 2x2   [N, 32,
//   14, 14] conv2  Conv2d(32, 64, 3x3, padding 1) -> bn2 BatchNorm2d(64) -> relu -> max-pool 2x2
//   [N, 64, 7, 7] flatten [N, 3136] -> fc1 Linear(3136, 128) -> relu -> dropout(p) -> fc2
//   Linear(128, 10)
// Conv + bn + relu run folded in evaluation (layers/conv.h conv_bn).
//
// MLP, [N, 1, 28, 28] (or [N, 784]) -> [N, 10], 235,146 parameters with the default widths:
//   flatten [N, 784] -> fc1 Linear(784, 256) -> relu -> fc2 Linear(256, 128) -> relu
//   -> fc3 Linear(128, 10)      (names fc1..fc{hidden.size() + 1})
//
// Blocks (layers/block_list.h), x -> x but the last (-> logits): SmallCNN
// "conv1", "conv2" (conv, bn, relu, pool), "fc1" (flatten, fc1, relu), "fc2"
// (dropout, fc2); MLP one per layer, "fc1" ... "fc<n>".
//
// Initialisation: PyTorch's layer defaults, from Generator(seed, kStreamInit);
// dropout masks from Generator(seed, kStreamDropout).
#pragma once

#include <memory>
#include <vector>

#include "layers/block_list.h"
#include "layers/conv.h"
#include "layers/linear.h"
#include "layers/pooling.h"

namespace trainer {

struct SmallCNNOptions {
  int64_t in_channels = 1;
  int64_t num_classes = 10;
  int64_t image_size = 28;  // square, divisible by 4
  double dropout = 0.25;
  uint64_t seed = 0;
};

class SmallCNN : public Model {
 public:
  explicit SmallCNN(const SmallCNNOptions& options = {});

 private:
  std::shared_ptr<Conv2d> conv1_, conv2_;
  std::shared_ptr<BatchNorm2d> bn1_, bn2_;
  std::shared_ptr<MaxPool2d> pool_;
  std::shared_ptr<Linear> fc1_, fc2_;
  std::shared_ptr<Dropout> dropout_;
};

struct MLPOptions {
  int64_t in_features = 784;
  std::vector<int64_t> hidden = {256, 128};
  int64_t num_classes = 10;
  uint64_t seed = 0;
};

class MLP : public Model {
 public:
  explicit MLP(const MLPOptions& options = {});

 private:
  std::vector<std::shared_ptr<Linear>> fcs_;
};

}  // namespace trainer
