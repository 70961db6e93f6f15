// What the loader reads from: a dataset is an indexable list of (image,
// label) samples. Images come back decoded as 8-bit pixels in OpenCV's
// layout (CV_8UC1 grey or CV_8UC3 in BGR order); the transform turns them
// into normalized floats. Two datasets implement it: ImageFolder (JPEG files
// on disk, data/image_folder.h) and MnistDataset (IDX arrays, data/idx.h).
//
//   const Dataset& ds = ...;
//   DecodedImage img = ds.load(i, /*min_side=*/256);   // may throw BadSampleError
//   DecodedImage crop = ds.load(i, transform.decode_hint(key));   // only what the crop needs
//   int64_t y = ds.label(i);
#pragma once

#include <algorithm>

#include <cstdint>
#include <functional>
#include <opencv2/core.hpp>
#include <string>
#include <utility>

#include "core/check.h"

namespace trainer::data {

// The shorter side below which an image is refused: upsampled to the
// model's input it would be a few blocks of flat colour, nothing to learn
// from; such sides come from a corrupt header or the wrong file. The
// smallest classic classification images (scikit-learn's digits) are 8x8.
inline constexpr int kMinImageSide = 8;

// A sample that cannot be read: a corrupt, truncated or non-image file. The
// loader skips it with a warning or rethrows it, per LoaderOptions::bad_files.
class BadSampleError : public Error {
 public:
  explicit BadSampleError(const std::string& message) : Error(message) {}
};

// A crop rectangle in pixels: columns [x, x + width), rows [y, y + height).
struct CropBox {
  int x = 0, y = 0, width = 0, height = 0;
  bool operator==(const CropBox&) const = default;
};

// What a transform will read of an image, so that a decoder may decode less.
// A JPEG decodes at a scale of M/8 (M = 1..8) in libjpeg's DCT:
//   - without `crop`, the smallest scale that keeps the shorter side of the
//     whole image at least min_side (0: full size);
//   - with `crop`, only the rows and columns that cover the source box
//     crop(height, width), at the smallest scale that keeps both sides of
//     that box at least crop_side.
// An int converts to a hint of that min_side: load(i, 0) decodes everything.
struct DecodeHint {
  DecodeHint(int min_side = 0) : min_side(min_side) {}  // NOLINT: an int means a min_side
  int min_side = 0;
  std::function<CropBox(int height, int width)> crop;
  int crop_side = 0;
};

// A decoded image and the size of the image it was decoded from. The whole
// source, scaled, is scaled_height x scaled_width; `pixels` are its rows
// [y, y + rows) and columns [x, x + cols) (all of it unless the hint had a
// crop). Transforms place their boxes in source coordinates and map them
// through these, so the geometry is the same however much was decoded.
struct DecodedImage {
  DecodedImage() = default;
  DecodedImage(cv::Mat pixels, int source_height, int source_width)
      : pixels(std::move(pixels)),
        source_height(source_height),
        source_width(source_width),
        scaled_height(this->pixels.rows),
        scaled_width(this->pixels.cols) {}
  cv::Mat pixels;  // CV_8UC1 or CV_8UC3 (BGR), possibly a view of the dataset's memory
  int source_height = 0;
  int source_width = 0;
  int scaled_height = 0;
  int scaled_width = 0;
  int x = 0, y = 0;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // The class index of sample i, in [0, num_classes()).
  virtual int64_t label(int64_t index) const = 0;
  virtual int64_t num_classes() const = 0;
  // Channels of every decoded image: 1 (grey) or 3 (colour).
  virtual int channels() const = 0;
  // Decodes sample i, or as much of it as `hint` says the transform reads (a
  // dataset may always decode more). Throws BadSampleError for a bad sample.
  // Safe to call from several threads at once.
  virtual DecodedImage load(int64_t index, const DecodeHint& hint) const = 0;
  // Where sample i comes from, for messages (a file path, or "file[i]").
  virtual std::string describe(int64_t index) const = 0;
};

// The first n samples of another dataset (a quick evaluation on part of a
// validation set); base must outlive it.
class FirstSamples final : public Dataset {
 public:
  FirstSamples(const Dataset& base, int64_t n) : base_(base), n_(std::min(n, base.size())) {}
  int64_t size() const override { return n_; }
  int64_t label(int64_t index) const override { return base_.label(index); }
  int64_t num_classes() const override { return base_.num_classes(); }
  int channels() const override { return base_.channels(); }
  DecodedImage load(int64_t index, const DecodeHint& hint) const override {
    return base_.load(index, hint);
  }
  std::string describe(int64_t index) const override { return base_.describe(index); }

 private:
  const Dataset& base_;
  int64_t n_;
};

}  // namespace trainer::data
