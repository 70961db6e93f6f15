// Recipes (trainer/recipe.h): the schema, every key bound to a field of a
// Recipe (its kinds of key: recipe_fields.cpp), read from YAML and overrides,
// and written back.
#include "trainer/recipe.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>

#include "core/check.h"
#include "data/files.h"
#include "trainer/recipe_parts.h"

namespace trainer {

namespace {

// A recipe is a page of YAML; a larger file is not one (and is not read whole).
constexpr uint64_t kMaxRecipeBytes = 16 << 20;

Origin origin_of(const std::string& file, const YAML::Node& node) {
  const YAML::Mark m = node.Mark();
  return Origin{m.line >= 0 ? cat(file, ":", m.line + 1) : file};
}

constexpr int64_t kBig = std::numeric_limits<int32_t>::max();

std::vector<Field> schema(Recipe& r) {
  ModelRecipe& m = r.model;
  DataRecipe& d = r.data;
  OptimizerRecipe& op = r.optimizer;
  ScheduleRecipe& s = r.schedule;
  TrainingRecipe& t = r.training;
  ParallelRecipe& p = r.parallel;
  std::vector<Field> fields = {
      string_field(
          "model.name", &m.name,
          {"small_cnn", "mlp", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
           "resnet18_small", "resnet34_small", "resnet50_small", "gpt", "llama", "lstm_lm"}),
      int_field("model.num_classes", &m.num_classes, 1, 1000000),
      int_field("model.in_channels", &m.in_channels, 1, 4096),
      bool_field("model.zero_init_residual", &m.zero_init_residual),
      int_field("model.vocab_size", &m.vocab_size, 0, 10000000),
      int_field("model.context", &m.context, 1, 1 << 20),
      int_field("model.n_layer", &m.n_layer, 1, 1024),
      int_field("model.n_head", &m.n_head, 1, 1024),
      int_field("model.d_model", &m.d_model, 1, 1 << 16),
      int_field("model.hidden", &m.hidden, 1, 1 << 16),
      float_field("model.dropout", &m.dropout, 0.0, 0.99),
      bool_field("model.tie_weights", &m.tie_weights),
      string_field("model.gelu", &m.gelu, {"exact", "tanh"}),
      int_field("model.intermediate_size", &m.intermediate_size, 0, 1 << 20),
      int_field("model.num_key_value_heads", &m.num_key_value_heads, 0, 1024),
      float_field("model.rope_theta", &m.rope_theta, 1.0, 1e9),
      float_field("model.rms_norm_eps", &m.rms_norm_eps, 1e-12, 1.0),
      string_field("model.rope_scaling", &m.rope_scaling, {"none", "linear", "llama3"}),
      float_field("model.rope_factor", &m.rope_factor, 1.0, 1e6),
      float_field("model.rope_low_freq_factor", &m.rope_low_freq_factor, 1e-3, 1e6),
      float_field("model.rope_high_freq_factor", &m.rope_high_freq_factor, 1e-3, 1e6),
      int_field("model.rope_original_max_position_embeddings",
                &m.rope_original_max_position_embeddings, 1, 1 << 24),
      int_field("model.moe.experts", &m.moe.experts, 0, 1 << 16),
      int_field("model.moe.top_k", &m.moe.top_k, 1, 1 << 16),
      int_field("model.moe.every_n_layers", &m.moe.every_n_layers, 1, 1024),
      int_field("model.moe.hidden", &m.moe.hidden, 0, 1 << 20),
      float_field("model.moe.capacity_factor", &m.moe.capacity_factor, 1e-3, 1e3),
      bool_field("model.moe.dropless", &m.moe.dropless),
      float_field("model.moe.aux_loss_coef", &m.moe.aux_loss_coef, 0.0, 1e3),
      float_field("model.moe.z_loss_coef", &m.moe.z_loss_coef, 0.0, 1e3),
      int_field("model.moe.shared_experts", &m.moe.shared_experts, 0, 1024),
      string_field("model.moe.score", &m.moe.score, {"softmax", "sigmoid"}),
      bool_field("model.moe.normalize_top_k", &m.moe.normalize_top_k),
      float_field("model.moe.bias_update_rate", &m.moe.bias_update_rate, 0.0, 1.0),

      string_field("data.name", &d.name, {"fashion_mnist", "image_folder", "text", "tokens"}),
      string_field("data.root", &d.root),
      int_field("data.image_size", &d.image_size, 1, 4096),
      int_field("data.resize", &d.resize, 0, 8192),
      bool_field("data.augment", &d.augment),
      int_field("data.workers", &d.workers, 0, 256),
      int_field("data.prefetch", &d.prefetch, 1, 1024),
      string_field("data.bad_files", &d.bad_files, {"skip", "error"}),
      float_field("data.val_fraction", &d.val_fraction, 0.0, 0.9),
      string_field("data.path", &d.path),
      string_field("data.vocab", &d.vocab, {"byte", "char"}),
      int_field("data.seq_len", &d.seq_len, 0, 1 << 20),
      int_field("data.val_windows", &d.val_windows, 0, kBig),
      int_field("data.val_samples", &d.val_samples, 0, kBig),
      string_field("data.sampling", &d.sampling, {"random", "contiguous"}),

      string_field("optimizer.name", &op.name, {"sgd", "adamw"}),
      float_field("optimizer.lr", &op.lr, 0.0, 100.0),
      bool_field("optimizer.scale_lr", &op.scale_lr),
      float_field("optimizer.momentum", &op.momentum, 0.0, 1.0),
      float_field("optimizer.dampening", &op.dampening, 0.0, 1.0),
      bool_field("optimizer.nesterov", &op.nesterov),
      float_field("optimizer.weight_decay", &op.weight_decay, 0.0, 1.0),
      bool_field("optimizer.decay_norm_and_bias", &op.decay_norm_and_bias),
      float_field("optimizer.beta1", &op.beta1, 0.0, 0.999999),
      float_field("optimizer.beta2", &op.beta2, 0.0, 0.999999999),
      float_field("optimizer.eps", &op.eps, 0.0, 1.0),
      float_field("optimizer.clip_grad_norm", &op.clip_grad_norm, 0.0, 1e9),

      string_field("schedule.name", &s.name, {"constant", "step", "multistep", "cosine"}),
      float_field("schedule.warmup_epochs", &s.warmup_epochs, 0.0, 1e6),
      int_field("schedule.warmup_steps", &s.warmup_steps, 0, kBig),
      float_field("schedule.step_size", &s.step_size, 1e-9, 1e9),
      float_list_field("schedule.milestones", &s.milestones, 0.0, 1e9),
      float_field("schedule.gamma", &s.gamma, 0.0, 1.0),
      float_field("schedule.min_lr", &s.min_lr, 0.0, 100.0),

      int_field("training.epochs", &t.epochs, 0, 1000000),
      int_field("training.steps", &t.steps, 0, kBig),
      int_field("training.global_batch", &t.global_batch, 1, 1 << 24),
      int_field("training.grad_accum", &t.grad_accum, 1, 65536),
      int_field("training.eval_every", &t.eval_every, 0, kBig),
      int_field("training.log_every", &t.log_every, 1, kBig),
      int_field("training.checkpoint_every", &t.checkpoint_every, 0, kBig),
      int_field("training.keep_last", &t.keep_last, 1, 100000),
      int_field("training.max_nonfinite", &t.max_nonfinite, 1, 1000000),
      int_field("training.threads", &t.threads, 0, 4096),
      bool_field("training.trace", &t.trace),
      bool_field("training.allow_non_finite", &t.allow_non_finite),
      bool_field("training.async_checkpoint", &t.async_checkpoint),
      int_field("training.async_checkpoint_mb", &t.async_checkpoint_mb, 0, 1 << 30),
      int_field("training.memory_limit_mb", &t.memory_limit_mb, 0, int64_t(1) << 30),

      int_field("parallel.dp", &p.dp, 0, 1 << 20),
      int_field("parallel.pp", &p.pp, 1, 4096),
      int_field("parallel.tp", &p.tp, 1, 4096),
      int_field("parallel.cp", &p.cp, 1, 4096),
      int_field("parallel.ep", &p.ep, 1, 4096),
      string_field("parallel.cp_attention", &p.cp_attention, {"ring", "all_to_all"}),
      bool_field("parallel.cp_load_balance", &p.cp_load_balance),
      bool_field("parallel.sequence_parallel", &p.sequence_parallel),
      int_field("parallel.micro_batches", &p.micro_batches, 0, 65536),
      string_field("parallel.schedule", &p.schedule,
                   {"gpipe", "1f1b", "interleaved", "zbh1", "wavefront"}),
      int_field("parallel.virtual_stages", &p.virtual_stages, 1, 1024),
      int_field("parallel.time_chunks", &p.time_chunks, 1, 65536),
      stages_field("parallel.stages", &p.stages, &p.stage_starts),
      float_field("parallel.stage_memory_mb", &p.stage_memory_mb, 0.0, 1e9),
      int_field("parallel.bucket_mb", &p.bucket_mb, 1, 1 << 16),
      bool_field("parallel.overlap", &p.overlap),
      string_field("parallel.allreduce", &p.allreduce,
                   {"auto", "ring", "recursive_doubling", "tree", "butterfly", "all_to_all",
                    "master_worker", "round_robin"}),
      string_field("parallel.shard", &p.shard, {"none", "optimizer", "gradients", "parameters"}),
      bool_field("parallel.zero1", &p.zero1),
      bool_field("parallel.reshard_after_forward", &p.reshard_after_forward),
      int_field("parallel.keep_last_blocks", &p.keep_last_blocks, 0, 1 << 20),
      int_field("parallel.dp_replicate", &p.dp_replicate, 1, 1 << 20),
      float_field("parallel.shard_unit_mb", &p.shard_unit_mb, 0.0, 1e6),
      string_field("parallel.param_dtype", &p.param_dtype, {"auto", "f32", "bf16"}),
      string_field("parallel.reduce_dtype", &p.reduce_dtype, {"f32", "bf16"}),
      bool_field("parallel.sync_bn", &p.sync_bn),
      bool_field("parallel.auto", &p.auto_plan),
      string_field("parallel.recompute", &p.recompute, {"none", "blocks", "selective"}),
      string_field("parallel.gpu_direct", &p.gpu_direct, {"auto", "on", "off"}),
      string_field("parallel.mode", &p.mode, {"allreduce", "parameter_server"}),
      int_field("parallel.servers", &p.servers, 1, 1 << 16),
      string_field("parallel.sync", &p.sync, {"bsp", "asp", "ssp"}),
      int_field("parallel.staleness", &p.staleness, 0, 1 << 20),

      string_field("precision", &r.precision, {"fp32", "bf16", "fp16"}),
      float_field("loss_scaler.init_scale", &r.loss_scaler.init_scale, 1e-30, 1e30),
      float_field("loss_scaler.growth_factor", &r.loss_scaler.growth_factor, 1.0 + 1e-9, 1e6),
      float_field("loss_scaler.backoff_factor", &r.loss_scaler.backoff_factor, 1e-9, 1.0 - 1e-9),
      int_field("loss_scaler.growth_interval", &r.loss_scaler.growth_interval, 1, kBig),
      string_field("device", &r.device, {"cpu", "cuda"}),
      int_field("seed", &r.seed, 0, std::numeric_limits<int64_t>::max()),
      string_field("output_dir", &r.output_dir),
  };
  // Hugging Face's LlamaConfig names for keys every Transformer has.
  const std::pair<const char*, const char*> aliases[] = {
      {"model.hidden_size", "model.d_model"},
      {"model.num_attention_heads", "model.n_head"},
      {"model.num_hidden_layers", "model.n_layer"},
      {"model.max_position_embeddings", "model.context"},
      {"model.tie_word_embeddings", "model.tie_weights"}};
  for (const auto& [alias, target] : aliases)
    for (size_t i = 0; i < fields.size(); ++i)
      if (fields[i].path == target) fields.push_back(alias_field(alias, fields[i]));
  // data.kind: another name of data.name (the kind of data a recipe reads).
  for (size_t i = 0; i < fields.size(); ++i)
    if (fields[i].path == "data.name") fields.push_back(alias_field("data.kind", fields[i]));
  return fields;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string closest_key(const std::vector<Field>& fields, const std::string& path) {
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const Field& f : fields) {
    size_t d = edit_distance(path, f.path);
    // Also compare with just the last component, for keys under the wrong section.
    std::string last = f.path.substr(f.path.rfind('.') + 1);
    std::string path_last = path.substr(path.rfind('.') + 1);
    d = std::min(d, edit_distance(path_last, last) + 1);
    if (d < best_d) best_d = d, best = f.path;
  }
  return best;
}

const Field* find_field(const std::vector<Field>& fields, const std::string& path) {
  for (const Field& f : fields)
    if (f.path == path) return &f;
  return nullptr;
}

bool is_section(const std::vector<Field>& fields, const std::string& path) {
  for (const Field& f : fields)
    if (f.path.rfind(path + ".", 0) == 0) return true;
  return false;
}

void walk(const std::vector<Field>& fields, const YAML::Node& node, const std::string& prefix,
          const std::string& file) {
  if (!node.IsMap())
    throw Error(cat(origin_of(file, node).text, ": ",
                    prefix.empty() ? "a recipe must be a YAML map of sections"
                                   : "section '" + prefix + "' must be a map"));
  std::map<std::string, Origin> seen;  // key -> where it was first given
  for (auto it = node.begin(); it != node.end(); ++it) {
    Origin o = origin_of(file, it->first);
    if (!it->first.IsScalar())
      throw Error(cat(o.text, ": a key in ",
                      prefix.empty() ? "the recipe" : "section '" + prefix + "'", " is ",
                      it->first.IsSequence() ? "a list" : "a map",
                      "; keys are plain names such as 'training' or 'epochs'"));
    std::string key = it->first.Scalar();
    std::string path = prefix.empty() ? key : prefix + "." + key;
    if (auto [first, fresh] = seen.emplace(key, o); !fresh)
      throw Error(cat(o.text, ": key '", path, "' is given twice (also at ", first->second.text,
                      "); keep one of them"));
    if (const Field* f = find_field(fields, path)) {
      f->parse(it->second, o);
    } else if (is_section(fields, path)) {
      walk(fields, it->second, path, file);
    } else {
      throw Error(cat(o.text, ": unknown key '", path, "'; did you mean '",
                      closest_key(fields, path),
                      "'? (`trainer train --help` lists the recipe keys)"));
    }
  }
}

void apply_override(const std::vector<Field>& fields, const std::string& text) {
  size_t eq = text.find('=');
  Origin o{cat("override '", text, "'")};
  if (eq == std::string::npos || eq == 0)
    throw Error(cat(o.text, ": expected key=value, e.g. training.epochs=3"));
  std::string path = text.substr(0, eq);
  const Field* f = find_field(fields, path);
  if (!f)
    throw Error(
        cat(o.text, ": unknown key '", path, "'; did you mean '", closest_key(fields, path), "'?"));
  YAML::Node value;
  try {
    value = YAML::Load(text.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    throw Error(cat(o.text, ": cannot parse the value: ", e.msg));
  }
  if (value.IsNull()) value = YAML::Node(std::string());
  f->parse(value, o);
}

}  // namespace

namespace {

Recipe parse_recipe_text(const std::string& text, const std::string& name,
                         const std::vector<std::string>& overrides, bool allow_empty) {
  Recipe r;
  r.source = name;
  std::vector<Field> fields = schema(r);
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw Error(cat(name, ":", e.mark.line + 1, ": YAML syntax error: ", e.msg));
  }
  if (root.IsNull() && !allow_empty)
    throw Error(cat(name,
                    ": the recipe is empty (no keys); write at least its model: and data: "
                    "sections (recipes/ holds examples)"));
  if (!root.IsNull()) walk(fields, root, "", name);
  for (const std::string& o : overrides) apply_override(fields, o);
  return r;
}

}  // namespace

Recipe parse_recipe(const std::string& text, const std::string& name,
                    const std::vector<std::string>& overrides) {
  return parse_recipe_text(text, name, overrides, /*allow_empty=*/true);
}

Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides) {
  // A directory or a FIFO is refused before reading (data/files.h).
  const std::string text = data::read_regular_file(path, "the recipe", kMaxRecipeBytes);
  return parse_recipe_text(text, path, overrides, /*allow_empty=*/false);
}

