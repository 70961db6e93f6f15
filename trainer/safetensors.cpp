#include "trainer/safetensors.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "data/files.h"

namespace trainer {

namespace {

using json = nlohmann::json;

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::f32, "F32"}, {DType::f64, "F64"}, {DType::bf16, "BF16"}, {DType::f16, "F16"},
    {DType::i32, "I32"}, {DType::i64, "I64"}, {DType::u8, "U8"},     {DType::boolean, "BOOL"},
};

bool parse_dtype(const std::string& s, DType* out) {
  for (const DTypeName& d : kDTypeNames)
    if (s == d.name) {
      *out = d.dtype;
      return true;
    }
  return false;
}

[[noreturn]] void bad(const std::string& file, const std::string& what) {
  throw Error(
      cat(file, ": not a valid safetensors file: ", what,
          ". The file may be truncated or corrupt; use an earlier checkpoint or re-export it"));
}

// Finds the first key given twice in one object of a JSON text, with the
// keys that lead to its object, as SAX events: no tree is built, and each
// object's keys are held only while it is open.
class DuplicateKeyFinder : public nlohmann::json_sax<json> {
 public:
  // "key 'dtype' is given twice in 'fc.weight'", or nothing.
  const std::optional<std::string>& found() const { return found_; }

  bool null() override { return element(); }
  bool boolean(bool) override { return element(); }
  bool number_integer(number_integer_t) override { return element(); }
  bool number_unsigned(number_unsigned_t) override { return element(); }
  bool number_float(number_float_t, const string_t&) override { return element(); }
  bool string(string_t&) override { return element(); }
  bool binary(binary_t&) override { return element(); }
  bool start_object(std::size_t) override { return begin(true); }
  bool key(string_t& name) override {
    Open& object = open_.back();
    if (!object.keys.insert(name).second) {
      found_ = cat("key '", name, "' is given twice",
                   open_.size() > 1 ? cat(" in '", where(), "'") : std::string());
      return false;  // stops the parse
    }
    object.last_key = name;
    return true;
  }
  bool end_object() override {
    open_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return begin(false); }
  bool end_array() override {
    open_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const json::exception&) override {
    return false;
  }

 private:
  struct Open {  // an object or array being read
    bool object = false;
    std::set<std::string> keys;  // an object's keys so far
    std::string last_key;
    int64_t elements = 0;  // an array's elements begun so far
  };
  bool element() {
    if (!open_.empty() && !open_.back().object) ++open_.back().elements;
    return true;
  }
  bool begin(bool object) {
    element();
    open_.emplace_back();
    open_.back().object = object;
    return true;
  }
  // The innermost object's place: "parallel", "link_models[1]", "fc.weight".
  std::string where() const {
    std::string out;
    for (size_t i = 0; i + 1 < open_.size(); ++i)
      out += open_[i].object ? cat(out.empty() ? "" : ".", open_[i].last_key)
                             : cat("[", open_[i].elements - 1, "]");
    return out;
  }

  std::vector<Open> open_;
  std::optional<std::string> found_;
};

}  // namespace

std::string read_file(const std::string& path, const std::string& what) {
  return data::read_regular_file(path, what);
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<Tensor> cpu;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {  // NamedTensor
    CHECK(t.defined()) << "write_safetensors: tensor '" << name << "' is undefined";
    CHECK(!header.contains(name)) << "write_safetensors: duplicate name '" << name << "'";
    Tensor c = t.detach().to(Device{}).contiguous();
    uint64_t bytes = c.nbytes();
    header[name] = {{"dtype", safetensors_dtype(c.dtype())},
                    {"shape", c.shape()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    cpu.push_back(c);
  }
  std::string h = header.dump();
  h.resize((h.size() + 7) / 8 * 8, ' ');  // align the data to 8 bytes, as the reference writer
  std::string length;
  const uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) length.push_back(char((n >> (8 * i)) & 0xff));
  // Written from the tensors' own memory: a checkpoint costs no copy of
  // the state it saves.
  std::vector<std::string_view> pieces = {length, h};
  for (const Tensor& c : cpu)
    pieces.emplace_back(static_cast<const char*>(c.data_ptr()), size_t(c.nbytes()));
  write_file_atomic(path, pieces);
}

namespace {

// The header entry `v` of tensor `key`, checked: a known dtype, a plausible
// shape, and data_offsets within the data_size bytes of data that hold
// exactly the shape's bytes. Offsets relative to the data start.
SafetensorsEntry parse_span(const std::string& name, const std::string& key, const json& v,
                            uint64_t data_size) {
  auto entry = [&](const std::string& what) { return cat("tensor '", key, "': ", what); };
  if (!v.is_object()) bad(name, entry("entry is not an object"));
  if (!v.contains("dtype") || !v["dtype"].is_string()) bad(name, entry("missing dtype"));
  DType dtype;
  if (!parse_dtype(v["dtype"].get<std::string>(), &dtype))
    bad(name, entry(cat("unsupported dtype ", v["dtype"].get<std::string>())));
  if (!v.contains("shape") || !v["shape"].is_array()) bad(name, entry("missing shape"));
  Shape shape;
  uint64_t numel = 1;
  for (const json& d : v["shape"]) {
    if (!d.is_number_unsigned()) bad(name, entry("shape holds a non-integer or negative size"));
    uint64_t s = d.get<uint64_t>();
    if (s > (uint64_t(1) << 40) || (s && numel > (uint64_t(1) << 48) / s))
      bad(name, entry("shape is implausibly large"));
    numel *= s;
    shape.push_back(int64_t(s));
  }
  const json& off = v.contains("data_offsets") ? v["data_offsets"] : json();
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned())
    bad(name, entry("data_offsets must be two non-negative integers"));
  uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
  if (b > e || e > data_size)
    bad(name, entry(cat("data_offsets [", b, ", ", e, ") outside the ", data_size, " data bytes")));
  if (e - b != numel * dtype_size(dtype))
    bad(name, entry(cat("data_offsets cover ", e - b, " bytes but shape ", shape_str(shape), " of ",
                        dtype_name(dtype), " needs ", numel * dtype_size(dtype))));
  return {key, dtype, shape, b, e};
}

// The header length the first 8 bytes give, checked against the file size.
uint64_t header_length(std::string_view first8, uint64_t file_size, const std::string& name) {
  if (file_size < 8)
    bad(name, cat("file is ", file_size, " bytes, shorter than the 8-byte header length"));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(first8[size_t(i)])) << (8 * i);
  if (n > kSafetensorsMaxHeader) bad(name, cat("header length ", n, " exceeds the limit"));
  if (n > file_size - 8)
    bad(name, cat("header length ", n, " exceeds the ", file_size - 8, " bytes that follow"));
  return n;
}

