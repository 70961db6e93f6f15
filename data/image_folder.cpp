// ImageFolder scanning and image decoding; see image_folder.h.
#include "data/image_folder.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <opencv2/imgcodecs.hpp>
#include <optional>

#include "data/files.h"
#include "data/jpeg_decode.h"

namespace trainer::data {

namespace fs = std::filesystem;

namespace {

bool has_image_extension(const std::string& name) {
  std::string lower = name;
  for (char& ch : lower) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  for (const std::string& ext : image_extensions())
    if (lower.size() >= ext.size() &&
        lower.compare(lower.size() - ext.size(), ext.size(), ext) == 0)
      return true;
  return false;
}

std::string join(const std::vector<std::string>& names, size_t limit = 10) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > limit) out += cat(", ... (", names.size(), " in all)");
  return out;
}

// The image files under a class folder in torchvision's order: sorted by
// folder (relative to the class folder), then by name.
std::vector<std::string> list_images(const fs::path& class_dir) {
  std::vector<std::pair<std::string, std::string>> found;
  auto options = fs::directory_options::follow_directory_symlink;
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(class_dir, options)) {
    if (entry.is_directory()) continue;
    std::string name = entry.path().filename().string();
    if (!has_image_extension(name)) continue;
    found.emplace_back(entry.path().parent_path().lexically_relative(class_dir).generic_string(),
                       name);
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> files;
  files.reserve(found.size());
  for (auto& [dir, name] : found) files.push_back(dir == "." ? name : dir + "/" + name);
  return files;
}

uint16_t load_be16(const uint8_t* p) { return uint16_t(p[0] << 8 | p[1]); }

int reduced_color_flag(int reduction) {
  switch (reduction) {
    case 2:
      return cv::IMREAD_REDUCED_COLOR_2;
    case 4:
      return cv::IMREAD_REDUCED_COLOR_4;
    case 8:
      return cv::IMREAD_REDUCED_COLOR_8;
    default:
      return cv::IMREAD_COLOR;
  }
}

}  // namespace

const std::vector<std::string>& image_extensions() {
  static const std::vector<std::string> extensions = {".jpg", ".jpeg", ".png",  ".ppm", ".bmp",
                                                      ".pgm", ".tif",  ".tiff", ".webp"};
  return extensions;
}

ImageFolder::ImageFolder(const std::string& root) : root_(root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec))
    throw Error(cat("ImageFolder: ", root,
                    fs::exists(root, ec) ? " is not a directory" : " does not exist",
                    "; point data.root at a folder laid out as <root>/<class>/<image>"));
  try {
    for (const fs::directory_entry& entry : fs::directory_iterator(root))
      if (entry.is_directory()) classes_.push_back(entry.path().filename().string());
    std::sort(classes_.begin(), classes_.end());
    if (classes_.empty())
      throw Error(cat("ImageFolder: no class folders in ", root,
                      "; expected <root>/<class>/<image> with one folder per class"));
    std::vector<std::string> empty_classes;
    for (size_t label = 0; label < classes_.size(); ++label) {
      std::vector<std::string> files = list_images(fs::path(root) / classes_[label]);
      if (files.empty()) empty_classes.push_back(classes_[label]);
      for (std::string& file : files)
        samples_.push_back(Sample{classes_[label] + "/" + file, int64_t(label)});
    }
    if (!empty_classes.empty())
      throw Error(cat("ImageFolder: no image files in the class folder(s) ", join(empty_classes),
                      " of ", root, "; images end in ", join(image_extensions(), 100),
                      " (any case)"));
  } catch (const fs::filesystem_error& e) {
    throw Error(cat("ImageFolder: cannot scan ", root, ": ", e.what()));
  }
}

std::string ImageFolder::path(int64_t index) const {
  return root_ + "/" + samples_[size_t(index)].relative_path;
}

DecodedImage ImageFolder::load(int64_t index, const DecodeHint& hint) const {
  std::string file = path(index);
  DecodedImage image = decode_image(read_file(file), hint, file);
  if (std::min(image.source_height, image.source_width) < kMinImageSide)
    throw BadSampleError(cat(file, ": an image ", image.source_width, " pixels wide and ",
                             image.source_height,
                             " high, too small to learn from: images need each side at least ",
                             kMinImageSide, " pixels"));
  return image;
}

ImageFolderSplits open_image_folder_splits(const std::string& root) {
  ImageFolderSplits splits{ImageFolder((fs::path(root) / "train").string()),
                           ImageFolder((fs::path(root) / "val").string())};
  check_same_classes(splits.train, splits.val);
  return splits;
}

void check_same_classes(const ImageFolder& train, const ImageFolder& val) {
  if (train.classes() == val.classes()) return;
  std::vector<std::string> only_train, only_val;
  std::set_difference(train.classes().begin(), train.classes().end(), val.classes().begin(),
                      val.classes().end(), std::back_inserter(only_train));
  std::set_difference(val.classes().begin(), val.classes().end(), train.classes().begin(),
                      train.classes().end(), std::back_inserter(only_val));
  throw Error(cat("ImageFolder: the class folders of ", train.root(), " (", train.classes().size(),
                  ") and ", val.root(), " (", val.classes().size(),
                  ") differ, so labels would not match; ", "only in ", train.root(), ": [",
                  join(only_train), "]; only in ", val.root(), ": [", join(only_val), "]"));
}

