// safetensors: round trip, and rejection of every truncation and of corrupted headers.
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
