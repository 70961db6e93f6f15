#include "models/small.h"

#include <algorithm>

namespace trainer {

SmallCNN::SmallCNN(const SmallCNNOptions& o) {
  // A user's choice (data.image_size), so an Error rather than a CHECK.
  if (o.image_size < 4 || o.image_size % 4 != 0)
    throw Error(cat("model small_cnn: image size ", o.image_size,
                    " (data.image_size) must be a multiple of 4, for its two 2x2 poolings; use ",
                    std::max<int64_t>(4, o.image_size / 4 * 4), " or ", o.image_size / 4 * 4 + 4));
  Generator gen(o.seed, kStreamInit);
  Conv2dAttrs same{.padding = {1, 1}};
  conv1_ = register_module(
      "conv1",
      std::make_shared<Conv2d>(
          Conv2dOptions{.in_channels = o.in_channels, .out_channels = 32, .attrs = same}, gen));
  bn1_ = register_module("bn1", std::make_shared<BatchNorm2d>(32));
  conv2_ = register_module(
      "conv2", std::make_shared<Conv2d>(
                   Conv2dOptions{.in_channels = 32, .out_channels = 64, .attrs = same}, gen));
  bn2_ = register_module("bn2", std::make_shared<BatchNorm2d>(64));
  pool_ = std::make_shared<MaxPool2d>(Pool2dAttrs{});
  int64_t side = o.image_size / 4;
  fc1_ = register_module("fc1", std::make_shared<Linear>(64 * side * side, 128, gen));
  dropout_ = register_module(
      "dropout", std::make_shared<Dropout>(o.dropout, Generator(o.seed, kStreamDropout)));
  fc2_ = register_module("fc2", std::make_shared<Linear>(128, o.num_classes, gen));

  std::vector<BlockSpec> specs;
  specs.push_back({.name = "conv1",
                   .members = {{"conv1", conv1_}, {"bn1", bn1_}},
                   .fn = [this](const TensorList& in) {
                     return TensorList{(*pool_)(conv_bn(*conv1_, *bn1_, in[0], /*relu=*/true))};
                   }});
  specs.push_back({.name = "conv2",
                   .members = {{"conv2", conv2_}, {"bn2", bn2_}},
                   .fn = [this](const TensorList& in) {
                     return TensorList{(*pool_)(conv_bn(*conv2_, *bn2_, in[0], /*relu=*/true))};
                   }});
  specs.push_back({.name = "fc1", .members = {{"fc1", fc1_}}, .fn = [this](const TensorList& in) {
                     return TensorList{relu((*fc1_)(in[0].flatten(1)))};
                   }});
  specs.push_back(
      {.name = "fc2",
       .members = {{"dropout", dropout_}, {"fc2", fc2_}},
       .outputs = {"logits"},
       .fn = [this](const TensorList& in) { return TensorList{(*fc2_)((*dropout_)(in[0]))}; }});
  set_blocks(BlockList({"x"}, {"logits"}, std::move(specs)));
}

MLP::MLP(const MLPOptions& o) {
  Generator gen(o.seed, kStreamInit);
  std::vector<int64_t> widths = {o.in_features};
  widths.insert(widths.end(), o.hidden.begin(), o.hidden.end());
  widths.push_back(o.num_classes);
  for (size_t i = 0; i + 1 < widths.size(); ++i)
    fcs_.push_back(register_module("fc" + std::to_string(i + 1),
                                   std::make_shared<Linear>(widths[i], widths[i + 1], gen)));

  std::vector<BlockSpec> specs;
  for (size_t i = 0; i < fcs_.size(); ++i) {
    const std::string name = "fc" + std::to_string(i + 1);
    const bool first = i == 0, last = i + 1 == fcs_.size();
    Linear* fc = fcs_[i].get();
    specs.push_back({.name = name,
                     .members = {{name, fcs_[i]}},
                     .outputs = {last ? "logits" : "x"},
                     .fn = [fc, first, last](const TensorList& in) {
                       Tensor y = (*fc)(first ? in[0].flatten(1) : in[0]);
                       return TensorList{last ? y : relu(y)};
                     }});
  }
  set_blocks(BlockList({"x"}, {"logits"}, std::move(specs)));
}

}  // namespace trainer
