#include "trainer/tensorboard.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/check.h"

namespace trainer {

uint32_t crc32c(const void* data, size_t n) {
  static uint32_t table[256] = {};
  static bool ready = [] {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      table[i] = c;
    }
    return true;
  }();
  (void)ready;
  uint32_t c = ~0u;
  const uint8_t* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return ~c;
}

namespace {

// Protocol-buffer wire format helpers.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(v | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}
void put_fixed(std::string& out, const void* p, size_t n) {
  out.append(static_cast<const char*>(p), n);
}
void put_bytes_field(std::string& out, int field, const std::string& bytes) {
  put_varint(out, uint64_t(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_varint(e, 1 << 3 | 1);  // wall_time: fixed64
  put_fixed(e, &wall_time, 8);
  put_varint(e, 2 << 3 | 0);  // step: varint
  put_varint(e, uint64_t(step));
  return e;
}

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& log_dir, const std::string& suffix) {
  std::filesystem::create_directories(log_dir);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  path_ = cat(log_dir, "/events.out.tfevents.", int64_t(now_seconds()), ".", host, suffix);
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_)
    throw Error(cat("cannot create TensorBoard file ", path_, ": ", std::strerror(errno)));
  std::string e = event_header(now_seconds(), 0);
  put_bytes_field(e, 3, "brain.Event:2");
  write_record(e);
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::add_histogram(const std::string& tag,
                                      const std::map<int64_t, int64_t>& counts, int64_t step) {
  double num = 0, sum = 0, squares = 0;
  std::string limits, buckets;
  const int64_t lo = counts.empty() ? 0 : counts.begin()->first,
                hi = counts.empty() ? 0 : counts.rbegin()->first;
  for (int64_t v = lo; v <= hi; ++v) {
    const auto it = counts.find(v);
    const double n = it == counts.end() ? 0 : double(it->second), limit = double(v) + 0.5;
    num += n;
    sum += n * double(v);
    squares += n * double(v) * double(v);
    put_fixed(limits, &limit, 8);
    put_fixed(buckets, &n, 8);
  }
  std::string histo;
  const double low = double(lo), high = double(hi);
  int field = 1;
  for (const double x : {low, high, num, sum, squares}) {
    put_varint(histo, uint64_t(field++) << 3 | 1);  // fixed64
    put_fixed(histo, &x, 8);
  }
  put_bytes_field(histo, 6, limits);  // packed repeated double
  put_bytes_field(histo, 7, buckets);
  std::string v;
  put_bytes_field(v, 1, tag);
  put_bytes_field(v, 5, histo);
  std::string summary;
  put_bytes_field(summary, 1, v);
  std::string e = event_header(now_seconds(), step);
  put_bytes_field(e, 5, summary);
  write_record(e);
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  std::string v;
  put_bytes_field(v, 1, tag);
  float f = float(value);
  put_varint(v, 2 << 3 | 5);  // simple_value: fixed32
  put_fixed(v, &f, 4);
  std::string summary;
  put_bytes_field(summary, 1, v);
  std::string e = event_header(now_seconds(), step);
  put_bytes_field(e, 5, summary);
  write_record(e);
}

void TensorBoardWriter::write_record(const std::string& payload) {
  uint64_t len = payload.size();
  uint32_t len_crc = masked_crc32c(&len, 8);
  uint32_t data_crc = masked_crc32c(payload.data(), payload.size());
  bool ok = std::fwrite(&len, 8, 1, file_) == 1 && std::fwrite(&len_crc, 4, 1, file_) == 1 &&
            std::fwrite(payload.data(), 1, payload.size(), file_) == payload.size() &&
            std::fwrite(&data_crc, 4, 1, file_) == 1;
  if (!ok) throw Error(cat("cannot write TensorBoard file ", path_, ": ", std::strerror(errno)));
}

void TensorBoardWriter::flush() { std::fflush(file_); }

}  // namespace trainer