// The header `prefix` (the 8-byte length and the JSON) of a file of
// file_size bytes, every entry checked and the data covered exactly (no
// overlaps, no gaps, nothing trailing); entries in file order, offsets
// absolute in the file.
SafetensorsHeader parse_header(std::string_view prefix, uint64_t file_size,
                               const std::string& name) {
  const uint64_t n = header_length(prefix, file_size, name);
  // The format's header begins with '{' and may be padded with spaces after
  // the object (the reference writer pads to 8 bytes).
  const std::string_view text(prefix.data() + 8, n);
  if (text.empty() || text[0] != '{')
    bad(name, "header is not a JSON object (it must begin with '{')");
  json header = parse_strict_json(
      text, [&](const std::string& problem) { bad(name, cat("header: ", problem)); });
  const uint64_t data_start = 8 + n, data_size = file_size - data_start;
  SafetensorsHeader out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object()) bad(name, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          bad(name, cat("__metadata__ value '", m.key(), "' is not a string"));
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    out.entries.push_back(parse_span(name, key, v, data_size));
  }
  std::vector<SafetensorsEntry>& spans = out.entries;
  std::sort(spans.begin(), spans.end(), [](const SafetensorsEntry& x, const SafetensorsEntry& y) {
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t pos = 0;
  for (const SafetensorsEntry& s : spans) {
    if (s.begin != pos)
      bad(name, cat("tensor '", s.name, "' starts at ", s.begin, " but the previous data ends at ",
                    pos, " (overlap or gap)"));
    pos = s.end;
  }
  if (pos != data_size)
    bad(name, cat("data section is ", data_size, " bytes but tensors cover ", pos));
  for (SafetensorsEntry& s : spans) {
    s.begin += data_start;
    s.end += data_start;
  }
  return out;
}

}  // namespace

const char* safetensors_dtype(DType t) {
  for (const DTypeName& d : kDTypeNames)
    if (d.dtype == t) return d.name;
  return "?";
}

SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& name) {
  const uint64_t n = header_length(bytes, bytes.size(), name);
  SafetensorsHeader header =
      parse_header(std::string_view(bytes).substr(0, 8 + n), bytes.size(), name);
  // Only now, with every span checked, copy the tensors out.
  SafetensorsFile file;
  file.metadata = std::move(header.metadata);
  for (const SafetensorsEntry& s : header.entries) {
    Tensor t = empty(s.shape, s.dtype);
    std::memcpy(t.data_ptr(), bytes.data() + s.begin, s.end - s.begin);
    file.tensors.emplace(s.name, std::move(t));
  }
  return file;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  data::RegularFile file(path, "the safetensors file");
  std::string prefix(std::min<uint64_t>(8, file.size()), '\0');
  file.read_exactly(prefix.data(), prefix.size());
  const uint64_t n = header_length(prefix, file.size(), path);
  prefix.resize(8 + n);
  file.read_exactly(prefix.data() + 8, n);
  return parse_header(prefix, file.size(), path);
}

nlohmann::json parse_strict_json(std::string_view text,
                                 const std::function<void(const std::string&)>& refuse) {
  auto fail = [&](const std::string& problem) {
    refuse(problem);
    CHECK(false) << "parse_strict_json: refuse() returned for: " << problem;
  };
  json value;
  try {
    value = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    fail(cat("not valid JSON (", e.what(), ")"));
  }
  // JSON text holds no NUL byte (in a string it is escaped as \u0000): the
  // parser took it for the end of the input and ignored what follows.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    fail(cat(text.size() - nul, " bytes after the JSON value, from byte ", nul,
             " (a NUL byte); only spaces may follow it"));
  DuplicateKeyFinder finder;
  json::sax_parse(text.begin(), text.end(), &finder);
  if (finder.found()) fail(*finder.found());
  return value;
}

SafetensorsFile read_safetensors(const std::string& path) {
  return parse_safetensors(read_file(path, "the safetensors file"), path);
}

}  // namespace trainer
