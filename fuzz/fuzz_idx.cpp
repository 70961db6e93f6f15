// libFuzzer target: IDX files (data/idx.h), plain or gzipped. Any input is
// either a tensor of exactly the announced size or a trainer::Error; the
// reader reads from a file, so each input is written to one first.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "data/idx.h"

namespace {

std::string input_path() {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir ? dir : "/tmp") + "/fuzz_idx." + std::to_string(::getpid());
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = input_path();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  try {
    trainer::Tensor t = trainer::data::read_idx(path);
    if (t.numel() < 0 || t.dim() < 1) std::abort();
  } catch (const trainer::Error&) {
  }
  return 0;
}
