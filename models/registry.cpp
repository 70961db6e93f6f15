#include "models/registry.h"

#include "models/resnet.h"
#include "models/small.h"

namespace trainer {

std::vector<std::string> model_names() {
  return {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "small_cnn", "mlp"};
}

std::shared_ptr<Module> make_model(const std::string& name, const ModelOptions& o) {
  for (int depth : {18, 34, 50, 101, 152}) {
    if (name != "resnet" + std::to_string(depth)) continue;
    return resnet({.depth = depth,
                   .num_classes = o.num_classes,
                   .in_channels = o.in_channels,
                   .small_input = o.small_input,
                   .zero_init_residual = o.zero_init_residual,
                   .width = o.width,
                   .seed = o.seed});
  }
  if (name == "small_cnn")
    return std::make_shared<SmallCNN>(SmallCNNOptions{.in_channels = o.in_channels,
                                                      .num_classes = o.num_classes,
                                                      .image_size = o.image_size,
                                                      .dropout = o.dropout,
                                                      .seed = o.seed});
  if (name == "mlp")
    return std::make_shared<MLP>(
        MLPOptions{.in_features = o.in_channels * o.image_size * o.image_size,
                   .num_classes = o.num_classes,
                   .seed = o.seed});
  std::string known;
  for (const std::string& n : model_names()) known += (known.empty() ? "" : ", ") + n;
  throw Error(cat("unknown model '", name, "'; known models: ", known));
}

}  // namespace trainer
