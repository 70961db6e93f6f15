// IDX files (the MNIST family's format) and the Fashion-MNIST dataset.
//
// An IDX file is a big-endian header and a dense array:
//   bytes 0-1  zero
//   byte  2    element type: 0x08 u8, 0x09 i8, 0x0B i16, 0x0C i32, 0x0D f32, 0x0E f64
//   byte  3    number of dims D
//   4*D bytes  the dims, u32 each
//   then prod(dims) elements, row-major, big-endian.
// Files may be gzipped (zlib reads both forms). The reader checks every
// field and that the payload has exactly the size the header announces.
//
//   Tensor images = read_idx("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
//   MnistDataset train = load_fashion_mnist(kFashionMnistDir, Split::train);
#pragma once

#include <string>

#include "core/tensor.h"
#include "data/dataset.h"

namespace trainer::data {

// Where the Debian package dataset-fashion-mnist installs its files; the
// recipe's data.root overrides it.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// Fashion-MNIST's per-channel statistics of the training images (in [0, 1]).
inline constexpr float kFashionMnistMean = 0.2860f;
inline constexpr float kFashionMnistStd = 0.3530f;

// Reads an IDX file, plain or gzipped, into a CPU tensor with the file's
// dims: u8 stays u8, i8/i16/i32 widen to i32, f32 and f64 keep their type.
// A bad header, a truncated or overlong payload, or an unreadable file is a
// trainer::Error naming the file.
Tensor read_idx(const std::string& path);

enum class Split { train, val };
const char* split_name(Split split);

// An in-memory image classification dataset: images u8 [N, H, W] (grey),
// labels i64 [N] in [0, num_classes).
class MnistDataset final : public Dataset {
 public:
  MnistDataset(Tensor images, Tensor labels, int64_t num_classes, std::string source);
  int64_t size() const override { return images_.size(0); }
  int64_t label(int64_t index) const override;
  int64_t num_classes() const override { return num_classes_; }
  int channels() const override { return 1; }
  // A view of the image (no copy); min_side is ignored.
  DecodedImage load(int64_t index, const DecodeHint& hint) const override;
  std::string describe(int64_t index) const override;

  const Tensor& images() const { return images_; }
  const Tensor& labels() const { return labels_; }
  // The images' file.
  const std::string& source() const { return source_; }

 private:
  Tensor images_, labels_;
  int64_t num_classes_;
  std::string source_;
};

// Fashion-MNIST from dir: {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz].
// 60000 training and 10000 test images of 28x28, 10 classes; the test set
// is the val split. Files missing, mismatched, with labels outside [0, 10)
// or images with a side below kMinImageSide are a trainer::Error.
MnistDataset load_fashion_mnist(const std::string& dir, Split split);
// A trainer::Error naming both files when the test images are not the size
// of the training images: a model learns one size, and evaluating it on
// images resized from another measures something else.
void check_same_image_size(const MnistDataset& train, const MnistDataset& val);

// Fashion-MNIST's class names, in label order.
const std::vector<std::string>& fashion_mnist_classes();

}  // namespace trainer::data
