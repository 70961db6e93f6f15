// Bilinear resampling of 8-bit images as Pillow's Image.resize(BILINEAR)
// computes it, which is what torchvision's Resize and RandomResizedCrop run
// on PIL images (antialias=True): a separable triangle filter whose support
// widens with the shrink factor, so a side that shrinks averages every pixel
// it covers and a side that grows interpolates between two. Each output
// pixel's weights are normalised over the taps inside the image (no border
// replication), quantised to 22 fractional bits, the rows resampled first
// into an 8-bit image, then the columns: Pillow's steps and rounding, so the
// same input pixels give the same output.
//
//   cv::Mat out;
//   resize_bilinear(crop, out, 224, 224);   // crop: CV_8UC1 or CV_8UC3, any size
#pragma once

#include <opencv2/core.hpp>
#include <vector>

namespace trainer::data {

// Pillow's per-output-pixel taps of one axis: output i reads input pixels
// [first[i], first[i] + count[i]) with the weights at weights[i * width].
struct ResampleTaps {
  int width = 0;  // taps per output pixel in `weights` (the widest filter)
  std::vector<int> first, count;
  std::vector<double> weights;
};
ResampleTaps bilinear_taps(int in_size, int out_size);

// dst = src resampled to height x width (CV_8U, 1 to 4 channels); dst must
// not be src.
void resize_bilinear(const cv::Mat& src, cv::Mat& dst, int height, int width);

}  // namespace trainer::data
