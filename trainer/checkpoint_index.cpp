// The index of a checkpoint of pieces (trainer/checkpoint.h): index.json,
// built from the headers of every rank's files when the checkpoint is
// committed, so it describes what is on disk.
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_parts.h"
#include "trainer/safetensors.h"

namespace fs = std::filesystem;

namespace trainer {

namespace {

using json = nlohmann::json;

constexpr const char* kIndexFormat = "trainer.checkpoint_index";
constexpr int kIndexVersion = 1;

json box_json(const parallel::Box& b) { return {{"offset", b.offset}, {"extent", b.extent}}; }

// The entries of the files of `stem`: per logical tensor, its dtype, shape
// and pieces.
json stem_index(const std::string& dir, const std::string& stem, json& files) {
  json tensors = json::object();
  for (const auto& [rank, path] : pieces_files(dir, stem)) {
    const SafetensorsHeader header = read_safetensors_header(path);
    require_pieces_file(header.metadata, path);
    const std::string file = fs::path(path).filename().string();
    files[file] = fs::file_size(path);
    for (const SafetensorsEntry& e : header.entries) {
      const TensorPiece p = piece_in_header(e.name, e.shape, header.metadata, path);
      json& t = tensors[p.name];
      if (t.is_null())
        t = {{"dtype", safetensors_dtype(e.dtype)}, {"shape", p.global}, {"pieces", {}}};
      json boxes = json::array();
      for (const parallel::Box& b : p.boxes) boxes.push_back(box_json(b));
      t["pieces"].push_back({{"file", file},
                             {"key", e.name},
                             {"offsets", {e.begin, e.end}},
                             {"shape", e.shape},
                             {"dim", p.dim},
                             {"boxes", boxes},
                             {"elements", {p.begin, p.end < 0 ? shape_numel(e.shape) : p.end}}});
    }
  }
  return tensors;
}

json build_index(const std::string& dir) {
  json files = json::object();
  json index = {{"format", kIndexFormat}, {"version", kIndexVersion}};
  index["model"] = stem_index(dir, "model", files);
  index["optimizer"] = stem_index(dir, "optimizer", files);
  index["files"] = files;
  return index;
}

}  // namespace

std::string checkpoint_index_file(const std::string& dir) { return dir + "/index.json"; }

void write_checkpoint_index(const std::string& dir) {
  if (!has_pieces(dir, "model")) return;
  write_file_atomic(checkpoint_index_file(dir), build_index(dir).dump(1) + "\n");
}

void verify_checkpoint_index(const std::string& dir) {
  const std::string path = checkpoint_index_file(dir);
  if (!fs::is_regular_file(status_of(path))) return;
  const json written =
      parse_strict_json(read_file(path, "the checkpoint index"), [&](const std::string& problem) {
        throw Error(cat(path, ": ", problem,
                        "; the index is damaged: use an "
                        "earlier checkpoint"));
      });
  const json actual = build_index(dir);
  for (const char* key : {"format", "version", "files", "model", "optimizer"}) {
    if (written.contains(key) && written[key] == actual[key]) continue;
    // Name the first tensor or file that differs.
    std::string what = key;
    if (written.contains(key) && written[key].is_object())
      for (auto it = actual[key].begin(); it != actual[key].end(); ++it)
        if (!written[key].contains(it.key()) || written[key][it.key()] != it.value()) {
          what = cat(key, " '", it.key(), "'");
          break;
        }
    throw Error(cat(path, ": ", what,
                    " is not what the checkpoint's files hold (a file was replaced, added or "
                    "removed after the checkpoint was written); use an earlier checkpoint"));
  }
}

}  // namespace trainer
