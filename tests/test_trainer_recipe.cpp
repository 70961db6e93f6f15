// Recipes: parsing, defaults, overrides, and the error messages for bad input.
#include "tests/testing.h"
#include "trainer/recipe.h"

using namespace trainer;

namespace {
std::string error_of(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    parse_recipe(text, "r.yaml", overrides);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("recipe: values, defaults and overrides", "[recipe]") {
  Recipe r = parse_recipe(R"(
model:
  name: resnet18
  num_classes: 100
optimizer:
  lr: 0.2
schedule:
  name: multistep
  milestones: [30, 60, 80]
training:
  epochs: 90
  global_batch: 256
seed: 7
)",
                          "r.yaml", {"training.epochs=3", "optimizer.nesterov=true"});
  REQUIRE(r.model.name == "resnet18");
  REQUIRE(r.model.num_classes == 100);
  REQUIRE(r.optimizer.lr == 0.2);
  REQUIRE(r.optimizer.nesterov);
  REQUIRE(r.schedule.milestones == std::vector<double>{30, 60, 80});
  REQUIRE(r.training.epochs == 3);
  REQUIRE(r.training.global_batch == 256);
  REQUIRE(r.training.grad_accum == 1);  // default
  REQUIRE(r.seed == 7);
  // The resolved YAML parses back to the same recipe.
  Recipe again = parse_recipe(recipe_to_yaml(r), "resolved.yaml");
  REQUIRE(recipe_to_yaml(again) == recipe_to_yaml(r));
  REQUIRE(recipe_to_yaml(r).find("lr: 0.2\n") != std::string::npos);
}

TEST_CASE("recipe: an unknown key names the file, line and the closest key", "[recipe]") {
  std::string e = error_of("training:\n  epochs: 3\n  glbal_batch: 64\n");
  REQUIRE(e.find("r.yaml:3") != std::string::npos);
  REQUIRE(e.find("unknown key 'training.glbal_batch'") != std::string::npos);
  REQUIRE(e.find("did you mean 'training.global_batch'") != std::string::npos);
  // A key under the wrong section still finds its closest match.
  e = error_of("model:\n  lr: 0.1\n");
  REQUIRE(e.find("did you mean 'optimizer.lr'") != std::string::npos);
  e = error_of("", {"optimizer.moment=0.8"});
  REQUIRE(e.find("override 'optimizer.moment=0.8'") != std::string::npos);
  REQUIRE(e.find("optimizer.momentum") != std::string::npos);
}

TEST_CASE("recipe: wrong types and out-of-range values", "[recipe]") {
  std::string e = error_of("training:\n  epochs: three\n");
  REQUIRE(e.find("r.yaml:2") != std::string::npos);
  REQUIRE(e.find("'training.epochs' expects an integer, got 'three'") != std::string::npos);
  e = error_of("optimizer:\n  momentum: 1.5\n");
  REQUIRE(e.find("out of range [0, 1]") != std::string::npos);
  e = error_of("model:\n  name: resnet17\n");
  REQUIRE(e.find("not one of") != std::string::npos);
  e = error_of("training: 5\n");
  REQUIRE(e.find("section 'training' must be a map") != std::string::npos);
  e = error_of("training:\n  epochs: [1\n");
  REQUIRE(e.find("YAML syntax error") != std::string::npos);
  e = error_of("", {"training.global_batch=0"});
  REQUIRE(e.find("out of range") != std::string::npos);
  e = error_of("", {"seed"});
  REQUIRE(e.find("expected key=value") != std::string::npos);
}

TEST_CASE("recipe: parallel.allreduce takes the algorithms by name", "[recipe]") {
  REQUIRE(parse_recipe("", "r.yaml").parallel.allreduce == "auto");
  for (std::string name : {"ring", "recursive_doubling", "tree", "butterfly", "all_to_all",
                           "master_worker", "round_robin"})
    REQUIRE(parse_recipe("", "r.yaml", {"parallel.allreduce=" + name}).parallel.allreduce == name);
  std::string e = error_of("parallel:\n  allreduce: hypercube\n");
  REQUIRE(e.find("r.yaml:2") != std::string::npos);
  REQUIRE(e.find("'parallel.allreduce' = 'hypercube' is not one of: auto, ring, "
                 "recursive_doubling, tree, butterfly, all_to_all, master_worker, round_robin") !=
          std::string::npos);
}
