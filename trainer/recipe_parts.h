// What the files of the recipe reader share (recipe.cpp: the schema, the
// walk over a recipe's YAML and the overrides; recipe_fields.cpp: the kinds
// of key the schema is made of). Not for other callers: trainer/recipe.h is
// the interface.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace trainer {

// Where a value came from, for messages: "recipes/x.yaml:12" or "override 'a=b'".
struct Origin {
  std::string text;
};

// One key of the schema, bound to a field of a Recipe. `type` and `range`
// describe it for people (recipe_schema(): --help and docs/recipes.md).
struct Field {
  std::string path;
  std::function<void(const YAML::Node&, const Origin&)> parse;
  std::function<YAML::Node()> emit;
  std::string type;
  std::string range;
  // Another name for the key `alias_of` (Hugging Face's config names for the
  // Llama family): parsed into the same field, not printed by recipe_to_yaml.
  std::string alias_of;
};

// The kinds of key, each parsed with its type and range checked (an Error
// names the origin, the key and what it accepts) into *p, and emitted from it.
Field int_field(std::string path, int64_t* p, int64_t lo, int64_t hi);
Field float_field(std::string path, double* p, double lo, double hi);
Field bool_field(std::string path, bool* p);
// A string; `choices` empty means free text.
Field string_field(std::string path, std::string* p, std::vector<std::string> choices = {});
// "even", "auto", or a list of block indices (parallel.stages).
Field stages_field(std::string path, std::string* mode, std::vector<int64_t>* starts);
// `path` as another name of `target`.
Field alias_field(std::string path, const Field& target);
Field float_list_field(std::string path, std::vector<double>* p, double lo, double hi);

}  // namespace trainer
