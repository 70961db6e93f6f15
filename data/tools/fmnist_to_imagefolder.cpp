// Writes Fashion-MNIST as a JPEG ImageFolder, root/{train,val}/<class>/<n>.jpg,
// so the ImageNet path (files, JPEG decoding, RandomResizedCrop) can run on
// real images. Class folders are "<label>_<name>" (0_t-shirt_top, 1_trouser,
// ...): sorted by name they keep Fashion-MNIST's label order.
//
//   fmnist_to_imagefolder --out /tmp/fmnist-jpeg [--size 64] [--limit 1000] [--quality 95]
#include <CLI/CLI.hpp>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>

#include "data/idx.h"

using namespace trainer;
using namespace trainer::data;

namespace {

std::string class_folder(int64_t label) {
  std::string name = cat(label, "_");
  for (char ch : fashion_mnist_classes()[size_t(label)])
    name += std::isalnum(static_cast<unsigned char>(ch)) || ch == '-'
                ? char(std::tolower(static_cast<unsigned char>(ch)))
                : '_';
  return name;
}

int64_t write_split(const MnistDataset& data, const std::filesystem::path& dir, int64_t limit,
                    int size, int quality) {
  for (size_t label = 0; label < fashion_mnist_classes().size(); ++label)
    std::filesystem::create_directories(dir / class_folder(int64_t(label)));
  const int64_t count = limit > 0 ? std::min(limit, data.size()) : data.size();
  const std::vector<int> params = {cv::IMWRITE_JPEG_QUALITY, quality};
  cv::Mat resized;
  for (int64_t i = 0; i < count; ++i) {
    cv::Mat image = data.load(i, 0).pixels;
    if (size > 0 && size != image.rows) {
      cv::resize(image, resized, cv::Size(size, size), 0, 0, cv::INTER_LINEAR);
      image = resized;
    }
    std::string path = (dir / class_folder(data.label(i)) / cat(i, ".jpg")).string();
    if (!cv::imwrite(path, image, params)) throw Error(cat("cannot write ", path));
  }
  return count;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Write Fashion-MNIST as a JPEG ImageFolder (train/ and val/)"};
  std::string source = kFashionMnistDir, out;
  int64_t limit = 0;
  int size = 0, quality = 95;
  app.add_option("--fmnist-dir", source, "folder with the IDX files")->capture_default_str();
  app.add_option("--out", out, "output root (train/ and val/ are created)")->required();
  app.add_option("--limit", limit, "images per split (0: all)")->capture_default_str();
  app.add_option("--size", size, "resize the 28x28 images to size x size (0: keep)")
      ->capture_default_str();
  app.add_option("--quality", quality, "JPEG quality")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    for (Split split : {Split::train, Split::val}) {
      MnistDataset data = load_fashion_mnist(source, split);
      std::filesystem::path dir = std::filesystem::path(out) / split_name(split);
      int64_t n = write_split(data, dir, limit, size, quality);
      std::printf("%s: %lld images in %s\n", split_name(split), static_cast<long long>(n),
                  dir.string().c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
