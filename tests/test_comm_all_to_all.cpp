// The all-to-all collectives (comm/collectives.h: all_to_all, all_to_all_v)
// on ranks as threads (tests/thread_world.h), 2, 3 and 4 ranks, through the
// shared-memory channel (staged and read in place) and without it (the
// pairwise exchange over the transport, one step in flight or several).
// Every value encodes its source rank, its destination rank and its index,
// so a block in the wrong place, from the wrong rank or cut short shows as a
// mismatch naming rank, source, index, expected and actual.
#include <random>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "comm/traffic.h"
#include "tests/testing.h"
#include "tests/thread_world.h"

using namespace trainer;
using namespace trainer::testing;
using comm::CollectiveOptions;
using comm::Communicator;

namespace {

// Byte j of the block rank `source` sends to rank `dest`.
uint8_t byte_of(int source, int dest, size_t j) {
  return uint8_t((size_t(source) * 97 + size_t(dest) * 41 + j * 13 + (j >> 8) * 7) % 251);
}

// The ways the collective can run: the channel staged and read in place
// (staged_bytes 0), and without it one pairwise step in flight or several.
struct Way {
  const char* name;
  bool shared_memory;
  CollectiveOptions options;
};
const Way kWays[] = {
    {"shm staged", true, {}},
    {"shm in place", true, {.staged_bytes = 0}},
    {"pairwise", false, {}},
    {"pairwise, one step in flight", false, {.steps_in_flight = 1}},
};

// The first mismatch of output (blocks from each source at offsets[s], bytes[s] long) on rank
// `dest`, or "".
std::string check_blocks(int dest, const std::vector<uint8_t>& output,
                         const std::vector<size_t>& bytes, const std::vector<size_t>& offsets,
                         const std::string& what) {
  for (size_t s = 0; s < bytes.size(); ++s)
    for (size_t j = 0; j < bytes[s]; ++j)
      if (output[offsets[s] + j] != byte_of(int(s), dest, j))
        return cat(what, ": rank ", dest, ", block from rank ", s, ", byte ", j, ": expected ",
                   int(byte_of(int(s), dest, j)), ", actual ", int(output[offsets[s] + j]));
  return "";
}

// Rank `rank`'s input for equal blocks of `block` bytes.
std::vector<uint8_t> equal_input(int rank, int n, size_t block) {
  std::vector<uint8_t> input(block * size_t(n));
  for (int d = 0; d < n; ++d)
    for (size_t j = 0; j < block; ++j) input[size_t(d) * block + j] = byte_of(rank, d, j);
  return input;
}

void require_all_empty(const std::vector<std::string>& failures) {
  for (const std::string& failure : failures) CHECK(failure == "");
}

}  // namespace

TEST_CASE("all_to_all: every block lands in place, 0 bytes to a few MB, every way",
          "[comm][all_to_all]") {
  for (const Way& way : kWays)
    for (int n : {2, 3, 4}) {
      INFO(way.name << ", " << n << " ranks");
      require_all_empty(run_thread_ranks<std::string>(
          n,
          [&](Communicator& world) {
            for (size_t block :
                 {size_t(0), size_t(1), size_t(7), size_t(4099), size_t(65537), size_t(1) << 20}) {
              const std::vector<uint8_t> input = equal_input(world.rank(), n, block);
              std::vector<uint8_t> output(input.size(), 0xee);
              comm::all_to_all(world, input.data(), output.data(), block, way.options);
              std::vector<size_t> bytes(static_cast<size_t>(n), block),
                  offsets(static_cast<size_t>(n));
              for (size_t s = 0; s < size_t(n); ++s) offsets[s] = s * block;
              if (std::string failure =
                      check_blocks(world.rank(), output, bytes, offsets, cat(block, " bytes"));
                  !failure.empty())
                return failure;
            }
            return std::string();
          },
          {.shared_memory = way.shared_memory}));
    }
}

namespace {

// Rank s's element i of the block for rank d, exact in bf16 (an integer
// below 256) when small.
double element_of(int source, int dest, int64_t i, bool small) {
  return small ? double(source * 64 + dest * 16 + int(i % 16))
               : double(source) * 1e6 + double(dest) * 1e4 + double(i);
}

}  // namespace

TEST_CASE("all_to_all: f32, bf16 and i64 tensors, blocks of dim 0", "[comm][all_to_all]") {
  for (bool shared_memory : {true, false})
    for (int n : {2, 3, 4}) {
      INFO(n << " ranks, shared memory " << shared_memory);
      require_all_empty(run_thread_ranks<std::string>(
          n,
          [&](Communicator& world) {
            for (DType dtype : {DType::f32, DType::bf16, DType::i64}) {
              const bool small = dtype == DType::bf16;
              const int64_t k = 3, width = 5;  // [n * k, width]: odd rows of odd width
              std::vector<double> values;
              for (int d = 0; d < n; ++d)
                for (int64_t i = 0; i < k * width; ++i)
                  values.push_back(element_of(world.rank(), d, i, small));
              const Tensor input = from_vector(values, {n * k, width}).to(dtype);
              const Tensor output = comm::all_to_all(world, input);
              if (output.shape() != input.shape() || output.dtype() != dtype)
                return cat("shape ", output.shape_str(), " dtype ", output.dtype());
              const std::vector<double> got = output.to(DType::f64).to_vector<double>();
              for (int s = 0; s < n; ++s)
                for (int64_t i = 0; i < k * width; ++i) {
                  const double want = element_of(s, world.rank(), i, small),
                               actual = got[size_t(s * k * width + i)];
                  if (actual != want)
                    return cat(dtype, ": rank ", world.rank(), ", block from rank ", s,
                               ", element ", i, ": expected ", want, ", actual ", actual);
                }
            }
            return std::string();
          },
          {.shared_memory = shared_memory}));
    }
}

