#include "models/resnet.h"

#include <string>

#include "core/check.h"

namespace trainer {

namespace {

std::shared_ptr<Conv2d> conv(int64_t in, int64_t out, int64_t k, int64_t stride, Generator& gen) {
  Conv2dOptions o{.in_channels = in,
                  .out_channels = out,
                  .kernel = {k, k},
                  .attrs = {.stride = {stride, stride}, .padding = {k / 2, k / 2}},
                  .bias = false,
                  .init = ConvInit::kaiming_normal_fan_out};
  return std::make_shared<Conv2d>(o, gen);
}

// conv1x1 (stride) -> bn, when the block changes the shape of its input.
std::shared_ptr<Sequential> make_downsample(int64_t in, int64_t out, int64_t stride,
                                            Generator& gen) {
  if (stride == 1 && in == out) return nullptr;
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      conv(in, out, 1, stride, gen), std::make_shared<BatchNorm2d>(out)});
}

// The closing residual of a block: relu(out + identity), channels-last kept.
Tensor residual_relu(const Tensor& out, const Tensor& x, const std::shared_ptr<Sequential>& down) {
  Tensor identity = down ? (*down)(x) : x;
  return relu_channels_last(add_channels_last(out, identity));
}

}  // namespace

BasicBlock::BasicBlock(int64_t in_planes, int64_t planes, int64_t stride, Generator& gen) {
  conv1 = register_module("conv1", conv(in_planes, planes, 3, stride, gen));
  bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(planes));
  conv2 = register_module("conv2", conv(planes, planes, 3, 1, gen));
  bn2 = register_module("bn2", std::make_shared<BatchNorm2d>(planes));
  downsample = make_downsample(in_planes, planes * kExpansion, stride, gen);
  if (downsample) register_module("downsample", downsample);
}

Tensor BasicBlock::forward(const Tensor& x) {
  Tensor out = conv_bn(*conv1, *bn1, x, /*relu=*/true);
  out = conv_bn(*conv2, *bn2, out, /*relu=*/false);
  return residual_relu(out, x, downsample);
}

// One allreduce each way per block: conv2's partial sums forward, the
// gradient of conv1's input (copy_to_region) backward.
void BasicBlock::shard(const std::shared_ptr<TensorParallelGroup>& g) {
  conv1->shard(g, ConvSplit::output_channels);
  bn1->shard(*g);
  conv2->shard(g, ConvSplit::input_channels);
}

Bottleneck::Bottleneck(int64_t in_planes, int64_t planes, int64_t stride, Generator& gen) {
  conv1 = register_module("conv1", conv(in_planes, planes, 1, 1, gen));
  bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(planes));
  conv2 = register_module("conv2", conv(planes, planes, 3, stride, gen));
  bn2 = register_module("bn2", std::make_shared<BatchNorm2d>(planes));
  conv3 = register_module("conv3", conv(planes, planes * kExpansion, 1, 1, gen));
  bn3 = register_module("bn3", std::make_shared<BatchNorm2d>(planes * kExpansion));
  downsample = make_downsample(in_planes, planes * kExpansion, stride, gen);
  if (downsample) register_module("downsample", downsample);
}

Tensor Bottleneck::forward(const Tensor& x) {
  Tensor out = conv_bn(*conv1, *bn1, x, /*relu=*/true);
  out = conv_bn(*conv2, *bn2, out, /*relu=*/true);
  out = conv_bn(*conv3, *bn3, out, /*relu=*/false);
  return residual_relu(out, x, downsample);
}

// The pair conv1 (1x1) -> conv2 (3x3) is split, as a BasicBlock's pair: one
// allreduce each way. Of the three convs' 4p^2, 9p^2 and 4p^2 weights (p
// planes), the 3x3 must be split; splitting conv3 as well (over output channels) would
// leave bn3's output a channel shard, and the residual sum needs it whole:
// an allgather forward and an allreduce backward more per block. Keeping
// conv3 rather than conv1 whole (conv2 over output channels, conv3 over
// input channels, the other pair) is the cheaper of the two: conv3 runs
// after conv2's stride, so at a quarter of conv1's positions in the first
// block of layers 2 to 4, and the same elsewhere.
void Bottleneck::shard(const std::shared_ptr<TensorParallelGroup>& g) {
  conv1->shard(g, ConvSplit::output_channels);
  bn1->shard(*g);
  conv2->shard(g, ConvSplit::input_channels);
}

template <class Block>
std::shared_ptr<Sequential> ResNet::make_layer(int64_t& in_planes, int64_t planes, int blocks,
                                               int64_t stride, Generator& gen) {
  auto layer = std::make_shared<Sequential>();
  for (int b = 0; b < blocks; ++b) {
    layer->push_back(std::make_shared<Block>(in_planes, planes, b == 0 ? stride : 1, gen));
    in_planes = planes * Block::kExpansion;
  }
  return layer;
}

