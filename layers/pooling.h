// Pooling layers and Flatten (no parameters). Images are channels-last
// [N, C, H, W] (core/ops_conv.h).
//
//   MaxPool2d pool({.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}});
//   AdaptiveAvgPool2d gap(1, 1);   // [N, C, H, W] -> [N, C, 1, 1]
//   Flatten flat;                  // -> [N, C]
#pragma once

#include "core/ops_conv.h"
#include "layers/module.h"

namespace trainer {

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(const Pool2dAttrs& attrs) : attrs_(attrs) {}
  Tensor forward(const Tensor& x) override { return max_pool2d(x, attrs_); }

 private:
  Pool2dAttrs attrs_;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(const Pool2dAttrs& attrs) : attrs_(attrs) {}
  Tensor forward(const Tensor& x) override { return avg_pool2d(x, attrs_); }

 private:
  Pool2dAttrs attrs_;
};

class AdaptiveAvgPool2d : public Module {
 public:
  AdaptiveAvgPool2d(int64_t out_h, int64_t out_w) : out_h_(out_h), out_w_(out_w) {}
  Tensor forward(const Tensor& x) override { return adaptive_avg_pool2d(x, out_h_, out_w_); }

 private:
  int64_t out_h_, out_w_;
};

// Merges dims start_dim..end_dim (torch.nn.Flatten: 1..-1). Flattening a
// channels-last image copies it to PyTorch's (C, H, W) order.
class Flatten : public Module {
 public:
  explicit Flatten(int start_dim = 1, int end_dim = -1) : start_(start_dim), end_(end_dim) {}
  Tensor forward(const Tensor& x) override { return x.flatten(start_, end_); }

 private:
  int start_, end_;
};

}  // namespace trainer
