// The trainer's models through the registry: GPT checkpoints carry nanoGPT's
// names (the tied head under both), checkpoints with the older names (no
// "transformer." prefix, no lm_head.weight when tied) still load by
// init_from and resume by load (model and optimizer), a tied pair that
// disagrees is refused, and model.gelu picks the MLP's GELU. Llama: Hugging
// Face's config names as recipe keys, a Hugging Face checkpoint (bf16, the
// tied head omitted) starts a run, and `trainer export` writes Hugging
// Face's names and config.json.
#include "tests/testing.h"

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "models/registry.h"
#include "tests/process.h"
#include "trainer/recipe.h"
#include "trainer/safetensors.h"
#include "trainer/session.h"

using namespace trainer;
using namespace trainer::testing;
namespace fs = std::filesystem;

namespace {

fs::path tiny_gpt_recipe() {
  const fs::path dir = fresh_temp_dir("models_recipe");
  std::string text;
  for (int i = 0; i < 400; ++i) text += "in the beginning was the word, and the word was good.\n";
  std::ofstream(dir / "corpus.txt", std::ios::binary) << text;
  const fs::path recipe = dir / "gpt.yaml";
  std::ofstream(recipe) << "model:\n  name: gpt\n  n_layer: 2\n  n_head: 2\n  d_model: 16\n"
                        << "  hidden: 16\n  context: 8\ndata:\n  name: text\n  path: "
                        << (dir / "corpus.txt").string() << "\n  vocab: char\n  seq_len: 8\n"
                        << "optimizer:\n  name: adamw\n  lr: 0.01\ntraining:\n  steps: 2\n"
                        << "  global_batch: 2\n  threads: 1\noutput_dir: " << (dir / "run").string()
                        << "\n";
  return recipe;
}

// Hugging Face's names for a Llama's keys (the schema's aliases).
const std::vector<std::string> kLlamaKeys = {"model.name=llama",
                                             "model.num_hidden_layers=2",
                                             "model.num_attention_heads=2",
                                             "model.hidden_size=16",
                                             "model.num_key_value_heads=1",
                                             "model.intermediate_size=24",
                                             "model.max_position_embeddings=8",
                                             "model.tie_word_embeddings=true",
                                             "model.rope_theta=500000"};

// tensors under names with the "transformer." prefix dropped and without
// lm_head.weight when drop_head: what this trainer wrote before.
std::vector<NamedTensor> old_names(const std::vector<NamedTensor>& state, bool drop_head) {
  std::vector<NamedTensor> out;
  const std::string prefix = "transformer.";
  for (const NamedTensor& t : state) {
    if (drop_head && t.name == "lm_head.weight") continue;
    out.push_back({t.name.rfind(prefix, 0) == 0 ? t.name.substr(prefix.size()) : t.name, t.tensor});
  }
  return out;
}

void require_same_state(Module& a, Module& b) {
  std::vector<NamedTensor> sa = a.state(), sb = b.state();
  REQUIRE(sa.size() == sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    REQUIRE(sa[i].name == sb[i].name);
    require_close(sa[i].tensor, sb[i].tensor, 0, 0, sa[i].name);
  }
}

}  // namespace

