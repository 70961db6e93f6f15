// libFuzzer target: the recipe reader and its schema (trainer/recipe.h).
// Any input is either a Recipe or a trainer::Error; a recipe that parses
// prints (recipe_to_yaml) as YAML that parses again to the same text.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/check.h"
#include "trainer/recipe.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  trainer::Recipe recipe;
  try {
    recipe = trainer::parse_recipe(text, "fuzz.yaml");
  } catch (const trainer::Error&) {
    return 0;
  }
  const std::string printed = trainer::recipe_to_yaml(recipe);
  // The resolved recipe must read back as itself.
  if (trainer::recipe_to_yaml(trainer::parse_recipe(printed, "resolved.yaml")) != printed)
    std::abort();
  return 0;
}
