// libFuzzer target: trainer_state.json (trainer/checkpoint.h). Any input is
// either a state with non-negative counters and a consistent layout, or a
// trainer::Error naming the file.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "trainer/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  trainer::TrainerStateFile file;
  try {
    file = trainer::parse_trainer_state(text, "trainer_state.json");
  } catch (const trainer::Error& e) {
    if (std::string(e.what()).rfind("trainer_state.json: ", 0) != 0) std::abort();
    return 0;
  }
  const trainer::TrainState& s = file.state;
  if (s.step < 0 || s.epoch < 0 || s.position < 0) std::abort();
  if (s.layout.world_size() < 1) std::abort();
  for (trainer::parallel::Dim d : trainer::parallel::kAllDims)
    if (s.layout.mesh[d] < 1) std::abort();
  return 0;
}
