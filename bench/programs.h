// What the benchmarks that run the trainer binary share: where it is, a run
// of it with its output in a log (polled while it runs), the log's end for
// a failure's message, and data written here so no dataset is needed.
//
//   const std::string trainer = bench::self_dir() + "/trainer";
//   if (!bench::run_logged({trainer, "train", ...}, log, [&](pid_t pid) { ... }))
//     std::printf("failed:\n%s", bench::tail_of(log, 8).c_str());
//   bench::write_fake_fashion_mnist(work + "/fmnist", 1024, 32);   // data.root=<work>/fmnist
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace trainer::bench {

// The directory of the running executable (the build directory's top).
inline std::string self_dir() {
  return std::filesystem::read_symlink("/proc/self/exe").parent_path().string();
}

// Runs argv with stdout and stderr into log; calls poll(pid) every 50 ms
// while it runs. True when it exits 0.
inline bool run_logged(const std::vector<std::string>& argv, const std::string& log,
                       const std::function<void(pid_t)>& poll = {}) {
  std::fflush(nullptr);  // or the child writes what this process has buffered
  const pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::freopen(log.c_str(), "w", stdout);
    if (!f || dup2(fileno(stdout), 2) < 0) _exit(127);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  if (pid < 0) return false;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (poll) poll(pid);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// The last lines of a log, indented, for a failure's message.
inline std::string tail_of(const std::string& path, int lines) {
  std::ifstream f(path);
  std::vector<std::string> all;
  for (std::string line; std::getline(f, line);) all.push_back(line);
  std::string out;
  for (size_t i = all.size() > size_t(lines) ? all.size() - size_t(lines) : 0; i < all.size(); ++i)
    out += "    " + all[i] + "\n";
  return out;
}

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

// An ImageFolder of one side x side grey PGM of random pixels per class in
// train/ and val/, so that a model of `classes` classes (ResNet-50's 1000)
// trains on the trainer's image reader: the pixels do not change what a
// step costs.
inline void write_class_images(const std::string& dir, int classes, int side) {
  uint64_t state = 0x9e3779b97f4a7c15ull;
  std::string pixels(size_t(side) * size_t(side), '\0');
  for (const char* split : {"train", "val"})
    for (int c = 0; c < classes; ++c) {
      char name[16];
      std::snprintf(name, sizeof name, "c%04d", c);
      const std::filesystem::path folder = std::filesystem::path(dir) / split / name;
      std::filesystem::create_directories(folder);
      for (char& p : pixels) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        p = char(state >> 56);
      }
      std::ofstream f(folder / "0.pgm", std::ios::binary);
      f << "P5\n" << side << " " << side << "\n255\n" << pixels;
    }
}

// The two large cases of the multi-rank benchmarks, as trainer arguments
// (recipe, then overrides):
//   gpt       recipes/gpt_kjv.yaml at layers x width (n_head = width / 64),
//             context 64, KJV characters, `sequences` per rank; AdamW
//   resnet50  recipes/fmnist_cnn.yaml's SGD on ResNet-50, 1000 classes, 28 x
//             28 images read as 3 channels from images_dir
//             (write_class_images), `images` per rank
struct LargeCase {
  std::string name;
  int layers = 12, width = 768, sequences = 1, images = 4, ranks = 1;
  std::string images_dir;
};
inline std::vector<std::string> large_case_args(const LargeCase& c) {
  const std::string src = TRAINER_SOURCE_DIR;
  if (c.name == "gpt")
    return {src + "/recipes/gpt_kjv.yaml",
            "data.path=" + src + "/datasets/kjv.txt",
            "model.n_layer=" + std::to_string(c.layers),
            "model.d_model=" + std::to_string(c.width),
            "model.n_head=" + std::to_string(std::max(1, c.width / 64)),
            "model.context=64",
            "data.seq_len=64",
            "data.val_windows=4",
            "training.global_batch=" + std::to_string(c.sequences * c.ranks)};
  // fmnist_cnn.yaml's SGD (momentum 0.9, Nesterov), another model and data.
  return {src + "/recipes/fmnist_cnn.yaml",
          "model.name=resnet50",
          "model.num_classes=1000",
          "model.in_channels=3",
          "data.name=image_folder",
          "data.root=" + c.images_dir,
          "data.image_size=28",
          "data.val_samples=8",
          "training.global_batch=" + std::to_string(c.images * c.ranks)};
}

}  // namespace trainer::bench
