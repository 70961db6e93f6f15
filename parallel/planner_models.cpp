// The planner's model descriptions (parallel/planner.h): each model
// family's blocks with their parameters, forward FLOPs, saved activations,
// messages and tensor-parallel allreduces, per sample.
#include <algorithm>
#include <map>

#include "core/check.h"
#include "parallel/planner.h"

namespace trainer::parallel {

// ---- models ----

double ModelDesc::params() const {
  double sum = 0;
  for (const BlockCost& block : blocks) sum += block.params;
  return sum;
}

double ModelDesc::forward_flops() const {
  double sum = 0;
  for (const BlockCost& block : blocks) sum += block.forward_flops;
  return sum;
}

ModelDesc gpt_model(const GptShape& shape) {
  const double T = double(shape.context), d = double(shape.d_model), a = double(shape.n_head);
  const int64_t pad = std::max<int64_t>(1, shape.pad_vocab_to);
  const int64_t vocab = (shape.vocab + pad - 1) / pad * pad;
  const double V = double(vocab);
  ModelDesc model;
  model.name = cat("gpt L=", shape.n_layer, " d=", shape.d_model, " a=", shape.n_head,
                   " T=", shape.context, " V=", vocab);
  model.tokens_per_sample = T;
  model.language_model = true;
  model.n_head = shape.n_head;
  model.d_model = shape.d_model;
  model.vocab = vocab;
  model.n_layer = shape.n_layer;
  model.experts = shape.experts;
  // Token and position embeddings; the token one is split over tp by vocabulary
  // (one allreduce of its output forward).
  model.blocks.push_back({.name = "embed",
                          .params = V * d + T * d,
                          .output_bytes = 2 * T * d,
                          .tp_allreduces = 1,
                          .tp_allreduces_fwd = 1,
                          .gemm_rows = T,
                          .gemm_width = d,
                          .tp_split = true});
  const double H = double(shape.moe_hidden > 0 ? shape.moe_hidden : 4 * shape.d_model);
  const double E = double(shape.experts), k = double(shape.top_k);
  for (int64_t layer = 0; layer < shape.n_layer; ++layer) {
    const bool moe = shape.experts > 0 && layer % shape.moe_every == shape.moe_every - 1;
    model.blocks.push_back({
        .name = cat("h.", layer),
        .params = 12 * d * d + 13 * d,  // QKV, proj, 2 MLP matrices; biases, 2 layer norms
        .forward_flops = T * (24 * d * d + 4 * T * d),
        .selective_flops = T * 4 * T * d,  // scores and their product with V
        .act_replicated = 10 * T * d,      // layer-norm inputs, residual, dropout masks
        .act_sharded = 24 * T * d + 5 * a * T * T,
        .act_selective = 5 * a * T * T,  // softmax, its dropout mask, the scores
        .input_bytes = 2 * T * d,
        .output_bytes = 2 * T * d,
        .tp_allreduces = 4,  // attention and MLP outputs forward, their inputs' gradients backward
        .tp_allreduces_fwd = 2,
        .gemm_rows = T,
        .gemm_width = d,
        .tp_split = true,
        .is_layer = true,
        .kv_bytes = 4 * T * d,  // K and V at 16 bits
    });
    if (!moe) continue;
    // The MLP (8 d^2 + 5 d parameters, 16 T d FLOPs per token, 16 T d of the
    // split activations) becomes the router and E experts, k of them active.
    BlockCost& b = model.blocks.back();
    b.expert_params = E * (2 * d * H + H + d);
    b.params += d * E + b.expert_params - (8 * d * d + 5 * d);
    b.forward_flops += T * (2 * d * E + k * 4 * d * H - 16 * d * d);
    b.act_sharded += 16 * T * d * (k * H / (4 * d) - 1) + 4 * k * T * d;
    b.a2a_bytes = 2 * k * T * d;
  }
  // Final layer norm and the logits (vocabulary-parallel, fp32 softmax kept for backward).
  model.blocks.push_back({.name = "head",
                          .params = shape.tie_weights ? 2 * d : V * d + 2 * d,
                          .forward_flops = 2 * T * d * V,
                          .act_replicated = 4 * T * d,
                          .act_sharded = 4 * T * V,
                          .input_bytes = 2 * T * d,
                          .output_bytes = 4 * T,
                          .gemm_rows = T,
                          .gemm_width = V,
                          .tp_split = true});
  if (shape.tie_weights) model.tied_params = V * d;
  return model;
}

ModelDesc llama_model(const LlamaShape& shape) {
  const double T = double(shape.context), d = double(shape.d_model), V = double(shape.vocab);
  const double kv = d * double(shape.n_kv_head) / double(shape.n_head);
  const double I = double(shape.intermediate);
  ModelDesc model;
  model.name = cat("llama L=", shape.n_layer, " d=", shape.d_model, " a=", shape.n_head,
                   " kv=", shape.n_kv_head, " I=", shape.intermediate, " T=", shape.context,
                   " V=", shape.vocab);
  model.tokens_per_sample = T;
  model.language_model = true;
  model.n_head = shape.n_head;
  model.d_model = shape.d_model;
  model.vocab = shape.vocab;
  model.n_layer = shape.n_layer;
  model.blocks.push_back({.name = "embed",
                          .params = V * d,
                          .output_bytes = 2 * T * d,
                          .tp_allreduces = 1,
                          .tp_allreduces_fwd = 1,
                          .gemm_rows = T,
                          .gemm_width = d,
                          .tp_split = true});
  const double matrices = 2 * d * d + 2 * d * kv + 3 * d * I;
  for (int64_t layer = 0; layer < shape.n_layer; ++layer)
    model.blocks.push_back({
        .name = cat("model.layers.", layer),
        .params = matrices + 2 * d,
        .forward_flops = T * (2 * matrices + 4 * T * d),
        .act_replicated = 8 * T * d,
        .act_sharded = 2 * T * (2 * d + 2 * kv) + 8 * T * I,
        .input_bytes = 2 * T * d,
        .output_bytes = 2 * T * d,
        .tp_allreduces = 4,
        .tp_allreduces_fwd = 2,
        .gemm_rows = T,
        .gemm_width = d,
        .tp_split = true,
        .is_layer = true,
        .kv_bytes = 4 * T * kv,  // K and V at 16 bits
    });
  model.blocks.push_back({.name = "head",
                          .params = shape.tie_weights ? d : V * d + d,
                          .forward_flops = 2 * T * d * V,
                          .act_replicated = 4 * T * d,
                          .act_sharded = 4 * T * V,
                          .input_bytes = 2 * T * d,
                          .output_bytes = 4 * T,
                          .gemm_rows = T,
                          .gemm_width = V,
                          .tp_split = true});
  if (shape.tie_weights) model.tied_params = V * d;
  return model;
}

namespace {

// A convolution's parameters (no bias: a batch norm follows) and its output elements.
struct ConvCost {
  double params = 0, flops = 0, out_elements = 0;
};
ConvCost conv(int64_t in, int64_t out, int64_t kernel, int64_t out_side) {
  const double params = double(kernel * kernel * in * out);
  const double positions = double(out_side * out_side);
  return {params + 2.0 * double(out), 2 * params * positions, double(out) * positions};
}

// A block made of convolutions: conv output, batch-norm output and ReLU mask
// saved per conv (3 values of 16 bits per output element).
void add_convs(BlockCost& block, std::initializer_list<ConvCost> convs) {
  for (const ConvCost& c : convs) {
    block.params += c.params;
    block.forward_flops += c.flops;
    block.act_replicated += 3 * 2 * c.out_elements;
  }
}

}  // namespace

ModelDesc resnet_model(const ResNetShape& shape) {
  static const std::map<int, std::vector<int>> kBlocks = {{18, {2, 2, 2, 2}},
                                                          {34, {3, 4, 6, 3}},
                                                          {50, {3, 4, 6, 3}},
                                                          {101, {3, 4, 23, 3}},
                                                          {152, {3, 8, 36, 3}}};
  auto it = kBlocks.find(shape.depth);
  if (it == kBlocks.end()) throw Error(cat("resnet depth ", shape.depth, " is not 18 .. 152"));
  const bool bottleneck = shape.depth >= 50;
  const int64_t expansion = bottleneck ? 4 : 1;
  ModelDesc model;
  model.name = cat("resnet", shape.depth, shape.small ? "_small" : "", " ", shape.image_size, "px");
  model.tp_channels = shape.width;
  int64_t side = shape.small ? shape.image_size : (shape.image_size + 1) / 2;
  BlockCost stem{
      .name = "stem",
      .input_bytes = 2.0 * double(shape.in_channels * shape.image_size * shape.image_size)};
  add_convs(stem, {conv(shape.in_channels, shape.width, shape.small ? 3 : 7, side)});
  if (!shape.small) side = (side + 1) / 2;  // max-pool
  stem.output_bytes = 2.0 * double(shape.width * side * side);
  stem.gemm_rows = double(side * side);
  stem.gemm_width = double(shape.width);
  model.blocks.push_back(stem);
  int64_t in = shape.width;
  for (int stage = 0; stage < 4; ++stage) {
    const int64_t c = shape.width << stage;
    for (int index = 0; index < it->second[size_t(stage)]; ++index) {
      const int stride = stage > 0 && index == 0 ? 2 : 1;
      const int64_t in_side = side;
      side = (side + stride - 1) / stride;
      const int64_t out = c * expansion;
      // tp splits the block's inner channels (models/resnet.h): one
      // allreduce of the last conv's partial sums forward, one of the
      // input's gradient backward.
      BlockCost block{.name = cat("layer", stage + 1, ".", index),
                      .input_bytes = 2.0 * double(in * in_side * in_side),
                      .output_bytes = 2.0 * double(out * side * side),
                      .tp_allreduces = 2,
                      .tp_allreduces_fwd = 1,
                      .gemm_rows = double(side * side),
                      .gemm_width = double(c),
                      .tp_split = true};
      if (bottleneck)
        add_convs(block, {conv(in, c, 1, in_side), conv(c, c, 3, side), conv(c, out, 1, side)});
      else
        add_convs(block, {conv(in, c, 3, side), conv(c, c, 3, side)});
      if (stride != 1 || in != out) add_convs(block, {conv(in, out, 1, side)});
      model.blocks.push_back(block);
      in = out;
    }
  }
  const double features = double(in), classes = double(shape.num_classes);
  model.blocks.push_back({.name = "head",
                          .params = features * classes + classes,
                          .forward_flops = 2 * features * classes,
                          .act_replicated = 2 * features,
                          .input_bytes = 2.0 * double(in * side * side),
                          .output_bytes = 4 * classes,
                          .gemm_width = classes});
  return model;
}

ModelDesc lstm_lm_model(int64_t vocab, int64_t embedding, int64_t hidden, int64_t layers,
                        int64_t sequence, bool tie_weights) {
  const double V = double(vocab), E = double(embedding), H = double(hidden), T = double(sequence);
  ModelDesc model;
  model.name = cat("lstm_lm L=", layers, " E=", embedding, " H=", hidden, " V=", vocab);
  model.tokens_per_sample = T;
  model.language_model = true;
  model.blocks.push_back({.name = "embed",
                          .params = V * E,
                          .output_bytes = 2 * T * E,
                          .gemm_rows = T,
                          .gemm_width = E});
  BlockCost rnn{.name = "rnn",
                .input_bytes = 2 * T * E,
                .output_bytes = 2 * T * H,
                .gemm_width = 4 * H};  // one time step: a GEMM of b rows
  for (int64_t layer = 0; layer < layers; ++layer) {
    const double in = layer == 0 ? E : H;
    rnn.params += 4 * H * (in + H) + 8 * H;
    rnn.forward_flops += T * 2 * 4 * H * (in + H);
    rnn.act_replicated += 2 * T * (4 * H + 2 * H + in);  // gates, c and h, the input
  }
  model.blocks.push_back(rnn);
  model.blocks.push_back({.name = "head",
                          .params = (tie_weights ? 0 : V * H) + V,
                          .forward_flops = 2 * T * H * V,
                          .act_replicated = 4 * T * V,
                          .input_bytes = 2 * T * H,
                          .output_bytes = 4 * T,
                          .gemm_rows = T,
                          .gemm_width = V});
  if (tie_weights) model.tied_params = V * E;
  return model;
}

ModelDesc mlp_model(int64_t in_features, const std::vector<int64_t>& hidden, int64_t classes) {
  ModelDesc model;
  model.name = cat("mlp ", in_features, " inputs");
  std::vector<int64_t> widths{in_features};
  widths.insert(widths.end(), hidden.begin(), hidden.end());
  widths.push_back(classes);
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    const double in = double(widths[i]), out = double(widths[i + 1]);
    model.blocks.push_back({.name = cat("fc", i + 1),
                            .params = in * out + out,
                            .forward_flops = 2 * in * out,
                            .act_replicated = 2 * in + 2 * out,
                            .input_bytes = 2 * in,
                            .output_bytes = 2 * out,
                            .gemm_width = out});
  }
  return model;
}

