// IDX reading (gzip through zlib) and Fashion-MNIST.
#include "data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "data/files.h"

namespace trainer::data {

namespace {

// An IDX file, plain or gzipped (gzread passes plain files through
// unchanged), opened as a regular file (data/files.h: a FIFO or a device is
// refused before reading).
class IdxReader {
 public:
  explicit IdxReader(const std::string& path) : path_(path) {
    RegularFile file(path, "the IDX file");
    file_size_ = file.size();
    gz_ = gzdopen(file.fd(), "rb");
    if (!gz_) throw Error(cat("cannot open ", path, ": ", std::strerror(errno)));
    file.release();  // gzclose closes it
    gzbuffer(gz_, 1 << 18);
  }
  ~IdxReader() { gzclose(gz_); }
  IdxReader(const IdxReader&) = delete;
  IdxReader& operator=(const IdxReader&) = delete;

  // The file's size on disk, and whether it is stored uncompressed.
  uint64_t file_size() const { return file_size_; }
  bool plain() { return gzdirect(gz_) == 1; }

  // Appends up to n bytes to out; returns how many came (fewer at the end).
  uint64_t read(std::vector<uint8_t>& out, uint64_t n) {
    constexpr uint64_t kChunk = uint64_t(1) << 22;
    uint64_t done = 0;
    while (done < n) {
      const size_t size = out.size();
      const unsigned want = unsigned(std::min(kChunk, n - done));
      out.resize(size + want);
      const int got = gzread(gz_, out.data() + size, want);
      out.resize(size + size_t(std::max(got, 0)));
      if (got <= 0) break;
      done += uint64_t(got);
    }
    int errnum = Z_OK;
    const char* message = gzerror(gz_, &errnum);
    if (errnum != Z_OK)
      throw Error(cat(path_, ": corrupt or truncated gzip stream (zlib: ", message,
                      "); download or reinstall the file"));
    return done;
  }

 private:
  std::string path_;
  uint64_t file_size_ = 0;
  gzFile gz_ = nullptr;
};

uint32_t load_be32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | uint32_t(p[3]);
}

// The element types of the IDX format: code, bytes per element, tensor dtype.
struct IdxType {
  uint8_t code;
  int bytes;
  DType dtype;
  const char* name;
};
constexpr IdxType kIdxTypes[] = {
    {0x08, 1, DType::u8, "u8"},   {0x09, 1, DType::i32, "i8"},  {0x0B, 2, DType::i32, "i16"},
    {0x0C, 4, DType::i32, "i32"}, {0x0D, 4, DType::f32, "f32"}, {0x0E, 8, DType::f64, "f64"},
};

// Big-endian element i of a payload of type t, as the tensor's type.
template <class T>
T load_element(const uint8_t* p, const IdxType& t) {
  uint64_t u = 0;
  for (int b = 0; b < t.bytes; ++b) u = (u << 8) | p[b];
  switch (t.code) {
    case 0x09:
      return T(int8_t(u));
    case 0x0B:
      return T(int16_t(u));
    case 0x0C:
      return T(int32_t(u));
    case 0x0D: {
      uint32_t bits = uint32_t(u);
      float f;
      std::memcpy(&f, &bits, 4);
      return T(f);
    }
    case 0x0E: {
      double d;
      std::memcpy(&d, &u, 8);
      return T(d);
    }
    default:
      return T(u);
  }
}

template <class T>
void convert_payload(const uint8_t* payload, const IdxType& t, uint64_t numel, T* dst) {
  for (uint64_t i = 0; i < numel; ++i) dst[i] = load_element<T>(payload + i * t.bytes, t);
}

std::string find_file(const std::string& dir, const std::string& name) {
  for (const std::string& candidate : {name + ".gz", name}) {
    std::string path = (std::filesystem::path(dir) / candidate).string();
    // symlink_status: a broken or looping link is found, and read_idx says what is wrong with it.
    std::error_code ec;
    if (std::filesystem::exists(std::filesystem::symlink_status(path, ec))) return path;
  }
  throw Error(cat("Fashion-MNIST: neither ", name, ".gz nor ", name, " in ", dir,
                  "; install the Debian package dataset-fashion-mnist or set data.root to the "
                  "folder holding the IDX files"));
}

}  // namespace

