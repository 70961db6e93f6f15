// Image transforms: torchvision's ImageNet recipes, on OpenCV images, writing
// a normalized channels-last float sample straight into a batch.
//
//   train: RandomResizedCrop(size, scale, ratio) -> RandomHorizontalFlip -> Normalize
//   eval:  Resize(resize) of the shorter side -> CenterCrop(size) -> Normalize
//   plain: Resize((size, size)) when the image differs -> Normalize (MNIST-style data)
//
// The output of a sample is [size, size, C] f32, C = the image's channels,
// in RGB order for colour images, value (pixel / 255 - mean[c]) / std[c].
//
// Randomness. Sample `index` of `epoch` draws its numbers from
//   PhiloxKey{seed, kStreamAugment + (epoch << 8), index * kAugmentBlocksPerSample}
// (the low 8 bits of a stream name the purpose, the bits above the epoch),
// so its augmentation depends on nothing else: not the rank that reads it,
// the worker thread, the batch it falls in, nor whether the run was resumed.
// Draw j of a sample is philox_uniform(key, j), with a fixed role per j:
//   j = 2a, 2a + 1   attempt a in [0, 10) of RandomResizedCrop: the area
//                    fraction in [scale_min, scale_max], the log aspect ratio
//                    in [log ratio_min, log ratio_max]
//   j = 20, 21       top and left offset of the accepted box
//   j = 22           the horizontal flip (flip when < hflip_prob)
//
// Resizing. With antialias (the default), Pillow's bilinear filter, the one
// torchvision runs on PIL images: a side that shrinks averages every pixel
// it covers, one that grows interpolates (data/resample.h); without it,
// plain bilinear interpolation (cv::INTER_LINEAR, pixel centres at +0.5, as
// torchvision's antialias=False on tensors).
//
//   ImageTransform t(TransformOptions{.mode = TransformMode::train, .size = 224}, 3);
//   PhiloxKey key = augment_key(seed, epoch, index);
//   t.apply(dataset.load(index, t.decode_hint(key)), key, out);   // out: 224*224*3 floats
#pragma once

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "data/dataset.h"

namespace trainer::data {

enum class TransformMode { train, eval, plain };

struct TransformOptions {
  TransformMode mode = TransformMode::train;
  int size = 224;                            // the output side
  int resize = 256;                          // eval: the shorter side before the center crop
  double scale_min = 0.08, scale_max = 1.0;  // train: crop area / image area
  double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;  // train: crop width / height
  double hflip_prob = 0.5;                              // train
  std::vector<float> mean = {0.485f, 0.456f, 0.406f};   // ImageNet, one value per channel
  std::vector<float> std = {0.229f, 0.224f, 0.225f};
  bool antialias = true;
  // Let a JPEG decode only what the transform reads, at a reduced scale M/8
  // in libjpeg's DCT (see DecodeHint): train decodes the rows and columns of
  // its crop box at the smallest scale that keeps both sides of the box at
  // least `size`; eval the whole image at the smallest scale that keeps its
  // shorter side at least `resize`. The crop then shrinks from fewer pixels
  // than torchvision's full decode (the DCT's scaling is the first low-pass
  // step); false decodes every pixel.
  bool reduced_decoding = true;
  uint64_t seed = 0;
};

inline constexpr uint64_t kAugmentBlocksPerSample = 8;  // 32 draws, 23 used
inline constexpr int kRandomResizedCropAttempts = 10;

PhiloxKey augment_key(uint64_t seed, int64_t epoch, int64_t index);

// torchvision's RandomResizedCrop.get_params on a height x width image: 10
// attempts at a box of random area and log-uniform aspect ratio that fits,
// then the center crop of the whole image clamped to the ratio range.
CropBox random_resized_crop_box(int height, int width, const TransformOptions& options,
                                PhiloxKey key);
bool random_flip(const TransformOptions& options, PhiloxKey key);
// torchvision's Resize(shorter) output (height, width): the shorter side
// becomes `shorter`, the longer int(shorter * long / short).
std::pair<int, int> resize_shorter_size(int height, int width, int shorter);
// torchvision's CenterCrop box (offsets rounded half to even, as Python's round).
CropBox center_crop_box(int height, int width, int crop);
// The box in a decoded image of decoded_height x decoded_width that covers
// `box` of the source image (they differ after reduced decoding).
CropBox scale_box(const CropBox& box, int source_height, int source_width, int decoded_height,
                  int decoded_width);

class ImageTransform {
 public:
  // channels: of the dataset's images (1 or 3); mean and std need that many
  // values. Invalid options are a trainer::Error.
  ImageTransform(TransformOptions options, int channels);
  const TransformOptions& options() const { return options_; }
  int size() const { return options_.size; }
  int channels() const { return channels_; }
  // Floats per sample: size * size * channels.
  int64_t sample_numel() const { return int64_t(options_.size) * options_.size * channels_; }
  // The shorter side a decoder must keep (0: decode at full size).
  int min_decode_side() const;
  // What apply() with `key` reads of an image: the hint for Dataset::load.
  DecodeHint decode_hint(PhiloxKey key) const;
  // Writes the transformed sample, [size, size, channels] f32, to out.
  // image.pixels has `channels` channels (BGR when 3).
  void apply(const DecodedImage& image, PhiloxKey key, float* out) const;

 private:
  // Resizes src to height x width (Pillow's bilinear, or plain without antialias).
  void resize(const cv::Mat& src, cv::Mat& dst, int height, int width) const;
  // Normalizes a size x size image into out, mirrored when flip, BGR -> RGB.
  void write_normalized(const cv::Mat& image, bool flip, float* out) const;

  TransformOptions options_;
  int channels_;
  std::vector<std::array<float, 256>> lut_;  // per output channel: (v / 255 - mean) / std
};

}  // namespace trainer::data
