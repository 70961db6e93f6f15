// IDX parsing of generated files (plain and gzipped, several element
// types), clear errors on truncated or malformed ones, and the real
// Fashion-MNIST files when the Debian package is installed.
#include "tests/testing.h"

#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "data/idx.h"

using namespace trainer;
using namespace trainer::data;

namespace {

std::filesystem::path temp_dir(const std::string& name) {
  return testing::fresh_temp_dir("test_idx_" + name);
}

std::vector<uint8_t> idx_header(uint8_t type, const std::vector<uint32_t>& dims) {
  std::vector<uint8_t> b = {0, 0, type, uint8_t(dims.size())};
  for (uint32_t d : dims)
    for (int shift : {24, 16, 8, 0}) b.push_back(uint8_t(d >> shift));
  return b;
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes, bool gzip = false) {
  if (gzip) {
    gzFile f = gzopen(path.c_str(), "wb");
    REQUIRE(f != nullptr);
    REQUIRE(gzwrite(f, bytes.data(), unsigned(bytes.size())) == int(bytes.size()));
    gzclose(f);
    return;
  }
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

}  // namespace

TEST_CASE("idx: u8 arrays, plain and gzipped", "[data][idx]") {
  auto dir = temp_dir("u8");
  std::vector<uint8_t> file = idx_header(0x08, {3, 2, 2});
  for (int i = 0; i < 12; ++i) file.push_back(uint8_t(i * 20));
  for (bool gz : {false, true}) {
    std::string path = (dir / (gz ? "a.idx.gz" : "a.idx")).string();
    write_bytes(path, file, gz);
    Tensor t = read_idx(path);
    REQUIRE(t.dtype() == DType::u8);
    REQUIRE(t.shape() == Shape{3, 2, 2});
    std::vector<int32_t> v = t.to_vector<int32_t>();
    for (int i = 0; i < 12; ++i) REQUIRE(v[size_t(i)] == i * 20);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("idx: big-endian i16, i32 and f32 elements", "[data][idx]") {
  auto dir = temp_dir("types");
  std::vector<uint8_t> i16 = idx_header(0x0B, {2});
  for (uint8_t b : {0xFF, 0xFE, 0x01, 0x00}) i16.push_back(b);  // -2, 256
  write_bytes((dir / "i16").string(), i16);
  REQUIRE(read_idx((dir / "i16").string()).to_vector<int32_t>() == std::vector<int32_t>{-2, 256});

  std::vector<uint8_t> i32 = idx_header(0x0C, {1, 1});
  for (uint8_t b : {0x80, 0x00, 0x00, 0x01}) i32.push_back(b);
  write_bytes((dir / "i32").string(), i32);
  Tensor t = read_idx((dir / "i32").string());
  REQUIRE(t.shape() == Shape{1, 1});
  REQUIRE(t.to_vector<int64_t>()[0] == -2147483647);

  std::vector<uint8_t> f32 = idx_header(0x0D, {2});
  for (uint8_t b : {0x3F, 0xC0, 0x00, 0x00, 0xC1, 0x20, 0x00, 0x00}) f32.push_back(b);  // 1.5, -10
  write_bytes((dir / "f32").string(), f32);
  REQUIRE(read_idx((dir / "f32").string()).to_vector<float>() == std::vector<float>{1.5f, -10.0f});
  std::filesystem::remove_all(dir);
}

TEST_CASE("idx: truncated and malformed files are errors naming the file", "[data][idx]") {
  auto dir = temp_dir("bad");
  std::vector<uint8_t> file = idx_header(0x08, {10, 28, 28});
  file.resize(file.size() + 10 * 28 * 28, 7);
  std::vector<uint8_t> cut(file.begin(), file.end() - 100);
  std::string path = (dir / "cut-images-idx3-ubyte").string();
  write_bytes(path, cut);
  REQUIRE_THROWS_WITH(read_idx(path), Catch::Contains(path) && Catch::Contains("truncated") &&
                                          Catch::Contains("7840 bytes") &&
                                          Catch::Contains("7740 bytes"));

  std::vector<uint8_t> longer = file;
  longer.push_back(1);
  write_bytes(path, longer);
  REQUIRE_THROWS_WITH(read_idx(path), Catch::Contains("overlong"));

  // A gzipped file cut in half: zlib reports the early end of the stream.
  std::string gz = (dir / "cut.gz").string();
  write_bytes(gz, file, /*gzip=*/true);
  std::vector<uint8_t> packed = read_bytes(gz);
  packed.resize(packed.size() / 2);
  write_bytes(gz, packed);
  REQUIRE_THROWS_WITH(read_idx(gz), Catch::Contains(gz) && Catch::Contains("truncated"));

  write_bytes(path, {1, 2, 8, 1, 0, 0, 0, 1, 5});
  REQUIRE_THROWS_WITH(read_idx(path), Catch::Contains("magic"));
  write_bytes(path, {0, 0, 0x42, 1, 0, 0, 0, 1, 5});
  REQUIRE_THROWS_WITH(read_idx(path), Catch::Contains("element type"));
  write_bytes(path, {0, 0, 8, 3, 0, 0});
  REQUIRE_THROWS_WITH(read_idx(path), Catch::Contains("truncated IDX header"));
  REQUIRE_THROWS_WITH(read_idx((dir / "missing").string()), Catch::Contains("cannot open"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("idx: MnistDataset from generated files", "[data][idx]") {
  auto dir = temp_dir("mnist");
  std::vector<uint8_t> images = idx_header(0x08, {4, 28, 28}), labels = idx_header(0x08, {4});
  for (int i = 0; i < 4; ++i) {
    images.insert(images.end(), 28 * 28, uint8_t(i * 50));
    labels.push_back(uint8_t(9 - i));
  }
  write_bytes((dir / "t10k-images-idx3-ubyte.gz").string(), images, true);
  write_bytes((dir / "t10k-labels-idx1-ubyte").string(), labels);
  MnistDataset val = load_fashion_mnist(dir.string(), Split::val);
  REQUIRE(val.size() == 4);
  REQUIRE(val.channels() == 1);
  REQUIRE(val.label(2) == 7);
  DecodedImage img = val.load(3, 0);
  REQUIRE(img.pixels.rows == 28);
  REQUIRE(img.pixels.at<uint8_t>(27, 27) == 150);
  REQUIRE_THROWS_WITH(
      load_fashion_mnist(dir.string(), Split::train),
      Catch::Contains("train-images-idx3-ubyte") && Catch::Contains("dataset-fashion-mnist"));
  labels.back() = 10;
  write_bytes((dir / "t10k-labels-idx1-ubyte").string(), labels);
  REQUIRE_THROWS_WITH(load_fashion_mnist(dir.string(), Split::val), Catch::Contains("label 10"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("idx: the Debian package's Fashion-MNIST", "[data][idx]") {
  if (!std::filesystem::exists(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte.gz")) {
    WARN("SKIPPED: Fashion-MNIST not found in " << kFashionMnistDir
                                                << " (apt install dataset-fashion-mnist)");
    return;
  }
  for (auto [split, count] : {std::pair{Split::train, 60000}, std::pair{Split::val, 10000}}) {
    MnistDataset ds = load_fashion_mnist(kFashionMnistDir, split);
    REQUIRE(ds.size() == count);
    REQUIRE(ds.images().shape() == Shape{count, 28, 28});
    std::vector<int64_t> per_class(10, 0);
    for (int64_t i = 0; i < ds.size(); ++i) {
      int64_t y = ds.label(i);
      REQUIRE(y >= 0);
      REQUIRE(y < 10);
      ++per_class[size_t(y)];
    }
    for (int64_t n : per_class) REQUIRE(n == count / 10);  // balanced classes
  }
}
