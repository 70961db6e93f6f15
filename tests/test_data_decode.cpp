// Pillow's bilinear resampling against Pillow's own output, and JPEG region
// decoding against whole-image decoding: the same pixels where they overlap,
// the same train samples within JPEG noise, less decoded.
#include "tests/testing.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>

#include "data/image_folder.h"
#include "data/jpeg_decode.h"
#include "data/resample.h"
#include "data/transforms.h"

#include <jpeglib.h>

using namespace trainer;
using namespace trainer::data;

namespace {

// A 7x9 grey image without structure a filter could hide behind.
cv::Mat odd_image() {
  cv::Mat m(7, 9, CV_8UC1);
  for (int y = 0; y < 7; ++y)
    for (int x = 0; x < 9; ++x)
      m.at<uint8_t>(y, x) = uint8_t((x * 37 + y * 91 + (x * y) % 7 * 13) % 256);
  return m;
}

std::vector<int> values(const cv::Mat& m) {
  std::vector<int> v;
  for (int y = 0; y < m.rows; ++y)
    for (int x = 0; x < m.cols * m.channels(); ++x) v.push_back(m.ptr<uint8_t>(y)[x]);
  return v;
}

// A textured 375x500 image (ImageNet's usual size): smooth gradients, a
// sine pattern and hard-edged blocks.
cv::Mat textured_image() {
  cv::Mat image(375, 500, CV_8UC3);
  for (int y = 0; y < image.rows; ++y)
    for (int x = 0; x < image.cols; ++x)
      image.at<cv::Vec3b>(y, x) =
          cv::Vec3b(uint8_t(x / 2), uint8_t(128 + 100 * std::sin(x * 0.05 + y * 0.03)),
                    uint8_t(((x / 40 + y / 30) % 2) * 200 + 20));
  return image;
}

struct Encoding {
  const char* name;
  int luma_h = 2, luma_v = 2;  // sampling factors of Y (chroma 1x1)
  bool progressive = false;
  J_COLOR_SPACE space = JCS_EXT_BGR;
};

// `image` encoded at quality 90 by libjpeg as `e` says (OpenCV 4.6 cannot
// choose the chroma subsampling).
std::vector<uint8_t> encode(const cv::Mat& image, const Encoding& e) {
  cv::Mat pixels = image;
  if (e.space == JCS_GRAYSCALE) cv::cvtColor(image, pixels, cv::COLOR_BGR2GRAY);
  if (e.space == JCS_CMYK) {  // inverted, as Adobe's CMYK JPEGs: C, M, Y = R, G, B; K = 255
    cv::Mat bgra;
    cv::cvtColor(image, bgra, cv::COLOR_BGR2BGRA);
    bgra.forEach<cv::Vec4b>([](cv::Vec4b& p, const int*) { p = {p[2], p[1], p[0], 255}; });
    pixels = bgra;
  }
  jpeg_compress_struct c;
  jpeg_error_mgr err;
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &buffer, &size);
  c.image_width = JDIMENSION(pixels.cols);
  c.image_height = JDIMENSION(pixels.rows);
  c.input_components = pixels.channels();
  c.in_color_space = e.space;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, 90, TRUE);
  if (e.space == JCS_EXT_BGR) {
    c.comp_info[0].h_samp_factor = e.luma_h;
    c.comp_info[0].v_samp_factor = e.luma_v;
  }
  if (e.progressive) jpeg_simple_progression(&c);
  jpeg_start_compress(&c, TRUE);
  for (int y = 0; y < pixels.rows; ++y) {
    JSAMPROW row = pixels.ptr<uint8_t>(y);
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  std::vector<uint8_t> out(buffer, buffer + size);
  free(buffer);
  jpeg_destroy_compress(&c);
  return out;
}

}  // namespace

