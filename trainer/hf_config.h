// Hugging Face's config.json for the models that have a transformers class
// (the Llama family: LlamaForCausalLM), written by `trainer export` beside
// the safetensors file so the pair loads with from_pretrained.
//
//   std::string json = hf_config_json(recipe, /*vocab=*/2048, DType::bf16);  // "" for others
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "trainer/recipe.h"

namespace trainer {

// The config of the recipe's model at vocabulary `vocab`, tensors of
// `dtype`; "" when the model has no Hugging Face counterpart.
std::string hf_config_json(const Recipe& recipe, int64_t vocab, DType dtype);

}  // namespace trainer
