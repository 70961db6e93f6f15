// The language models' batch source: the text corpus and its windows, the
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
#include "layers/rnn.h"
#include "models/lstm_lm.h"
#include "trainer/batch_source.h"
#include "trainer/checkpoint.h"
#include "trainer/device.h"

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
  }
  bool is_language_model() const override { return true; }
  const char* item_name() const override { return "tokens"; }
  int64_t vocab_size() const override { return corpus_->vocab().size(); }
  const data::Vocab& vocab() const override { return corpus_->vocab(); }
  int64_t batches_per_epoch() const override {
    return train_windows_->windows_per_epoch() / micro_batch_;
  }
  std::string epoch_text() const override {
    return cat(train_windows_->windows_per_epoch(), " training windows");
  }
  std::string summary() const override;

  void start_epoch(int64_t epoch, int64_t position) override {
    epoch_ = epoch;
    position_ = position;
    // A new epoch's streams start from zeros; a resumed one from the saved state.
    if (position == 0) carried_ = RNNState{};
  }
  bool next(StepBatch& batch) override;
  Tensor loss(const StepBatch& batch) override;
  Tensor probe_loss(int64_t n) override;
  TensorList model_inputs(const StepBatch& batch) override;
  void keep_outputs(const TensorList& outputs) override;
  Tensor loss_from(const StepBatch& batch, const TensorList& outputs) override;
  StepBatch probe_batch(int64_t n) override;
  void set_holds_carried_state(bool holds) override { holds_state_ = holds; }
  EvalSums evaluate_shard() override;

  std::optional<std::vector<NamedTensor>> stream_state() const override;
  void load_stream_state(const std::string& dir, int64_t position) override;
  void check_vocab(const std::string& state_path,
                   const std::vector<int64_t>& symbols) const override;

 private:
  // Whether the LSTM LM carries its state between micro-batches
  // (data.sampling: contiguous), saved per rank with checkpoints.
  bool carries_state() const {
    return lstm_ != nullptr && train_windows_->contiguous() && holds_state_;
  }

  const RankLayout layout_;
  const int64_t micro_batch_;
  std::unique_ptr<data::TextCorpus> corpus_;
  std::unique_ptr<data::TextWindows> train_windows_;
  std::unique_ptr<data::EvalWindows> val_windows_;
  int64_t epoch_ = 0, position_ = 0;   // the epoch being read
  std::shared_ptr<LSTMLM> lstm_;       // model_ when it is the LSTM LM
  const Model* loss_model_ = nullptr;  // model_ as a Model (its output_loss)
  RNNState carried_;                   // its state after the last micro-batch
  bool holds_state_ = true;            // false on a pipeline stage without the LSTM
};

