// Run logs: a JSONL file of metrics (one object per line, appended, flushed
// per record so a crash loses nothing) mirrored to TensorBoard, and the
// console progress line.
//
//   MetricsLog log("runs/x");                  // runs/x/metrics.jsonl, runs/x/tb/
//   log.write("train", step, {{"loss", 0.4}, {"lr", 0.1}});
//   std::cout << progress_line(p) << "\n";    // "epoch 2 step 1200/4680 | loss 0.4123 | ..."
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "trainer/tensorboard.h"

namespace trainer {

using Scalars = std::vector<std::pair<std::string, double>>;

class MetricsLog {
 public:
  // tensorboard: also write TensorBoard events under dir/tb.
  explicit MetricsLog(const std::string& dir, bool tensorboard = true);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  // One JSONL record {"split": ..., "step": ..., "time": ..., <scalars>}; TensorBoard tags
  // "<split>/<name>".
  void write(const std::string& split, int64_t step, const Scalars& scalars);

 private:
  std::FILE* jsonl_ = nullptr;
  std::unique_ptr<TensorBoardWriter> tb_;
};

struct Progress {
  int64_t epoch = 0;
  int64_t step = 0;
  int64_t total_steps = 0;
  double loss = 0;
  double lr = 0;
  double samples_per_second = 0;
  double eta_seconds = 0;        // negative: unknown
  const char* unit = "samples";  // of the throughput: samples, or tokens for language models
};

// "epoch 2 step 1200/4680 (25.6%) | loss 0.4123 | lr 0.1 | 2950 samples/s | ETA 3m12s"
std::string progress_line(const Progress& p);
// 3725 s -> "1h02m05s"
std::string format_duration(double seconds);
// 421834 -> "421,834"
std::string with_commas(int64_t value);

// This process's memory so far, in MiB: the peak of its tensors (the CPU
// allocator's peak plus its parts of the regions shared with the host's
// other ranks, which live for the whole run), those shared parts, and the
// peak resident set (VmHWM: the binary, libraries and caches too).
struct MemoryPeaks {
  double tensors_mib = 0, shared_mib = 0, resident_mib = 0;
};
MemoryPeaks memory_peaks();

// The MiB per step this process's collectives and point-to-point sends moved
// (comm::traffic().total(): bus bytes, comm/traffic.h), from one reading to
// the next.
class CommPerStep {
 public:
  explicit CommPerStep(int64_t step);
  // Since the previous reading (or construction), divided by the steps since
  // then; 0 when no step passed (those bytes then count in the next reading).
  double mib(int64_t step);

 private:
  uint64_t bytes_;
  int64_t step_;
};

}  // namespace trainer