TEST_CASE("GPT checkpoints: nanoGPT's names written, the older names still read",
          "[train][models]") {
  const std::string recipe = tiny_gpt_recipe().string();
  for (bool tie : {true, false}) {
    INFO("tie_weights " << tie);
    const std::string tie_key = std::string("model.tie_weights=") + (tie ? "true" : "false");
    Session target(load_recipe(recipe, {tie_key}));
    Session donor(load_recipe(recipe, {tie_key, "seed=7"}));
    const fs::path dir = fresh_temp_dir("models_ckpt");

    // Written: nanoGPT's state_dict, the tied head under both names, equal.
    donor.save(dir.string(), TrainState{});
    const std::string model_path = pieces_file(dir.string(), "model", 0);
    SafetensorsFile written = read_safetensors(model_path);
    REQUIRE(written.tensors.count("transformer.wte.weight") == 1);
    REQUIRE(written.tensors.count("transformer.h.1.mlp.c_proj.bias") == 1);
    REQUIRE(written.tensors.count("lm_head.weight") == 1);
    REQUIRE(written.tensors.count("wte.weight") == 0);
    if (tie)
      require_close(written.tensors.at("lm_head.weight"),
                    written.tensors.at("transformer.wte.weight"), 0, 0, "tied head");
    target.init_from(model_path, /*strict=*/true);
    require_same_state(target.model(), donor.model());

    // Read: the older names, through init_from and through a checkpoint directory.
    Session fresh(load_recipe(recipe, {tie_key}));
    const fs::path old_file = dir / "old.safetensors";
    write_safetensors(old_file.string(), old_names(donor.model().state(), tie));
    fresh.init_from(old_file.string(), /*strict=*/true);
    require_same_state(fresh.model(), donor.model());
    // Resuming reads the optimizer's entries (<parameter>.<slot>) under the older names too.
    Session resumed(load_recipe(recipe, {tie_key}));
    write_safetensors(model_path, old_names(donor.model().state(), tie), written.metadata);
    const std::string optimizer_path = pieces_file(dir.string(), "optimizer", 0);
    SafetensorsFile optimizer_file = read_safetensors(optimizer_path);
    std::vector<NamedTensor> optimizer_state;
    for (const auto& [name, t] : optimizer_file.tensors) optimizer_state.push_back({name, t});
    std::vector<NamedTensor> renamed = old_names(optimizer_state, false);
    REQUIRE(renamed.size() > 10);
    CHECK(renamed.front().name.rfind("transformer.", 0) == std::string::npos);
    write_safetensors(optimizer_path, renamed, optimizer_file.metadata);
    resumed.load(dir.string());
    require_same_state(resumed.model(), donor.model());
  }
}

TEST_CASE("GPT checkpoints: a tied head that differs from the embedding is refused",
          "[train][models]") {
  const std::string recipe = tiny_gpt_recipe().string();
  Session session(load_recipe(recipe));
  std::vector<NamedTensor> state = session.model().state();
  for (NamedTensor& t : state)
    if (t.name == "lm_head.weight") t.tensor = t.tensor.clone() * 2.0;
  const fs::path file = fresh_temp_dir("models_bad_tie") / "model.safetensors";
  write_safetensors(file.string(), state);
  const std::string message = error_of([&] { session.init_from(file.string(), true); });
  CHECK(message.find(file.string() +
                     ": lm_head.weight differs from transformer.wte.weight, but this GPT "
                     "ties them") != std::string::npos);
  // Untied, the same file loads: two tensors.
  Session untied(load_recipe(recipe, {"model.tie_weights=false"}));
  untied.init_from(file.string(), true);
}

TEST_CASE("model.gelu: exact by default (nanoGPT), tanh on request", "[train][models]") {
  const std::string recipe = tiny_gpt_recipe().string();
  CHECK(load_recipe(recipe).model.gelu == "exact");
  Session exact(load_recipe(recipe)), tanh_form(load_recipe(recipe, {"model.gelu=tanh"}));
  const Tensor tokens = from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 6}, {1, 6});
  // Same weights (same seed); only the GELU differs.
  require_same_state(exact.model(), tanh_form.model());
  Tensor a = exact.model()(tokens), b = tanh_form.model()(tokens);
  CHECK(max(abs(a - b)).item<float>() > 0.0f);
  CHECK(error_of([&] {
          load_recipe(recipe, {"model.gelu=erf"});
        }).find("key 'model.gelu' = 'erf' is not one of: exact, tanh") != std::string::npos);
}

