#include "models/llama.h"

#include <string>

#include "core/autograd.h"
#include "core/ops.h"
#include "layers/init.h"
#include "models/lm_vocab.h"
#include "models/tied.h"

namespace trainer {

int64_t llama_intermediate_size(int64_t hidden_size) {
  const int64_t width = (8 * hidden_size + 2) / 3;
  return (width + 255) / 256 * 256;
}

Llama::Llama(const LlamaOptions& o) : options_(o), vocab_rows_(o.vocab_size) {
  CHECK(o.vocab_size >= 1 && o.max_position_embeddings >= 1 && o.num_hidden_layers >= 0 &&
        o.num_attention_heads >= 1 && o.num_key_value_heads >= 1 &&
        o.hidden_size % o.num_attention_heads == 0 &&
        o.num_attention_heads % o.num_key_value_heads == 0 && o.intermediate_size >= 1)
      << "Llama: vocab " << o.vocab_size << ", " << o.num_hidden_layers << " layers, "
      << o.num_attention_heads << " heads, " << o.num_key_value_heads << " key/value heads, width "
      << o.hidden_size << ", MLP " << o.intermediate_size;
  Generator gen(o.seed, kStreamInit);
  const LlamaLayerOptions layer{.hidden_size = o.hidden_size,
                                .intermediate_size = o.intermediate_size,
                                .num_heads = o.num_attention_heads,
                                .num_kv_heads = o.num_key_value_heads,
                                .rms_norm_eps = o.rms_norm_eps,
                                .rope = o.rope,
                                .attention_dropout = o.attention_dropout,
                                .seed = o.seed};
  const double std = o.initializer_range;
  model = register_module("model", std::make_shared<ModuleDict>());
  embed_tokens =
      model->add("embed_tokens", std::make_shared<Embedding>(o.vocab_size, o.hidden_size, gen));
  normal_(embed_tokens->weight, 0.0, std, gen);
  auto stack = model->add("layers", std::make_shared<Sequential>());
  for (int64_t i = 0; i < o.num_hidden_layers; ++i) {
    auto l = std::make_shared<LlamaDecoderLayer>(layer, gen, uint64_t(i));
    for (Linear* lin : {l->self_attn->q_proj.get(), l->self_attn->k_proj.get(),
                        l->self_attn->v_proj.get(), l->self_attn->o_proj.get(),
                        l->mlp->gate_proj.get(), l->mlp->up_proj.get(), l->mlp->down_proj.get()})
      normal_(lin->weight, 0.0, std, gen);
    stack->push_back(l);
    layers.push_back(l);
  }
  norm = model->add("norm", std::make_shared<RMSNorm>(o.hidden_size, o.rms_norm_eps));
  if (o.tie_word_embeddings) {
    lm_head = register_module("lm_head", std::make_shared<Linear>(embed_tokens->weight, Tensor()));
  } else {
    lm_head = register_module(
        "lm_head", std::make_shared<Linear>(o.hidden_size, o.vocab_size, gen, /*bias=*/false));
    normal_(lm_head->weight, 0.0, std, gen);
  }

  std::vector<BlockSpec> specs;
  specs.push_back({.name = "embed",
                   .members = {{"model.embed_tokens", embed_tokens}},
                   .inputs = {"tokens"},
                   .outputs = {"x"},
                   .fn = [this](const TensorList& in) {
                     const Tensor& tokens = in[0];
                     CHECK(tokens.dim() == 2)
                         << "Llama expects tokens [B, T], got " << tokens.shape_str();
                     const int64_t T = tokens.size(1) * (cp_ ? cp_->size() : 1);
                     CHECK(T >= 1 && T <= options_.max_position_embeddings)
                         << "Llama: sequence of " << T << " tokens, longest "
                         << options_.max_position_embeddings;
                     return TensorList{(*embed_tokens)(tokens)};  // [B, T, D]
                   }});
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string name = "model.layers." + std::to_string(i);
    LlamaDecoderLayer* l = layers[i].get();
    specs.push_back({.name = name, .members = {{name, layers[i]}}, .fn = [l](const TensorList& in) {
                       return TensorList{(*l)(in[0])};
                     }});
  }
  specs.push_back({.name = "head",
                   .members = {{"model.norm", norm}, {"lm_head", lm_head}},
                   .inputs = {"x"},
                   .outputs = {"logits"},
                   .fn = [this](const TensorList& in) {
                     return TensorList{(*lm_head)((*norm)(in[0]))};
                   }});  // [B, T, V]
  set_blocks(BlockList({"tokens"}, {"logits"}, std::move(specs)));
}