TEST_CASE("resample: bilinear equals Pillow's Image.resize(BILINEAR)", "[data][resample]") {
  // Pillow 13.0: Image.fromarray(odd_image()).resize((w, h), Image.BILINEAR).
  cv::Mat src = odd_image(), out;
  resize_bilinear(src, out, 4, 5);
  REQUIRE(values(out) == std::vector<int>{72,  131, 123, 145, 82,  145, 138, 134, 145, 154,
                                          120, 128, 113, 121, 122, 109, 123, 181, 134, 109});
  resize_bilinear(src, out, 7, 4);  // along x only
  REQUIRE(values(out) == std::vector<int>{31,  106, 172, 61,  132, 171, 92,  121, 183, 102,
                                          155, 214, 80,  172, 154, 51,  164, 87,  93,  144,
                                          104, 88,  179, 143, 111, 193, 161, 75});
  resize_bilinear(src, out, 11, 13);  // growing: interpolation, weights renormalised at the border
  REQUIRE(values(out) ==
          std::vector<int>{
              0,   20,  46,  71,  97,  122, 148, 174, 199, 205, 54,  20,  40,  41,  65,  95,
              124, 154, 147, 97,  127, 156, 172, 76,  64,  87,  99,  127, 157, 176, 210, 171,
              40,  76,  110, 139, 111, 126, 153, 157, 189, 187, 100, 127, 126, 73,  114, 155,
              189, 167, 188, 220, 122, 159, 168, 102, 116, 132, 139, 163, 164, 147, 130, 156,
              193, 17,  58,  111, 163, 160, 177, 230, 220, 146, 34,  23,  55,  96,  75,  120,
              166, 183, 117, 82,  100, 136, 126, 84,  79,  117, 162, 133, 145, 156, 157, 84,
              46,  65,  112, 133, 135, 135, 146, 159, 191, 120, 62,  68,  66,  92,  156, 169,
              178, 185, 191, 133, 62,  109, 105, 106, 118, 131, 156, 197, 210, 169, 95,  107,
              109, 105, 34,  96,  155, 171, 188, 204, 221, 238, 156, 15,  31,  90,  152});

  // Three channels resample as three independent grey images.
  cv::Mat b = odd_image(), g = odd_image() * 0.5, r = 255 - odd_image(), bgr, channel;
  cv::merge(std::vector<cv::Mat>{b, g, r}, bgr);
  resize_bilinear(bgr, out, 4, 5);
  for (int c = 0; c < 3; ++c) {
    cv::Mat expected;
    resize_bilinear(std::vector<cv::Mat>{b, g, r}[size_t(c)], expected, 4, 5);
    cv::extractChannel(out, channel, c);
    REQUIRE(values(channel) == values(expected));
  }

  // Wide colour rows take the vectorised path (8 pixels at a time); it must
  // give the per-channel results exactly, shrinking and growing.
  cv::Mat wide(40, 301, CV_8UC3), wide_out;
  cv::randu(wide, 0, 256);
  std::vector<cv::Mat> planes;
  cv::split(wide, planes);
  for (int out_width : {224, 97, 300, 450, 17}) {
    INFO("width " << out_width);
    resize_bilinear(wide, wide_out, 31, out_width);
    for (int c = 0; c < 3; ++c) {
      cv::Mat expected;
      resize_bilinear(planes[size_t(c)], expected, 31, out_width);
      cv::extractChannel(wide_out, channel, c);
      REQUIRE(values(channel) == values(expected));
    }
  }

  // A 2x shrink weights 1/8, 3/8, 3/8, 1/8 (the triangle widened to 2); at
  // the border the taps inside the image are renormalised: 3/7, 3/7, 1/7.
  ResampleTaps taps = bilinear_taps(8, 4);
  REQUIRE(taps.first == std::vector<int>{0, 1, 3, 5});
  REQUIRE(taps.count == std::vector<int>{3, 4, 4, 3});
  const double* w1 = taps.weights.data() + taps.width;
  CHECK(w1[0] == Approx(0.125));
  CHECK(w1[1] == Approx(0.375));
  CHECK(w1[2] == Approx(0.375));
  CHECK(w1[3] == Approx(0.125));
  CHECK(taps.weights[0] == Approx(3.0 / 7));
  CHECK(taps.weights[2] == Approx(1.0 / 7));
}