ResNet::ResNet(const ResNetOptions& o) : options_(o) {
  struct Config {
    int depth;
    bool bottleneck;
    int blocks[4];
  };
  static const Config kConfigs[] = {{18, false, {2, 2, 2, 2}},
                                    {34, false, {3, 4, 6, 3}},
                                    {50, true, {3, 4, 6, 3}},
                                    {101, true, {3, 4, 23, 3}},
                                    {152, true, {3, 8, 36, 3}}};
  const Config* cfg = nullptr;
  for (const Config& c : kConfigs)
    if (c.depth == o.depth) cfg = &c;
  if (!cfg) throw Error(cat("ResNet depth ", o.depth, " is not one of 18, 34, 50, 101, 152"));
  CHECK(o.num_classes >= 1 && o.in_channels >= 1 && o.width >= 1) << "ResNet options";

  Generator gen(o.seed, kStreamInit);
  conv1_ = register_module("conv1", o.small_input ? conv(o.in_channels, o.width, 3, 1, gen)
                                                  : conv(o.in_channels, o.width, 7, 2, gen));
  bn1_ = register_module("bn1", std::make_shared<BatchNorm2d>(o.width));
  maxpool_ = std::make_shared<MaxPool2d>(
      Pool2dAttrs{.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}});
  int64_t in_planes = o.width;
  for (int i = 0; i < 4; ++i) {
    int64_t planes = o.width << i, stride = i == 0 ? 1 : 2;
    layers_[i] = cfg->bottleneck
                     ? make_layer<Bottleneck>(in_planes, planes, cfg->blocks[i], stride, gen)
                     : make_layer<BasicBlock>(in_planes, planes, cfg->blocks[i], stride, gen);
    register_module("layer" + std::to_string(i + 1), layers_[i]);
  }
  avgpool_ = std::make_shared<AdaptiveAvgPool2d>(1, 1);
  fc_ = register_module("fc", std::make_shared<Linear>(in_planes, o.num_classes, gen));

  // Convs were drawn kaiming_normal(fan_out), batch norms start at weight 1,
  // bias 0, fc as nn.Linear: torchvision's initialisation.
  if (o.zero_init_residual) {
    apply([](Module& m) {
      if (auto* b = dynamic_cast<Bottleneck*>(&m)) b->bn3->weight.detach().zero_();
      if (auto* b = dynamic_cast<BasicBlock*>(&m)) b->bn2->weight.detach().zero_();
    });
  }

  std::vector<BlockSpec> specs;
  specs.push_back({.name = "stem",
                   .members = {{"conv1", conv1_}, {"bn1", bn1_}},
                   .fn = [this](const TensorList& in) {
                     Tensor y = conv_bn(*conv1_, *bn1_, in[0], /*relu=*/true);
                     return TensorList{options_.small_input ? y : (*maxpool_)(y)};
                   }});
  for (int i = 0; i < 4; ++i)
    for (const auto& [index, block] : layers_[i]->children()) {
      const std::string name = "layer" + std::to_string(i + 1) + "." + index;
      Module* m = block.get();
      specs.push_back({.name = name, .members = {{name, block}}, .fn = [m](const TensorList& in) {
                         return TensorList{(*m)(in[0])};
                       }});
    }
  specs.push_back({.name = "head",
                   .members = {{"fc", fc_}},
                   .outputs = {"logits"},
                   .fn = [this](const TensorList& in) {
                     return TensorList{(*fc_)((*avgpool_)(in[0]).flatten(1))};
                   }});
  set_blocks(BlockList({"x"}, {"logits"}, std::move(specs)));
}

void ResNet::shard_tensor_parallel(std::shared_ptr<TensorParallelGroup> g) {
  CHECK(!tp_) << "ResNet::shard_tensor_parallel: already split";
  const int n = g->size();
  if (g->sequence_parallel())
    throw Error(
        "parallel.sequence_parallel splits a Transformer's sequence; a ResNet has none: set it "
        "to false");
  if (options_.width % n != 0)
    throw Error(cat("the ResNet's width ", options_.width,
                    " (the channels of its stem and layer1; the later layers double it) is not "
                    "divisible by parallel.tp ",
                    n, ": its blocks are split by channels; use parallel.tp of ",
                    divisors_of(options_.width)));
  if (n == 1) return;
  for (const std::shared_ptr<Sequential>& layer : layers_)
    for (const auto& [index, block] : layer->children()) {
      if (auto* basic = dynamic_cast<BasicBlock*>(block.get())) basic->shard(g);
      if (auto* bottleneck = dynamic_cast<Bottleneck*>(block.get())) bottleneck->shard(g);
    }
  tp_ = std::move(g);
}

std::shared_ptr<ResNet> resnet(const ResNetOptions& options) {
  return std::make_shared<ResNet>(options);
}

}  // namespace trainer
