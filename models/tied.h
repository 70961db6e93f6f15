// A weight tied to another (a language model's head or decoder to its
// embedding) is one tensor under two names, in our state and in PyTorch's
// state_dict. Older checkpoints wrote it once, under the embedding's name:
// upgrade_tied_weight adds the tied name to such a set of loaded tensors,
// and refuses one where the two differ (a model trained untied).
//
//   upgrade_tied_weight(tensors, "encoder.weight", "decoder.weight", file, "this LSTM LM");
#pragma once

#include <map>
#include <string>

#include "core/tensor.h"

namespace trainer {

inline void upgrade_tied_weight(std::map<std::string, Tensor>& tensors, const std::string& source,
                                const std::string& tied, const std::string& file,
                                const std::string& model) {
  auto source_it = tensors.find(source);
  auto tied_it = tensors.find(tied);
  if (source_it == tensors.end()) return;  // reported as missing by the loader
  if (tied_it == tensors.end()) {
    tensors.emplace(tied, source_it->second);
  } else if (!same_bits(source_it->second, tied_it->second)) {
    throw Error(cat(file, ": ", tied, " differs from ", source, ", but ", model,
                    " ties them (model.tie_weights: true); load it with model.tie_weights: false"));
  }
}

}  // namespace trainer