namespace {

// A pattern of row counts: counts[s][d] rows go from rank s to rank d.
using Counts = std::vector<std::vector<int64_t>>;

Counts random_counts(int n, uint32_t seed) {
  std::mt19937 random(seed);
  Counts counts(static_cast<size_t>(n), std::vector<int64_t>(size_t(n)));
  for (auto& row : counts)
    for (int64_t& c : row) c = random() % 3 == 0 ? 0 : int64_t(random() % 40);
  return counts;
}

// The patterns MoE routing produces: random with zeros, a rank that sends
// nothing, a rank that receives nothing, everything to one rank, large blocks.
std::vector<std::pair<std::string, Counts>> count_patterns(int n) {
  std::vector<std::pair<std::string, Counts>> patterns;
  for (uint32_t seed : {1u, 2u, 3u})
    patterns.emplace_back(cat("random ", seed), random_counts(n, seed));
  Counts silent = random_counts(n, 4);
  for (int64_t& c : silent[1]) c = 0;
  patterns.emplace_back("rank 1 sends nothing", silent);
  Counts deaf = random_counts(n, 5);
  for (auto& row : deaf) row[size_t(n - 1)] = 0;
  patterns.emplace_back("the last rank receives nothing", deaf);
  Counts one(static_cast<size_t>(n), std::vector<int64_t>(size_t(n), 0));
  for (auto& row : one) row[0] = 7;
  patterns.emplace_back("everything to rank 0", one);
  Counts large = random_counts(n, 6);
  for (auto& row : large)
    for (int64_t& c : row) c *= 3000;  // up to ~0.5 MB a block, beyond the staging areas
  patterns.emplace_back("large", large);
  return patterns;
}

}  // namespace

TEST_CASE("all_to_all_v: random row counts, silent and deaf ranks, all to one",
          "[comm][all_to_all]") {
  const int64_t width = 3;  // f32 rows of 12 bytes
  for (const Way& way : kWays)
    for (int n : {2, 3, 4}) {
      INFO(way.name << ", " << n << " ranks");
      require_all_empty(run_thread_ranks<std::string>(
          n,
          [&](Communicator& world) {
            const int rank = world.rank();
            for (const auto& [name, counts] : count_patterns(n)) {
              std::vector<double> values;
              for (int d = 0; d < n; ++d)
                for (int64_t i = 0; i < counts[size_t(rank)][size_t(d)] * width; ++i)
                  values.push_back(element_of(rank, d, i, false));
              const Tensor input =
                  from_vector(values, {int64_t(values.size()) / width, width}).to(DType::f32);
              std::vector<int64_t> received;
              const Tensor output =
                  comm::all_to_all_v(world, input, counts[size_t(rank)], &received, way.options);
              int64_t rows = 0;
              for (int s = 0; s < n; ++s) {
                if (received[size_t(s)] != counts[size_t(s)][size_t(rank)])
                  return cat(name, ": rank ", rank, " received count ", received[size_t(s)],
                             " from rank ", s, ", expected ", counts[size_t(s)][size_t(rank)]);
                rows += received[size_t(s)];
              }
              if (output.shape() != Shape{rows, width})
                return cat(name, ": rank ", rank, " got ", output.shape_str(), ", expected [", rows,
                           ", ", width, "]");
              const float* got = output.data<float>();
              int64_t at = 0;
              for (int s = 0; s < n; ++s)
                for (int64_t i = 0; i < received[size_t(s)] * width; ++i, ++at)
                  if (got[at] != float(element_of(s, rank, i, false)))
                    return cat(name, ": rank ", rank, ", rows from rank ", s, ", element ", i,
                               ": expected ", float(element_of(s, rank, i, false)), ", actual ",
                               got[at]);
            }
            return std::string();
          },
          {.shared_memory = way.shared_memory}));
    }
}