std::string recipe_to_yaml(const Recipe& r) {
  Recipe copy = r;
  YAML::Node root(YAML::NodeType::Map);
  for (const Field& f : schema(copy)) {
    if (!f.alias_of.empty()) continue;
    size_t dot = f.path.find('.');
    if (dot == std::string::npos)
      root[f.path] = f.emit();
    else
      root[f.path.substr(0, dot)][f.path.substr(dot + 1)] = f.emit();
  }
  YAML::Emitter out;
  out << root;
  return std::string(out.c_str()) + "\n";
}

// A default value as one line of YAML ("0.1", "[]", "" for an empty string).
std::string yaml_text(const YAML::Node& node) {
  YAML::Emitter out;
  out << node;
  std::string text = out.c_str();
  return text == "\"\"" || text == "~" ? "" : text;
}

std::vector<RecipeKey> recipe_schema() {
  Recipe defaults;
  std::vector<RecipeKey> keys;
  for (const Field& f : schema(defaults))
    keys.push_back(RecipeKey{f.path, f.type, yaml_text(f.emit()), f.range});
  return keys;
}

std::vector<std::string> recipe_keys() {
  Recipe r;
  std::vector<std::string> keys;
  for (const Field& f : schema(r)) keys.push_back(f.path);
  return keys;
}

}  // namespace trainer
