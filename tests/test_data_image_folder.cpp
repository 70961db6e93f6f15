// ImageFolder: torchvision's class order and extensions, clear errors for
// missing, empty or mismatched folders, and bad files (truncated JPEGs,
// random bytes, a text file named .jpg) under both bad-file policies.
#include "tests/testing.h"

#include <filesystem>
#include <fstream>
#include <opencv2/imgcodecs.hpp>

#include "data/image_folder.h"
#include "data/loader.h"

using namespace trainer;
using namespace trainer::data;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir(const std::string& name) {
  return testing::fresh_temp_dir("test_folder_" + name);
}

std::vector<uint8_t> encode(const cv::Mat& image, const std::string& ext) {
  std::vector<uint8_t> bytes;
  REQUIRE(cv::imencode(ext, image, bytes));
  return bytes;
}

cv::Mat solid(int height, int width, uint8_t value) {
  return cv::Mat(height, width, CV_8UC3, cv::Scalar(value, value / 2, 255 - value));
}

void write(const fs::path& path, const std::vector<uint8_t>& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

void write_text(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

}  // namespace

TEST_CASE("image folder: classes sorted by name, torchvision's extensions and order",
          "[data][folder]") {
  fs::path root = temp_dir("order");
  std::vector<uint8_t> jpg = encode(solid(8, 8, 10), ".jpg"), png = encode(solid(8, 8, 20), ".png");
  write(root / "b" / "z.jpg", jpg);
  write(root / "b" / "a.JPEG", jpg);
  write(root / "b" / "sub" / "c.png", png);
  write(root / "b" / "sub-x" / "d.Png", png);
  write_text(root / "b" / "notes.txt", "not an image");
  write(root / "a" / "1.jpg", jpg);
  write(root / "C" / "only.webp", encode(solid(8, 8, 30), ".webp"));
  write_text(root / "readme.txt", "files at the root are not classes");

  ImageFolder folder(root.string());
  REQUIRE(folder.classes() == std::vector<std::string>{"C", "a", "b"});
  REQUIRE(folder.size() == 6);
  std::vector<std::string> paths;
  for (int64_t i = 0; i < folder.size(); ++i)
    paths.push_back(fs::path(folder.path(i)).lexically_relative(root).generic_string());
  // Within a class: the class folder's files by name, then subfolders by path.
  REQUIRE(paths == std::vector<std::string>{"C/only.webp", "a/1.jpg", "b/a.JPEG", "b/z.jpg",
                                            "b/sub/c.png", "b/sub-x/d.Png"});
  REQUIRE(folder.label(0) == 0);
  REQUIRE(folder.label(1) == 1);
  REQUIRE(folder.label(5) == 2);
  DecodedImage img = folder.load(4, 0);
  REQUIRE(img.pixels.type() == CV_8UC3);
  REQUIRE(img.pixels.rows == 8);
  REQUIRE(img.pixels.at<cv::Vec3b>(0, 0) == cv::Vec3b(20, 10, 235));  // BGR as written
  fs::remove_all(root);
}

TEST_CASE("image folder: missing, empty and mismatched folders are clear errors",
          "[data][folder]") {
  fs::path root = temp_dir("errors");
  REQUIRE_THROWS_WITH(ImageFolder((root / "nope").string()), Catch::Contains("does not exist"));
  REQUIRE_THROWS_WITH(ImageFolder(root.string()), Catch::Contains("no class folders"));
  fs::create_directories(root / "cat");
  write_text(root / "cat" / "a.txt", "x");
  write(root / "dog" / "d.jpg", encode(solid(4, 4, 1), ".jpg"));
  REQUIRE_THROWS_WITH(ImageFolder(root.string()), Catch::Contains("no image files") &&
                                                      Catch::Contains("cat") &&
                                                      !Catch::Contains("dog,"));

  fs::path data = temp_dir("splits");
  std::vector<uint8_t> jpg = encode(solid(4, 4, 1), ".jpg");
  for (const char* c : {"n01", "n02", "n03"}) write(data / "train" / c / "x.jpg", jpg);
  for (const char* c : {"n01", "n03", "n04"}) write(data / "val" / c / "x.jpg", jpg);
  REQUIRE_THROWS_WITH(open_image_folder_splits(data.string()), Catch::Contains("differ") &&
                                                                   Catch::Contains("[n02]") &&
                                                                   Catch::Contains("[n04]"));
  fs::remove_all(data / "val" / "n04");
  write(data / "val" / "n02" / "y.jpg", jpg);
  ImageFolderSplits splits = open_image_folder_splits(data.string());
  REQUIRE(splits.train.size() == 3);
  REQUIRE(splits.val.classes() == splits.train.classes());
  fs::remove_all(root);
  fs::remove_all(data);
}

TEST_CASE("image folder: broken files are BadSampleErrors naming the file", "[data][folder]") {
  std::vector<uint8_t> good = encode(solid(40, 60, 100), ".jpg");
  REQUIRE(decode_image(good, 0, "good.jpg").pixels.cols == 60);
  std::vector<uint8_t> truncated(good.begin(), good.begin() + long(good.size() / 2));
  std::vector<uint8_t> header_only(good.begin(), good.begin() + 20);
  std::vector<uint8_t> random(3000);
  for (size_t i = 0; i < random.size(); ++i) random[i] = uint8_t(i * 7919 % 251);
  std::string text = "this is not an image\n";
  std::vector<uint8_t> text_bytes(text.begin(), text.end());
  // A corrupt DICOM file (its "DICM" after a 128-byte preamble): OpenCV
  // handed it to GDCM, which aborted on an assert (found by fuzz_image).
  std::vector<uint8_t> dicom(128, 0xFF);
  dicom.insert(dicom.end(), {'D', 'I', 'C', 'M', 0xFF, 0xD8, 0x00});
  for (auto& [bytes, reason] :
       std::vector<std::pair<std::vector<uint8_t>, std::string>>{{truncated, "truncated JPEG"},
                                                                 {header_only, "JPEG header"},
                                                                 {random, "not a decodable"},
                                                                 {text_bytes, "not a decodable"},
                                                                 {dicom, "none of JPEG, PNG"},
                                                                 {{}, "empty file"}}) {
    REQUIRE_THROWS_MATCHES(decode_image(bytes, 0, "dir/bad.jpg"), BadSampleError,
                           Catch::Matchers::Predicate<BadSampleError>(
                               [&](const BadSampleError& e) {
                                 std::string m = e.what();
                                 return m.find("dir/bad.jpg") != std::string::npos &&
                                        m.find(reason) != std::string::npos;
                               },
                               reason));
  }
}

TEST_CASE("image folder: the loader skips or rejects broken files", "[data][folder][loader]") {
  fs::path root = temp_dir("broken");
  std::vector<uint8_t> good = encode(solid(32, 48, 100), ".jpg");
  for (int i = 0; i < 6; ++i) write(root / "a" / cat("good", i, ".jpg"), good);
  write(root / "b" / "cut.jpg",
        std::vector<uint8_t>(good.begin(), good.begin() + long(good.size() / 2)));
  write_text(root / "b" / "text.jpg", "hello");
  std::vector<uint8_t> random(500, 0x5A);
  write(root / "b" / "random.jpeg", random);
  write(root / "b" / "zgood.jpg", good);
  ImageFolder folder(root.string());
  REQUIRE(folder.size() == 10);

  TransformOptions t{.mode = TransformMode::eval, .size = 16, .resize = 20};
  DistributedSampler sampler(SamplerOptions{folder.size(), 0, 1, 0, /*shuffle=*/false});
  std::vector<std::string> warnings;
  std::mutex mu;
  LoaderOptions o{.batch_size = 4, .num_workers = 2, .prefetch_batches = 2};
  o.log = [&](const std::string& m) {
    std::lock_guard<std::mutex> lock(mu);
    warnings.push_back(m);
  };
  {
    Loader loader(folder, ImageTransform(t, 3), sampler, o);
    loader.start_epoch(0);
    Batch batch;
    std::vector<int64_t> sizes, seen;
    while (loader.next(batch)) {
      sizes.push_back(batch.images.size(0));
      REQUIRE(batch.labels.size(0) == batch.images.size(0));
      seen.insert(seen.end(), batch.indices.begin(), batch.indices.end());
    }
    // Order in b: cut.jpg (6), random.jpeg (7), text.jpg (8), zgood.jpg (9).
    REQUIRE(sizes == std::vector<int64_t>{4, 2, 1});
    REQUIRE(seen == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 9});
    REQUIRE(loader.stats().skipped == 3);
    REQUIRE(loader.skipped_total() == 3);
  }
  std::string all;
  for (auto& w : warnings) all += w + "\n";
  INFO(all);
  REQUIRE(warnings.size() == 4);  // three bad files and the epoch report
  for (const char* name : {"cut.jpg", "text.jpg", "random.jpeg"})
    REQUIRE(all.find(name) != std::string::npos);
  REQUIRE(all.find("3 bad samples skipped") != std::string::npos);

  o.bad_files = BadFilePolicy::error;
  Loader strict(folder, ImageTransform(t, 3), sampler, o);
  strict.start_epoch(0);
  Batch batch;
  REQUIRE(strict.next(batch));
  REQUIRE_THROWS_WITH(strict.next(batch),
                      Catch::Contains("cut.jpg") && Catch::Contains("truncated"));
  fs::remove_all(root);
}
