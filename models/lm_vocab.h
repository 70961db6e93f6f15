// The vocabulary of a Transformer language model under tensor parallelism,
// shared by GPT and Llama: the token embedding and the LM head split by
// vocabulary rows (Megatron-LM), the vocabulary padded with zero rows to a
// multiple of the group as Megatron-LM's --make-vocab-size-divisible-by
// does, and checkpoints written at one tp loaded at another.
//
//   vocab_rows_ = shard_vocabulary(g, *wte, *lm_head, tied, vocab_size);
//   fit_vocab_rows(tensors, "transformer.wte.weight", vocab_size, vocab_rows_);
#pragma once

#include <map>
#include <memory>
#include <string>

#include "core/tensor.h"
#include "layers/linear.h"
#include "layers/transformer.h"

namespace trainer {

// A vocabulary of `vocab` rows as a split over tp ranks holds it.
inline int64_t padded_vocab(int64_t vocab, int64_t tp) { return (vocab + tp - 1) / tp * tp; }

// Fits tensor `name` of a loaded checkpoint, and its optimizer state
// ("<name>.<slot>", whole tensors), to `rows` rows of which the first
// `vocab` are the vocabulary: the rows past it that the writer padded
// (zero) are dropped and zero rows added up to `rows`. Anything else is
// left for the loader to report.
void fit_vocab_rows(std::map<std::string, Tensor>& tensors, const std::string& name, int64_t vocab,
                    int64_t rows);

// Pads the token embedding (and an untied head) to a multiple of g's size
// and splits both by vocabulary over g; a tied head multiplies by the
// embedding's part. Returns the padded row count.
int64_t shard_vocabulary(std::shared_ptr<TensorParallelGroup> g, Embedding& embedding, Linear& head,
                         bool tied, int64_t vocab_size);

// The whole shapes of the embedding (and the untied head) at tp: what a
// checkpoint written there holds (shapes_at_tensor_parallel()).
std::map<std::string, Shape> vocab_shapes(const std::string& embedding, const std::string& head,
                                          bool tied, int64_t vocab_size, int64_t width, int tp);

// The line tensor_parallel_note() prints when the vocabulary was padded ("" when not).
std::string vocab_padding_note(int64_t vocab_size, int64_t rows, int tp);

}  // namespace trainer
