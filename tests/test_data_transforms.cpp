// Transforms against hand-computed crops on synthetic images: fixed crop
// boxes, RandomResizedCrop's limits and fallback, flip, Resize + CenterCrop
// sizes, bilinear and area resampling of gradients, Normalize values and
// reduced JPEG decoding.
#include "tests/testing.h"

#include <cmath>
#include <opencv2/imgcodecs.hpp>

#include "data/image_folder.h"
#include "data/transforms.h"

using namespace trainer;
using namespace trainer::data;

namespace {

TransformOptions unit_normalize(TransformOptions o, int channels) {
  o.mean.assign(size_t(channels), 0.0f);
  o.std.assign(size_t(channels), 1.0f);
  return o;
}

// B = x, G = y, R = 200 - x (x, y < 200).
cv::Mat gradient_bgr(int height, int width) {
  cv::Mat m(height, width, CV_8UC3);
  for (int y = 0; y < height; ++y)
    for (int x = 0; x < width; ++x)
      m.at<cv::Vec3b>(y, x) = cv::Vec3b(uint8_t(x), uint8_t(y), uint8_t(200 - x));
  return m;
}

std::vector<float> run(const ImageTransform& t, const cv::Mat& image, PhiloxKey key) {
  std::vector<float> out(size_t(t.sample_numel()));
  t.apply(DecodedImage{image, image.rows, image.cols}, key, out.data());
  return out;
}

}  // namespace

TEST_CASE("transforms: RandomResizedCrop boxes stay within scale, ratio and image",
          "[data][transforms]") {
  TransformOptions o;
  for (auto [h, w] : {std::pair{375, 500}, std::pair{100, 100}, std::pair{60, 400}}) {
    int fallbacks = 0;
    double min_scale = 1, max_scale = 0, min_ratio = 10, max_ratio = 0;
    for (int64_t i = 0; i < 2000; ++i) {
      PhiloxKey key = augment_key(1, 0, i);
      CropBox box = random_resized_crop_box(h, w, o, key);
      REQUIRE(box == random_resized_crop_box(h, w, o, key));
      REQUIRE(box.x >= 0);
      REQUIRE(box.y >= 0);
      REQUIRE(box.width > 0);
      REQUIRE(box.height > 0);
      REQUIRE(box.x + box.width <= w);
      REQUIRE(box.y + box.height <= h);
      double scale = double(box.width) * box.height / (double(w) * h);
      double ratio = double(box.width) / box.height;
      // Rounding w and h to pixels moves scale and ratio by about 1/side.
      double slack = 2.5 / std::min(box.width, box.height);
      bool is_fallback = scale > o.scale_max + slack || scale < o.scale_min - slack ||
                         ratio < o.ratio_min * (1 - slack) || ratio > o.ratio_max * (1 + slack);
      if (is_fallback) {
        ++fallbacks;
        continue;
      }
      min_scale = std::min(min_scale, scale);
      max_scale = std::max(max_scale, scale);
      min_ratio = std::min(min_ratio, ratio);
      max_ratio = std::max(max_ratio, ratio);
    }
    INFO(h << "x" << w);
    REQUIRE(fallbacks < 20);
    REQUIRE(min_scale < 0.1);
    REQUIRE(max_scale > (h == 60 ? 0.15 : 0.9));
    REQUIRE(min_ratio < 0.8);
    REQUIRE(max_ratio > 1.25);
  }
}

TEST_CASE("transforms: RandomResizedCrop with a fixed scale and ratio gives the hand box",
          "[data][transforms]") {
  TransformOptions o{.scale_min = 0.25, .scale_max = 0.25, .ratio_min = 1, .ratio_max = 1};
  for (int64_t i = 0; i < 20; ++i) {
    PhiloxKey key = augment_key(3, 2, i);
    CropBox box = random_resized_crop_box(100, 100, o, key);
    // Area 2500 at ratio 1: 50x50, offsets torch.randint(0, 51) from draws 20 (top), 21 (left).
    int y = int(double(philox_uniform(key, 20)) * 51),
        x = int(double(philox_uniform(key, 21)) * 51);
    REQUIRE(box == CropBox{x, y, 50, 50});
  }
}

