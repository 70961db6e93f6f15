// Where a tensor's memory lives: Device{kCPU} or Device{kCUDA, index}.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

namespace trainer {

enum class DeviceKind : uint8_t { kCPU = 0, kCUDA = 1 };
constexpr DeviceKind kCPU = DeviceKind::kCPU;
constexpr DeviceKind kCUDA = DeviceKind::kCUDA;
constexpr int kNumDeviceKinds = 2;

struct Device {
  DeviceKind kind = kCPU;
  int index = 0;

  bool is_cpu() const { return kind == kCPU; }
  bool is_cuda() const { return kind == kCUDA; }
  friend bool operator==(const Device&, const Device&) = default;
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
};

inline std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

}  // namespace trainer
