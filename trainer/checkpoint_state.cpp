// trainer_state.json (trainer/checkpoint.h): the replicated state of a
// checkpoint written and read back, each field checked for its type and
// range; and what changes when a checkpoint is resumed on another layout.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/rng.h"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"

namespace trainer {

namespace {
using json = nlohmann::json;

// The fields of trainer_state.json, each checked for its JSON type: an
// Error names the file and the field ("parallel.world_size").
struct StateFields {
  const std::string& path;

  [[noreturn]] void wrong_type(const std::string& field, const json& value,
                               const char* expected) const {
    throw Error(cat(path, ": missing or wrong field '", field, "': it is ", value.type_name(),
                    ", expected ", expected, "; use an earlier checkpoint"));
  }
  // object[key], or nullptr with a fallback when it is absent.
  const json* find(const json& object, const char* key, const std::string& prefix,
                   bool has_fallback) const {
    if (object.contains(key)) return &object[key];
    if (!has_fallback)
      throw Error(cat(path, ": missing or wrong field '", prefix, key,
                      "': it is missing; use an earlier checkpoint"));
    return nullptr;
  }
  int64_t integer(const json& object, const char* key, std::optional<int64_t> fallback = {},
                  const std::string& prefix = "", int64_t at_least_one_up_to = 0) const {
    const json* v = find(object, key, prefix, fallback.has_value());
    if (!v) return *fallback;
    if (!v->is_number_integer()) wrong_type(prefix + key, *v, "an integer");
    const int64_t x = v->get<int64_t>();
    if (at_least_one_up_to > 0 && (x < 1 || x > at_least_one_up_to))
      throw Error(cat(path, ": missing or wrong field '", prefix, key, "': ", x, " is outside [1, ",
                      at_least_one_up_to, "]; use an earlier checkpoint"));
    return x;
  }
  double number(const json& object, const char* key, std::optional<double> fallback = {}) const {
    const json* v = find(object, key, "", fallback.has_value());
    if (!v) return *fallback;
    if (!v->is_number()) wrong_type(key, *v, "a number");
    return v->get<double>();
  }
  bool boolean(const json& object, const char* key, bool fallback,
               const std::string& prefix) const {
    const json* v = find(object, key, prefix, true);
    if (!v) return fallback;
    if (!v->is_boolean()) wrong_type(prefix + key, *v, "true or false");
    return v->get<bool>();
  }
  const json& object(const json& parent, const char* key, const std::string& prefix = "") const {
    const json& v = *find(parent, key, prefix, false);
    if (!v.is_object()) wrong_type(prefix + key, v, "an object");
    return v;
  }
  std::string text(const json& object, const char* key, const std::string& prefix) const {
    const json& v = *find(object, key, prefix, false);
    if (!v.is_string()) wrong_type(prefix + key, v, "a string");
    return v.get<std::string>();
  }
};

// "tokenizer": {"type": "sentencepiece", "checksum", "vocab_size", "model"}.
void read_tokenizer(const StateFields& fields, const json& t, TrainerStateFile& file) {
  if (fields.text(t, "type", "tokenizer.") != "sentencepiece")
    throw Error(cat(fields.path,
                    ": tokenizer.type is not \"sentencepiece\", the only kind this "
                    "trainer reads; use an earlier checkpoint"));
  file.tokenizer_checksum = fields.text(t, "checksum", "tokenizer.");
  file.tokenizer_size = fields.integer(t, "vocab_size", {}, "tokenizer.", int64_t(1) << 32);
  file.tokenizer_model = fields.text(t, "model", "tokenizer.");
}

}  // namespace

void write_trainer_state(const std::string& dir, const TrainerStateFile& file) {
  const TrainState& s = file.state;
  json j;
  j["format"] = kTrainerStateFormat;
  j["step"] = s.step;
  j["epoch"] = s.epoch;
  j["position"] = s.position;
  j["best_metric"] = s.best_metric;
  j["nonfinite_skipped"] = s.nonfinite_skipped;
  j["lr"] = file.lr;
  j["rng"] = {{"seed", file.seed},
              {"init_stream", uint64_t(kStreamInit)},
              {"dropout", "re-keyed per micro-step from (seed, layer, micro-step, rank)"},
              {"augment", "keyed by (seed, epoch, sample index)"}};
  const ParallelLayout& l = s.layout;
  j["parallel"] = {{"world_size", l.world_size()},
                   {"dp", l.mesh.size(parallel::kDataParallel)},
                   {"pp", l.mesh[parallel::Dim::pp]},
                   {"tp", l.mesh[parallel::Dim::tp]},
                   {"zero1", l.zero1}};
  // Sharded gradients or parameters; zero1 says the rest.
  if (l.zero1 && l.zero_stage > 1) j["parallel"]["shard"] = kShardNames[l.zero_stage];
  // dp, pp and tp say it all unless another dimension is in use.
  const parallel::Dims said{parallel::Dim::dp_replicate, parallel::Dim::pp, parallel::Dim::tp};
  if (l.mesh.size(said.complement()) > 1)
    for (parallel::Dim d : parallel::kAllDims)
      j["parallel"]["mesh"][parallel::dim_name(d)] = l.mesh[d];
  for (const auto& [ranks, model] : s.link_models)
    j["link_models"].push_back({{"ranks", ranks},
                                {"alpha_s", model.alpha},
                                {"beta_s_per_byte", model.beta},
                                {"gamma_s_per_byte", model.gamma}});
  if (!file.vocab.empty()) j["vocab"] = file.vocab;
  if (!file.tokenizer_checksum.empty())
    j["tokenizer"] = {{"type", "sentencepiece"},
                      {"checksum", file.tokenizer_checksum},
                      {"vocab_size", file.tokenizer_size},
                      {"model", file.tokenizer_model}};
  j["recipe"] = file.recipe_yaml;
  write_file_atomic(trainer_state_file(dir), j.dump(2) + "\n");
}

TrainerStateFile read_trainer_state(const std::string& dir) {
  const std::string path = trainer_state_file(dir);
  return parse_trainer_state(read_file(path, "the trainer state"), path);
}

namespace {

// parallel.mesh (format 2), or the data x pipeline x tensor figures of
// format 1 (written before pipeline and tensor parallelism had keys: all
// data-parallel).
parallel::MeshShape read_mesh(StateFields& fields, const json& p, int64_t world, int64_t max) {
  parallel::MeshShape mesh;
  if (!p.contains("mesh")) {
    mesh.set(parallel::Dim::dp_replicate, int(fields.integer(p, "dp", world, "parallel.", max)));
    mesh.set(parallel::Dim::pp, int(fields.integer(p, "pp", 1, "parallel.", max)));
    mesh.set(parallel::Dim::tp, int(fields.integer(p, "tp", 1, "parallel.", max)));
    return mesh;
  }
  const json& m = fields.object(p, "mesh", "parallel.");
  for (const auto& [key, value] : m.items())
    if (!parallel::dim_from_name(key))
      throw Error(cat(fields.path, ": parallel.mesh names a dimension '", key,
                      "' this build does not know; resume with the trainer that wrote it"));
  for (parallel::Dim d : parallel::kAllDims)
    mesh.set(d, int(fields.integer(m, parallel::dim_name(d), 1, "parallel.mesh.", max)));
  return mesh;
}

// parallel.shard: the ZeRO stage, which zero1 must agree with (files
// without it: zero1's stage, 1 or 0).
int read_shard(StateFields& fields, const json& p, bool zero1) {
  if (!p.contains("shard")) return zero1 ? 1 : 0;
  const json& shard = p["shard"];
  const auto* it = shard.is_string() ? std::find(std::begin(kShardNames), std::end(kShardNames),
                                                 shard.get<std::string>())
                                     : std::end(kShardNames);
  if (it == std::end(kShardNames) || (it != std::begin(kShardNames)) != zero1)
    fields.wrong_type(
        "parallel.shard", shard,
        zero1 ? "optimizer, gradients or parameters (zero1 is on)" : "none (zero1 is off)");
  return int(it - std::begin(kShardNames));
}

}  // namespace

TrainerStateFile parse_trainer_state(const std::string& text, const std::string& path) {
  // A key given twice is refused: which of the two values holds is not known.
  const json j = parse_strict_json(text, [&](const std::string& problem) {
    throw Error(cat(path, ": ", problem, "; the file is damaged: use an earlier checkpoint"));
  });
  if (!j.is_object())
    throw Error(
        cat(path, ": not a JSON object but ", j.type_name(), "; use an earlier checkpoint"));
  StateFields fields{path};
  const int64_t format = fields.integer(j, "format", 1);
  if (format > kTrainerStateFormat)
    throw Error(cat(path, ": format ", format,
                    " was written by a newer trainer (this one reads up to ", kTrainerStateFormat,
                    "); resume with that trainer"));
  if (format < 1)
    throw Error(cat(path, ": format ", format, " is not a version; use an earlier checkpoint"));
  TrainerStateFile file;
  TrainState& s = file.state;
  s.step = fields.integer(j, "step");
  s.epoch = fields.integer(j, "epoch");
  s.position = fields.integer(j, "position");
  s.best_metric = fields.number(j, "best_metric");
  s.nonfinite_skipped = fields.integer(j, "nonfinite_skipped");
  file.lr = fields.number(j, "lr", 0.0);
  if (s.step < 0 || s.epoch < 0 || s.position < 0)
    throw Error(cat(path, ": negative step, epoch or position; use an earlier checkpoint"));
  if (j.contains("parallel")) {
    const json& p = fields.object(j, "parallel");
    // Up to 2^20 ranks per dimension: world_size below cannot overflow.
    constexpr int64_t kMaxRanks = int64_t(1) << 20;
    const int64_t world = fields.integer(p, "world_size", 1, "parallel.", kMaxRanks);
    s.layout.mesh = read_mesh(fields, p, world, kMaxRanks);
    s.layout.zero1 = fields.boolean(p, "zero1", false, "parallel.");
    s.layout.zero_stage = read_shard(fields, p, s.layout.zero1);
    if (int64_t(s.layout.mesh.size()) != world)
      throw Error(cat(path, ": parallel.world_size ", world, " is not ",
                      p.contains("mesh") ? "the product of parallel.mesh" : "dp x pp x tp", " (",
                      parallel::to_string(s.layout.mesh), "); use an earlier checkpoint"));
  }
  if (j.contains("link_models")) {
    const json& models = j["link_models"];
    const char* expected = "a list of {ranks, alpha_s, beta_s_per_byte, gamma_s_per_byte}";
    if (!models.is_array()) fields.wrong_type("link_models", models, expected);
    for (const json& m : models) {
      if (!m.is_object() || !m.contains("ranks") || !m["ranks"].is_array())
        fields.wrong_type("link_models", m, expected);
      std::vector<int> ranks;
      for (const json& r : m["ranks"]) {
        if (!r.is_number_integer() || r.get<int64_t>() < 0 ||
            r.get<int64_t>() >= s.layout.world_size())
          fields.wrong_type("link_models.ranks", r,
                            cat("ranks below the world size ", s.layout.world_size()).c_str());
        ranks.push_back(int(r.get<int64_t>()));
      }
      comm::LinkModel model{.alpha = fields.number(m, "alpha_s"),
                            .beta = fields.number(m, "beta_s_per_byte"),
                            .gamma = fields.number(m, "gamma_s_per_byte")};
      if (!(model.alpha >= 0 && model.beta >= 0 && model.gamma >= 0))
        throw Error(cat(path, ": link_models: negative cost for ranks ", json(ranks).dump(),
                        "; use an earlier checkpoint"));
      s.link_models[std::move(ranks)] = model;
    }
  }
  if (j.contains("vocab")) {
    const json& vocab = j["vocab"];
    if (!vocab.is_array()) fields.wrong_type("vocab", vocab, "a list of integers");
    for (const json& symbol : vocab) {
      if (!symbol.is_number_integer()) fields.wrong_type("vocab", symbol, "a list of integers");
      file.vocab.push_back(symbol.get<int64_t>());
    }
  }
  if (j.contains("tokenizer")) read_tokenizer(fields, fields.object(j, "tokenizer"), file);
  if (j.contains("recipe")) {
    if (!j["recipe"].is_string()) fields.wrong_type("recipe", j["recipe"], "a string");
    file.recipe_yaml = j["recipe"].get<std::string>();
  }
  return file;
}

std::string resharding(const ParallelLayout& saved, const ParallelLayout& current) {
  std::string out;
  auto change = [&](const char* what, auto was, auto now) {
    if (was == now) return;
    out += cat(out.empty() ? "" : ", ", what, " ", was, " -> ", now);
  };
  change("dp", saved.mesh.size(parallel::kDataParallel),
         current.mesh.size(parallel::kDataParallel));
  change("dp_replicate", saved.replica_groups(), current.replica_groups());
  change("pp", saved.mesh[parallel::Dim::pp], current.mesh[parallel::Dim::pp]);
  change("tp", saved.mesh[parallel::Dim::tp], current.mesh[parallel::Dim::tp]);
  change("zero1", saved.zero1 ? "on" : "off", current.zero1 ? "on" : "off");
  if (saved.zero1 && current.zero1)
    change("shard", kShardNames[std::max(saved.zero_stage, 1)],
           kShardNames[std::max(current.zero_stage, 1)]);
  return out;
}

}  // namespace trainer