TEST_CASE("transforms: RandomResizedCrop falls back to the clamped center crop",
          "[data][transforms]") {
  PhiloxKey key = augment_key(0, 0, 0);
  // Whole-image area at ratio >= 2 never fits a square: fallback, in_ratio 1 < 2.
  REQUIRE(random_resized_crop_box(100, 100,
                                  {.scale_min = 1, .scale_max = 1, .ratio_min = 2, .ratio_max = 3},
                                  key) == (CropBox{0, 25, 100, 50}));
  // Ratio <= 0.4: in_ratio 1 > 0.4, width round(100 * 0.4) = 40, centred.
  REQUIRE(random_resized_crop_box(
              100, 100, {.scale_min = 1, .scale_max = 1, .ratio_min = 0.25, .ratio_max = 0.4},
              key) == (CropBox{30, 0, 40, 100}));
  // In range: the whole image.
  REQUIRE(random_resized_crop_box(90, 100,
                                  {.scale_min = 1, .scale_max = 1, .ratio_min = 2, .ratio_max = 3},
                                  key) == (CropBox{0, 20, 100, 50}));
  REQUIRE(random_resized_crop_box(
              80, 100, {.scale_min = 1, .scale_max = 1, .ratio_min = 0.5, .ratio_max = 0.9}, key) ==
          (CropBox{14, 0, 72, 80}));
}

TEST_CASE("transforms: Resize and CenterCrop sizes follow torchvision", "[data][transforms]") {
  REQUIRE(resize_shorter_size(375, 500, 256) == std::pair{256, 341});
  REQUIRE(resize_shorter_size(500, 375, 256) == std::pair{341, 256});
  REQUIRE(resize_shorter_size(300, 300, 256) == std::pair{256, 256});
  REQUIRE(resize_shorter_size(100, 333, 256) == std::pair{256, 852});
  // Offsets round half to even: (500 - 224) / 2 = 138, (375 - 224) / 2 = 75.5 -> 76, 16.5 -> 16.
  REQUIRE(center_crop_box(375, 500, 224) == (CropBox{138, 76, 224, 224}));
  REQUIRE(center_crop_box(257, 257, 224) == (CropBox{16, 16, 224, 224}));
}

TEST_CASE("transforms: a crop without resampling copies pixels, flipped or not, RGB",
          "[data][transforms]") {
  cv::Mat image = gradient_bgr(100, 100);
  for (double flip_prob : {0.0, 1.0}) {
    TransformOptions o{.mode = TransformMode::train,
                       .size = 50,
                       .scale_min = 0.25,
                       .scale_max = 0.25,
                       .ratio_min = 1,
                       .ratio_max = 1,
                       .hflip_prob = flip_prob};
    ImageTransform t(unit_normalize(o, 3), 3);
    PhiloxKey key = augment_key(5, 1, 17);
    CropBox box = random_resized_crop_box(100, 100, t.options(), key);
    std::vector<float> out = run(t, image, key);
    for (int y = 0; y < 50; ++y)
      for (int x = 0; x < 50; ++x) {
        int sx = box.x + (flip_prob > 0 ? 49 - x : x), sy = box.y + y;
        const float* px = &out[size_t((y * 50 + x) * 3)];
        REQUIRE(px[0] == float(200 - sx) / 255.0f);  // R
        REQUIRE(px[1] == float(sy) / 255.0f);        // G
        REQUIRE(px[2] == float(sx) / 255.0f);        // B
      }
  }
}

TEST_CASE("transforms: the flip is a fair coin per sample", "[data][transforms]") {
  TransformOptions o;
  int flips = 0;
  for (int64_t i = 0; i < 4000; ++i) flips += random_flip(o, augment_key(11, 0, i));
  REQUIRE(std::abs(flips - 2000) < 200);
}

TEST_CASE("transforms: bilinear upscaling of a gradient", "[data][transforms]") {
  // A 50x50 crop to 100: dst x samples src x / 2 - 0.25 (pixel centres), so
  // B = x reads x0 + x / 2 - 0.25 away from the clamped border.
  cv::Mat image = gradient_bgr(100, 100);
  TransformOptions o{.mode = TransformMode::train,
                     .size = 100,
                     .scale_min = 0.25,
                     .scale_max = 0.25,
                     .ratio_min = 1,
                     .ratio_max = 1,
                     .hflip_prob = 0};
  ImageTransform t(unit_normalize(o, 3), 3);
  PhiloxKey key = augment_key(2, 0, 4);
  CropBox box = random_resized_crop_box(100, 100, t.options(), key);
  std::vector<float> out = run(t, image, key);
  for (int y = 1; y < 99; ++y)
    for (int x = 1; x < 99; ++x) {
      const float* px = &out[size_t((y * 100 + x) * 3)];
      REQUIRE(std::fabs(px[2] * 255.0f - (box.x + x / 2.0f - 0.25f)) <= 0.51f);
      REQUIRE(std::fabs(px[1] * 255.0f - (box.y + y / 2.0f - 0.25f)) <= 0.51f);
    }
}

