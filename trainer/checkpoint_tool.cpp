// The checkpoint commands (trainer/checkpoint_tool.h).
#include "trainer/checkpoint_tool.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>

#include "core/check.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_parts.h"
#include "trainer/hf_config.h"
#include "trainer/metrics.h"
#include "trainer/model_setup.h"
#include "trainer/safetensors.h"
#include "trainer/session.h"

namespace fs = std::filesystem;

namespace trainer {

namespace {

std::string size_text(double bytes) {
  char buf[32];
  if (bytes < 1024)
    std::snprintf(buf, sizeof buf, "%.0f B", bytes);
  else if (bytes < 1024.0 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f KiB", bytes / 1024);
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1024.0 * 1024));
  return buf;
}

// The name of the first non-finite tensor of `tensors`, or "".
std::string non_finite_tensor(const std::map<std::string, Tensor>& tensors) {
  for (const auto& [name, t] : tensors)
    if (first_non_finite(t).first >= 0) return name;
  return "";
}

// Per logical tensor, how many pieces the files of `stem` hold.
std::map<std::string, int> piece_counts(const std::string& dir, const std::string& stem) {
  std::map<std::string, int> counts;
  for (const auto& [rank, path] : pieces_files(dir, stem))
    for (const SafetensorsEntry& e : read_safetensors_header(path).entries)
      ++counts[e.name.substr(
          0, e.name.rfind('#') == std::string::npos ? e.name.size() : e.name.rfind('#'))];
  return counts;
}

std::string tensor_lines(const std::map<std::string, Tensor>& tensors,
                         const std::map<std::string, int>& pieces, const char* what) {
  int64_t elements = 0, bytes = 0;
  std::string lines;
  for (const auto& [name, t] : tensors) {
    elements += t.numel();
    bytes += int64_t(t.nbytes());
    auto p = pieces.find(name);
    const int n = p == pieces.end() ? 1 : p->second;
    lines += cat("    ", name, "  ", t.shape_str(), " ", t.dtype(),
                 n > 1 ? cat("  ", n, " pieces") : "", "\n");
  }
  return cat("  ", what, ": ", tensors.size(), " tensors, ", with_commas(elements), " elements (",
             size_text(double(bytes)), ")\n", lines);
}

}  // namespace

std::string find_checkpoint(const std::string& given, const std::string& option) {
  const fs::path path(given);
  const fs::file_status status = status_of(path);
  if (fs::is_regular_file(status)) {
    // A pointer file: the step directory it names beside it.
    const std::string root = path.has_parent_path() ? path.parent_path().string() : ".";
    if (auto dir = CheckpointDir::pointer_in(root, path.filename().string())) return *dir;
    throw Error(cat(option, " ", given,
                    ": a file that names no complete checkpoint beside it; "
                    "give a checkpoint directory, a pointer file (latest, best), a run's output "
                    "directory or its checkpoints/ folder"));
  }
  if (!fs::is_directory(status))
    throw Error(cat(option, " ", given, ": not a complete checkpoint: no such file or directory"));
  if (CheckpointDir::is_complete(given)) return given;
  const fs::path folder =
      fs::is_directory(status_of(path / "checkpoints")) ? path / "checkpoints" : path;
  if (auto latest = CheckpointDir::latest_in(folder.string())) return *latest;
  throw Error(cat(option, " ", given,
                  ": not a complete checkpoint (no trainer_state.json), nor a checkpoints/ "
                  "folder or run directory holding one"));
}

std::string checkpoint_info(const std::string& dir) {
  const TrainerStateFile file = read_trainer_state(dir);
  const TrainState& s = file.state;
  std::string out = cat("checkpoint ", dir, "\n  step ", s.step, ", epoch ", s.epoch, ", position ",
                        s.position, " per data-parallel rank; learning rate ", file.lr, "\n",
                        "  layout: world ", s.layout.world_size(), " (",
                        parallel::to_string(s.layout.mesh), s.layout.zero1 ? ", zero1" : "", ")\n");
  if (!file.tokenizer_checksum.empty())
    out += cat("  tokenizer: SentencePiece, ", file.tokenizer_size, " pieces, checksum ",
               file.tokenizer_checksum, ", model ", file.tokenizer_model, "\n");
  else if (!file.vocab.empty())
    out += cat("  vocabulary: ", file.vocab.size(), " symbols\n");
  out += "  files:\n";
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const fs::path& f : files) {
    const std::string name = f.filename().string();
    std::string what;
    if (name.ends_with(".safetensors"))  // read whole: every check of the format
      what = cat(", ", read_safetensors(f.string()).tensors.size(), " tensors");
    out += cat("    ", name, "  ", size_text(double(fs::file_size(f))), what, "\n");
  }
  const std::map<std::string, Tensor> model = read_model(dir);
  out += tensor_lines(model, piece_counts(dir, "model"), "model");
  std::string non_finite = non_finite_tensor(model);
  if (has_pieces(dir, "optimizer")) {
    const std::map<std::string, Tensor> optim = read_pieces(dir, "optimizer");
    int64_t bytes = 0;
    for (const auto& [name, t] : optim) bytes += int64_t(t.nbytes());
    out += cat("  optimizer: ", optim.size(), " tensors (", size_text(double(bytes)), ")\n");
    if (non_finite.empty()) non_finite = non_finite_tensor(optim);
  }
  verify_checkpoint_index(dir);
  const std::string checked =
      cat("  verified: every file whole, every tensor's pieces cover it once",
          fs::exists(checkpoint_index_file(dir)) ? ", the index matches the files" : "");
  out += non_finite.empty() ? cat(checked, ", all values finite\n")
                            : cat(checked, "; tensor '", non_finite, "' holds a NaN or Inf\n");
  return out;
}