TEST_CASE("jpeg: the scale keeps the needed side", "[data][jpeg]") {
  REQUIRE(decode_eighths(375, 500, 224) == 5);  // 235 x 313
  REQUIRE(decode_eighths(375, 500, 256) == 6);
  REQUIRE(decode_eighths(375, 500, 0) == 8);
  REQUIRE(decode_eighths(100, 100, 224) == 8);  // smaller than needed: full size
  REQUIRE(decode_eighths(1500, 2000, 224) == 2);
  DecodeHint hint(0);
  hint.crop = [](int, int) { return CropBox{100, 50, 300, 240}; };
  hint.crop_side = 224;
  DecodePlan plan = plan_decode(375, 500, hint);
  REQUIRE(plan.eighths == 8);  // 240 * 7 / 8 = 210 < 224
  REQUIRE(plan.box == (CropBox{100, 50, 300, 240}));
  hint.crop = [](int, int) { return CropBox{100, 40, 400, 320}; };
  plan = plan_decode(375, 500, hint);
  REQUIRE(plan.eighths == 6);  // 320 * 6 / 8 = 240
  REQUIRE(plan.scaled_height == 282);
  REQUIRE(plan.scaled_width == 375);
  REQUIRE(plan.box == (CropBox{75, 30, 300, 241}));
}

TEST_CASE("jpeg: a region decodes to the whole image's pixels, and trains alike", "[data][jpeg]") {
  const cv::Mat image = textured_image();
  const std::vector<Encoding> encodings = {
      {"4:2:0"},       {"4:2:0 progressive", 2, 2, true},    {"4:4:4", 1, 1}, {"4:2:2", 2, 1},
      {"4:4:0", 1, 2}, {"grey", 1, 1, false, JCS_GRAYSCALE},
  };
  ImageTransform train(TransformOptions{.mode = TransformMode::train, .size = 96}, 3);
  for (const Encoding& e : encodings) {
    INFO(e.name);
    const std::vector<uint8_t> jpeg = encode(image, e);
    for (int sample = 0; sample < 12; ++sample) {
      INFO("sample " << sample);
      PhiloxKey key = augment_key(3, 0, sample);
      DecodeHint hint = train.decode_hint(key);
      DecodedImage region = decode_image(jpeg, hint, "t.jpg");
      REQUIRE(region.source_height == 375);
      REQUIRE(region.source_width == 500);
      REQUIRE(region.pixels.channels() == 3);
      DecodePlan plan = plan_decode(375, 500, hint);
      REQUIRE(region.scaled_height == plan.scaled_height);
      REQUIRE(region.scaled_width == plan.scaled_width);
      // The decoded part covers the box (columns widened to whole blocks) and little more.
      REQUIRE(region.x <= plan.box.x);
      REQUIRE(region.x + region.pixels.cols >= plan.box.x + plan.box.width);
      REQUIRE(region.pixels.cols <= plan.box.width + 32);
      REQUIRE(region.y == plan.box.y);
      REQUIRE(region.pixels.rows == plan.box.height);

      // The whole image at the same scale has the same pixels there (the
      // edge columns may see other neighbours through chroma upsampling).
      DecodeHint whole(std::min(plan.scaled_height, plan.scaled_width));
      DecodedImage all = decode_image(jpeg, whole, "t.jpg");
      REQUIRE(all.pixels.rows == plan.scaled_height);
      cv::Mat same =
          all.pixels(cv::Rect(region.x, region.y, region.pixels.cols, region.pixels.rows));
      cv::Mat diff;
      cv::absdiff(same, region.pixels, diff);
      cv::Mat inner = diff(cv::Rect(2, 0, diff.cols - 4, diff.rows));
      REQUIRE(cv::norm(inner, cv::NORM_INF) <= 1);
      REQUIRE(cv::mean(diff)[0] < 0.25);

      // The train sample from the region is the one from the full decode,
      // up to the DCT's scaling (a low-pass filter of its own).
      DecodedImage full = decode_image(jpeg, 0, "t.jpg");
      REQUIRE(full.pixels.rows == 375);
      std::vector<float> a(size_t(train.sample_numel())), b(a.size());
      train.apply(region, key, a.data());
      train.apply(full, key, b.data());
      double mean_abs = 0;
      for (size_t i = 0; i < a.size(); ++i) mean_abs += std::fabs(a[i] - b[i]);
      mean_abs /= double(a.size());
      // Normalised units (grey level / 255 / std, std about 0.225): 0.1 is
      // about 5.7 grey levels; this image's hard edges give up to 0.08.
      REQUIRE(mean_abs < 0.1);
    }
  }
}

