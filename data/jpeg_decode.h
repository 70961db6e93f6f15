// JPEG decoding straight on libjpeg(-turbo), reading only what a transform
// needs (DecodeHint, data/dataset.h): the DCT scales the image by M/8
// (M = 1..8) while it decodes, whole rows above the needed ones are skipped
// without their inverse DCT and colour conversion (jpeg_skip_scanlines),
// columns outside them are never converted (jpeg_crop_scanline), and the
// rows below are never decoded at all.
//
// A RandomResizedCrop of a 500x375 ImageNet image keeps 8%-100% of its area
// and shrinks it to 224x224: decoding that box at the scale that keeps it
// just above 224 costs a fraction of a full decode, and so does the resize
// after it.
//
//   JpegInfo info = parse_jpeg(bytes.data(), bytes.size());   // data/image_folder.h
//   std::optional<DecodedImage> image = decode_jpeg(bytes, info, hint, "a.jpg");
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/image_folder.h"

namespace trainer::data {

// The smallest M in 1..8 with ceil(side * M / 8) >= min_side for both
// sides (8 when even the full size is smaller; 8 for min_side <= 0).
int decode_eighths(int height, int width, int min_side);

// The region of a JPEG of height x width that `hint` needs, at the scale it
// allows: the scale (eighths), the scaled size of the whole image and the
// box of it to decode (the whole scaled image without a crop).
struct DecodePlan {
  int eighths = 8;
  int scaled_height = 0, scaled_width = 0;
  CropBox box;
};
DecodePlan plan_decode(int height, int width, const DecodeHint& hint);

// Decodes a JPEG (whose header parse_jpeg found valid and complete) to BGR
// pixels as `hint` allows. std::nullopt when libjpeg cannot convert its
// colour space to BGR (CMYK, YCCK): the caller decodes it another way. A
// decoding error is a BadSampleError naming `what`.
std::optional<DecodedImage> decode_jpeg(const std::vector<uint8_t>& bytes, const JpegInfo& info,
                                        const DecodeHint& hint, const std::string& what);

}  // namespace trainer::data
