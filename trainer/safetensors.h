// safetensors files (the format of Hugging Face's safetensors): an 8-byte
// little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
//    "__metadata__": {"key": "value"}}
// then the raw little-endian tensor bytes, offsets relative to the data start.
//
// Loading validates everything before touching tensor memory: the header
// length against the file size and a cap, the JSON (it begins with '{',
// only whitespace follows the object, no key is given twice: the format
// forbids duplicate keys), each dtype, shape and offset pair (size = numel x
// element size, inside the data, no overlaps, no gaps), so a truncated,
// corrupt or hostile file is a trainer::Error that names the file and the
// entry, never a crash.
//
//   write_safetensors("model.safetensors", {{"fc.weight", w}}, {{"step", "100"}});
//   SafetensorsFile f = read_safetensors("model.safetensors");
//   Tensor w = f.tensors.at("fc.weight");
#pragma once

#include <functional>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace trainer {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;  // CPU, contiguous
  std::map<std::string, std::string> metadata;
};

// Writes tensors (copied to CPU, contiguous) to path via a temporary file
// that is fsynced and renamed, so path is either the old or the new file.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

SafetensorsFile read_safetensors(const std::string& path);

// One tensor of a file as its header gives it, checked: the bytes
// [begin, end) of the file hold it.
struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in file order
  std::map<std::string, std::string> metadata;
};
// The format's name of a dtype ("F32", "BF16").
const char* safetensors_dtype(DType t);
// Reads and checks a file's header only (its data is not read).
SafetensorsHeader read_safetensors_header(const std::string& path);
// Parses an in-memory image of a file; `name` is used in error messages.
SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& name);

// Largest header accepted (the reference implementation's limit).
inline constexpr uint64_t kSafetensorsMaxHeader = 100 * 1000 * 1000;

// Writes bytes to path atomically: temporary file, fsync, rename, fsync of
// the directory.
void write_file_atomic(const std::string& path, const std::string& bytes);
// The same, the file being the pieces one after the other.
void write_file_atomic(const std::string& path, const std::vector<std::string_view>& pieces);
// The whole regular file (data/files.h: FIFOs, devices and directories are
// refused before reading); `what` names it in errors ("the trainer state").
std::string read_file(const std::string& path, const std::string& what = "the file");

// JSON text parsed as nlohmann::json::parse does, refusing two flaws it lets
// through: bytes after the value (it stops reading at a NUL byte) and a key
// given twice in one object (it keeps the last value silently, so a damaged
// file would load with whichever copy came last). `refuse` receives what is
// wrong, ready to follow the file's name ("key 'dtype' is given twice in
// 'fc.weight'"), and must throw. Also the trainer state's reader.
nlohmann::json parse_strict_json(std::string_view text,
                                 const std::function<void(const std::string&)>& refuse);

}  // namespace trainer
