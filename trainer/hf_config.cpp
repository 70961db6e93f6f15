#include "trainer/hf_config.h"

#include <nlohmann/json.hpp>

#include "models/llama.h"

namespace trainer {

namespace {

using json = nlohmann::ordered_json;

json rope_scaling(const ModelRecipe& m) {
  if (m.rope_scaling == "none") return nullptr;
  json s = {{"rope_type", m.rope_scaling}, {"factor", m.rope_factor}};
  if (m.rope_scaling == "llama3") {
    s["low_freq_factor"] = m.rope_low_freq_factor;
    s["high_freq_factor"] = m.rope_high_freq_factor;
    s["original_max_position_embeddings"] = m.rope_original_max_position_embeddings;
  }
  return s;
}

}  // namespace

std::string hf_config_json(const Recipe& recipe, int64_t vocab, DType dtype) {
  const ModelRecipe& m = recipe.model;
  if (m.name != "llama") return "";
  const int64_t kv = m.num_key_value_heads > 0 ? m.num_key_value_heads : m.n_head;
  const json config = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"vocab_size", vocab},
      {"hidden_size", m.d_model},
      {"intermediate_size",
       m.intermediate_size > 0 ? m.intermediate_size : llama_intermediate_size(m.d_model)},
      {"num_hidden_layers", m.n_layer},
      {"num_attention_heads", m.n_head},
      {"num_key_value_heads", kv},
      {"head_dim", m.d_model / m.n_head},
      {"max_position_embeddings", m.context},
      {"rms_norm_eps", m.rms_norm_eps},
      {"rope_theta", m.rope_theta},
      {"rope_scaling", rope_scaling(m)},
      {"tie_word_embeddings", m.tie_weights},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"attention_dropout", m.dropout},
      {"initializer_range", 0.02},
      {"torch_dtype", dtype == DType::bf16  ? "bfloat16"
                      : dtype == DType::f16 ? "float16"
                                            : "float32"},
  };
  return config.dump(2) + "\n";
}

}  // namespace trainer