TEST_CASE("jpeg: corrupt data in a region decode is a BadSampleError or grey, never a crash",
          "[data][jpeg]") {
  std::vector<uint8_t> jpeg = encode(textured_image(), Encoding{"4:2:0"});
  ImageTransform train(TransformOptions{.mode = TransformMode::train, .size = 64}, 3);
  // Overwrite entropy-coded bytes in the middle: libjpeg warns and goes on.
  for (size_t i = jpeg.size() / 2; i < jpeg.size() / 2 + 200; ++i) jpeg[i] = uint8_t(i * 31);
  for (int sample = 0; sample < 4; ++sample) {
    PhiloxKey key = augment_key(0, 0, sample);
    try {
      DecodedImage image = decode_image(jpeg, train.decode_hint(key), "bad.jpg");
      std::vector<float> out(size_t(train.sample_numel()));
      train.apply(image, key, out.data());
      for (float v : out) REQUIRE(std::isfinite(v));
    } catch (const BadSampleError& e) {
      CHECK_THAT(e.what(), Catch::Contains("bad.jpg"));
    }
  }
  // A header whose frame is wider than the scan data: a clear error or pixels.
  std::vector<uint8_t> cut(jpeg.begin(), jpeg.begin() + 700);
  cut.push_back(0xFF);
  cut.push_back(0xD9);
  DecodeHint hint = train.decode_hint(augment_key(0, 0, 1));
  try {
    DecodedImage image = decode_image(cut, hint, "cut.jpg");
    REQUIRE(image.pixels.rows > 0);
  } catch (const BadSampleError& e) {
    CHECK_THAT(e.what(), Catch::Contains("cut.jpg"));
  }
}

TEST_CASE("jpeg: CMYK JPEGs decode whole through OpenCV", "[data][jpeg]") {
  const cv::Mat image = textured_image();
  std::vector<uint8_t> jpeg = encode(image, Encoding{"CMYK", 1, 1, false, JCS_CMYK});
  ImageTransform train(TransformOptions{.mode = TransformMode::train, .size = 96}, 3);
  PhiloxKey key = augment_key(0, 0, 5);
  DecodedImage decoded = decode_image(jpeg, train.decode_hint(key), "cmyk.jpg");
  REQUIRE(decoded.pixels.channels() == 3);
  REQUIRE(decoded.x == 0);
  REQUIRE(decoded.y == 0);
  REQUIRE(decoded.pixels.rows == decoded.scaled_height);
  REQUIRE(decoded.source_height == 375);
  cv::Mat diff;
  cv::absdiff(decode_image(jpeg, 0, "cmyk.jpg").pixels, image, diff);
  REQUIRE(cv::mean(diff)[0] < 6);  // the colours survive
  std::vector<float> out(size_t(train.sample_numel()));
  train.apply(decoded, key, out.data());
}
