// Data the benchmarks write for themselves, so they need no dataset on disk.
//
//   bench::write_fake_fashion_mnist(work + "/fmnist", 1024, 32);   // data.root=<work>/fmnist
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

namespace trainer::bench {

// Fashion-MNIST's four IDX files for `train` and `val` images of random
// pixels (28 x 28, labels i % 10), in dir.
inline void write_fake_fashion_mnist(const std::string& dir, int64_t train, int64_t val) {
  std::filesystem::create_directories(dir);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return uint8_t(state >> 56);
  };
  auto be32 = [](std::ofstream& f, uint32_t v) {
    const char b[4] = {char(v >> 24), char(v >> 16), char(v >> 8), char(v)};
    f.write(b, 4);
  };
  for (auto [prefix, n] : {std::pair<const char*, int64_t>{"train", train}, {"t10k", val}}) {
    std::ofstream images(dir + "/" + prefix + "-images-idx3-ubyte", std::ios::binary);
    be32(images, 0x00000803);
    for (uint32_t d : {uint32_t(n), 28u, 28u}) be32(images, d);
    for (int64_t i = 0; i < n * 28 * 28; ++i) images.put(char(next()));
    std::ofstream labels(dir + "/" + prefix + "-labels-idx1-ubyte", std::ios::binary);
    be32(labels, 0x00000801);
    be32(labels, uint32_t(n));
    for (int64_t i = 0; i < n; ++i) labels.put(char(i % 10));
  }
}

}  // namespace trainer::bench
