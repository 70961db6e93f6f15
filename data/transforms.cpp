// RandomResizedCrop, flip, Resize + CenterCrop, Normalize; see transforms.h.
#include "data/transforms.h"

#include <algorithm>
#include <cmath>
#include <opencv2/imgproc.hpp>

#include "data/resample.h"

namespace trainer::data {

namespace {

constexpr uint64_t kDrawOffsetY = 2 * kRandomResizedCropAttempts;
constexpr uint64_t kDrawOffsetX = kDrawOffsetY + 1;
constexpr uint64_t kDrawFlip = kDrawOffsetX + 1;
static_assert(kDrawFlip < 4 * kAugmentBlocksPerSample, "a sample's draws must fit its blocks");

// Python's round(): half to even (the default floating-point rounding mode).
int round_half_even(double v) { return int(std::nearbyint(v)); }

// torch.randint(0, n): an integer in [0, n) from a uniform draw in [0, 1).
int uniform_int(float u, int n) { return std::min(int(double(u) * n), n - 1); }

}  // namespace

PhiloxKey augment_key(uint64_t seed, int64_t epoch, int64_t index) {
  return PhiloxKey{seed, kStreamAugment + (uint64_t(epoch) << 8),
                   uint64_t(index) * kAugmentBlocksPerSample};
}

CropBox random_resized_crop_box(int height, int width, const TransformOptions& options,
                                PhiloxKey key) {
  const double area = double(height) * width;
  const double log_ratio_min = std::log(options.ratio_min);
  const double log_ratio_max = std::log(options.ratio_max);
  for (int attempt = 0; attempt < kRandomResizedCropAttempts; ++attempt) {
    double u_area = philox_uniform(key, 2 * uint64_t(attempt));
    double u_ratio = philox_uniform(key, 2 * uint64_t(attempt) + 1);
    double target_area =
        area * (options.scale_min + u_area * (options.scale_max - options.scale_min));
    double aspect = std::exp(log_ratio_min + u_ratio * (log_ratio_max - log_ratio_min));
    int w = round_half_even(std::sqrt(target_area * aspect));
    int h = round_half_even(std::sqrt(target_area / aspect));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      int y = uniform_int(philox_uniform(key, kDrawOffsetY), height - h + 1);
      int x = uniform_int(philox_uniform(key, kDrawOffsetX), width - w + 1);
      return CropBox{x, y, w, h};
    }
  }
  // Fallback: the whole image's center crop, clamped to the ratio range.
  double in_ratio = double(width) / height;
  int w = width, h = height;
  if (in_ratio < options.ratio_min) {
    h = round_half_even(w / options.ratio_min);
  } else if (in_ratio > options.ratio_max) {
    w = round_half_even(h * options.ratio_max);
  }
  return CropBox{(width - w) / 2, (height - h) / 2, w, h};
}

bool random_flip(const TransformOptions& options, PhiloxKey key) {
  return philox_uniform(key, kDrawFlip) < options.hflip_prob;
}

std::pair<int, int> resize_shorter_size(int height, int width, int shorter) {
  if (width <= height) return {int(double(shorter) * height / width), shorter};
  return {shorter, int(double(shorter) * width / height)};
}

CropBox center_crop_box(int height, int width, int crop) {
  return CropBox{round_half_even((width - crop) / 2.0), round_half_even((height - crop) / 2.0),
                 crop, crop};
}

CropBox scale_box(const CropBox& box, int source_height, int source_width, int decoded_height,
                  int decoded_width) {
  if (source_height == decoded_height && source_width == decoded_width) return box;
  double fy = double(decoded_height) / source_height, fx = double(decoded_width) / source_width;
  int x0 = std::clamp(int(std::lround(box.x * fx)), 0, decoded_width - 1);
  int y0 = std::clamp(int(std::lround(box.y * fy)), 0, decoded_height - 1);
  int x1 = std::clamp(int(std::lround((box.x + box.width) * fx)), x0 + 1, decoded_width);
  int y1 = std::clamp(int(std::lround((box.y + box.height) * fy)), y0 + 1, decoded_height);
  return CropBox{x0, y0, x1 - x0, y1 - y0};
}

