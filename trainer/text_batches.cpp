// The language-model side of Session: the text corpus and its windows,
// the training loss over every token, evaluation, and the recurrent state
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
#include "models/lstm_lm.h"
#include "trainer/device.h"
#include "trainer/safetensors.h"
#include "trainer/session.h"

namespace trainer {

namespace {

// Cross-entropy of logits [N, T, V] against targets [N, T] over all N x T tokens.
Tensor token_cross_entropy(const Tensor& logits, const Tensor& targets,
                           const CrossEntropyOptions& options = {}) {
  return cross_entropy(logits.flatten(0, 1), targets.flatten(), options);
}

std::string stream_state_file(const std::string& dir, int rank) {
  return cat(dir, "/stream_state.rank", rank, ".safetensors");
}

}  // namespace

void Session::build_text_data() {
  const Recipe& r = recipe_;
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
                                    .rank = layout_.rank,
                                    .world_size = layout_.world_size,
                                    .streams = contiguous ? micro_batch_ : 0});
  val_windows_ = std::make_unique<data::EvalWindows>(
      *corpus_, data::EvalOptions{.seq_len = T,
                                  .max_windows = d.val_windows,
                                  .streams = contiguous ? micro_batch_ * layout_.world_size : 0});
}

bool Session::carries_state() const {
  return lstm_ != nullptr && train_windows_ && train_windows_->contiguous();
}

bool Session::next_text_batch(StepBatch& batch) {
  if (text_position_ + micro_batch_ > train_windows_->windows_per_epoch()) return false;
  data::TextBatch b = train_windows_->batch(text_epoch_, text_position_, micro_batch_);
  text_position_ += micro_batch_;
  batch = StepBatch{b.inputs, b.targets, text_position_, b.targets.numel()};
  return true;
}

Tensor Session::text_loss(const StepBatch& batch) {
  if (!carries_state()) return token_cross_entropy((*model_)(batch.inputs), batch.targets);
  LSTMLMOutput out = lstm_->forward(batch.inputs, carried_);
  carried_ = out.state.detach();
  return token_cross_entropy(out.logits, batch.targets);
}

EvalSums Session::evaluate_text() {
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
    const int64_t S = val.streams(), first = micro_batch_ * layout_.rank;
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
      sums.loss += token_cross_entropy(logits, b.targets, sum_loss).item<double>();
      sums.samples += b.targets.numel();
    }
  } else {
    const int64_t stride = micro_batch_ * layout_.world_size;
    for (int64_t first = micro_batch_ * layout_.rank; first < val.size(); first += stride) {
      data::TextBatch b = on_device(val.batch(first, micro_batch_));
      sums.loss += token_cross_entropy((*model_)(b.inputs), b.targets, sum_loss).item<double>();
      sums.samples += b.targets.numel();
    }
  }
  model_->train();
  return sums;
}

void Session::save_stream_state(const std::string& dir) const {
  std::vector<NamedTensor> state;
  if (carried_.defined()) state = {{"h", carried_.h}, {"c", carried_.c}};
  write_safetensors(stream_state_file(dir, layout_.rank), state);
}

void Session::load_stream_state(const std::string& dir, int64_t position) {
  const std::string path = stream_state_file(dir, layout_.rank);
  SafetensorsFile f = read_safetensors(path);
  carried_ = RNNState{};
  if (f.tensors.empty()) {
    if (position != 0)
      throw Error(cat(path, " holds no state, but the checkpoint is ", position,
                      " windows into an epoch; use an earlier checkpoint"));
    return;
  }
  auto h = f.tensors.find("h"), c = f.tensors.find("c");
  const Shape expected{lstm_->options().num_layers, micro_batch_, lstm_->options().hidden_size};
  if (h == f.tensors.end() || c == f.tensors.end() || h->second.shape() != expected ||
      c->second.shape() != expected || h->second.dtype() != DType::f32 ||
      c->second.dtype() != DType::f32)
    throw Error(cat(path, " is not the carried LSTM state (h and c, f32 ", shape_str(expected),
                    "); was it written with another model, batch or world size?"));
  const Device device = module_device(*model_);
  carried_ = RNNState{to_device(h->second, device), to_device(c->second, device)};
}

}  // namespace trainer
