// Region and scale decoding of JPEGs on libjpeg; see jpeg_decode.h.
#include "data/jpeg_decode.h"

#include <jpeglib.h>
#include <setjmp.h>

#include <algorithm>
#include <cstdio>

#include "data/transforms.h"

namespace trainer::data {

namespace {

// The most pixels one decode may produce (as OpenCV's default cap, a
// quarter of it): larger is a corrupt header or not a training image.
constexpr int64_t kMaxDecodedPixels = int64_t(1) << 28;
// libjpeg's own working memory (progressive JPEGs buffer every coefficient).
constexpr long kMaxDecoderMemory = 1L << 30;

int scaled(int side, int eighths) { return (side * eighths + 7) / 8; }

// libjpeg reports a fatal error through error_exit, which must not return:
// it long-jumps back into the step that made the call. The steps below hold
// no object with a destructor, so the jump skips none.
struct ErrorManager {
  jpeg_error_mgr base;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void error_exit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

// Corrupt-data warnings: the decoder carries on (grey blocks), as OpenCV's.
void output_message(j_common_ptr) {}

enum class Started { ok, failed, unsupported };

// The region of the decode once started: the columns libjpeg widened the
// box to (whole iMCU columns) and the rows to read.
struct Region {
  int scaled_height = 0, scaled_width = 0;
  int x = 0, width = 0, y = 0, rows = 0;
};

// Reads the header, sets the scale and colour space, starts the decoder,
// restricts it to the columns of `box` and skips the rows above it.
Started start(jpeg_decompress_struct& cinfo, const uint8_t* bytes, size_t size, int eighths,
              const CropBox& box, Region& region) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo.err);
  if (setjmp(err->jump)) return Started::failed;
  jpeg_mem_src(&cinfo, bytes, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK)
    return Started::unsupported;
  cinfo.out_color_space = JCS_EXT_BGR;
  cinfo.scale_num = static_cast<unsigned>(eighths);
  cinfo.scale_denom = 8;
  jpeg_start_decompress(&cinfo);
  region.scaled_height = int(cinfo.output_height);
  region.scaled_width = int(cinfo.output_width);
  if (box.x + box.width > region.scaled_width || box.y + box.height > region.scaled_height)
    return Started::failed;
  JDIMENSION x = JDIMENSION(box.x), width = JDIMENSION(box.width);
  if (width < cinfo.output_width) jpeg_crop_scanline(&cinfo, &x, &width);
  region.x = int(x);
  region.width = int(width);
  region.y = box.y;
  region.rows = box.height;
  if (box.y > 0 && int(jpeg_skip_scanlines(&cinfo, JDIMENSION(box.y))) != box.y)
    return Started::failed;
  return Started::ok;
}

// Reads region.rows scanlines into rows of `step` bytes from `out`.
bool read_rows(jpeg_decompress_struct& cinfo, const Region& region, uint8_t* out, size_t step) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo.err);
  if (setjmp(err->jump)) return false;
  for (int row = 0; row < region.rows;) {
    JSAMPROW line = out + size_t(row) * step;
    JDIMENSION got = jpeg_read_scanlines(&cinfo, &line, 1);
    if (got == 0) return false;
    row += int(got);
  }
  return true;
}

// A decompressor that is destroyed whichever way the decode ends.
struct Decompressor {
  Decompressor() {
    cinfo.err = jpeg_std_error(&err.base);
    err.base.error_exit = error_exit;
    err.base.output_message = output_message;
    err.message[0] = '\0';
    jpeg_create_decompress(&cinfo);
    cinfo.mem->max_memory_to_use = kMaxDecoderMemory;
  }
  ~Decompressor() { jpeg_destroy_decompress(&cinfo); }
  Decompressor(const Decompressor&) = delete;
  Decompressor& operator=(const Decompressor&) = delete;
  ErrorManager err;
  jpeg_decompress_struct cinfo;
};

}  // namespace

int decode_eighths(int height, int width, int min_side) {
  if (min_side <= 0) return 8;
  for (int m = 1; m < 8; ++m)
    if (scaled(height, m) >= min_side && scaled(width, m) >= min_side) return m;
  return 8;
}

DecodePlan plan_decode(int height, int width, const DecodeHint& hint) {
  const CropBox source = hint.crop ? hint.crop(height, width) : CropBox{0, 0, width, height};
  DecodePlan plan;
  plan.eighths = hint.crop ? decode_eighths(source.height, source.width, hint.crop_side)
                           : decode_eighths(height, width, hint.min_side);
  plan.scaled_height = scaled(height, plan.eighths);
  plan.scaled_width = scaled(width, plan.eighths);
  plan.box = scale_box(source, height, width, plan.scaled_height, plan.scaled_width);
  return plan;
}

std::optional<DecodedImage> decode_jpeg(const std::vector<uint8_t>& bytes, const JpegInfo& info,
                                        const DecodeHint& hint, const std::string& what) {
  CHECK(info.valid) << "decode_jpeg: " << what << " has no valid JPEG header";
  DecodePlan plan = plan_decode(info.height, info.width, hint);
  if (int64_t(plan.box.width) * plan.box.height > kMaxDecodedPixels)
    throw BadSampleError(cat(what, ": a JPEG of ", info.width, "x", info.height,
                             " pixels, too large to decode (at most ", kMaxDecodedPixels,
                             " pixels)"));
  Decompressor d;
  Region region;
  Started started = start(d.cinfo, bytes.data(), bytes.size(), plan.eighths, plan.box, region);
  if (started == Started::unsupported) return std::nullopt;
  if (started == Started::ok &&
      (region.scaled_height != plan.scaled_height || region.scaled_width != plan.scaled_width))
    throw BadSampleError(cat(what, ": the JPEG decodes to ", region.scaled_width, "x",
                             region.scaled_height, " pixels where its header says ",
                             plan.scaled_width, "x", plan.scaled_height));
  cv::Mat pixels;
  if (started == Started::ok) {
    pixels.create(region.rows, region.width, CV_8UC3);
    if (read_rows(d.cinfo, region, pixels.data, pixels.step)) {
      DecodedImage out(pixels, info.height, info.width);
      out.scaled_height = region.scaled_height;
      out.scaled_width = region.scaled_width;
      out.x = region.x;
      out.y = region.y;
      return out;
    }
  }
  throw BadSampleError(cat(what, ": cannot decode the JPEG: ",
                           d.err.message[0] ? d.err.message : "its region is out of range"));
}

}  // namespace trainer::data
