// Models by name, for recipes: make_model("resnet50", {.num_classes = 1000}).
//
// Names: resnet18, resnet34, resnet50, resnet101, resnet152 (models/resnet.h)
// and their small-image variants resnet18_small ... resnet152_small,
// small_cnn, mlp (models/small.h), gpt (models/gpt.h), llama
// (models/llama.h), lstm_lm (models/lstm_lm.h). Every model is a Model: its forward is a block list
// (layers/block_list.h).
//
// Bad options (an unknown name, a width that heads do not divide, tied
// weights of different widths) throw Error naming the recipe key they come
// from ("model.d_model 100 is not divisible by model.n_head 3").
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/ops.h"
#include "core/ops_transformer.h"
#include "layers/block_list.h"
#include "layers/moe.h"

namespace trainer {

struct ModelOptions {
  int64_t num_classes = 1000;
  int64_t in_channels = 3;
  int64_t image_size =
      224;  // small_cnn: the (square) input side; mlp: side * side * in_channels inputs
  bool zero_init_residual = false;
  int64_t width = 64;     // ResNets: channels of the stem and layer1
  double dropout = 0.25;  // small_cnn; the language models' everywhere
  // Language models (recipe keys model.<name>).
  int64_t vocab_size = 256;
  int64_t context = 256;  // gpt: block size; llama: max_position_embeddings
  int64_t n_layer = 6;    // gpt and llama layers, or lstm_lm layers
  int64_t n_head = 6;     // gpt and llama
  int64_t d_model = 384;  // gpt and llama width, or lstm_lm's embedding width
  int64_t hidden = 512;   // lstm_lm hidden size
  bool tie_weights = true;
  GeluApprox gelu = GeluApprox::none;  // gpt: exact (nanoGPT's nn.GELU()) or tanh
  // llama
  int64_t intermediate_size = 0;  // 0: llama_intermediate_size(d_model)
  int64_t n_kv_head = 0;          // 0: n_head
  double rms_norm_eps = 1e-6;
  RopeOptions rope{};
  // gpt: mixture-of-experts blocks (models/gpt.h's moe and moe_every; 0: dense)
  MoEOptions moe{};
  int64_t moe_every = 0;
  uint64_t seed = 0;
};

std::shared_ptr<Model> make_model(const std::string& name, const ModelOptions& options = {});
std::vector<std::string> model_names();
// gpt, llama and lstm_lm: models of token sequences (i64 [B, T] -> logits [B, T, V]).
bool is_language_model(const std::string& name);
// What the trainer asks of a model by name, before it is built (recipe
// checks, the planner): capabilities, not names, at the call sites.
struct ModelTraits {
  bool language_model = false;  // token sequences in, logits out (gpt, lstm_lm)
  // Carries its state from window to window and through time chunks
  // (lstm_lm): split over ranks by layers (a wavefront), not within them.
  bool recurrent = false;
  bool sequence_parallel = false;  // tensor parallelism may split its sequence too (gpt, llama)
  bool bounded_context = false;    // windows no longer than model.context (gpt, llama)
};
ModelTraits model_traits(const std::string& name);

}  // namespace trainer
