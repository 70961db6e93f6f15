// ImageFolder: torchvision's layout of an image classification dataset,
//   root/<class>/<image>   (images may sit in subfolders of a class folder)
// with ImageNet's usual split folders root/train and root/val.
//
// Classes are the class folder names sorted by byte value (Python's sorted()
// on the names, torchvision's order), so label i means the same class in
// both tools. A file is an image when its name ends, case-insensitively, in
// one of torchvision's IMG_EXTENSIONS; within a class, files are ordered as
// torchvision's make_dataset orders them (by folder path, then file name).
//
// Decoding gives BGR, EXIF orientation ignored (as PIL). JPEGs decode on
// libjpeg directly, only the part and at the scale the DecodeHint allows
// (data/jpeg_decode.h); other formats, and JPEGs in CMYK, through OpenCV,
// whole (a JPEG at 1/2, 1/4 or 1/8 scale if its shorter side stays at least
// hint.min_side). A file that cannot be decoded (corrupt, truncated, not an
// image), or an image with a side below kMinImageSide, is a BadSampleError
// naming it.
//
//   ImageFolderSplits data = open_image_folder_splits("/data/imagenet");   // train/ and val/
//   DecodedImage img = data.train.load(0, /*min_side=*/224);
#pragma once

#include <string>
#include <vector>

#include "data/dataset.h"

namespace trainer::data {

// torchvision.datasets.folder.IMG_EXTENSIONS.
const std::vector<std::string>& image_extensions();

class ImageFolder final : public Dataset {
 public:
  // Scans root. A missing root, a root without class folders or a class
  // folder without images is a trainer::Error saying what was found.
  explicit ImageFolder(const std::string& root);
  int64_t size() const override { return int64_t(samples_.size()); }
  int64_t label(int64_t index) const override { return samples_[size_t(index)].label; }
  int64_t num_classes() const override { return int64_t(classes_.size()); }
  int channels() const override { return 3; }
  DecodedImage load(int64_t index, const DecodeHint& hint) const override;
  std::string describe(int64_t index) const override { return path(index); }

  const std::string& root() const { return root_; }
  const std::vector<std::string>& classes() const { return classes_; }
  std::string path(int64_t index) const;

 private:
  struct Sample {
    std::string relative_path;  // from root, starting with the class folder
    int64_t label;
  };
  std::string root_;
  std::vector<std::string> classes_;
  std::vector<Sample> samples_;
};

struct ImageFolderSplits {
  ImageFolder train;
  ImageFolder val;
};
// root/train and root/val, checked to have identical class folders.
ImageFolderSplits open_image_folder_splits(const std::string& root);
// A trainer::Error listing the classes found in only one of the two folders.
void check_same_classes(const ImageFolder& train, const ImageFolder& val);

// ---- decoding, exposed for tests and the tools ----

// The size of a JPEG from its SOF marker, and whether its entropy-coded data
// is followed by an end-of-image marker (a truncated file has none).
struct JpegInfo {
  bool valid = false;  // a parsable JPEG header up to the first scan
  int height = 0, width = 0;
  bool complete = false;
};
JpegInfo parse_jpeg(const uint8_t* bytes, size_t size);
// The largest reduction in {1, 2, 4, 8} with ceil(min(height, width) / r) >= min_side.
int decode_reduction(int height, int width, int min_side);
// Decodes an encoded image (JPEG, PNG, PPM/PGM, BMP, TIFF, WebP) to
// CV_8UC3 BGR, as much of it as `hint` allows; `what` names it in a
// BadSampleError.
DecodedImage decode_image(const std::vector<uint8_t>& bytes, const DecodeHint& hint,
                          const std::string& what);
// The bytes of a file; a missing or unreadable file is a BadSampleError.
std::vector<uint8_t> read_file(const std::string& path);

}  // namespace trainer::data