ImageTransform::ImageTransform(TransformOptions options, int channels)
    : options_(std::move(options)), channels_(channels) {
  const TransformOptions& o = options_;
  if (channels != 1 && channels != 3)
    throw Error(cat("transform: images with ", channels, " channels (1 or 3 supported)"));
  if (o.size <= 0) throw Error(cat("transform: size ", o.size, " must be positive"));
  if (o.mode == TransformMode::eval && o.resize < o.size)
    throw Error(
        cat("transform: eval resize ", o.resize, " is smaller than the crop size ", o.size));
  if (!(o.scale_min > 0 && o.scale_min <= o.scale_max && o.scale_max <= 1))
    throw Error(cat("transform: scale [", o.scale_min, ", ", o.scale_max,
                    "] must satisfy 0 < min <= max <= 1"));
  if (!(o.ratio_min > 0 && o.ratio_min <= o.ratio_max))
    throw Error(
        cat("transform: ratio [", o.ratio_min, ", ", o.ratio_max, "] must satisfy 0 < min <= max"));
  if (!(o.hflip_prob >= 0 && o.hflip_prob <= 1))
    throw Error(cat("transform: hflip probability ", o.hflip_prob, " outside [0, 1]"));
  if (int(o.mean.size()) != channels || int(o.std.size()) != channels)
    throw Error(cat("transform: mean and std need one value per channel (", channels, "), got ",
                    o.mean.size(), " and ", o.std.size()));
  lut_.resize(size_t(channels));
  for (int c = 0; c < channels; ++c) {
    if (!(o.std[c] > 0)) throw Error(cat("transform: std[", c, "] = ", o.std[c], " must be > 0"));
    for (int v = 0; v < 256; ++v) lut_[c][v] = (float(v) / 255.0f - o.mean[c]) / o.std[c];
  }
}

int ImageTransform::min_decode_side() const {
  if (!options_.reduced_decoding) return 0;
  return options_.mode == TransformMode::eval ? options_.resize : options_.size;
}

DecodeHint ImageTransform::decode_hint(PhiloxKey key) const {
  DecodeHint hint(min_decode_side());
  if (options_.mode == TransformMode::train && options_.reduced_decoding) {
    hint.crop = [this, key](int height, int width) {
      return random_resized_crop_box(height, width, options_, key);
    };
    hint.crop_side = options_.size;
  }
  return hint;
}

void ImageTransform::resize(const cv::Mat& src, cv::Mat& dst, int height, int width) const {
  if (options_.antialias) {
    resize_bilinear(src, dst, height, width);
    return;
  }
  cv::resize(src, dst, cv::Size(width, height), 0, 0, cv::INTER_LINEAR);
}

void ImageTransform::write_normalized(const cv::Mat& image, bool flip, float* out) const {
  const int s = options_.size, c = channels_;
  CHECK(image.rows == s && image.cols == s && image.channels() == c && image.depth() == CV_8U)
      << "transform: a " << image.rows << "x" << image.cols << "x" << image.channels()
      << " image where " << s << "x" << s << "x" << c << " u8 was expected";
  for (int y = 0; y < s; ++y) {
    const uint8_t* row = image.ptr<uint8_t>(y);
    float* o = out + int64_t(y) * s * c;
    if (c == 1) {
      const std::array<float, 256>& lut = lut_[0];
      for (int x = 0; x < s; ++x) o[x] = lut[row[flip ? s - 1 - x : x]];
      continue;
    }
    const std::array<float, 256>&r = lut_[0], &g = lut_[1], &b = lut_[2];
    for (int x = 0; x < s; ++x) {
      const uint8_t* px = row + 3 * (flip ? s - 1 - x : x);  // B, G, R
      o[3 * x + 0] = r[px[2]];
      o[3 * x + 1] = g[px[1]];
      o[3 * x + 2] = b[px[0]];
    }
  }
}

void ImageTransform::apply(const DecodedImage& image, PhiloxKey key, float* out) const {
  const cv::Mat& pixels = image.pixels;
  CHECK(pixels.channels() == channels_ && !pixels.empty())
      << "transform: image with " << pixels.channels() << " channels, expected " << channels_;
  const int s = options_.size;
  cv::Mat resized;
  switch (options_.mode) {
    case TransformMode::train: {
      CropBox box = random_resized_crop_box(image.source_height, image.source_width, options_, key);
      box = scale_box(box, image.source_height, image.source_width, image.scaled_height,
                      image.scaled_width);
      box.x -= image.x;
      box.y -= image.y;
      CHECK(box.x >= 0 && box.y >= 0 && box.x + box.width <= pixels.cols &&
            box.y + box.height <= pixels.rows)
          << "transform: the crop box reaches outside the decoded part of the image";
      cv::Mat roi = pixels(cv::Rect(box.x, box.y, box.width, box.height));
      if (roi.rows == s && roi.cols == s) {
        write_normalized(roi, random_flip(options_, key), out);
        return;
      }
      resize(roi, resized, s, s);
      write_normalized(resized, random_flip(options_, key), out);
      return;
    }
    case TransformMode::eval: {
      auto [h, w] = resize_shorter_size(image.source_height, image.source_width, options_.resize);
      CHECK(pixels.rows == image.scaled_height && pixels.cols == image.scaled_width)
          << "transform: eval needs the whole image decoded";
      if (pixels.rows != h || pixels.cols != w) resize(pixels, resized, h, w);
      const cv::Mat& scaled = resized.empty() ? pixels : resized;
      CropBox box = center_crop_box(h, w, s);
      write_normalized(scaled(cv::Rect(box.x, box.y, box.width, box.height)), false, out);
      return;
    }
    case TransformMode::plain: {
      if (pixels.rows == s && pixels.cols == s) {
        write_normalized(pixels, false, out);
        return;
      }
      resize(pixels, resized, s, s);
      write_normalized(resized, false, out);
      return;
    }
  }
}

}  // namespace trainer::data
