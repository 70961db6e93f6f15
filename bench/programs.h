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

}  // namespace trainer::bench
