// Helpers of the hardening tests (tests/test_hardening*.cpp): the trainer
// run as a subprocess on broken recipes, checkpoints and data, and the
// files they break.
#pragma once

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/process.h"
#include "tests/testing.h"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"

namespace trainer::testing::hardening {

namespace fs = std::filesystem;

inline const std::string kRecipes = std::string(TRAINER_SOURCE_DIR) + "/recipes/";

// The MLP on Fashion-MNIST, quick: one thread, a small evaluation.
inline std::vector<std::string> mlp_args(const fs::path& out, std::vector<std::string> extra) {
  std::vector<std::string> a{"train",
                             kRecipes + "fmnist_mlp.yaml",
                             "output_dir=" + out.string(),
                             "training.threads=1",
                             "data.workers=1",
                             "data.val_samples=100"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// The trainer fails cleanly: exit 1 and `error: ` followed by every piece of text.
inline void require_error(const ProcessResult& r, const std::vector<std::string>& texts) {
  INFO(r.output);
  REQUIRE(r.code == 1);
  REQUIRE(r.output.find("error: ") != std::string::npos);
  for (const std::string& t : texts) CHECK(r.output.find(t) != std::string::npos);
  CHECK(r.output.find("terminate called") == std::string::npos);
}

inline void write_text(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

inline void make_fifo(const fs::path& path) {
  fs::remove_all(path);
  REQUIRE(::mkfifo(path.c_str(), 0644) == 0);
}

// A run of 4 steps of the MLP with checkpoints at steps 2 and 4 (made once).
inline fs::path base_run() {
  static const fs::path base = [] {
    fs::path out = fresh_temp_dir("hardening_base", false);
    ProcessResult r = run_trainer(
        mlp_args(out, {"training.steps=4", "training.checkpoint_every=2", "training.log_every=2"}));
    INFO(r.output);
    REQUIRE(r.code == 0);
    return out;
  }();
  return base;
}

// A fresh copy of the base run, to break.
inline fs::path copy_of_base(const std::string& name) {
  fs::path out = fresh_temp_dir("hardening_" + name, false);
  fs::copy(base_run(), out, fs::copy_options::recursive);
  return out;
}

inline fs::path step_dir(const fs::path& run, int64_t step) {
  return run / "checkpoints" / CheckpointDir::step_name(step);
}

inline void edit_state(const fs::path& checkpoint,
                       const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = trainer_state_file(checkpoint.string());
  nlohmann::json j = nlohmann::json::parse(read_file(path));
  edit(j);
  write_file_atomic(path, j.dump(2));
}

inline std::vector<uint8_t> idx_header(uint8_t type, const std::vector<uint32_t>& dims) {
  std::vector<uint8_t> b = {0, 0, type, uint8_t(dims.size())};
  for (uint32_t d : dims)
    for (int shift : {24, 16, 8, 0}) b.push_back(uint8_t(d >> shift));
  return b;
}

inline void write_bytes(const fs::path& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// Fashion-MNIST's four files in dir with images of the given dims, one label each.
inline void write_fmnist(const fs::path& dir, uint32_t n, uint32_t h, uint32_t w) {
  fs::create_directories(dir);
  std::vector<uint8_t> images = idx_header(0x08, {n, h, w});
  images.resize(images.size() + size_t(n) * h * w, 7);
  std::vector<uint8_t> labels = idx_header(0x08, {n});
  labels.resize(labels.size() + n, 1);
  for (const char* split : {"train", "t10k"}) {
    write_bytes(dir / cat(split, "-images-idx3-ubyte"), images);
    write_bytes(dir / cat(split, "-labels-idx1-ubyte"), labels);
  }
}

// The safetensors file rewritten with tensor `name`'s element 3 set to value.
inline void poison(const fs::path& file, const std::string& name, float value) {
  SafetensorsFile f = read_safetensors(file.string());
  std::vector<NamedTensor> tensors;
  for (auto& [n, t] : f.tensors) {
    if (n == name) t.data<float>()[3] = value;
    tensors.push_back({n, t});
  }
  write_safetensors(file.string(), tensors, f.metadata);
}

}  // namespace trainer::testing::hardening
