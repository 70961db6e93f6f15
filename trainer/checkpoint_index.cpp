// The index of a checkpoint of pieces (trainer/checkpoint.h): index.json,
// built from the headers of every rank's files when the checkpoint is
// committed, so it describes what is on disk.
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

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

// The index is written as text, not built as a JSON document and dumped:
// ResNet-50's 660 pieces on 4 ranks took 10-12 ms that way, a commit's
// largest part.

// s as a JSON string: quoted, escaped by the JSON library.
void put_string(std::string& out, const std::string& s) { out += json(s).dump(); }

template <class Ints>
void put_ints(std::string& out, const Ints& values) {
  out += '[';
  bool first = true;
  for (const auto v : values) {
    if (!first) out += ',';
    first = false;
    out += std::to_string(v);
  }
  out += ']';
}

// One piece: where its bytes are, and which elements of the tensor they hold.
std::string piece_text(const std::string& file, const SafetensorsEntry& e, const TensorPiece& p) {
  std::string out = "{\"file\":";
  put_string(out, file);
  out += ",\"key\":";
  put_string(out, e.name);
  out += ",\"offsets\":";
  put_ints(out, std::vector<uint64_t>{e.begin, e.end});
  out += ",\"shape\":";
  put_ints(out, e.shape);
  out += cat(",\"dim\":", p.dim, ",\"boxes\":[");
  for (size_t i = 0; i < p.boxes.size(); ++i) {
    out += i ? ",{\"offset\":" : "{\"offset\":";
    put_ints(out, p.boxes[i].offset);
    out += ",\"extent\":";
    put_ints(out, p.boxes[i].extent);
    out += '}';
  }
  out += "],\"elements\":";
  put_ints(out, std::vector<int64_t>{p.begin, p.end < 0 ? shape_numel(e.shape) : p.end});
  return out + '}';
}

// The entries of the files of `stem`, one logical tensor per line: its
// dtype, shape and pieces.
std::string stem_index(const std::string& dir, const std::string& stem,
                       std::map<std::string, uint64_t>& files) {
  struct Entry {
    std::string dtype;
    Shape global;
    std::vector<std::string> pieces;
  };
  std::map<std::string, Entry> tensors;
  for (const auto& [rank, path] : pieces_files(dir, stem)) {
    const SafetensorsHeader header = read_safetensors_header(path);
    require_pieces_file(header.metadata, path);
    const std::string file = fs::path(path).filename().string();
    files[file] = fs::file_size(path);
    for (const SafetensorsEntry& e : header.entries) {
      const TensorPiece p = piece_in_header(e.name, e.shape, header.metadata, path);
      Entry& t = tensors[p.name];
      if (t.pieces.empty()) t = {safetensors_dtype(e.dtype), p.global, {}};
      t.pieces.push_back(piece_text(file, e, p));
    }
  }
  std::string out = "{";
  for (const auto& [name, t] : tensors) {
    out += out.size() > 1 ? ",\n" : "\n";
    put_string(out, name);
    out += ":{\"dtype\":";
    put_string(out, t.dtype);
    out += ",\"shape\":";
    put_ints(out, t.global);
    out += ",\"pieces\":[";
    for (size_t i = 0; i < t.pieces.size(); ++i) out += (i ? "," : "") + t.pieces[i];
    out += "]}";
  }
  return out + "\n}";
}

std::string index_text(const std::string& dir) {
  std::map<std::string, uint64_t> files;
  std::string out = "{\"format\":";
  put_string(out, kIndexFormat);
  out += cat(",\"version\":", kIndexVersion, ",\n\"model\":", stem_index(dir, "model", files));
  out += ",\n\"optimizer\":" + stem_index(dir, "optimizer", files) + ",\n\"files\":{";
  bool first = true;
  for (const auto& [file, bytes] : files) {
    out += first ? "\n" : ",\n";
    first = false;
    put_string(out, file);
    out += cat(":", bytes);
  }
  return out + "\n}}\n";
}

}  // namespace

std::string checkpoint_index_file(const std::string& dir) { return dir + "/index.json"; }

void write_checkpoint_index(const std::string& dir) {
  if (!has_pieces(dir, "model")) return;
  write_file_atomic(checkpoint_index_file(dir), index_text(dir));
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
  const json actual = json::parse(index_text(dir));
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
