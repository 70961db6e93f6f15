// libFuzzer target: image decoding on the ImageFolder path (data/image_folder.h):
// the JPEG marker walk (parse_jpeg) and decode_image at several decode
// sizes and of a region. Any input is either pixels or a BadSampleError.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "data/image_folder.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  trainer::data::parse_jpeg(data, size);
  const std::vector<uint8_t> bytes(data, data + size);
  // Whole images at full and reduced size, and the middle of one at the
  // scale that keeps it 4 pixels wide (region decoding).
  trainer::data::DecodeHint middle(0);
  middle.crop = [](int height, int width) {
    return trainer::data::CropBox{width / 4, height / 4, std::max(1, width / 2),
                                  std::max(1, height / 2)};
  };
  middle.crop_side = 4;
  for (const trainer::data::DecodeHint& hint :
       {trainer::data::DecodeHint(0), trainer::data::DecodeHint(4), middle}) {
    try {
      trainer::data::DecodedImage image = trainer::data::decode_image(bytes, hint, "fuzz.jpg");
      if (image.pixels.empty() || image.pixels.depth() != CV_8U) std::abort();
    } catch (const trainer::data::BadSampleError&) {
    }
  }
  return 0;
}
