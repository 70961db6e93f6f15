#include "models/small.h"

namespace trainer {

SmallCNN::SmallCNN(const SmallCNNOptions& o) {
  CHECK(o.image_size >= 4 && o.image_size % 4 == 0)
      << "SmallCNN: image size " << o.image_size << " must be a multiple of 4";
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
}

Tensor SmallCNN::forward(const Tensor& x) {
  Tensor y = (*pool_)(conv_bn(*conv1_, *bn1_, x, /*relu=*/true));
  y = (*pool_)(conv_bn(*conv2_, *bn2_, y, /*relu=*/true));
  y = relu((*fc1_)(y.flatten(1)));
  return (*fc2_)((*dropout_)(y));
}

MLP::MLP(const MLPOptions& o) {
  Generator gen(o.seed, kStreamInit);
  std::vector<int64_t> widths = {o.in_features};
  widths.insert(widths.end(), o.hidden.begin(), o.hidden.end());
  widths.push_back(o.num_classes);
  for (size_t i = 0; i + 1 < widths.size(); ++i)
    fcs_.push_back(register_module("fc" + std::to_string(i + 1),
                                   std::make_shared<Linear>(widths[i], widths[i + 1], gen)));
}

Tensor MLP::forward(const Tensor& x) {
  Tensor y = x.flatten(1);
  for (size_t i = 0; i < fcs_.size(); ++i) {
    y = (*fcs_[i])(y);
    if (i + 1 < fcs_.size()) y = relu(y);
  }
  return y;
}

}  // namespace trainer