void Llama::upgrade_loaded_state(std::map<std::string, Tensor>& tensors,
                                 const std::string& file) const {
  if (options_.tie_word_embeddings)
    upgrade_tied_weight(tensors, "model.embed_tokens.weight", "lm_head.weight", file, "this Llama");
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight"})
    fit_vocab_rows(tensors, name, options_.vocab_size, vocab_rows_);
}

std::string Llama::tensor_parallel_note() const {
  return tp_ ? vocab_padding_note(options_.vocab_size, vocab_rows_, tp_->size()) : "";
}

std::map<std::string, Shape> Llama::shapes_at_tensor_parallel(int tp) const {
  return vocab_shapes("model.embed_tokens.weight", "lm_head.weight", options_.tie_word_embeddings,
                      options_.vocab_size, options_.hidden_size, tp);
}

void Llama::shard_tensor_parallel(std::shared_ptr<TensorParallelGroup> g) {
  const int n = g->size();
  CHECK(!tp_) << "Llama::shard_tensor_parallel: already split";
  const LlamaOptions& o = options_;
  if (o.num_attention_heads % n != 0)
    throw Error(cat(
        "model.num_attention_heads ", o.num_attention_heads, " is not divisible by parallel.tp ", n,
        ": attention is split by heads; use parallel.tp of ", divisors_of(o.num_attention_heads)));
  if (o.num_key_value_heads % n != 0 && n % o.num_key_value_heads != 0)
    throw Error(cat("model.num_key_value_heads ", o.num_key_value_heads, " and parallel.tp ", n,
                    ": key/value heads are split over tp ranks or replicated on them, so one "
                    "must divide the other"));
  if (o.intermediate_size % n != 0)
    throw Error(cat("model.intermediate_size ", o.intermediate_size,
                    " is not divisible by parallel.tp ", n));
  if (n == 1) return;
  vocab_rows_ = shard_vocabulary(g, *embed_tokens, *lm_head, o.tie_word_embeddings, o.vocab_size);
  for (const std::shared_ptr<LlamaDecoderLayer>& l : layers) l->shard(g);
  if (g->sequence_parallel()) {
    autograd::NoGradGuard no_grad;
    norm->mark_sequence_parallel(*g);
  }
  tp_ = std::move(g);
}

void Llama::set_context_parallel(std::shared_ptr<ContextParallelGroup> g) {
  CHECK(!cp_) << "Llama::set_context_parallel: already set";
  const int n = g->size();
  for (const std::shared_ptr<LlamaDecoderLayer>& l : layers) {
    const int64_t heads = l->self_attn->local_heads(), kv = l->self_attn->local_kv_heads();
    if (g->attention() == ContextAttention::all_to_all && (heads % n != 0 || kv % n != 0))
      throw Error(cat("model.num_attention_heads ", options_.num_attention_heads,
                      " and num_key_value_heads ", options_.num_key_value_heads, " (", heads,
                      " and ", kv, " per tensor-parallel rank) must both divide by parallel.cp ", n,
                      ": all-to-all attention splits the heads over the context-parallel ranks; "
                      "use parallel.cp_attention=ring"));
  }
  if (n == 1) return;
  for (const std::shared_ptr<LlamaDecoderLayer>& l : layers) l->self_attn->set_context_parallel(g);
  cp_ = std::move(g);
}

Tensor Llama::output_loss(const Tensor& logits, const Tensor& targets,
                          const CrossEntropyOptions& options) const {
  if (!tp_) return cross_entropy(logits, targets, options);
  return vocab_parallel_cross_entropy(logits, targets, embed_tokens->vocab_start(), *tp_, options,
                                      options_.vocab_size);
}

std::shared_ptr<Llama> make_llama(const LlamaOptions& options) {
  return std::make_shared<Llama>(options);
}

}  // namespace trainer
