// One checkpoint format for every layout (trainer/checkpoint.h): each rank
// writes the pieces of the logical tensors it holds, described by their
// placements, and a reader joins every rank's pieces into whole tensors.
#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/check.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_parts.h"
#include "trainer/safetensors.h"

namespace fs = std::filesystem;

namespace trainer {

namespace {

// The metadata key marking a file of pieces, and its version.
constexpr const char* kPiecesKey = "trainer.pieces";
constexpr const char* kPiecesVersion = "1";

bool whole(const TensorPiece& p) {
  return p.boxes.size() == 1 && p.boxes[0].offset == Shape(p.global.size(), 0) &&
         p.boxes[0].extent == p.global && p.begin == 0 && p.end < 0;
}

std::string dims_text(const Shape& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) out += cat(i ? "," : "", s[i]);
  return out;
}

// "global=1152,384 dim=0 boxes=0+192,0+384;384+192,0+384 elements=0:73728"
std::string describe(const TensorPiece& p) {
  std::string boxes;
  for (size_t k = 0; k < p.boxes.size(); ++k) {
    boxes += k ? ";" : "";
    for (size_t i = 0; i < p.global.size(); ++i)
      boxes += cat(i ? "," : "", p.boxes[k].offset[i], "+", p.boxes[k].extent[i]);
  }
  return cat("global=", dims_text(p.global), " dim=", p.dim, " boxes=", boxes,
             " elements=", p.begin, ":", p.end);
}

// Parses describe()'s text; Error naming the file and the key otherwise.
class DescriptionParser {
 public:
  DescriptionParser(const std::string& text, const std::string& file, const std::string& key)
      : text_(text), file_(file), key_(key) {}

  TensorPiece parse() {
    TensorPiece p;
    expect("global=");
    if (peek() != ' ') p.global = dims(',');
    expect(" dim=");
    p.dim = int(number());
    expect(" boxes=");
    do {
      parallel::Box b;
      for (size_t i = 0; i < p.global.size(); ++i) {
        if (i) expect(",");
        b.offset.push_back(number());
        expect("+");
        b.extent.push_back(number());
      }
      p.boxes.push_back(std::move(b));
    } while (take(';'));
    expect(" elements=");
    p.begin = number();
    expect(":");
    p.end = number(/*signed_ok=*/true);
    if (at_ != text_.size()) fail("text after the elements");
    return p;
  }

 private:
  char peek() const { return at_ < text_.size() ? text_[at_] : '\0'; }
  bool take(char c) {
    if (peek() != c) return false;
    ++at_;
    return true;
  }
  void expect(const char* s) {
    if (text_.compare(at_, std::strlen(s), s) != 0) fail(cat("'", s, "' expected"));
    at_ += std::strlen(s);
  }
  int64_t number(bool signed_ok = false) {
    int64_t v = 0;
    const char* first = text_.data() + at_;
    auto [end, ec] = std::from_chars(first, text_.data() + text_.size(), v);
    if (ec != std::errc() || (v < 0 && !(signed_ok && v == -1))) fail("a number expected");
    at_ += size_t(end - first);
    return v;
  }
  Shape dims(char sep) {
    Shape s{number()};
    while (take(sep)) s.push_back(number());
    return s;
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(cat(file_, ": metadata '", key_, "' = '", text_, "' is not a piece's description (",
                    what, " at character ", at_,
                    "); the file is damaged: use an earlier "
                    "checkpoint"));
  }

