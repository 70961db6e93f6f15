// safetensors: round trip, and rejection of every truncation and of corrupted headers.
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "tests/testing.h"
#include "trainer/safetensors.h"

using namespace trainer;
using namespace trainer::testing;

namespace {
// name inside this process's own directory (created on first use).
std::string file_path(const std::string& name) {
  const std::filesystem::path dir = temp_path("test_safetensors");
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

std::vector<NamedTensor> sample_tensors() {
  Generator gen(11);
  return {{"layer1.0.conv1.weight", rand_tensor({4, 3, 3, 3}, gen)},
          {"bn.num_batches_tracked", from_vector<int64_t>({7}).reshape({})},
          {"half", rand_tensor({5}, gen).to(DType::bf16)},
          {"mask", from_vector<bool>({true, false, true})}};
}
}  // namespace

TEST_CASE("safetensors: round trip keeps names, dtypes, shapes, bytes and metadata",
          "[checkpoint]") {
  std::string path = file_path("round.safetensors");
  std::vector<NamedTensor> in = sample_tensors();
  write_safetensors(path, in, {{"step", "42"}});
  SafetensorsFile f = read_safetensors(path);
  REQUIRE(f.metadata.at("step") == "42");
  REQUIRE(f.tensors.size() == in.size());
  for (const NamedTensor& e : in) {
    const Tensor& t = e.tensor;
    const Tensor& u = f.tensors.at(e.name);
    REQUIRE(u.dtype() == t.dtype());
    REQUIRE(u.shape() == t.shape());
    REQUIRE(std::memcmp(u.data_ptr(), t.contiguous().data_ptr(), t.nbytes()) == 0);
  }
  // The header is 8-byte aligned as the reference writer does.
  std::string bytes = read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  REQUIRE(n % 8 == 0);
}

TEST_CASE("safetensors: every truncation is rejected with a message naming the file",
          "[checkpoint]") {
  std::string path = file_path("trunc.safetensors");
  write_safetensors(path, sample_tensors());
  std::string bytes = read_file(path);
  for (size_t len = 0; len < bytes.size(); ++len) {
    INFO("truncated to " << len << " of " << bytes.size() << " bytes");
    try {
      parse_safetensors(bytes.substr(0, len), "trunc.safetensors");
      FAIL("accepted a truncated file");
    } catch (const Error& e) {
      REQUIRE(std::string(e.what()).find("trunc.safetensors") != std::string::npos);
    }
  }
}

TEST_CASE("safetensors: corrupted bytes never crash", "[checkpoint]") {
  std::string path = file_path("corrupt.safetensors");
  write_safetensors(path, sample_tensors());
  const std::string bytes = read_file(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  int rejected = 0, accepted = 0;
  // Every byte of the length and header flipped to several values: the parse
  // either fails cleanly or yields tensors that validate (e.g. a changed digit
  // in a name). Data bytes are opaque payload and always accepted.
  for (size_t i = 0; i < 8 + header_len; ++i) {
    for (char v : {char(0), char(0xff), '9', '"', '}', '-'}) {
      std::string b = bytes;
      if (b[i] == v) continue;
      b[i] = v;
      try {
        SafetensorsFile f = parse_safetensors(b, "corrupt.safetensors");
        for (const auto& [name, t] : f.tensors) REQUIRE(t.nbytes() <= b.size());
        ++accepted;
      } catch (const Error&) {
        ++rejected;
      }
    }
  }
  REQUIRE(rejected > accepted);
}

TEST_CASE("safetensors: hostile headers are rejected", "[checkpoint]") {
  auto file_with_header = [](const std::string& header, size_t data_bytes) {
    std::string b(8, '\0');
    uint64_t n = header.size();
    std::memcpy(b.data(), &n, 8);
    return b + header + std::string(data_bytes, '\0');
  };
  auto rejects = [](const std::string& b, const std::string& fragment) {
    try {
      parse_safetensors(b, "x.safetensors");
    } catch (const Error& e) {
      INFO(e.what());
      REQUIRE(std::string(e.what()).find(fragment) != std::string::npos);
      return;
    }
    FAIL("accepted: " << fragment);
  };
  rejects(file_with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8),
          "outside");
  rejects(file_with_header(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
          "needs 12");
  rejects(file_with_header(R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8), "dtype");
  rejects(file_with_header(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
          "shape");
  rejects(file_with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           12),
          "overlap");
  rejects(file_with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8),
          "cover");
  rejects(file_with_header(
              R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
          "large");
  rejects(file_with_header("[1,2,3]", 0), "object");
  rejects(file_with_header("{not json", 0), "JSON");
  std::string huge(8, '\xff');
  rejects(huge, "exceeds");
}

TEST_CASE("safetensors: a key given twice or bytes after the header's JSON are refused",
          "[checkpoint]") {
  // The format forbids duplicate keys, and nlohmann::json keeps the last of
  // two: a damaged or hostile file loaded with whichever came last. After
  // the JSON object only spaces may pad the header, and nlohmann::json
  // stops reading at a NUL byte, so anything after one was never looked at.
  auto file_with_header = [](const std::string& header) {
    std::string b(8, '\0');
    uint64_t n = header.size();
    std::memcpy(b.data(), &n, 8);
    return b + header + std::string(8, '\0');  // two F32 or I32
  };
  auto error_for = [](const std::string& bytes) {
    try {
      parse_safetensors(bytes, "x.safetensors");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string a_i32 = R"("a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]})";
  CHECK_NOTHROW(parse_safetensors(file_with_header("{" + a + "}"), "x.safetensors"));
  struct Case {
    std::string header, message;
  };
  const std::vector<Case> cases = {
      // A tensor twice on the same bytes: the data is covered either way.
      {"{" + a + "," + a_i32 + "}", "header: key 'a' is given twice"},
      {R"({"a":{"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]}})",
       "header: key 'dtype' is given twice in 'a'"},
      {R"({"a":{"dtype":"F32","shape":[2],"shape":[1,2],"data_offsets":[0,8]}})",
       "header: key 'shape' is given twice in 'a'"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4],"data_offsets":[0,8]}})",
       "header: key 'data_offsets' is given twice in 'a'"},
      {R"({"__metadata__":{"step":"1"},"__metadata__":{"step":"2"},)" + a + "}",
       "header: key '__metadata__' is given twice"},
      {R"({"__metadata__":{"step":"1","step":"2"},)" + a + "}",
       "header: key 'step' is given twice in '__metadata__'"},
      {"{" + a + "}" + std::string(1, '\0') + "junk",
       "header: 5 bytes after the JSON value, from byte 54 (a NUL byte)"},
      {"{" + a + "}    " + std::string(3, '\0'), "header: 3 bytes after the JSON value"},
      {"{" + a + "} x", "header: not valid JSON"},
      {" {" + a + "}", "header is not a JSON object (it must begin with '{')"},
  };
  for (const Case& c : cases) {
    INFO(c.header);
    CHECK_THAT(error_for(file_with_header(c.header)),
               Catch::Contains("x.safetensors: not a valid safetensors file: " + c.message) &&
                   Catch::Contains("use an earlier checkpoint"));
  }
  // Spaces (and JSON's other whitespace) after the object pad the header:
  // the reference writer pads it to a multiple of 8 bytes.
  for (const std::string& padding : {std::string("   "), std::string(" \n\t\r ")}) {
    SafetensorsFile f = parse_safetensors(file_with_header("{" + a + "}" + padding), "x");
    CHECK(f.tensors.at("a").shape() == Shape{2});
  }
  // The same key in two objects is no duplicate.
  CHECK_NOTHROW(parse_safetensors(file_with_header(R"({"__metadata__":{"dtype":"x"},)" + a + "}"),
                                  "x.safetensors"));
}