JpegInfo parse_jpeg(const uint8_t* b, size_t size) {
  JpegInfo info;
  if (size < 4 || b[0] != 0xFF || b[1] != 0xD8) return info;
  size_t pos = 2, scan_start = 0;
  while (pos < size) {
    if (b[pos] != 0xFF) return info;
    while (pos < size && b[pos] == 0xFF) ++pos;  // fill bytes
    if (pos >= size) return info;
    uint8_t marker = b[pos++];
    if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD8)) continue;  // no payload
    if (marker == 0xD9 || pos + 2 > size) return info;
    size_t length = load_be16(b + pos);
    if (length < 2 || pos + length > size) return info;
    bool sof =
        marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC;
    if (sof && length >= 7) {
      info.height = load_be16(b + pos + 3);
      info.width = load_be16(b + pos + 5);
    }
    pos += length;
    if (marker == 0xDA) {
      scan_start = pos;
      break;
    }
  }
  if (scan_start == 0 || info.height <= 0 || info.width <= 0) return info;
  info.valid = true;
  // Entropy-coded data stuffs every 0xFF with a 0x00, so the first FF D9
  // from the end that follows the first scan is the end-of-image marker.
  for (size_t i = size - 1; i > scan_start && !info.complete; --i)
    info.complete = b[i - 1] == 0xFF && b[i] == 0xD9;
  return info;
}

int decode_reduction(int height, int width, int min_side) {
  if (min_side <= 0) return 1;
  int shorter = std::min(height, width);
  for (int r : {8, 4, 2})
    if ((shorter + r - 1) / r >= min_side) return r;
  return 1;
}

namespace {

// Whether bytes start as one of the formats of image_extensions() does.
// OpenCV picks its decoder by signature, among others DICOM's (GDCM), which
// asserts (aborts) on some corrupt input: only these formats reach it.
bool known_image_signature(const std::vector<uint8_t>& b) {
  auto starts = [&](std::initializer_list<uint8_t> sig, size_t at = 0) {
    if (b.size() < at + sig.size()) return false;
    size_t i = at;
    for (uint8_t c : sig)
      if (b[i++] != c) return false;
    return true;
  };
  return starts({0xFF, 0xD8}) ||                                             // JPEG
         starts({0x89, 'P', 'N', 'G'}) ||                                    // PNG
         (b.size() >= 2 && b[0] == 'P' && b[1] >= '1' && b[1] <= '6') ||     // PBM, PGM, PPM
         starts({'B', 'M'}) ||                                               // BMP
         starts({'I', 'I', 42, 0}) || starts({'M', 'M', 0, 42}) ||           // TIFF
         (starts({'R', 'I', 'F', 'F'}) && starts({'W', 'E', 'B', 'P'}, 8));  // WebP
}

}  // namespace

DecodedImage decode_image(const std::vector<uint8_t>& bytes, const DecodeHint& hint,
                          const std::string& what) {
  if (bytes.empty()) throw BadSampleError(cat(what, ": empty file"));
  if (!known_image_signature(bytes))
    throw BadSampleError(cat(what,
                             ": not a decodable image (its first bytes are none of JPEG, PNG, "
                             "PPM/PGM, BMP, TIFF or WebP)"));
  int flags = cv::IMREAD_COLOR;
  JpegInfo jpeg;
  bool is_jpeg = bytes.size() >= 2 && bytes[0] == 0xFF && bytes[1] == 0xD8;
  if (is_jpeg) {
    jpeg = parse_jpeg(bytes.data(), bytes.size());
    if (!jpeg.valid) throw BadSampleError(cat(what, ": corrupt or truncated JPEG header"));
    if (!jpeg.complete)
      throw BadSampleError(
          cat(what, ": truncated JPEG (no end-of-image marker after the image data)"));
    if (std::optional<DecodedImage> image = decode_jpeg(bytes, jpeg, hint, what)) return *image;
    // A colour space libjpeg does not turn into BGR (CMYK): OpenCV converts it.
    flags = reduced_color_flag(decode_reduction(jpeg.height, jpeg.width, hint.min_side));
  }
  cv::Mat pixels;
  try {
    cv::Mat encoded(1, int(bytes.size()), CV_8UC1, const_cast<uint8_t*>(bytes.data()));
    pixels = cv::imdecode(encoded, flags | cv::IMREAD_IGNORE_ORIENTATION);
  } catch (const cv::Exception& e) {
    throw BadSampleError(cat(what, ": cannot decode: ", e.what()));
  }
  if (pixels.empty()) throw BadSampleError(cat(what, ": not a decodable image"));
  DecodedImage out{pixels, pixels.rows, pixels.cols};
  if (is_jpeg) {
    out.source_height = jpeg.height;
    out.source_width = jpeg.width;
  }
  return out;
}

std::vector<uint8_t> read_file(const std::string& path) {
  // An image is at most a few MB; 1 GiB bounds what a mislabelled file may cost.
  constexpr uint64_t kMaxImageBytes = uint64_t(1) << 30;
  try {
    return read_regular_file_bytes(path, "an image", kMaxImageBytes);
  } catch (const BadSampleError&) {
    throw;
  } catch (const Error& e) {
    throw BadSampleError(e.what());
  }
}

}  // namespace trainer::data