Tensor read_idx(const std::string& path) {
  IdxReader file(path);
  std::vector<uint8_t> bytes;
  file.read(bytes, 4);
  if (bytes.size() < 4)
    throw Error(cat(path, ": not an IDX file (", bytes.size(), " bytes, the header needs 4)"));
  if (bytes[0] != 0 || bytes[1] != 0)
    throw Error(cat(path, ": not an IDX file (magic bytes ", int(bytes[0]), " ", int(bytes[1]),
                    ", expected 0 0)"));
  const IdxType* type = nullptr;
  for (const IdxType& t : kIdxTypes)
    if (t.code == bytes[2]) type = &t;
  if (!type) throw Error(cat(path, ": unknown IDX element type code ", int(bytes[2])));
  int ndim = bytes[3];
  if (ndim == 0) throw Error(cat(path, ": IDX header with 0 dims"));
  size_t header = 4 + 4 * size_t(ndim);
  file.read(bytes, header - 4);
  if (bytes.size() < header)
    throw Error(cat(path, ": truncated IDX header: ", ndim, " dims need ", header,
                    " bytes, the file has ", bytes.size()));
  // The payload's size, overflow-checked: dims of up to 2^32 each may
  // multiply past 2^64 and wrap to a small number. The bound applies to the
  // non-zero dims too, so that an empty tensor's strides cannot overflow.
  constexpr uint64_t kMaxElements = uint64_t(1) << 40;
  Shape shape;
  uint64_t numel = 1, nonzero = 1;
  for (int d = 0; d < ndim; ++d) {
    const uint64_t dim = load_be32(bytes.data() + 4 + 4 * d);
    shape.push_back(int64_t(dim));
    if (dim != 0 && nonzero > kMaxElements / dim)
      throw Error(cat(path, ": IDX dims ", shape_str(shape), (d + 1 < ndim ? "..." : ""),
                      " are implausibly large (more than 2^40 elements); the header is corrupt"));
    numel *= dim;
    nonzero *= std::max<uint64_t>(dim, 1);
  }
  const uint64_t expected = numel * uint64_t(type->bytes);
  auto wrong_size = [&](const char* how, uint64_t actual) {
    return Error(cat(path, ": ", how, " IDX payload: the header announces ", type->name, " ",
                     shape_str(shape), " = ", expected, " bytes, the file holds ", actual,
                     " bytes after the header"));
  };
  // A plain file's real size is known before anything is allocated.
  if (file.plain() && file.file_size() - header != expected)
    throw wrong_size(file.file_size() - header < expected ? "truncated" : "overlong",
                     file.file_size() - header);
  // Gzipped: read at most one byte more than announced, so that a lying
  // header costs no more memory than the data that is really there.
  bytes.clear();
  const uint64_t actual = file.read(bytes, expected + 1);
  if (actual != expected) throw wrong_size(actual < expected ? "truncated" : "overlong", actual);

  Tensor out = empty(shape, type->dtype);
  const uint8_t* payload = bytes.data();
  if (type->dtype == DType::u8) {
    if (expected) std::memcpy(out.data_ptr(), payload, expected);
    return out;
  }
  switch (type->dtype) {
    case DType::i32:
      convert_payload(payload, *type, numel, out.data<int32_t>());
      break;
    case DType::f32:
      convert_payload(payload, *type, numel, out.data<float>());
      break;
    default:
      convert_payload(payload, *type, numel, out.data<double>());
      break;
  }
  return out;
}

const char* split_name(Split split) { return split == Split::train ? "train" : "val"; }

