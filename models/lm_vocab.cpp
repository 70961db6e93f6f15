#include "models/lm_vocab.h"

#include <algorithm>

#include "core/autograd.h"
#include "core/ops.h"

namespace trainer {

void fit_vocab_rows(std::map<std::string, Tensor>& tensors, const std::string& name, int64_t vocab,
                    int64_t rows) {
  for (auto& [key, t] : tensors) {
    const bool entry = key == name || (key.starts_with(name + ".") &&
                                       key.find('[') == std::string::npos);  // not a ZeRO-1 shard
    if (!entry || t.dim() != 2 || t.size(0) == rows || t.size(0) < vocab) continue;
    const Tensor padding = t.narrow(0, vocab, t.size(0) - vocab);
    if (padding.numel() > 0 && max(abs(padding.to(DType::f64))).item<double>() != 0) continue;
    t = zero_padded_rows(t.narrow(0, 0, vocab).contiguous(), rows);
  }
}

int64_t shard_vocabulary(std::shared_ptr<TensorParallelGroup> g, Embedding& embedding, Linear& head,
                         bool tied, int64_t vocab_size) {
  const int n = g->size();
  const int64_t rows = padded_vocab(vocab_size, n);
  embedding.pad_rows(rows);
  if (!tied) head.pad_outputs(rows);
  embedding.shard_vocab(g);
  const ParameterSplit by_vocab{.dim = 0, .rank = g->rank(), .size = n};
  if (tied) {
    head.share_sharded_weight(g, embedding.weight, by_vocab);
  } else {
    head.shard(g, LinearSplit::column);
  }
  return rows;
}

std::map<std::string, Shape> vocab_shapes(const std::string& embedding, const std::string& head,
                                          bool tied, int64_t vocab_size, int64_t width, int tp) {
  const int64_t rows = padded_vocab(vocab_size, std::max(tp, 1));
  std::map<std::string, Shape> shapes{{embedding, {rows, width}}};
  if (!tied) shapes[head] = {rows, width};
  return shapes;
}

std::string vocab_padding_note(int64_t vocab_size, int64_t rows, int tp) {
  if (rows == vocab_size) return "";
  return cat("model: vocabulary ", vocab_size, " padded to ", rows, " rows for parallel.tp=", tp,
             "; the padded rows are never sampled or predicted (zero, and left out of the loss)");
}

}  // namespace trainer