TEST_CASE("transforms: eval resizes the shorter side with Pillow's filter, then center crops",
          "[data][transforms]") {
  // A 160x240 grey image v = x / 2 + y / 4 (exact at even x and y multiples
  // of 4); resize 80 halves it, and on this linear ramp the 1/8, 3/8, 3/8,
  // 1/8 taps of Pillow's widened triangle give the 2x2 average of the source
  // pixels; crop 64 starts at (8, 28).
  cv::Mat image(160, 240, CV_8UC1);
  for (int y = 0; y < 160; ++y)
    for (int x = 0; x < 240; ++x) image.at<uint8_t>(y, x) = uint8_t(x / 2 + y / 4);
  TransformOptions o{.mode = TransformMode::eval, .size = 64, .resize = 80};
  ImageTransform t(unit_normalize(o, 1), 1);
  std::vector<float> out = run(t, image, augment_key(0, 0, 0));
  for (int y = 0; y < 64; ++y)
    for (int x = 0; x < 64; ++x) {
      int sy = 2 * (y + 8), sx = 2 * (x + 28);
      float expected = (image.at<uint8_t>(sy, sx) + image.at<uint8_t>(sy, sx + 1) +
                        image.at<uint8_t>(sy + 1, sx) + image.at<uint8_t>(sy + 1, sx + 1)) /
                       4.0f;
      REQUIRE(std::fabs(out[size_t(y * 64 + x)] * 255.0f - expected) <= 0.51f);
    }
}

TEST_CASE("transforms: Normalize uses the ImageNet statistics per channel", "[data][transforms]") {
  cv::Mat image(4, 4, CV_8UC3, cv::Scalar(0, 128, 255));  // B 0, G 128, R 255
  ImageTransform t(TransformOptions{.mode = TransformMode::plain, .size = 4}, 3);
  std::vector<float> out = run(t, image, augment_key(0, 0, 0));
  REQUIRE(out[0] == Approx((1.0 - 0.485) / 0.229).epsilon(1e-6));
  REQUIRE(out[1] == Approx((128 / 255.0 - 0.456) / 0.224).epsilon(1e-6));
  REQUIRE(out[2] == Approx((0.0 - 0.406) / 0.225).epsilon(1e-6));
  REQUIRE(out[45] == out[0]);
  REQUIRE_THROWS_WITH(ImageTransform(TransformOptions{}, 1),
                      Catch::Contains("one value per channel"));
  REQUIRE_THROWS_AS(
      ImageTransform(TransformOptions{.mode = TransformMode::eval, .size = 224, .resize = 200}, 3),
      Error);
}

TEST_CASE("transforms: reduced JPEG decoding keeps the geometry", "[data][transforms]") {
  REQUIRE(decode_reduction(375, 500, 224) == 1);
  REQUIRE(decode_reduction(1500, 2000, 224) == 4);
  REQUIRE(decode_reduction(2000, 3000, 256) == 4);
  REQUIRE(decode_reduction(4000, 3000, 256) == 8);
  REQUIRE(decode_reduction(4000, 3000, 0) == 1);
  REQUIRE(scale_box(CropBox{100, 40, 800, 600}, 1500, 2000, 375, 500) ==
          (CropBox{25, 10, 200, 150}));

  // A smooth 600x800 image: the eval transform on the 1/2-scale decode is
  // close to the one on the full decode.
  cv::Mat image(600, 800, CV_8UC3);
  for (int y = 0; y < 600; ++y)
    for (int x = 0; x < 800; ++x)
      image.at<cv::Vec3b>(y, x) = cv::Vec3b(uint8_t(x * 255 / 800), uint8_t(y * 255 / 600),
                                            uint8_t(128 + 100 * std::sin(x * 0.01 + y * 0.02)));
  std::vector<uint8_t> jpeg;
  REQUIRE(cv::imencode(".jpg", image, jpeg, {cv::IMWRITE_JPEG_QUALITY, 95}));
  JpegInfo info = parse_jpeg(jpeg.data(), jpeg.size());
  REQUIRE(info.valid);
  REQUIRE(info.complete);
  REQUIRE(info.height == 600);
  REQUIRE(info.width == 800);
  DecodedImage reduced = decode_image(jpeg, 256, "smooth.jpg");
  REQUIRE(reduced.pixels.rows == 300);
  REQUIRE(reduced.pixels.cols == 400);
  REQUIRE(reduced.source_height == 600);
  REQUIRE(reduced.source_width == 800);
  DecodedImage full = decode_image(jpeg, 0, "smooth.jpg");
  REQUIRE(full.pixels.rows == 600);
  for (TransformMode mode : {TransformMode::eval, TransformMode::train}) {
    ImageTransform t(unit_normalize(TransformOptions{.mode = mode, .size = 128, .resize = 256}, 3),
                     3);
    std::vector<float> a(size_t(t.sample_numel())), b(size_t(t.sample_numel()));
    t.apply(reduced, augment_key(1, 0, 9), a.data());
    t.apply(full, augment_key(1, 0, 9), b.data());
    double diff = 0;
    for (size_t i = 0; i < a.size(); ++i) diff += std::fabs(a[i] - b[i]);
    REQUIRE(diff / double(a.size()) < 0.02);
  }
}