std::string export_checkpoint(const std::string& dir, const std::string& out, DType dtype) {
  const TrainerStateFile file = read_trainer_state(dir);
  const Recipe recipe = parse_recipe(file.recipe_yaml, trainer_state_file(dir));
  // The model the recipe builds (shapes only), at the data's vocabulary.
  const int64_t vocab = !file.vocab.empty()       ? int64_t(file.vocab.size())
                        : file.tokenizer_size > 0 ? file.tokenizer_size
                                                  : recipe.model.vocab_size;
  std::shared_ptr<Model> model;
  {
    DeferredInit deferred;
    model = build_model(recipe, vocab);
  }
  std::map<std::string, Tensor> tensors = read_model(dir, {.refuse_non_finite = true});
  model->upgrade_loaded_state(tensors, dir);
  const std::vector<std::string> problems = load_named(model->state(), tensors);
  if (!problems.empty()) {
    std::string lines;
    for (const std::string& p : problems) lines += "\n  " + p;
    throw Error(cat(dir, " does not hold the model of its recipe:", lines));
  }
  std::vector<NamedTensor> whole;
  int64_t bytes = 0;
  for (const NamedTensor& t : model->state()) {
    Tensor v = tensors.at(t.name);
    if (is_floating(v.dtype()) && v.dtype() != dtype) v = v.to(dtype);
    bytes += int64_t(v.nbytes());
    whole.push_back({t.name, v});
  }
  if (fs::path(out).has_parent_path()) fs::create_directories(fs::path(out).parent_path());
  write_safetensors(out, whole, {{"format", "pt"}});
  std::string config_note;
  const std::string config = hf_config_json(recipe, vocab, dtype);
  if (!config.empty()) {
    const fs::path config_path = fs::path(out).parent_path() / "config.json";
    write_file_atomic(config_path.string(), config);
    config_note = cat(", and its Hugging Face config ", config_path.string());
  }
  return cat("exported ", dir, " (step ", file.state.step, ") to ", out, ": ", whole.size(),
             " tensors, ", dtype, ", ", size_text(double(bytes)), config_note);
}

void add_checkpoint_commands(CLI::App& app, CheckpointArgs& args) {
  CLI::App* ckpt = app.add_subcommand("checkpoint", "inspect a checkpoint");
  ckpt->require_subcommand(1);
  CLI::App* info = ckpt->add_subcommand(
      "info", "print a checkpoint's step, layout, files and tensors, and verify every file");
  info->add_option("checkpoint", args.checkpoint,
                   "a checkpoint directory, a pointer file (latest, best), a checkpoints/ folder "
                   "or a run's output directory (their latest)")
      ->required();
  CLI::App* exp = app.add_subcommand(
      "export",
      "write a checkpoint's model as one safetensors file of whole tensors (PyTorch's "
      "names), from any layout");
  exp->add_option("checkpoint", args.checkpoint,
                  "a checkpoint directory, a pointer file, a checkpoints/ folder or a run's "
                  "output directory")
      ->required();
  exp->add_option("--out", args.out, "the safetensors file to write")->required();
  exp->add_option("--dtype", args.dtype, "floating tensors as f32, bf16 or f16")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
}

int run_checkpoint_commands(CLI::App& app, const CheckpointArgs& args) {
  if (app.got_subcommand("checkpoint")) {
    const std::string text = checkpoint_info(find_checkpoint(args.checkpoint, "checkpoint info"));
    std::printf("%s", text.c_str());
    return text.find("holds a NaN or Inf") == std::string::npos ? 0 : 1;
  }
  if (app.got_subcommand("export")) {
    const DType dtype = args.dtype == "bf16"  ? DType::bf16
                        : args.dtype == "f16" ? DType::f16
                                              : DType::f32;
    std::printf(
        "%s\n",
        export_checkpoint(find_checkpoint(args.checkpoint, "export"), args.out, dtype).c_str());
    return 0;
  }
  return -1;
}

}  // namespace trainer
