// TensorBoard event files and checkpoint directories.
#include <cstring>
#include <filesystem>
#include <map>
#include <vector>

#include "tests/testing.h"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"
#include "trainer/tensorboard.h"

using namespace trainer;
namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& name) { return testing::fresh_temp_dir("test_" + name); }

uint64_t read_varint(const std::string& s, size_t& i) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    uint8_t b = uint8_t(s.at(i++));
    v |= uint64_t(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
}

struct Scalar {
  int64_t step = -1;
  std::string tag;
  float value = 0;
  std::string file_version;
};

// Decodes the Event messages this project writes (see tensorboard.h).
Scalar decode_event(const std::string& e) {
  Scalar out;
  size_t i = 0;
  while (i < e.size()) {
    uint64_t key = read_varint(e, i);
    int field = int(key >> 3), wire = int(key & 7);
    if (wire == 1) {
      i += 8;
    } else if (wire == 0) {
      uint64_t v = read_varint(e, i);
      if (field == 2) out.step = int64_t(v);
    } else if (wire == 2) {
      uint64_t len = read_varint(e, i);
      std::string body = e.substr(i, len);
      i += len;
      if (field == 3) out.file_version = body;
      if (field == 5) {  // Summary -> Value
        size_t j = 0;
        read_varint(body, j);
        uint64_t vlen = read_varint(body, j);
        std::string value = body.substr(j, vlen);
        size_t k = 0;
        while (k < value.size()) {
          uint64_t vk = read_varint(value, k);
          if ((vk >> 3) == 1) {
            uint64_t tl = read_varint(value, k);
            out.tag = value.substr(k, tl);
            k += tl;
          } else {
            std::memcpy(&out.value, value.data() + k, 4);
            k += 4;
          }
        }
      }
    } else {
      FAIL("unexpected wire type " << wire);
    }
  }
  return out;
}

}  // namespace

TEST_CASE("tensorboard: CRC-32C matches the standard check value", "[logs]") {
  REQUIRE(crc32c("123456789", 9) == 0xE3069283u);
  REQUIRE(crc32c("", 0) == 0u);
}

TEST_CASE("tensorboard: records are framed, checksummed and decode to the scalars", "[logs]") {
  fs::path dir = fresh_dir("tb");
  std::string path;
  {
    TensorBoardWriter tb(dir.string());
    tb.add_scalar("train/loss", 0.25, 10);
    tb.add_scalar("val/top1", 91.5, 20);
    path = tb.path();
  }
  REQUIRE(fs::path(path).filename().string().rfind("events.out.tfevents.", 0) == 0);
  std::string bytes = read_file(path);
  std::vector<Scalar> events;
  size_t pos = 0;
  while (pos < bytes.size()) {
    uint64_t len;
    uint32_t len_crc, data_crc;
    std::memcpy(&len, bytes.data() + pos, 8);
    std::memcpy(&len_crc, bytes.data() + pos + 8, 4);
    REQUIRE(len_crc == masked_crc32c(bytes.data() + pos, 8));
    std::string payload = bytes.substr(pos + 12, len);
    std::memcpy(&data_crc, bytes.data() + pos + 12 + len, 4);
    REQUIRE(data_crc == masked_crc32c(payload.data(), payload.size()));
    events.push_back(decode_event(payload));
    pos += 12 + len + 4;
  }
  REQUIRE(events.size() == 3);
  REQUIRE(events[0].file_version == "brain.Event:2");
  REQUIRE(events[1].tag == "train/loss");
  REQUIRE(events[1].step == 10);
  REQUIRE(events[1].value == 0.25f);
  REQUIRE(events[2].tag == "val/top1");
  REQUIRE(events[2].value == 91.5f);
}

TEST_CASE("tensorboard: an integer histogram is a HistogramProto with a bucket per value",
          "[logs]") {
  fs::path dir = fresh_dir("tb_histogram");
  std::string path;
  {
    TensorBoardWriter tb(dir.string(), ".server0");
    tb.add_histogram("staleness/server0", {{1, 5}, {3, 2}}, 42);
    path = tb.path();
  }
  CHECK(path.ends_with(".server0"));
  const std::string bytes = read_file(path);
  // The second record: Event{wall_time, step, summary{value{tag, histo}}}.
  uint64_t first;
  std::memcpy(&first, bytes.data(), 8);
  const size_t at = 12 + first + 4;
  uint64_t len;
  std::memcpy(&len, bytes.data() + at, 8);
  const std::string e = bytes.substr(at + 12, len);
  size_t i = 0;
  std::string summary;
  int64_t step = -1;
  while (i < e.size()) {
    const uint64_t key = read_varint(e, i);
    if ((key & 7) == 1) i += 8;
    if ((key & 7) == 0) step = int64_t(read_varint(e, i));
    if ((key & 7) == 2) {
      const uint64_t n = read_varint(e, i);
      summary = e.substr(i, n);
      i += n;
    }
  }
  CHECK(step == 42);
  // Summary.value (field 1) -> Value: tag (1), histo (5).
  size_t j = 0;
  read_varint(summary, j);  // the key of Summary.value
  const uint64_t value_bytes = read_varint(summary, j);
  const std::string value = summary.substr(j, value_bytes);
  size_t k = 0;
  std::string tag, histo;
  while (k < value.size()) {
    const uint64_t key = read_varint(value, k);
    const uint64_t n = read_varint(value, k);
    ((key >> 3) == 1 ? tag : histo) = value.substr(k, n);
    k += n;
  }
  CHECK(tag == "staleness/server0");
  std::map<int, std::vector<double>> fields;  // field -> its doubles
  for (size_t h = 0; h < histo.size();) {
    const uint64_t key = read_varint(histo, h);
    size_t n = 8;
    if ((key & 7) == 2) n = read_varint(histo, h);
    for (size_t d = 0; d < n; d += 8) {
      double x;
      std::memcpy(&x, histo.data() + h + d, 8);
      fields[int(key >> 3)].push_back(x);
    }
    h += n;
  }
  CHECK(fields[1] == std::vector<double>{1});   // min
  CHECK(fields[2] == std::vector<double>{3});   // max
  CHECK(fields[3] == std::vector<double>{7});   // num
  CHECK(fields[4] == std::vector<double>{11});  // sum: 5 + 6
  CHECK(fields[5] == std::vector<double>{23});  // sum of squares: 5 + 18
  CHECK(fields[6] == std::vector<double>{1.5, 2.5, 3.5});
  CHECK(fields[7] == std::vector<double>{5, 0, 2});
}