TEST_CASE("Llama: Hugging Face's key names, a bf16 checkpoint without the tied head starts a run",
          "[train][models][llama]") {
  const std::string recipe = tiny_gpt_recipe().string();
  const Recipe r = load_recipe(recipe, kLlamaKeys);
  CHECK(r.model.d_model == 16);
  CHECK(r.model.n_head == 2);
  CHECK(r.model.context == 8);
  CHECK(r.model.rope_theta == 500000.0);
  const std::string yaml = recipe_to_yaml(r);
  CHECK(yaml.find("d_model: 16") != std::string::npos);
  CHECK(yaml.find("hidden_size") == std::string::npos);  // printed once, under the schema's name

  Session donor(load_recipe(recipe, [] {
    std::vector<std::string> k = kLlamaKeys;
    k.push_back("seed=7");
    return k;
  }()));
  // As Hugging Face's save_pretrained writes a tied Llama: bf16, no lm_head.weight.
  std::vector<NamedTensor> hf;
  for (const NamedTensor& t : donor.model().state())
    if (t.name != "lm_head.weight") hf.push_back({t.name, t.tensor.to(DType::bf16)});
  REQUIRE(hf.front().name == "model.embed_tokens.weight");
  const fs::path file = fresh_temp_dir("llama_hf") / "model.safetensors";
  write_safetensors(file.string(), hf);
  Session target(r);
  target.init_from(file.string(), /*strict=*/true);
  for (const NamedTensor& t : target.model().state()) {
    const std::string source = t.name == "lm_head.weight" ? "model.embed_tokens.weight" : t.name;
    const Tensor expected = [&] {
      for (const NamedTensor& h : hf)
        if (h.name == source) return h.tensor.to(DType::f32);
      return Tensor();
    }();
    REQUIRE(expected.defined());
    require_close(t.tensor, expected, 0, 0, t.name);
  }
  CHECK(error_of([&] {
          Session bad(load_recipe(recipe, {"model.name=llama", "model.n_head=4", "model.d_model=16",
                                           "model.num_key_value_heads=3"}));
        }).find("model.num_key_value_heads 3 does not divide model.num_attention_heads 4") !=
        std::string::npos);
}

TEST_CASE("Llama: trainer export writes Hugging Face's names and config.json",
          "[train][models][llama]") {
  const std::string recipe = tiny_gpt_recipe().string();
  const fs::path run = fresh_temp_dir("llama_export");
  std::vector<std::string> args = {"train",
                                   recipe,
                                   "output_dir=" + (run / "run").string(),
                                   "training.checkpoint_every=2",
                                   "training.eval_every=0",
                                   "model.rope_scaling=llama3",
                                   "model.rope_factor=8"};
  args.insert(args.end(), kLlamaKeys.begin(), kLlamaKeys.end());
  const ProcessResult trained = run_trainer(args);
  INFO(trained.output);
  REQUIRE(trained.code == 0);
  const fs::path out = run / "hf" / "model.safetensors";
  const ProcessResult exported =
      run_trainer({"export", (run / "run").string(), "--out", out.string(), "--dtype", "bf16"});
  INFO(exported.output);
  REQUIRE(exported.code == 0);
  const SafetensorsFile file = read_safetensors(out.string());
  for (const char* name :
       {"model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.gate_proj.weight", "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight", "lm_head.weight"}) {
    INFO(name);
    REQUIRE(file.tensors.count(name) == 1);
    CHECK(file.tensors.at(name).dtype() == DType::bf16);
  }
  CHECK(file.tensors.at("model.layers.1.self_attn.k_proj.weight").shape() == Shape{8, 16});
  std::ifstream config_file(run / "hf" / "config.json");
  REQUIRE(config_file);
  const nlohmann::json config = nlohmann::json::parse(config_file);
  CHECK(config["architectures"][0] == "LlamaForCausalLM");
  CHECK(config["hidden_size"] == 16);
  CHECK(config["num_key_value_heads"] == 1);
  CHECK(config["intermediate_size"] == 24);
  CHECK(config["tie_word_embeddings"] == true);
  CHECK(config["rope_theta"] == 500000.0);
  CHECK(config["rope_scaling"]["rope_type"] == "llama3");
  CHECK(config["rope_scaling"]["factor"] == 8.0);
  CHECK(config["torch_dtype"] == "bfloat16");
  // The corpus's characters.
  CHECK(config["vocab_size"] == file.tensors.at("model.embed_tokens.weight").size(0));
}