ModelDesc small_cnn_model(int64_t in_channels, int64_t image_size, int64_t classes) {
  ModelDesc model;
  model.name = cat("small_cnn ", image_size, "px");
  const int64_t side = image_size;
  BlockCost conv1{.name = "conv1",
                  .input_bytes = 2.0 * double(in_channels * side * side),
                  .output_bytes = 2.0 * double(32 * (side / 2) * (side / 2)),
                  .gemm_rows = double(side * side),
                  .gemm_width = 32};
  add_convs(conv1, {conv(in_channels, 32, 3, side)});
  BlockCost conv2{.name = "conv2",
                  .input_bytes = conv1.output_bytes,
                  .output_bytes = 2.0 * double(64 * (side / 4) * (side / 4)),
                  .gemm_rows = double((side / 2) * (side / 2)),
                  .gemm_width = 64};
  add_convs(conv2, {conv(32, 64, 3, side / 2)});
  model.blocks = {conv1, conv2};
  const double flat = double(64 * (side / 4) * (side / 4)), c = double(classes);
  model.blocks.push_back({.name = "fc1",
                          .params = flat * 128 + 128,
                          .forward_flops = 2 * flat * 128,
                          .act_replicated = 2 * (flat + 128),
                          .input_bytes = 2 * flat,
                          .output_bytes = 2 * 128,
                          .gemm_width = 128});
  model.blocks.push_back({.name = "fc2",
                          .params = 128 * c + c,
                          .forward_flops = 2 * 128 * c,
                          .act_replicated = 2 * 128,
                          .input_bytes = 2 * 128,
                          .output_bytes = 4 * c,
                          .gemm_width = c});
  return model;
}

}  // namespace trainer::parallel