  const std::string& text_;
  const std::string& file_;
  const std::string& key_;
  size_t at_ = 0;
};

// The local tensor's shape: the boxes concatenated along dim (Error naming
// the file and the tensor when they do not fit the global shape or each other).
Shape local_shape_of(const TensorPiece& p, const std::string& file) {
  auto bad = [&](const std::string& what) {
    return Error(cat(file, ": piece of '", p.name, "' (", describe(p), "): ", what,
                     "; the file is damaged: use an earlier checkpoint"));
  };
  if (p.boxes.empty() || (p.global.empty() && p.boxes.size() > 1))
    throw bad(p.boxes.empty() ? "no box" : "a scalar in several boxes");
  if (p.dim < 0 || (p.global.size() > 0 && size_t(p.dim) >= p.global.size()) ||
      (p.global.empty() && p.dim != 0))
    throw bad("the dimension is outside the tensor");
  Shape local = p.boxes[0].extent;
  for (size_t k = 0; k < p.boxes.size(); ++k) {
    const parallel::Box& b = p.boxes[k];
    if (b.offset.size() != p.global.size() || b.extent.size() != p.global.size())
      throw bad("a box of another rank");
    for (size_t i = 0; i < p.global.size(); ++i)
      if (b.offset[i] < 0 || b.extent[i] < 0 || b.offset[i] > p.global[i] - b.extent[i])
        throw bad("a box outside the tensor");
    for (size_t i = 0; k > 0 && i < p.global.size(); ++i)
      if (int(i) != p.dim && b.extent[i] != local[i]) throw bad("boxes that do not join");
    if (k > 0) local[size_t(p.dim)] += b.extent[size_t(p.dim)];
  }
  const int64_t n = shape_numel(local);
  const int64_t end = p.end < 0 ? n : p.end;
  if (p.begin > end || end > n) throw bad("elements outside the piece");
  const bool shaped = p.end < 0 ? p.values.shape() == local : p.values.numel() == end - p.begin;
  if (!shaped) throw bad(cat("its tensor is ", p.values.shape_str(), ", not what it describes"));
  return local;
}

// Copies the box `extent` at `from` of src (shape src_shape) to `to` of dst,
// row-major, `bytes` per element.
void copy_box(const char* src, const Shape& src_shape, const Shape& from, char* dst,
              const Shape& dst_shape, const Shape& to, const Shape& extent, size_t bytes,
              size_t d = 0) {
  if (d == extent.size()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const Shape src_strides = contiguous_strides(src_shape),
              dst_strides = contiguous_strides(dst_shape);
  if (d + 1 == extent.size()) {
    std::memcpy(dst + size_t(to[d] * dst_strides[d]) * bytes,
                src + size_t(from[d] * src_strides[d]) * bytes, size_t(extent[d]) * bytes);
    return;
  }
  for (int64_t i = 0; i < extent[d]; ++i)
    copy_box(src + size_t((from[d] + i) * src_strides[d]) * bytes, src_shape, from,
             dst + size_t((to[d] + i) * dst_strides[d]) * bytes, dst_shape, to, extent, bytes,
             d + 1);
}

bool intersect(const parallel::Box& a, const parallel::Box& b) {
  for (size_t i = 0; i < a.offset.size(); ++i)
    if (a.offset[i] + a.extent[i] <= b.offset[i] || b.offset[i] + b.extent[i] <= a.offset[i])
      return false;
  return true;
}

// A piece and the file it came from.
struct FoundPiece {
  TensorPiece piece;
  std::string file;
};

// The local tensor of `pieces` (one rank's boxes) from their element
// ranges, which must cover it exactly once. `missing` says which ranks
// wrote no file, for the error of elements in none.
Tensor join_ranges(const std::string& name, std::vector<const FoundPiece*>& pieces,
                   const Shape& local, const std::string& missing) {
  const DType dtype = pieces[0]->piece.values.dtype();
  const size_t bytes = dtype_size(dtype);
  const int64_t n = shape_numel(local);
  std::stable_sort(pieces.begin(), pieces.end(), [](const FoundPiece* a, const FoundPiece* b) {
    return a->piece.begin < b->piece.begin;
  });
  Tensor joined = empty(local, dtype);
  int64_t covered = 0;
  const FoundPiece* last = nullptr;
  auto gap = [&](int64_t end) {
    return Error(cat(fs::path(pieces[0]->file).parent_path().string(), ": elements [", covered,
                     ", ", end, ") of '", name, "' (of a part of ", shape_str(local),
                     ") are in no file", missing, "; use an earlier checkpoint"));
  };
  for (const FoundPiece* f : pieces) {
    local_shape_of(f->piece, f->file);
    const int64_t end = f->piece.end < 0 ? n : f->piece.end;
    if (f->piece.begin > covered) throw gap(f->piece.begin);
    if (f->piece.begin < covered)
      throw Error(cat(f->file, ": elements [", f->piece.begin, ", ", end, ") of '", name,
                      "' are also in ", last->file,
                      ": a file is extra or was copied over another's; use an earlier checkpoint"));
    Tensor values = f->piece.values.contiguous();
    std::memcpy(static_cast<char*>(joined.data_ptr()) + size_t(covered) * bytes, values.data_ptr(),
                size_t(end - covered) * bytes);
    covered = end;
    last = f;
  }
  if (covered != n) throw gap(n);
  return joined;
}

// One logical tensor from its pieces: each local tensor joined from its
// element ranges, then placed in its boxes.
Tensor join(const std::string& name, std::vector<FoundPiece>& found, const std::string& missing) {
  const Shape global = found[0].piece.global;
  const DType dtype = found[0].piece.values.dtype();
  for (const FoundPiece& f : found)
    if (f.piece.global != global || f.piece.values.dtype() != dtype)
      throw Error(cat(f.file, ": piece of '", name, "' is ", shape_str(f.piece.global), " ",
                      f.piece.values.dtype(), ", another (", found[0].file, ") ", shape_str(global),
                      " ", dtype, "; use an earlier checkpoint"));
  // The local tensors, by their boxes (a ZeRO shard's ranges share them).
  std::map<std::string, std::vector<const FoundPiece*>> locals;
  for (const FoundPiece& f : found) {
    std::string key = cat(f.piece.dim, ":");
    for (const parallel::Box& b : f.piece.boxes)
      key += cat(dims_text(b.offset), "+", dims_text(b.extent), ";");
    locals[key].push_back(&f);
  }
  Tensor out = empty(global, dtype);
  std::vector<std::pair<parallel::Box, std::string>> placed;
  for (auto& [key, pieces] : locals) {
    const TensorPiece& first = pieces[0]->piece;
    const Shape local = local_shape_of(first, pieces[0]->file);
    const Tensor joined = join_ranges(name, pieces, local, missing);
    // The boxes take consecutive slices of the local tensor along dim.
    int64_t along = 0;
    for (const parallel::Box& b : first.boxes) {
      for (const auto& [other, file] : placed)
        if (intersect(b, other))
          throw Error(cat(pieces[0]->file, ": a block of '", name, "' is also in ", file,
                          ": a file is extra or was copied over another's; use an earlier "
                          "checkpoint"));
      placed.push_back({b, pieces[0]->file});
      Shape from(local.size(), 0);
      if (!from.empty()) from[size_t(first.dim)] = along;
      copy_box(static_cast<const char*>(joined.data_ptr()), local, from,
               static_cast<char*>(out.data_ptr()), global, b.offset, b.extent, dtype_size(dtype));
      if (!local.empty()) along += b.extent[size_t(first.dim)];
    }
  }
  int64_t volume = 0;
  for (const auto& [b, file] : placed) volume += shape_numel(b.extent);
  if (volume != shape_numel(global))
    throw Error(cat(fs::path(found[0].file).parent_path().string(), ": ",
                    shape_numel(global) - volume, " of the ", shape_numel(global), " elements of '",
                    name, "' are in no file", missing, "; use an earlier checkpoint"));
  return out;
}

// <stem>-rank<r>.safetensors -> r; -1 for another name.
int pieces_file_rank(const std::string& name, const std::string& stem) {
  const std::string prefix = stem + "-rank", suffix = ".safetensors";
  if (name.size() != prefix.size() + 5 + suffix.size() || !name.starts_with(prefix) ||
      !name.ends_with(suffix))
    return -1;
  int rank = 0;
  const char* first = name.data() + prefix.size();
  auto [end, ec] = std::from_chars(first, first + 5, rank);
  return ec == std::errc() && end == first + 5 ? rank : -1;
}

}  // namespace

std::map<int, std::string> pieces_files(const std::string& dir, const std::string& stem) {
  std::map<int, std::string> files;
  checked_fs(dir, [&] {
    for (const auto& e : fs::directory_iterator(dir)) {
      const int rank = pieces_file_rank(e.path().filename().string(), stem);
      if (rank >= 0) files[rank] = e.path().string();
    }
  });
  return files;
}

std::string pieces_file(const std::string& dir, const std::string& stem, int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "-rank%05d.safetensors", rank);
  return dir + "/" + stem + name;
}

