// TensorBoard event files, written directly: TFRecord framing (length,
// masked CRC-32C of the length, payload, masked CRC-32C of the payload)
// around hand-encoded Event protocol buffers holding scalar summaries:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; HistogramProto histo = 5; }
//   HistogramProto { double min = 1, max = 2, num = 3, sum = 4, sum_squares = 5;
//                    repeated double bucket_limit = 6 [packed]; repeated double bucket = 7
//                    [packed]; }
// TensorBoard reads files named events.out.tfevents.<time>.<host> in the log dir.
//
//   TensorBoardWriter tb("runs/x/tb");
//   tb.add_scalar("train/loss", 0.53, /*step=*/100);
//   tb.add_histogram("staleness", {{0, 281}, {1, 639}, {2, 280}}, /*step=*/900);
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>

namespace trainer {

class TensorBoardWriter {
 public:
  // suffix: appended to the file name, for several writers of one directory.
  explicit TensorBoardWriter(const std::string& log_dir, const std::string& suffix = "");
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void add_scalar(const std::string& tag, double value, int64_t step);
  // A histogram of integer values (value -> count), one bucket per integer
  // from the smallest to the largest (bucket i holds (limit[i-1], limit[i]],
  // the limits at v + 0.5).
  void add_histogram(const std::string& tag, const std::map<int64_t, int64_t>& counts,
                     int64_t step);
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& payload);
  std::string path_;
  std::FILE* file_ = nullptr;
};

// CRC-32C (Castagnoli), and TFRecord's masking of it.
uint32_t crc32c(const void* data, size_t n);
inline uint32_t masked_crc32c(const void* data, size_t n) {
  uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

}  // namespace trainer
