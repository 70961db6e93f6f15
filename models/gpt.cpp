#include "models/gpt.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/autograd.h"
#include "core/ops.h"
#include "layers/init.h"
#include "models/lm_vocab.h"
#include "models/tied.h"

namespace trainer {

namespace {

void init_linear(Linear& l, double std, Generator& gen) {
  normal_(l.weight, 0.0, std, gen);
  if (l.bias.defined()) l.bias.detach().fill_(0.0);
}

}  // namespace

GPT::GPT(const GPTOptions& o) : options_(o), vocab_rows_(o.vocab_size) {
  CHECK(o.vocab_size >= 1 && o.block_size >= 1 && o.n_layer >= 0 && o.n_head >= 1 &&
        o.n_embd >= 1 && o.n_embd % o.n_head == 0)
      << "GPT: vocab " << o.vocab_size << ", block " << o.block_size << ", " << o.n_layer
      << " layers, " << o.n_head << " heads, width " << o.n_embd;
  Generator gen(o.seed, kStreamInit);
  TransformerOptions t{.d_model = o.n_embd,
                       .num_heads = o.n_head,
                       .dropout = o.dropout,
                       .bias = o.bias,
                       .ln_eps = 1e-5,
                       .gelu = o.gelu,
                       .seed = o.seed};
  transformer = register_module("transformer", std::make_shared<ModuleDict>());
  wte = transformer->add("wte", std::make_shared<Embedding>(o.vocab_size, o.n_embd, gen));
  wpe = transformer->add("wpe", std::make_shared<Embedding>(o.block_size, o.n_embd, gen));
  drop = transformer->add("drop", std::make_shared<Dropout>(
                                      o.dropout, Generator(o.seed, dropout_stream(3 * o.n_layer))));
  auto blocks = transformer->add("h", std::make_shared<Sequential>());
  double proj_std = 0.02 / std::sqrt(2.0 * double(std::max<int64_t>(o.n_layer, 1)));
  MoEOptions moe = o.moe;
  moe.d_model = o.n_embd, moe.gelu = o.gelu, moe.bias = o.bias;
  for (int64_t i = 0; i < o.n_layer; ++i) {
    const bool sparse = o.moe_every > 0 && i % o.moe_every == o.moe_every - 1;
    auto b = std::make_shared<Block>(t, gen, uint64_t(i), sparse ? &moe : nullptr);
    init_linear(*b->attn->c_attn, 0.02, gen);
    init_linear(*b->attn->c_proj, proj_std, gen);
    if (b->mlp) {
      init_linear(*b->mlp->c_fc, 0.02, gen);
      init_linear(*b->mlp->c_proj, proj_std, gen);
    } else {
      init_linear(*b->moe->router, 0.02, gen);
      std::vector<std::shared_ptr<ExpertMLP>> experts = b->moe->expert_list;
      if (b->moe->shared) experts.push_back(b->moe->shared);
      for (const std::shared_ptr<ExpertMLP>& e : experts) {
        init_linear(*e->c_fc, 0.02, gen);
        init_linear(*e->c_proj, proj_std, gen);
      }
    }
    blocks->push_back(b);
    h.push_back(b);
  }
  ln_f = transformer->add("ln_f", std::make_shared<LayerNorm>(o.n_embd, 1e-5, o.bias));
  if (o.tie_weights) {
    lm_head = register_module("lm_head", std::make_shared<Linear>(wte->weight, Tensor()));
  } else {
    lm_head = register_module(
        "lm_head", std::make_shared<Linear>(o.n_embd, o.vocab_size, gen, /*bias=*/false));
    init_linear(*lm_head, 0.02, gen);
  }

  std::vector<BlockSpec> specs;
  specs.push_back(
      {.name = "embed",
       .members = {{"transformer.wte", wte}, {"transformer.wpe", wpe}, {"transformer.drop", drop}},
       .inputs = {"tokens"},
       .outputs = {"x"},
       .fn = [this](const TensorList& in) {
         const Tensor& tokens = in[0];
         CHECK(tokens.dim() == 2) << "GPT expects tokens [B, T], got " << tokens.shape_str();
         const int64_t T = tokens.size(1), ranks = cp_ ? cp_->size() : 1;
         CHECK(T >= 1 && T * ranks <= options_.block_size)
             << "GPT: sequence of " << T * ranks << " tokens, block size " << options_.block_size;
         Tensor pos = cp_ ? cp_->layout(T * ranks).positions_tensor(tokens.device())
                          : arange(T, DType::i64, tokens.device());
         if (tp_ && tp_->sequence_parallel()) {
           // This rank's part of the sequence: [B, T/n, D].
           const int64_t part = T / tp_->size();
           pos = pos.narrow(0, part * tp_->rank(), part);
         }
         return TensorList{(*drop)((*wte)(tokens) + (*wpe)(pos))};  // [B, T, D]
       }});
  for (size_t i = 0; i < h.size(); ++i) {
    const std::string name = "transformer.h." + std::to_string(i);
    Block* block = h[i].get();
    specs.push_back({.name = name, .members = {{name, h[i]}}, .fn = [block](const TensorList& in) {
                       return TensorList{(*block)(in[0])};
                     }});
  }
  specs.push_back({.name = "head",
                   .members = {{"transformer.ln_f", ln_f}, {"lm_head", lm_head}},
                   .inputs = {"x"},
                   .outputs = {"logits"},
                   .fn = [this](const TensorList& in) {
                     return TensorList{(*lm_head)((*ln_f)(in[0]))};
                   }});  // [B, T, V]
  set_blocks(BlockList({"tokens"}, {"logits"}, std::move(specs)));
}

void GPT::upgrade_loaded_state(std::map<std::string, Tensor>& tensors,
                               const std::string& file) const {
  // Older names: the same tensors without the "transformer." prefix.
  for (const char* old_prefix : {"wte.", "wpe.", "h.", "ln_f."}) {
    for (auto it = tensors.lower_bound(old_prefix);
         it != tensors.end() && it->first.rfind(old_prefix, 0) == 0;) {
      const std::string renamed = "transformer." + it->first;
      if (!tensors.count(renamed)) tensors.emplace(renamed, it->second);
      it = tensors.erase(it);
    }
  }
  if (options_.tie_weights)
    upgrade_tied_weight(tensors, "transformer.wte.weight", "lm_head.weight", file, "this GPT");
  for (const char* name : {"transformer.wte.weight", "lm_head.weight"})
    fit_vocab_rows(tensors, name, options_.vocab_size, vocab_rows_);
}

std::string GPT::tensor_parallel_note() const {
  return tp_ ? vocab_padding_note(options_.vocab_size, vocab_rows_, tp_->size()) : "";
}

std::map<std::string, Shape> GPT::shapes_at_tensor_parallel(int tp) const {
  return vocab_shapes("transformer.wte.weight", "lm_head.weight", options_.tie_weights,
                      options_.vocab_size, options_.n_embd, tp);
}

void GPT::shard_tensor_parallel(std::shared_ptr<TensorParallelGroup> g) {
  const int n = g->size();
  CHECK(!tp_) << "GPT::shard_tensor_parallel: already split";
  if (options_.n_head % n != 0)
    throw Error(cat("model.n_head ", options_.n_head, " is not divisible by parallel.tp ", n,
                    ": attention is split by heads; use parallel.tp of ",
                    divisors_of(options_.n_head)));
  if (n == 1) return;
  vocab_rows_ = shard_vocabulary(g, *wte, *lm_head, options_.tie_weights, options_.vocab_size);
  for (const std::shared_ptr<Block>& b : h) b->shard(g);
  if (g->sequence_parallel()) {
    // wpe, the embedding dropout and ln_f work on this rank's part of the sequence.
    autograd::NoGradGuard no_grad;
    ln_f->mark_sequence_parallel(*g);
    wpe->mark_sequence_parallel(*g);
    drop->set_stream_rank(uint64_t(g->rank()) + 1);
  }
  tp_ = std::move(g);
}

void GPT::set_context_parallel(std::shared_ptr<ContextParallelGroup> g) {
  CHECK(!cp_) << "GPT::set_context_parallel: already set";
  const int n = g->size();
  const int64_t heads = h.empty() ? options_.n_head : h[0]->attn->local_heads();
  if (g->attention() == ContextAttention::all_to_all && heads % n != 0)
    throw Error(cat("model.n_head ", options_.n_head, " (", heads,
                    " per tensor-parallel rank) is not divisible by parallel.cp ", n,
                    ": all-to-all attention splits the heads over the context-parallel ranks; "
                    "use parallel.cp_attention=ring"));
  if (n == 1) return;
  drop->set_context_parallel(g);
  for (const std::shared_ptr<Block>& b : h) {
    b->attn->set_context_parallel(g);
    b->attn->resid_dropout->set_context_parallel(g);
    if (b->mlp) b->mlp->dropout->set_context_parallel(g);
  }
  cp_ = std::move(g);
}

std::vector<std::shared_ptr<MoEFeedForward>> GPT::moe_layers() const {
  std::vector<std::shared_ptr<MoEFeedForward>> out;
  for (const std::shared_ptr<Block>& b : h)
    if (b->moe) out.push_back(b->moe);
  return out;
}

Tensor GPT::output_loss(const Tensor& logits, const Tensor& targets,
                        const CrossEntropyOptions& options) const {
  if (!tp_) return cross_entropy(logits, targets, options);
  return vocab_parallel_cross_entropy(logits, targets, wte->vocab_start(), *tp_, options,
                                      options_.vocab_size);
}

std::shared_ptr<GPT> make_gpt(const GPTOptions& options) { return std::make_shared<GPT>(options); }

}  // namespace trainer
