// Models by name, for recipes: make_model("resnet50", {.num_classes = 1000}).
//
// Names: resnet18, resnet34, resnet50, resnet101, resnet152 (models/resnet.h),
// small_cnn, mlp (models/small.h). An unknown name throws Error listing them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "layers/module.h"

namespace trainer {

struct ModelOptions {
  int64_t num_classes = 1000;
  int64_t in_channels = 3;
  int64_t image_size =
      224;  // small_cnn: the (square) input side; mlp: side * side * in_channels inputs
  bool small_input = false;  // ResNets: 3x3 stride-1 stem, no max-pool
  bool zero_init_residual = false;
  int64_t width = 64;     // ResNets: channels of the stem and layer1
  double dropout = 0.25;  // small_cnn
  uint64_t seed = 0;
};

std::shared_ptr<Module> make_model(const std::string& name, const ModelOptions& options = {});
std::vector<std::string> model_names();

}  // namespace trainer