TEST_CASE("checkpoint: commit, latest, keep-last-k and best", "[checkpoint]") {
  fs::path root = fresh_dir("ckpt");
  CheckpointDir ckpt(root.string(), 2);
  REQUIRE(!ckpt.latest_complete());
  auto save = [&](int64_t step, bool best) {
    std::string tmp = ckpt.begin(step);
    write_file_atomic(tmp + "/trainer_state.json", "{\"step\": " + std::to_string(step) + "}");
    return ckpt.commit(step, best);
  };
  save(100, true);
  save(200, false);
  save(300, false);
  save(400, false);
  // keep_last=2 keeps 300 and 400, plus the best (100).
  std::vector<std::string> all = ckpt.complete();
  REQUIRE(all.size() == 3);
  REQUIRE(fs::path(all[0]).filename() == "step_00000100");
  REQUIRE(fs::path(*ckpt.latest_complete()).filename() == "step_00000400");
  REQUIRE(!fs::exists(root / "step_00000200"));
}

TEST_CASE("checkpoint: an interrupted write leaves the previous checkpoint findable",
          "[checkpoint]") {
  fs::path root = fresh_dir("ckpt_crash");
  CheckpointDir ckpt(root.string(), 3);
  std::string tmp = ckpt.begin(100);
  write_file_atomic(tmp + "/trainer_state.json", "{}");
  ckpt.commit(100, false);
  // A crash mid-write of step 200: the tmp dir exists, latest still points to 100.
  std::string partial = ckpt.begin(200);
  write_file_atomic(partial + "/model.safetensors", "partial");
  REQUIRE(fs::path(*ckpt.latest_complete()).filename() == "step_00000100");
  // A missing or garbage `latest` falls back to the newest complete directory.
  write_file_atomic((root / "latest").string(), "../../etc\n");
  REQUIRE(fs::path(*ckpt.latest_complete()).filename() == "step_00000100");
  fs::remove(root / "latest");
  REQUIRE(fs::path(*ckpt.latest_complete()).filename() == "step_00000100");
  // A directory without trainer_state.json is not complete.
  fs::create_directories(root / "step_00000300");
  REQUIRE(fs::path(*ckpt.latest_complete()).filename() == "step_00000100");
}

TEST_CASE("checkpoint: a commit leaves the directory of the checkpoint being written",
          "[checkpoint]") {
  fs::path root = fresh_dir("ckpt_overlap");
  // A stale temporary of a crashed write of step 300 goes at the next commit.
  fs::create_directories(root / "step_00000300.tmp");
  std::string second;
  {
    CheckpointDir ckpt(root.string(), 2);
    std::string first = ckpt.begin(100);
    write_file_atomic(first + "/trainer_state.json", "{}");
    // Step 200 is being written while step 100 is committed (in the
    // background while training goes on, trainer/checkpoint_writer.h).
    second = ckpt.begin(200);
    write_file_atomic(second + "/model.safetensors", "being written");
    ckpt.commit(100, false);
    REQUIRE(fs::path(*ckpt.latest_complete()).filename() == "step_00000100");
  }  // waits for the deletion of what the commit pruned
  REQUIRE(fs::is_regular_file(fs::path(second) / "model.safetensors"));
  REQUIRE(!fs::exists(root / "step_00000300.tmp"));
}

#include "trainer/metrics.h"

TEST_CASE("metrics: JSONL records and the progress line", "[logs]") {
  fs::path dir = fresh_dir("metrics");
  {
    MetricsLog log(dir.string());
    log.write("train", 5, {{"loss", 0.5}, {"lr", 0.1}});
    log.write("val", 5, {{"top1", NAN}});
  }
  std::string text = read_file((dir / "metrics.jsonl").string());
  size_t nl = text.find('\n');
  std::string first = text.substr(0, nl);
  REQUIRE(first.find("\"split\":\"train\"") != std::string::npos);
  REQUIRE(first.find("\"step\":5") != std::string::npos);
  REQUIRE(first.find("\"loss\":0.5") != std::string::npos);
  REQUIRE(text.find("\"top1\":null") != std::string::npos);
  REQUIRE(fs::exists(dir / "tb"));

  Progress p{2, 1200, 4800, 0.41234, 0.1, 2950, 180.0};
  std::string line = progress_line(p);
  REQUIRE(line ==
          "epoch 2 step 1200/4800 (25.0%) | loss 0.4123 | lr 0.1 | 2950 samples/s | ETA 3m00s");
  REQUIRE(format_duration(3725) == "1h02m05s");
}