TEST_CASE("write_file_atomic: large files go through the aligned buffer byte for byte",
          "[checkpoint]") {
  // From 1 MiB a file is written with O_DIRECT through 32 MiB aligned
  // buffers: pieces of odd sizes straddle their chunks, and the last chunk
  // is padded to 4 KiB and the file cut back. /dev/shm (tmpfs) is a second
  // filesystem (kernels before 6.6 refuse O_DIRECT there: the buffered
  // path then writes the same bytes). A small file is always buffered.
  std::string big(size_t(70) << 20, '\0');
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < big.size(); i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(&big[i], &x, std::min<size_t>(8, big.size() - i));
  }
  const std::string_view all(big);
  const size_t cut1 = 12345, cut2 = (size_t(33) << 20) + 7, end = big.size() - 4093;
  const std::vector<std::string_view> pieces = {all.substr(0, cut1), all.substr(cut1, cut2 - cut1),
                                                all.substr(cut2, end - cut2)};
  std::vector<std::string> dirs = {file_path("")};
  if (std::filesystem::is_directory("/dev/shm")) dirs.push_back("/dev/shm");
  for (const std::string& dir : dirs) {
    INFO("directory " << dir);
    const std::string path = dir + "/write_file_atomic_" + std::to_string(::getpid()) + ".bin";
    write_file_atomic(path, pieces);
    CHECK(std::filesystem::file_size(path) == end);
    CHECK(read_file(path) == big.substr(0, end));
    CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
    // A whole number of chunks and a smaller file over the first.
    write_file_atomic(path, {all.substr(0, size_t(64) << 20)});
    CHECK(read_file(path) == big.substr(0, size_t(64) << 20));
    // Less than a chunk, more than the O_DIRECT threshold.
    write_file_atomic(path, {all.substr(0, cut1), all.substr(cut1, (size_t(3) << 20) + 5)});
    CHECK(read_file(path) == big.substr(0, cut1 + (size_t(3) << 20) + 5));
    write_file_atomic(path, std::string("small"));
    CHECK(read_file(path) == "small");
    // A filesystem that refuses the first O_DIRECT write: the same bytes, buffered.
    ::setenv("TRAINER_FAULT_DIRECT_EINVAL", "1", 1);
    write_file_atomic(path, pieces);
    ::unsetenv("TRAINER_FAULT_DIRECT_EINVAL");
    CHECK(std::filesystem::file_size(path) == end);
    CHECK(read_file(path) == big.substr(0, end));
    CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
    std::filesystem::remove(path);
  }
}