TensorPiece piece_of(const std::string& name, const Tensor& local,
                     const parallel::TensorPlacement& placement, const parallel::MeshShape& mesh,
                     const parallel::MeshCoord& coord) {
  TensorPiece p;
  p.name = name;
  p.global = placement.global;
  p.boxes = parallel::local_boxes(placement, mesh, coord);
  p.values = local;
  for (parallel::Dim d : parallel::kAllDims)
    if (placement[d].kind == parallel::Placement::Kind::shard) p.dim = placement[d].dim;
  return p;
}

void require_pieces_file(const std::map<std::string, std::string>& metadata,
                         const std::string& path) {
  auto version = metadata.find(kPiecesKey);
  if (version == metadata.end() || version->second != kPiecesVersion)
    throw Error(cat(path, ": metadata '", kPiecesKey, "' is not ", kPiecesVersion,
                    ": not a file of this trainer's checkpoints; use an earlier checkpoint"));
}

TensorPiece piece_in_header(const std::string& key, const Shape& shape,
                            const std::map<std::string, std::string>& metadata,
                            const std::string& path) {
  auto described = metadata.find(key);
  TensorPiece p;
  if (described == metadata.end() && key.find('#') != std::string::npos)
    throw Error(cat(path, ": tensor '", key,
                    "' is a piece with no description in the "
                    "metadata; the file is damaged: use an earlier checkpoint"));
  if (described == metadata.end()) {
    p.name = key;
    p.global = shape;
    p.boxes = {{Shape(shape.size(), 0), shape}};
  } else {
    p = DescriptionParser(described->second, path, key).parse();
    p.name = key.substr(0, key.rfind('#'));
  }
  return p;
}

