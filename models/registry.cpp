#include "models/registry.h"

#include "models/gpt.h"
#include "models/llama.h"
#include "models/lstm_lm.h"
#include "models/resnet.h"
#include "models/small.h"

namespace trainer {

namespace {

const int kResNetDepths[] = {18, 34, 50, 101, 152};

std::shared_ptr<Model> make_llama_model(const ModelOptions& o) {
  const int64_t kv = o.n_kv_head > 0 ? o.n_kv_head : o.n_head;
  if (o.n_head % kv != 0)
    throw Error(cat("model.num_key_value_heads ", kv, " does not divide model.num_attention_heads ",
                    o.n_head));
  if ((o.d_model / o.n_head) % 2 != 0)
    throw Error(cat("model.hidden_size / model.num_attention_heads = ", o.d_model / o.n_head,
                    ": rotary embeddings need an even head width"));
  return make_llama({.vocab_size = o.vocab_size,
                     .hidden_size = o.d_model,
                     .intermediate_size = o.intermediate_size > 0
                                              ? o.intermediate_size
                                              : llama_intermediate_size(o.d_model),
                     .num_hidden_layers = o.n_layer,
                     .num_attention_heads = o.n_head,
                     .num_key_value_heads = kv,
                     .max_position_embeddings = o.context,
                     .rms_norm_eps = o.rms_norm_eps,
                     .rope = o.rope,
                     .tie_word_embeddings = o.tie_weights,
                     .attention_dropout = o.dropout,
                     .seed = o.seed});
}

std::shared_ptr<Model> make_language_model(const std::string& name, const ModelOptions& o) {
  if (o.vocab_size < 1) throw Error(cat("model.vocab_size ", o.vocab_size, " must be at least 1"));
  if (name == "lstm_lm") {
    if (o.tie_weights && o.d_model != o.hidden)
      throw Error(cat("model.tie_weights needs model.d_model (", o.d_model, ") == model.hidden (",
                      o.hidden, ") for lstm_lm"));
    return make_lstm_lm({.vocab_size = o.vocab_size,
                         .embedding_dim = o.d_model,
                         .hidden_size = o.hidden,
                         .num_layers = o.n_layer,
                         .dropout = o.dropout,
                         .tie_weights = o.tie_weights,
                         .seed = o.seed});
  }
  if (o.d_model % o.n_head != 0)
    throw Error(cat("model.d_model ", o.d_model, " is not divisible by model.n_head ", o.n_head));
  if (name == "llama") return make_llama_model(o);
  return make_gpt({.vocab_size = o.vocab_size,
                   .block_size = o.context,
                   .n_layer = o.n_layer,
                   .n_head = o.n_head,
                   .n_embd = o.d_model,
                   .dropout = o.dropout,
                   .tie_weights = o.tie_weights,
                   .gelu = o.gelu,
                   .seed = o.seed,
                   .moe = o.moe,
                   .moe_every = o.moe_every});
}

}  // namespace

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (int depth : kResNetDepths) names.push_back("resnet" + std::to_string(depth));
  for (int depth : kResNetDepths) names.push_back("resnet" + std::to_string(depth) + "_small");
  for (const char* n : {"small_cnn", "mlp", "gpt", "llama", "lstm_lm"}) names.push_back(n);
  return names;
}

bool is_language_model(const std::string& name) { return model_traits(name).language_model; }

ModelTraits model_traits(const std::string& name) {
  if (name == "gpt" || name == "llama")
    return {.language_model = true, .sequence_parallel = true, .bounded_context = true};
  if (name == "lstm_lm") return {.language_model = true, .recurrent = true};
  return {};
}

std::shared_ptr<Model> make_model(const std::string& name, const ModelOptions& o) {
  if (is_language_model(name)) return make_language_model(name, o);
  for (int depth : kResNetDepths) {
    const std::string base = "resnet" + std::to_string(depth);
    if (name != base && name != base + "_small") continue;
    return resnet({.depth = depth,
                   .num_classes = o.num_classes,
                   .in_channels = o.in_channels,
                   .small_input = name != base,
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