TextBatches::TextBatches(const Recipe& r, const RankLayout& layout, int64_t micro_batch)
    : layout_(layout), micro_batch_(micro_batch) {
  const DataRecipe& d = r.data;
  if (d.path.empty())
    throw Error(cat(r.source, ": data.path must name the text corpus (e.g. datasets/kjv.txt)"));
  const int64_t T = d.seq_len > 0 ? d.seq_len : r.model.context;
  if (r.model.name == "gpt" && T > r.model.context)
    throw Error(cat(r.source, ": data.seq_len ", T, " is longer than model.context ",
                    r.model.context, " (GPT's block size)"));
  corpus_ = std::make_unique<data::TextCorpus>(data::TextCorpus::load(
      d.path, {.vocab = d.vocab == "byte" ? data::VocabKind::bytes : data::VocabKind::chars,
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
  return cat("data ", c.name(), ": ", with_commas(c.size()), " tokens (train ",
             with_commas(c.train_tokens()), ", val ", with_commas(c.val_tokens()), "), ",
             c.vocab().kind() == data::VocabKind::bytes ? "byte" : "char", " vocabulary of ",
             c.vocab().size(), ", windows of ", train_windows_->seq_len(), " tokens (",
             with_commas(train_windows_->windows_per_epoch()), " per epoch, ",
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
  const Device device = module_device(*model_);
  batch = StepBatch{to_device(b.inputs, device), to_device(b.targets, device), position_,
                    b.targets.numel()};
  return true;
}

Tensor TextBatches::loss(const StepBatch& batch) {
  if (!carries_state())
    return token_cross_entropy(loss_model_, (*model_)(batch.inputs), batch.targets);
  LSTMLMOutput out = lstm_->forward(batch.inputs, carried_);
  carried_ = out.state.detach();
  return token_cross_entropy(loss_model_, out.logits, batch.targets);
}

TensorList TextBatches::model_inputs(const StepBatch& batch) {
  if (!lstm_) return {batch.inputs};
  if (!carries_state()) return {batch.inputs, Tensor(), Tensor()};
  return {batch.inputs, carried_.h, carried_.c};
}

void TextBatches::keep_outputs(const TensorList& outputs) {
  if (!carries_state() || !outputs.at(1).defined()) return;
  carried_ = RNNState{outputs[1], outputs[2]}.detach();
}

Tensor TextBatches::loss_from(const StepBatch& batch, const TensorList& outputs) {
  return token_cross_entropy(loss_model_, outputs.at(0), batch.targets);
}

StepBatch TextBatches::probe_batch(int64_t n) {
  const Device device = module_device(*model_);
  const int64_t T = train_windows_->seq_len();
  return StepBatch{to_device(zeros({n, T}, DType::i64), device),
                   to_device(zeros({n, T}, DType::i64), device)};
}

Tensor TextBatches::probe_loss(int64_t n) {
  RNNState kept = carried_;  // the probe must not become the carried state
  Tensor l = loss(probe_batch(n));
  carried_ = kept;
  return l;
}

EvalSums TextBatches::evaluate_shard() {
  autograd::NoGradGuard no_grad;
  model_->eval();
  CrossEntropyOptions sum_loss;
  sum_loss.reduction = CrossEntropyOptions::Reduction::sum;
  EvalSums sums;
  const data::EvalWindows& val = *val_windows_;
  const Device device = module_device(*model_);
  auto on_device = [&](data::TextBatch b) {
    return data::TextBatch{to_device(b.inputs, device), to_device(b.targets, device)};
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
      sums.loss += token_cross_entropy(loss_model_, logits, b.targets, sum_loss).item<double>();
      sums.samples += b.targets.numel();
    }
  } else {
    const int64_t stride = micro_batch_ * layout_.dp_size();
    for (int64_t first = micro_batch_ * layout_.dp_rank(); first < val.size(); first += stride) {
      data::TextBatch b = on_device(val.batch(first, micro_batch_));
      sums.loss +=
          token_cross_entropy(loss_model_, (*model_)(b.inputs), b.targets, sum_loss).item<double>();
      sums.samples += b.targets.numel();
    }
  }
  model_->train();
  return sums;
}

std::optional<std::vector<NamedTensor>> TextBatches::stream_state() const {
  if (!carries_state()) return std::nullopt;
  std::vector<NamedTensor> state;
  if (carried_.defined()) state = {{"h", carried_.h}, {"c", carried_.c}};
  return state;
}

void TextBatches::load_stream_state(const std::string& dir, int64_t position) {
  if (!carries_state()) return;
  const std::string path = stream_state_file(dir, layout_.rank);
  std::map<std::string, Tensor> saved = read_stream_state(dir, layout_.rank);
  carried_ = RNNState{};
  if (saved.empty()) {
    if (position != 0)
      throw Error(cat(path, " holds no state, but the checkpoint is ", position,
                      " windows into an epoch; use an earlier checkpoint"));
    return;
  }
  auto h = saved.find("h"), c = saved.find("c");
  const Shape expected{lstm_->options().num_layers, micro_batch_, lstm_->options().hidden_size};
  if (h == saved.end() || c == saved.end() || h->second.shape() != expected ||
      c->second.shape() != expected || h->second.dtype() != DType::f32 ||
      c->second.dtype() != DType::f32)
    throw Error(cat(path, " is not the carried LSTM state (h and c, f32 ", shape_str(expected),
                    "); was it written with another model, batch or world size?"));
  const Device device = module_device(*model_);
  carried_ = RNNState{to_device(h->second, device), to_device(c->second, device)};
}

void TextBatches::check_vocab(const std::string& state_path,
                              const std::vector<int64_t>& symbols) const {
  if (!(data::Vocab::from_symbols(symbols) == corpus_->vocab()))
    throw Error(cat(state_path, ": the checkpoint's vocabulary of ", symbols.size(),
                    " symbols differs from the ", corpus_->vocab().size(), " of ", corpus_->name(),
                    "; the corpus or data.vocab changed since it was written"));
}

}  // namespace

std::unique_ptr<BatchSource> make_text_batches(const Recipe& recipe, const RankLayout& layout,
                                               int64_t micro_batch) {
  return std::make_unique<TextBatches>(recipe, layout, micro_batch);
}

}  // namespace trainer
