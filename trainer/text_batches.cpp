// The language models' batch source: the text corpus (a text file, or the
// token shards of data.name: tokens) and its windows, the
// training loss over every token, evaluation, and the recurrent state
// carried between batches under data.sampling: contiguous (truncated
// backpropagation through time, as PyTorch's word_language_model).
//
// Carried state: with contiguous streams, row i of consecutive micro-batches
// continues the same text, so the LSTM LM starts each micro-batch from the
// (detached) state the previous one ended in. The state is part of the
// training state: every rank saves its own rows in
// stream_state.rank<r>.safetensors next to the optimizer state, a new epoch
// starts from zeros, and a resumed one from the saved state. Evaluation
// streams are cut the same way; the state is carried through them from zeros.
#include <cmath>

#include "core/ops.h"
#include "data/token_shards.h"
#include "layers/rnn.h"
#include "models/lstm_lm.h"
#include "models/registry.h"
#include "trainer/batch_source.h"
#include "trainer/checkpoint.h"
#include "trainer/device.h"
#include "trainer/model_setup.h"

namespace trainer {

namespace {

// Cross-entropy of logits [N, T, V] against targets [N, T] over all N x T
// tokens, as the model computes its loss (vocabulary-parallel under tensor
// parallelism, Model::output_loss).
Tensor token_cross_entropy(const Model* model, const Tensor& logits, const Tensor& targets,
                           const CrossEntropyOptions& options = {}) {
  if (!model) return cross_entropy(logits.flatten(0, 1), targets.flatten(), options);
  return model->output_loss(logits.flatten(0, 1), targets.flatten(), options);
}

class TextBatches final : public BatchSource {
 public:
  TextBatches(const Recipe& recipe, const RankLayout& layout, int64_t micro_batch);

  void bind(std::shared_ptr<Module> model) override {
    BatchSource::bind(model);
    lstm_ = std::dynamic_pointer_cast<LSTMLM>(model_);
    loss_model_ = dynamic_cast<const Model*>(model_.get());
    carried_.assign(lstm_ ? size_t(2 * lstm_->options().num_layers) : 0, Tensor());
  }
  bool is_language_model() const override { return true; }
  const char* item_name() const override { return "tokens"; }
  int64_t vocab_size() const override { return corpus_->tokenizer().size(); }
  const data::Tokenizer& vocab() const override { return corpus_->tokenizer(); }
  int64_t batches_per_epoch() const override {
    return train_windows_->windows_per_epoch() / micro_batch_;
  }
  int64_t samples_per_epoch() const override { return train_windows_->windows_per_epoch(); }
  std::string epoch_text() const override {
    return cat(train_windows_->windows_per_epoch(), " training windows");
  }
  std::string summary() const override;

  void start_epoch(int64_t epoch, int64_t position) override {
    epoch_ = epoch;
    position_ = position;
    // A new epoch's streams start from zeros; a resumed one from the saved state.
    if (position == 0) carried_.assign(carried_.size(), Tensor());
  }
  bool next(StepBatch& batch) override;
  Tensor loss(const StepBatch& batch) override;
  Tensor probe_loss(int64_t n) override;
  TensorList model_inputs(const StepBatch& batch) override;
  void keep_outputs(const TensorList& outputs) override;
  Tensor loss_from(const StepBatch& batch, const TensorList& outputs) override;
  StepBatch probe_batch(int64_t n) override;
  void set_holds_carried_state(bool holds) override { holds_state_ = holds; }
  void set_context_parallel(std::shared_ptr<ContextParallelGroup> g) override { cp_ = g; }
  EvalSums evaluate_shard() override;
  void start_eval() override;
  bool next_eval(StepBatch& batch) override;
  TensorList eval_inputs(const StepBatch& batch) override;
  void keep_eval_outputs(const TensorList& outputs) override;
  void add_eval_sums(const StepBatch& batch, const TensorList& outputs,
                     EvalSums& sums) const override;

  std::optional<std::vector<NamedTensor>> stream_state() const override;
  void save_vocab(TrainerStateFile& file) const override;
  void check_vocab(const std::string& state_path, const TrainerStateFile& file) const override;

