// Geometry of 2-d convolution and pooling, shared by the ops (core/ops_conv.h)
// and the kernels (core/backend.h), and the output-size arithmetic both use.
//
// Sizes follow PyTorch (floor mode):
//   out = (in + 2 * padding - dilation * (kernel - 1) - 1) / stride + 1
//
//   Conv2dAttrs a{.stride = {2, 2}, .padding = {1, 1}};
//   int64_t oh = conv_out_size(224, 3, a.stride[0], a.padding[0], a.dilation[0]);  // 112
#pragma once

#include <array>
#include <cstdint>

#include "core/hd.h"

namespace trainer {

using Pair = std::array<int64_t, 2>;  // {height, width}

struct Conv2dAttrs {
  Pair stride{1, 1};
  Pair padding{0, 0};
  Pair dilation{1, 1};
  int64_t groups = 1;
};

struct Pool2dAttrs {
  Pair kernel{2, 2};
  Pair stride{2, 2};
  Pair padding{0, 0};
  // Average pooling: divide by the whole window, padding included (PyTorch's
  // default) instead of by the in-bounds count.
  bool count_include_pad = true;
};

inline int64_t conv_out_size(int64_t in, int64_t kernel, int64_t stride, int64_t padding,
                             int64_t dilation = 1) {
  return (in + 2 * padding - dilation * (kernel - 1) - 1) / stride + 1;
}

// Adaptive pooling window of output index i for in -> out (PyTorch's formula;
// host and device):
// [floor(i * in / out), ceil((i + 1) * in / out)).
TRAINER_HD int64_t adaptive_start(int64_t i, int64_t in, int64_t out) { return i * in / out; }
TRAINER_HD int64_t adaptive_end(int64_t i, int64_t in, int64_t out) {
  return ((i + 1) * in + out - 1) / out;
}

}  // namespace trainer
