// libFuzzer target: image decoding on the ImageFolder path (data/image_folder.h):
// the JPEG marker walk (parse_jpeg) and decode_image at several decode
// sizes. Any input is either pixels or a BadSampleError.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "data/image_folder.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  trainer::data::parse_jpeg(data, size);
  const std::vector<uint8_t> bytes(data, data + size);
  for (int min_side : {0, 4}) {
    try {
      trainer::data::DecodedImage image = trainer::data::decode_image(bytes, min_side, "fuzz.jpg");
      if (image.pixels.empty() || image.pixels.depth() != CV_8U) std::abort();
    } catch (const trainer::data::BadSampleError&) {
    }
  }
  return 0;
}