void write_pieces(const std::string& path, const std::vector<TensorPiece>& pieces) {
  std::map<std::string, std::string> metadata{{"format", "pt"}, {kPiecesKey, kPiecesVersion}};
  std::vector<NamedTensor> tensors;
  std::map<std::string, int> count;
  for (const TensorPiece& p : pieces) {
    if (whole(p)) {
      tensors.push_back({p.name, p.values});
      continue;
    }
    // Keys of pieces carry a number: a rank may hold several of one tensor.
    const std::string key = cat(p.name, "#", count[p.name]++);
    metadata[key] = describe(p);
    tensors.push_back({key, p.values});
  }
  write_safetensors(path, tensors, metadata);
}

bool has_pieces(const std::string& dir, const std::string& stem) {
  return !pieces_files(dir, stem).empty();
}

std::map<std::string, Tensor> read_pieces(const std::string& dir, const std::string& stem,
                                          const CheckpointReadOptions& options) {
  std::map<std::string, std::vector<FoundPiece>> by_name;
  const std::map<int, std::string> files = pieces_files(dir, stem);
  if (files.empty())
    throw Error(cat(pieces_file(dir, stem, 0), ": no ", stem,
                    " file in the checkpoint; use an "
                    "earlier one"));
  // The files are those of the ranks that wrote the checkpoint; which of
  // them wrote none is said when elements are in no file.
  std::string missing;
  if (fs::is_regular_file(status_of(trainer_state_file(dir)))) {
    const int world = read_trainer_state(dir).state.layout.world_size();
    for (const auto& [rank, path] : files)
      if (rank >= world)
        throw Error(cat(path, ": the pieces of rank ", rank, ", but the checkpoint was written by ",
                        world, " rank", world == 1 ? "" : "s", " (", trainer_state_file(dir),
                        "): the file is not part of it; remove it, or use an earlier checkpoint"));
    std::vector<std::string> absent;
    for (int rank = 0; rank < world; ++rank)
      if (!files.count(rank))
        absent.push_back(fs::path(pieces_file(dir, stem, rank)).filename().string());
    for (size_t k = 0; k < std::min<size_t>(absent.size(), 3); ++k)
      missing += cat(k ? ", " : " (missing? there is no ", absent[k]);
    if (absent.size() > 3) missing += cat(" nor ", absent.size() - 3, " more");
    if (!absent.empty()) missing += ")";
  }
  for (const auto& [rank, path] : files) {
    SafetensorsFile f = read_safetensors(path);
    if (options.refuse_non_finite) require_finite(f.tensors, path);
    require_pieces_file(f.metadata, path);
    for (auto& [key, tensor] : f.tensors) {
      TensorPiece p = piece_in_header(key, tensor.shape(), f.metadata, path);
      p.values = tensor;
      by_name[p.name].push_back({std::move(p), path});
    }
  }
  std::map<std::string, Tensor> out;
  for (auto& [name, found] : by_name) out[name] = join(name, found, missing);
  return out;
}

}  // namespace trainer
