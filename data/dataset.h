// What the loader reads from: a dataset is an indexable list of (image,
// label) samples. Images come back decoded as 8-bit pixels in OpenCV's
// layout (CV_8UC1 grey or CV_8UC3 in BGR order); the transform turns them
// into normalized floats. Two datasets implement it: ImageFolder (JPEG files
// on disk, data/image_folder.h) and MnistDataset (IDX arrays, data/idx.h).
//
//   const Dataset& ds = ...;
//   DecodedImage img = ds.load(i, /*min_side=*/256);   // may throw BadSampleError
//   int64_t y = ds.label(i);
#pragma once

#include <algorithm>

#include <cstdint>
#include <opencv2/core.hpp>
#include <string>

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

// A decoded image and the size of the image it was decoded from. They differ
// when a JPEG was decoded at 1/2, 1/4 or 1/8 scale; transforms place their
// crop boxes in source coordinates so the geometry is the same either way.
struct DecodedImage {
  cv::Mat pixels;  // CV_8UC1 or CV_8UC3 (BGR), possibly a view of the dataset's memory
  int source_height = 0;
  int source_width = 0;
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
  // Decodes sample i. min_side is the shorter side the transform needs; a
  // dataset may decode at a reduced size as long as the shorter side stays
  // at least min_side (0: full size). Throws BadSampleError for a bad sample.
  // Safe to call from several threads at once.
  virtual DecodedImage load(int64_t index, int min_side) const = 0;
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
  DecodedImage load(int64_t index, int min_side) const override {
    return base_.load(index, min_side);
  }
  std::string describe(int64_t index) const override { return base_.describe(index); }

 private:
  const Dataset& base_;
  int64_t n_;
};

}  // namespace trainer::data