 private:
  void restore_stream_state(const std::string& dir, int64_t position) override;
  // Whether the LSTM LM carries its state between micro-batches
  // (data.sampling: contiguous), saved per rank with checkpoints.
  bool carries_state() const {
    return lstm_ != nullptr && train_windows_->contiguous() && holds_state_;
  }
  // The carried state of every layer as the LSTM LM takes it (undefined
  // until each layer has some), and back.
  RNNState whole_state() const;
  void set_whole_state(const RNNState& state);
  // This rank's tokens of windows [N, T] under context parallelism, on the model's device.
  Tensor local(const Tensor& windows) const {
    const Tensor t = cp_ ? cp_->layout(windows.size(1)).local(windows).contiguous() : windows;
    return to_device(t, module_device(*model_));
  }

  const RankLayout layout_;
  const int64_t micro_batch_;
  std::unique_ptr<data::TextCorpus> corpus_;
  std::unique_ptr<data::TextWindows> train_windows_;
  std::unique_ptr<data::EvalWindows> val_windows_;
  int64_t epoch_ = 0, position_ = 0;   // the epoch being read
  std::shared_ptr<LSTMLM> lstm_;       // model_ when it is the LSTM LM
  const Model* loss_model_ = nullptr;  // model_ as a Model (its output_loss)
  // Its state after the last micro-batch: h0, c0, h1, c1, .. [B, H] (the
  // model inputs after the tokens); on a pipeline stage only its layers'.
  std::vector<Tensor> carried_;
  bool holds_state_ = true;  // false on a pipeline stage without the LSTM
  std::shared_ptr<ContextParallelGroup> cp_;
  // Pipelined evaluation: the next batch (a chunk of the streams, or the
  // next of this rank's windows) and the state carried through the
  // evaluation streams, laid out as carried_.
  int64_t eval_next_ = 0;
  std::vector<Tensor> eval_carried_;
};

TextBatches::TextBatches(const Recipe& r, const RankLayout& layout, int64_t micro_batch)
    : layout_(layout), micro_batch_(micro_batch) {
  const DataRecipe& d = r.data;
  const bool tokens = d.name == "tokens";
  if (d.path.empty())
    throw Error(
        cat(r.source, tokens ? ": data.path must name the token directory (written by `trainer "
                               "tokenize --model M CORPUS --out DIR`)"
                             : ": data.path must name the text corpus (e.g. datasets/kjv.txt)"));
  const int64_t T = window_tokens(r);
  if (model_traits(r.model.name).bounded_context && T > r.model.context)
    throw Error(cat(r.source, ": data.seq_len ", T, " is longer than model.context ",
                    r.model.context, " (GPT's block size)"));
  corpus_ = std::make_unique<data::TextCorpus>(
      tokens ? data::load_token_corpus(d.path, d.val_fraction)
             : data::TextCorpus::load(d.path, {.vocab = d.vocab == "byte" ? data::VocabKind::bytes
                                                                          : data::VocabKind::chars,
                                               .val_fraction = d.val_fraction}));
  // Contiguous: one stream per row of a micro-batch on every rank, and as
  // many evaluation streams in all (the same for any split of the batch).
  const bool contiguous = d.sampling == "contiguous";
  train_windows_ = std::make_unique<data::TextWindows>(
      *corpus_, data::WindowOptions{.seq_len = T,
                                    .seed = uint64_t(r.seed),
                                    .rank = layout_.dp_rank(),
                                    .world_size = layout_.dp_size(),
                                    .streams = contiguous ? micro_batch_ : 0});
  val_windows_ = std::make_unique<data::EvalWindows>(
      *corpus_, data::EvalOptions{.seq_len = T,
                                  .max_windows = d.val_windows,
                                  .streams = contiguous ? micro_batch_ * layout_.dp_size() : 0});
}

std::string TextBatches::summary() const {
  const data::TextCorpus& c = *corpus_;
  const size_t shards = c.tokens().segments().size();
  return cat("data ", c.name(), ": ", with_commas(c.size()), " tokens",
             dynamic_cast<const data::Vocab*>(&c.tokenizer())
                 ? std::string()
                 : cat(" in ", shards, shards == 1 ? " shard" : " shards"),
             " (train ", with_commas(c.train_tokens()), ", val ", with_commas(c.val_tokens()),
             "), ", c.tokenizer().description(), ", windows of ", train_windows_->seq_len(),
             " tokens (", with_commas(train_windows_->windows_per_epoch()), " per epoch, ",
             with_commas(val_windows_->size()), " per evaluation",
             train_windows_->contiguous() ? cat("; contiguous streams, ", micro_batch_, " per rank",
                                                carries_state() ? ", state carried" : "")
                                          : std::string(),
             ")\n");
}

bool TextBatches::next(StepBatch& batch) {
  if (position_ + micro_batch_ > train_windows_->windows_per_epoch()) return false;
  data::TextBatch b = train_windows_->batch(epoch_, position_, micro_batch_);
  position_ += micro_batch_;
  batch = StepBatch{local(b.inputs), local(b.targets), position_, b.targets.numel()};
  return true;
}

Tensor TextBatches::loss(const StepBatch& batch) {
  if (!carries_state())
    return token_cross_entropy(loss_model_, (*model_)(batch.inputs), batch.targets);
  LSTMLMOutput out = lstm_->forward(batch.inputs, whole_state());
  set_whole_state(out.state.detach());
  return token_cross_entropy(loss_model_, out.logits, batch.targets);
}

RNNState TextBatches::whole_state() const {
  for (const Tensor& t : carried_)
    if (!t.defined()) return {};
  TensorList hs, cs;
  for (size_t k = 0; k < carried_.size(); k += 2) {
    hs.push_back(carried_[k]);
    cs.push_back(carried_[k + 1]);
  }
  return {stack(hs, 0), stack(cs, 0)};
}

void TextBatches::set_whole_state(const RNNState& state) {
  for (size_t k = 0; k < carried_.size(); k += 2) {
    carried_[k] = state.defined() ? state.h.select(0, int64_t(k / 2)) : Tensor();
    carried_[k + 1] = state.defined() ? state.c.select(0, int64_t(k / 2)) : Tensor();
  }
}

TensorList TextBatches::model_inputs(const StepBatch& batch) {
  TensorList in = {batch.inputs};
  if (!lstm_) return in;
  for (const Tensor& t : carried_) in.push_back(carries_state() ? t : Tensor());
  return in;
}

void TextBatches::keep_outputs(const TensorList& outputs) {
  if (!carries_state()) return;
  for (size_t k = 0; k < carried_.size(); ++k)
    if (outputs.at(k + 1).defined()) carried_[k] = outputs[k + 1].detach();
}

Tensor TextBatches::loss_from(const StepBatch& batch, const TensorList& outputs) {
  return token_cross_entropy(loss_model_, outputs.at(0), batch.targets);
}

StepBatch TextBatches::probe_batch(int64_t n) {
  const Device device = module_device(*model_);
  const int64_t T = train_windows_->seq_len();
  return StepBatch{local(to_device(zeros({n, T}, DType::i64), device)),
                   local(to_device(zeros({n, T}, DType::i64), device))};
}

Tensor TextBatches::probe_loss(int64_t n) {
  std::vector<Tensor> kept = carried_;  // the probe must not become the carried state
  Tensor l = loss(probe_batch(n));
  carried_ = kept;
  return l;
}

EvalSums TextBatches::evaluate_shard() {
  autograd::NoGradGuard no_grad;
  model_->eval();
  EvalSums sums;
  const data::EvalWindows& val = *val_windows_;
  auto on_device = [&](data::TextBatch b) {
    return data::TextBatch{local(b.inputs), local(b.targets)};
  };
  if (val.streams() > 0) {
    // Chunk k of this rank's streams, the state carried from chunk k - 1.
    RNNState state;
    const int64_t S = val.streams(), first = micro_batch_ * layout_.dp_rank();
    for (int64_t k = 0; k < val.size() / S; ++k) {
      data::TextBatch b = on_device(val.batch(k * S + first, micro_batch_));
      Tensor logits;
      if (lstm_) {
        LSTMLMOutput out = lstm_->forward(b.inputs, state);
        logits = out.logits;
        state = out.state;
      } else {
        logits = (*model_)(b.inputs);
      }
      add_eval_sums(StepBatch{b.inputs, b.targets}, {logits}, sums);
    }
  } else {
    // Shared over the dp ranks only: the ep ranks evaluate the same windows.
    const int64_t stride = micro_batch_ * layout_.eval_size();
    for (int64_t first = micro_batch_ * layout_.eval_rank(); first < val.size(); first += stride) {
      data::TextBatch b = on_device(val.batch(first, micro_batch_));
      add_eval_sums(StepBatch{b.inputs, b.targets}, {(*model_)(b.inputs)}, sums);
    }
  }
  model_->train();
  return sums;
}

void TextBatches::add_eval_sums(const StepBatch& batch, const TensorList& outputs,
                                EvalSums& sums) const {
  CrossEntropyOptions sum_loss;
  sum_loss.reduction = CrossEntropyOptions::Reduction::sum;
  // The real windows' logits: the rows after them are padding.
  const Tensor logits = outputs.at(0).narrow(0, 0, batch.targets.size(0));
  sums.loss += token_cross_entropy(loss_model_, logits, batch.targets, sum_loss).item<double>();
  sums.samples += batch.targets.numel();
}

void TextBatches::start_eval() {
  eval_next_ = 0;
  eval_carried_.assign(carried_.size(), Tensor());
}

bool TextBatches::next_eval(StepBatch& batch) {
  // The windows evaluate_shard() reads, in its order.
  const data::EvalWindows& val = *val_windows_;
  int64_t first = 0;
  if (val.streams() > 0) {
    if (eval_next_ >= val.size() / val.streams()) return false;
    first = eval_next_ * val.streams() + micro_batch_ * layout_.dp_rank();
  } else {
    first = micro_batch_ * (layout_.eval_rank() + eval_next_ * layout_.eval_size());
    if (first >= val.size()) return false;
  }
  ++eval_next_;
  // A window starts from zeros unless the streams carry the state.
  if (val.streams() == 0) eval_carried_.assign(eval_carried_.size(), Tensor());
  data::TextBatch b = val.batch(first, micro_batch_);
  batch = StepBatch{local(pad_samples(b.inputs, micro_batch_)), local(b.targets), eval_next_,
                    b.targets.numel()};
  return true;
}

TensorList TextBatches::eval_inputs(const StepBatch& batch) {
  TensorList in = {batch.inputs};
  if (!lstm_) return in;
  for (const Tensor& t : eval_carried_) in.push_back(t);
  return in;
}

void TextBatches::keep_eval_outputs(const TensorList& outputs) {
  // Carried to the next time chunk of the batch, and to the next batch of
  // the streams (whole batches: no padding rows).
  if (!lstm_) return;
  for (size_t k = 0; k < eval_carried_.size(); ++k)
    if (outputs.at(k + 1).defined()) eval_carried_[k] = outputs[k + 1];
}

std::optional<std::vector<NamedTensor>> TextBatches::stream_state() const {
  if (!carries_state()) return std::nullopt;
  // Every layer's: h and c [L, B, H]; a pipeline stage's: h<k> and c<k>
  // [B, H] of its layers.
  std::vector<NamedTensor> state;
  const RNNState whole = whole_state();
  if (whole.defined()) return std::vector<NamedTensor>{{"h", whole.h}, {"c", whole.c}};
  for (size_t k = 0; k < carried_.size(); ++k)
    if (carried_[k].defined()) state.push_back({cat(k % 2 ? "c" : "h", k / 2), carried_[k]});
  return state;
}

void TextBatches::restore_stream_state(const std::string& dir, int64_t position) {
  if (!carries_state()) return;
  const std::string path = stream_state_file(dir, layout_.rank);
  std::map<std::string, Tensor> saved = read_stream_state(dir, layout_.rank);
  carried_.assign(carried_.size(), Tensor());
  if (saved.empty()) {
    if (position != 0)
      throw Error(cat(path, " holds no state, but the checkpoint is ", position,
                      " windows into an epoch; use an earlier checkpoint"));
    return;
  }
  const Device device = module_device(*model_);
  const int64_t L = lstm_->options().num_layers, H = lstm_->options().hidden_size;
  auto fits = [](const Tensor& t, const Shape& shape) {
    return t.shape() == shape && t.dtype() == DType::f32;
  };
  auto h = saved.find("h"), c = saved.find("c");
  const Shape whole{L, micro_batch_, H}, layer{micro_batch_, H};
  if (h != saved.end() && c != saved.end() && saved.size() == 2 && fits(h->second, whole) &&
      fits(c->second, whole)) {
    set_whole_state({to_device(h->second, device), to_device(c->second, device)});
    return;
  }
  // A pipeline stage's layers.
  for (const auto& [name, t] : saved) {
    size_t k = carried_.size();
    if (name.size() > 1 && (name[0] == 'h' || name[0] == 'c') &&
        name.find_first_not_of("0123456789", 1) == std::string::npos) {
      const size_t layer_index = std::stoul(name.substr(1));
      if (layer_index < size_t(L)) k = 2 * layer_index + (name[0] == 'c');
    }
    if (k >= carried_.size() || !fits(t, layer))
      throw Error(cat(path, " is not the carried LSTM state (h and c, f32 ", shape_str(whole),
                      ", or a pipeline stage's h<k> and c<k>, f32 ", shape_str(layer), "; found '",
                      name, "' ", t.shape_str(),
                      "); was it written with another model, batch or world size?"));
    carried_[k] = to_device(t, device);
  }
}

void TextBatches::save_vocab(TrainerStateFile& file) const {
  if (const auto* sp = dynamic_cast<const data::SentencePieceTokenizer*>(&corpus_->tokenizer())) {
    file.tokenizer_checksum = data::checksum_hex(sp->checksum());
    file.tokenizer_size = sp->size();
    file.tokenizer_model = sp->name();
    return;
  }
  for (uint8_t symbol : corpus_->vocab().symbols()) file.vocab.push_back(symbol);
}

void TextBatches::check_vocab(const std::string& state_path, const TrainerStateFile& file) const {
  const auto* sp = dynamic_cast<const data::SentencePieceTokenizer*>(&corpus_->tokenizer());
  if (!sp && !file.vocab.empty() && !(data::Vocab::from_symbols(file.vocab) == corpus_->vocab()))
    throw Error(cat(state_path, ": the checkpoint's vocabulary of ", file.vocab.size(),
                    " symbols differs from the ", corpus_->vocab().size(), " of ", corpus_->name(),
                    "; the corpus or data.vocab changed since it was written"));
  if (!sp && !file.tokenizer_checksum.empty())
    throw Error(cat(state_path, ": the checkpoint was trained on SentencePiece tokens (",
                    file.tokenizer_model, ", checksum ", file.tokenizer_checksum,
                    "), but the recipe reads ", corpus_->name(), " with a ",
                    corpus_->tokenizer().description(),
                    "; set data.name: tokens and data.path to its token directory"));
  if (sp && file.tokenizer_checksum.empty() && !file.vocab.empty())
    throw Error(cat(state_path,
                    ": the checkpoint was trained on a text corpus with a vocabulary of ",
                    file.vocab.size(), " symbols, but the recipe reads the tokens of ",
                    corpus_->name(), "; set data.name: text and data.path to that corpus"));
  if (sp && !file.tokenizer_checksum.empty() &&
      file.tokenizer_checksum != data::checksum_hex(sp->checksum()))
    throw Error(cat(state_path, ": the checkpoint was trained with the tokenizer ",
                    file.tokenizer_model, " (checksum ", file.tokenizer_checksum, ", ",
                    file.tokenizer_size, " pieces), but ", sp->name(), " has checksum ",
                    data::checksum_hex(sp->checksum()), " (", sp->size(),
                    " pieces): its ids mean other text; point data.path at the token directory "
                    "the model was trained on, or encode the corpus again with the checkpoint's "
                    "tokenizer"));
}

}  // namespace

std::unique_ptr<BatchSource> make_text_batches(const Recipe& recipe, const RankLayout& layout,
                                               int64_t micro_batch) {
  return std::make_unique<TextBatches>(recipe, layout, micro_batch);
}

}  // namespace trainer