TEST_CASE("all_to_all_v: raw buffers at scattered offsets", "[comm][all_to_all]") {
  // Blocks in reverse rank order with gaps between them, on both sides.
  for (bool shared_memory : {true, false}) {
    INFO("shared memory " << shared_memory);
    require_all_empty(run_thread_ranks<std::string>(
        3,
        [&](Communicator& world) {
          const int n = 3, rank = world.rank();
          auto size = [](int s, int d) { return size_t(s * 5 + d * 3 + (s == d ? 0 : 100)); };
          std::vector<size_t> send_bytes(n), send_offsets(n), recv_bytes(n), recv_offsets(n);
          size_t in_at = 9, out_at = 17;
          for (int r = n - 1; r >= 0; --r) {
            send_bytes[size_t(r)] = size(rank, r);
            send_offsets[size_t(r)] = in_at;
            in_at += send_bytes[size_t(r)] + 11;
            recv_bytes[size_t(r)] = size(r, rank);
            recv_offsets[size_t(r)] = out_at;
            out_at += recv_bytes[size_t(r)] + 5;
          }
          std::vector<uint8_t> input(in_at, 0xaa), output(out_at, 0xee);
          for (int d = 0; d < n; ++d)
            for (size_t j = 0; j < send_bytes[size_t(d)]; ++j)
              input[send_offsets[size_t(d)] + j] = byte_of(rank, d, j);
          comm::all_to_all_v(world, input.data(), send_bytes, send_offsets, output.data(),
                             recv_bytes, recv_offsets);
          std::string failure = check_blocks(rank, output, recv_bytes, recv_offsets, "scattered");
          // The gaps are untouched.
          for (size_t j = 0; j < 17 && failure.empty(); ++j)
            if (output[j] != 0xee) failure = cat("rank ", rank, ": byte ", j, " written");
          return failure;
        },
        {.shared_memory = shared_memory}));
  }
}

TEST_CASE("all_to_all_v: mismatched sizes are an Error naming both ranks on every rank",
          "[comm][all_to_all]") {
  for (bool shared_memory : {true, false}) {
    INFO("shared memory " << shared_memory);
    // Rank 0 sends 12 bytes to rank 2, which expects 8 from it; then the
    // channel still works.
    const std::vector<std::string> errors = run_thread_ranks<std::string>(
        3,
        [&](Communicator& world) {
          const int n = 3, rank = world.rank();
          std::vector<size_t> send_bytes(n, 8), recv_bytes(n, 8), offsets(n);
          for (int r = 0; r < n; ++r) offsets[size_t(r)] = size_t(r) * 16;
          if (rank == 0) send_bytes[2] = 12;
          std::vector<uint8_t> input(48), output(48);
          std::string error = error_of([&] {
            comm::all_to_all_v(world, input.data(), send_bytes, offsets, output.data(), recv_bytes,
                               offsets);
          });
          const std::vector<uint8_t> block = equal_input(rank, n, 100);
          std::vector<uint8_t> after(block.size());
          comm::all_to_all(world, block.data(), after.data(), 100);
          std::vector<size_t> bytes(n, 100), at(n);
          for (int r = 0; r < n; ++r) at[size_t(r)] = size_t(r) * 100;
          std::string failure = check_blocks(rank, after, bytes, at, "after the error");
          return failure.empty() ? error : failure;
        },
        {.timeout = comm::Millis(10000), .shared_memory = shared_memory});
    for (const std::string& error : errors)
      CHECK_THAT(error, Catch::Contains("rank 0 sends 12 bytes to rank 2, which expects 8 bytes"));
  }
}

TEST_CASE("all_to_all_async: runs in issue order with other collectives, traffic counted",
          "[comm][all_to_all]") {
  for (bool shared_memory : {true, false}) {
    INFO("shared memory " << shared_memory);
    const int n = 3;
    const size_t block = 30000;
    const comm::Traffic before = comm::traffic();
    require_all_empty(run_thread_ranks<std::string>(
        n,
        [&](Communicator& world) {
          const int rank = world.rank();
          const std::vector<uint8_t> input = equal_input(rank, n, block);
          std::vector<uint8_t> output(input.size());
          comm::Work exchanged = comm::all_to_all_async(world, input.data(), output.data(), block);
          Tensor sum = full({1000}, double(rank + 1));
          comm::Work reduced = comm::allreduce_async(world, sum);
          const Tensor moved = comm::all_to_all(world, full({n * 2}, double(rank)));
          exchanged.wait();
          reduced.wait();
          std::vector<size_t> bytes(n, block), offsets(n);
          for (size_t s = 0; s < size_t(n); ++s) offsets[s] = s * block;
          if (std::string failure = check_blocks(rank, output, bytes, offsets, "async");
              !failure.empty())
            return failure;
          if (sum.data<float>()[999] != 6.0f)
            return cat("rank ", rank,
                       ": allreduce during all_to_all_async: ", sum.data<float>()[999]);
          for (int64_t i = 0; i < n * 2; ++i)
            if (moved.data<float>()[i] != float(i / 2))
              return cat("rank ", rank, ": all_to_all after async, element ", i, ": ",
                         moved.data<float>()[i]);
          return std::string();
        },
        {.shared_memory = shared_memory}));
    const comm::Traffic d = comm::traffic() - before;
    // Per rank: (n - 1) blocks of the async call, (n - 1) x 2 floats of the tensor call.
    CHECK(d.all_to_all == uint64_t(n) * (uint64_t(n - 1) * block + uint64_t(n - 1) * 8));
    CHECK(d.total() == d.all_to_all + d.allreduce);
  }
}