MnistDataset::MnistDataset(Tensor images, Tensor labels, int64_t num_classes, std::string source)
    : images_(std::move(images)),
      labels_(std::move(labels)),
      num_classes_(num_classes),
      source_(std::move(source)) {
  CHECK(images_.dtype() == DType::u8 && images_.dim() == 3 && images_.is_contiguous())
      << "MnistDataset: images must be contiguous u8 [N, H, W], got " << images_.shape_str();
  CHECK(labels_.dtype() == DType::i64 && labels_.dim() == 1 && labels_.size(0) == images_.size(0))
      << "MnistDataset: labels must be i64 [N], got " << labels_.shape_str();
}

int64_t MnistDataset::label(int64_t index) const { return labels_.data<int64_t>()[index]; }

DecodedImage MnistDataset::load(int64_t index, const DecodeHint&) const {
  int h = int(images_.size(1)), w = int(images_.size(2));
  uint8_t* p = images_.data<uint8_t>() + index * int64_t(h) * w;
  return DecodedImage{cv::Mat(h, w, CV_8UC1, p), h, w};
}

std::string MnistDataset::describe(int64_t index) const { return cat(source_, "[", index, "]"); }

MnistDataset load_fashion_mnist(const std::string& dir, Split split) {
  std::string prefix = split == Split::train ? "train" : "t10k";
  std::string images_path = find_file(dir, prefix + "-images-idx3-ubyte");
  std::string labels_path = find_file(dir, prefix + "-labels-idx1-ubyte");
  Tensor images = read_idx(images_path);
  Tensor labels = read_idx(labels_path);
  if (images.dtype() != DType::u8 || images.dim() != 3)
    throw Error(cat(images_path, ": expected u8 images [N, H, W], got ", dtype_name(images.dtype()),
                    " ", images.shape_str()));
  // OpenCV and the transforms take sides as int; an empty image has no pixels to train on.
  constexpr int64_t kMaxSide = 1 << 15;
  if (images.size(0) < 1 || images.size(1) < 1 || images.size(2) < 1 || images.size(1) > kMaxSide ||
      images.size(2) > kMaxSide)
    throw Error(cat(images_path, ": images ", images.shape_str(),
                    ": expected at least one image, each side in [1, ", kMaxSide,
                    "]; the file is corrupt or not Fashion-MNIST's"));
  if (images.size(1) < kMinImageSide || images.size(2) < kMinImageSide)
    throw Error(cat(images_path, ": images ", images.shape_str(),
                    " (count, height, width) are too small to ",
                    split == Split::train ? "train" : "test", " on: expected each side at least ",
                    kMinImageSide,
                    " pixels (Fashion-MNIST's are 28x28); the file is corrupt or not "
                    "Fashion-MNIST's"));
  if (labels.dtype() != DType::u8 || labels.dim() != 1 || labels.size(0) != images.size(0))
    throw Error(cat(labels_path, ": expected ", images.size(0), " u8 labels, got ",
                    dtype_name(labels.dtype()), " ", labels.shape_str()));
  const int64_t num_classes = int64_t(fashion_mnist_classes().size());
  const uint8_t* raw = labels.data<uint8_t>();
  for (int64_t i = 0; i < labels.numel(); ++i)
    if (raw[i] >= num_classes)
      throw Error(cat(labels_path, ": label ", int(raw[i]), " of item ", i, " is outside [0, ",
                      num_classes, ")"));
  return MnistDataset(images, labels.to(DType::i64), num_classes, images_path);
}

void check_same_image_size(const MnistDataset& train, const MnistDataset& val) {
  const Tensor &a = train.images(), &b = val.images();
  if (a.size(1) == b.size(1) && a.size(2) == b.size(2)) return;
  throw Error(cat(val.source(), ": test images ", b.shape_str(),
                  " (count, height, width) differ in size from the training images of ",
                  train.source(), " ", a.shape_str(),
                  ": expected test images of the training images' size; the files come from "
                  "different datasets: point data.root at a folder holding one dataset's four "
                  "files"));
}

const std::vector<std::string>& fashion_mnist_classes() {
  static const std::vector<std::string> names = {"T-shirt/top", "Trouser",   "Pullover", "Dress",
                                                 "Coat",        "Sandal",    "Shirt",    "Sneaker",
                                                 "Bag",         "Ankle boot"};
  return names;
}

}  // namespace trainer::data
