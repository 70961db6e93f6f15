#include "trainer/metrics.h"

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "comm/shm_region.h"
#include "comm/traffic.h"
#include "core/check.h"
#include "core/tensor.h"
#include "data/files.h"

namespace trainer {

MetricsLog::MetricsLog(const std::string& dir, bool tensorboard) {
  data::make_directories(dir, "output_dir");
  std::string path = dir + "/metrics.jsonl";
  jsonl_ = std::fopen(path.c_str(), "a");
  if (!jsonl_) throw Error(cat("cannot open ", path, ": ", std::strerror(errno)));
  if (tensorboard) {
    data::make_directories(dir + "/tb", "the TensorBoard directory (output_dir/tb)");
    tb_ = std::make_unique<TensorBoardWriter>(dir + "/tb");
  }
}

MetricsLog::~MetricsLog() {
  if (jsonl_) std::fclose(jsonl_);
}

void MetricsLog::write(const std::string& split, int64_t step, const Scalars& scalars) {
  using namespace std::chrono;
  nlohmann::ordered_json j;
  j["split"] = split;
  j["step"] = step;
  j["time"] = duration<double>(system_clock::now().time_since_epoch()).count();
  for (const auto& [name, value] : scalars) {
    if (std::isfinite(value))
      j[name] = value;
    else
      j[name] = nullptr;  // JSON has no NaN/inf
    if (tb_) tb_->add_scalar(split + "/" + name, value, step);
  }
  std::string line = j.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), jsonl_);
  std::fflush(jsonl_);
  if (tb_) tb_->flush();
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  int64_t s = int64_t(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm%02llds", (long long)(s / 3600),
                  (long long)(s / 60 % 60), (long long)(s % 60));
  else if (s >= 60)
    std::snprintf(buf, sizeof buf, "%lldm%02llds", (long long)(s / 60), (long long)(s % 60));
  else
    std::snprintf(buf, sizeof buf, "%llds", (long long)s);
  return buf;
}

std::string progress_line(const Progress& p) {
  char buf[256];
  double frac = p.total_steps > 0 ? double(p.step) / double(p.total_steps) : 0.0;
  std::snprintf(buf, sizeof buf,
                "epoch %lld step %lld/%lld (%.1f%%) | loss %.4f | lr %.4g | %.0f %s/s | ETA %s",
                (long long)p.epoch, (long long)p.step, (long long)p.total_steps, 100.0 * frac,
                p.loss, p.lr, p.samples_per_second, p.unit, format_duration(p.eta_seconds).c_str());
  return buf;
}

std::string with_commas(int64_t value) {
  std::string digits = std::to_string(value), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

MemoryPeaks memory_peaks() {
  constexpr double kMiB = 1 << 20;
  const double shared = double(comm::ShmRegion::local_bytes_in_use());
  MemoryPeaks m{.tensors_mib = (double(allocator(Device{}).stats().peak_bytes) + shared) / kMiB,
                .shared_mib = shared / kMiB};
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) m.resident_mib = std::atof(line.c_str() + 6) / 1024;
  return m;
}

CommPerStep::CommPerStep(int64_t step) : bytes_(comm::traffic().total()), step_(step) {}

double CommPerStep::mib(int64_t step) {
  if (step <= step_) return 0;  // the bytes so far go to the next reading
  const uint64_t bytes = comm::traffic().total();
  const double per_step = double(bytes - bytes_) / double(step - step_) / double(1 << 20);
  bytes_ = bytes;
  step_ = step;
  return per_step;
}

}  // namespace trainer
