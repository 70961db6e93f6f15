// The rank program of the multi-process comm tests (tests/test_comm_mp.cpp),
// started by `trainer launch` or forked by the test with torchrun-style
// variables. Each scenario checks results against closed forms and prints
// mismatches with rank, index, expected and actual; the exit code tells the test.
//
//   comm_worker collectives            every collective, dtype, op and algorithm; exit 0
//   comm_worker kill VICTIM TIMEOUT_MS [ALGORITHM]
//                                      the victim SIGKILLs itself mid-run; the others must
//                                      get an Error within the timeout and exit 3; ALGORITHM:
//                                      ring (default) or another by name (tree, butterfly, ...),
//                                      shm-staged, shm-pipelined, shm-direct, shm-in-place
//   comm_worker hang VICTIM TIMEOUT_MS [ALGORITHM]
//                                      the victim stops taking part (exit 5 later); likewise
//   comm_worker fail RANK CODE         RANK exits with CODE at once, the others idle for a minute
//   comm_worker algorithms [full] [no-shm]
//                                      every allreduce algorithm by name
//                                      (tests/comm_worker_algorithms.cpp)
//   comm_worker p2p [no-shm] | p2p-kill VICTIM
//                                      point-to-point messages (tests/comm_worker_p2p.cpp);
//                                      no-shm: CommOptions::shared_memory = false
//   comm_worker traffic [no-shm]       the traffic counters of every collective
//                                      (tests/comm_worker_traffic.cpp)
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "comm/collectives.h"
#include "comm/shm_channel.h"

#include "tests/comm_worker.h"

using namespace trainer;
using namespace trainer::comm;
using namespace trainer::comm_test;

namespace {

template <class T>
void check_allreduce(Communicator& comm, size_t count, const AllreduceOptions& o) {
  std::vector<T> data = make_input<T>(comm.rank(), count);
  allreduce(comm, data.data(), count, dtype_of<T>(), o);
  expect(
      cat("allreduce ", dtype_of<T>(), " ", reduce_op_name(o.op), " ", algorithm_name(o.algorithm),
          " count ", count, " segment ", o.segment_bytes, " staged ", o.staged_bytes, " (",
          comm.size(), " ranks)"),
      data, [&](size_t i) { return expected_reduction(o.op, comm.size(), i); }, dtype_of<T>());
}

// The shared-memory allreduce's three ways: staged (counts under the
// default staged_bytes), pipelined through the segment and direct by
// cross-memory attach (both with staged_bytes 0).
std::vector<AllreduceOptions> shm_variants(ReduceOp op) {
  return {
      {.op = op, .algorithm = AllreduceAlgorithm::shm},
      {.op = op, .algorithm = AllreduceAlgorithm::shm, .staged_bytes = 0},
      {.op = op, .algorithm = AllreduceAlgorithm::shm, .staged_bytes = 0, .cross_memory = true}};
}

// Every algorithm on odd counts, and the large shm ways on a count that spans
// several of their blocks (pipelined) and pieces (direct).
template <class T>
void check_all_allreduces(Communicator& comm) {
  const int n = comm.size();
  for (size_t count : {size_t(0), size_t(1), size_t(n * 3 + 1), size_t(1000), size_t(4099)})
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      for (AllreduceAlgorithm a : {AllreduceAlgorithm::automatic, AllreduceAlgorithm::ring})
        for (size_t segment : {size_t(64), size_t(1) << 20})
          check_allreduce<T>(comm, count, {.op = op, .algorithm = a, .segment_bytes = segment});
      check_allreduce<T>(comm, count,
                         {.op = op, .algorithm = AllreduceAlgorithm::recursive_doubling});
      for (const AllreduceOptions& o : shm_variants(op)) check_allreduce<T>(comm, count, o);
    }
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
    std::vector<AllreduceOptions> large = shm_variants(op);
    // At least three staging blocks for every dtype (the areas are reused).
    const size_t count = ShmChannel::kStagingBytes * 5 / 4 + 11;
    for (size_t v = 1; v < large.size(); ++v) check_allreduce<T>(comm, count, large[v]);
  }
  // Above kWholeAreaMaxBytes the pipelined way moves quarter-area blocks
  // (on up to 4 ranks: 8 would hold 0.5 GB).
  if constexpr (std::is_same_v<T, float>)
    if (comm.size() <= 4)
      check_allreduce<T>(comm, ShmChannel::kWholeAreaMaxBytes / sizeof(float) + 12345,
                         shm_variants(ReduceOp::avg)[1]);
}

// The in-place allreduce: buffers at the same (odd) offset of a shared
// region on every rank, sizes around the piece size and the chunk split, and
// after it an ordinary buffer (the region must not leak into other
// operations). Then one rank places its buffer elsewhere: every rank must get
// an Error naming the placements, and the channel must go on working.
template <class T>
void check_in_place_allreduces(Communicator& comm) {
  const int n = comm.size();
  const size_t max_count = (size_t(1) << 20) / sizeof(T) * 3 + 7;
  std::shared_ptr<ShmRegion> region = comm.share_memory((max_count + 64) * sizeof(T));
  ++g_checks;
  if ((region != nullptr) != (n > 1)) {
    std::printf("rank %d: share_memory on %d ranks returned %s\n", g_rank, n,
                region ? "a region" : "null");
    ++g_failures;
  }
  if (!region) return;
  T* buffer = reinterpret_cast<T*>(region->local()) + 3;
  for (size_t count : {size_t(n * 3 + 1), size_t(70001), max_count})
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      const std::vector<T> input = make_input<T>(comm.rank(), count);
      std::copy(input.begin(), input.end(), buffer);
      allreduce(comm, buffer, count, dtype_of<T>(), {.op = op, .staged_bytes = 0});
      expect(
          cat("in-place allreduce ", dtype_of<T>(), " ", reduce_op_name(op), " count ", count, " (",
              n, " ranks)"),
          std::vector<T>(buffer, buffer + count),
          [&](size_t i) { return expected_reduction(op, n, i); }, dtype_of<T>());
      check_allreduce<T>(comm, count, {.op = op, .staged_bytes = 0});
    }
  if constexpr (std::is_same_v<T, float>) {
    std::vector<T> elsewhere = make_input<T>(comm.rank(), 5000);
    T* data = comm.rank() == n - 1 ? elsewhere.data() : buffer;
    expect_error(cat("allreduce with rank ", n - 1, "'s buffer outside the region"),
                 "every rank must place the buffer alike",
                 [&] { allreduce(comm, data, 5000, DType::f32, {.staged_bytes = 0}); });
    check_allreduce<T>(comm, 5000, {.op = ReduceOp::sum, .staged_bytes = 0});
  }
}

// The shared-memory ways reduce in rank order, so every rank ends with the
// same bits even where the order shows: NaN payloads (x86 keeps the first
// operand's) and max against a NaN. Each rank's result is hashed and the
// hashes are gathered; with 2 ranks this is the pair way, which lets both
// ranks compute every element.
void check_same_bits_everywhere(Communicator& comm) {
  const int n = comm.size();
  for (size_t count : {size_t(1000), ShmChannel::kStagingBytes * 5 / 4 + 11})
    for (const AllreduceOptions& o : shm_variants(ReduceOp::sum))
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
        std::vector<uint32_t> bits(count);
        for (size_t i = 0; i < count; ++i)
          bits[i] = i % 3 == 0 ? 0x7fc00000u + uint32_t(comm.rank() + 1) + uint32_t(i % 101) * 8
                               : std::bit_cast<uint32_t>(float(comm.rank() * 3 + int(i % 5)));
        AllreduceOptions options = o;
        options.op = op;
        allreduce(comm, bits.data(), count, DType::f32, options);
        uint64_t hash = 1469598103934665603ull;
        for (uint32_t b : bits) hash = (hash ^ b) * 1099511628211ull;
        std::vector<uint64_t> hashes(static_cast<size_t>(n), 0);
        allgather(comm, &hash, hashes.data(), sizeof hash, {});
        ++g_checks;
        for (int r = 0; r < n; ++r)
          if (hashes[size_t(r)] != hash) {
            std::printf(
                "rank %d: shm allreduce %s count %zu staged %zu cross-memory %d: rank %d "
                "ended with other bits (%d ranks)\n",
                g_rank, std::string(reduce_op_name(op)).c_str(), count, o.staged_bytes,
                int(o.cross_memory), r, n);
            ++g_failures;
            break;
          }
      }
}

void check_reduce_scatter(Communicator& comm, size_t count);

// reduce_scatter and allgather in place in a shared region
// (CollectiveOptions::shared_region): the input, resp. output, at an odd
// offset of the region, the output of reduce_scatter elsewhere and inside the
// input, the input of allgather elsewhere and inside the output; then buffers
// in no region must be an Error on every rank, after which the channel works;
// and allgather with its input in the region and its output outside.
void check_shared_region_scatter_gather(Communicator& comm) {
  const int n = comm.size();
  const size_t count = 70001, offset = 5;
  std::shared_ptr<ShmRegion> region = comm.share_memory((count * size_t(n) + offset) * 4);
  if (!region) return;  // one rank: the ring's own tests cover it
  float* flat = reinterpret_cast<float*>(region->local()) + offset;
  const CollectiveOptions shared{.op = ReduceOp::avg, .shared_region = true};
  auto average = [&](size_t first) {
    return [&, first](size_t i) { return expected_reduction(ReduceOp::avg, n, first + i); };
  };
  for (bool output_inside : {false, true}) {
    const std::vector<float> input = make_input<float>(comm.rank(), count * size_t(n));
    std::copy(input.begin(), input.end(), flat);
    std::vector<float> elsewhere(count);
    float* out = output_inside ? flat + size_t(comm.rank()) * count : elsewhere.data();
    reduce_scatter(comm, flat, out, count, DType::f32, shared);
    expect(cat("reduce_scatter in place, output ", output_inside ? "inside" : "outside",
               " the input (", n, " ranks)"),
           std::vector<float>(out, out + count), average(size_t(comm.rank()) * count), DType::f32);
  }
  for (bool input_inside : {false, true}) {
    std::fill(flat, flat + count * size_t(n), -1.0f);
    std::vector<float> mine(count);
    for (size_t i = 0; i < count; ++i) mine[i] = float(comm.rank() * 1000 + int(i % 997));
    float* in = input_inside ? flat + size_t(comm.rank()) * count : mine.data();
    if (input_inside) std::copy(mine.begin(), mine.end(), in);
    allgather(comm, in, flat, count * sizeof(float), shared);
    expect(
        cat("allgather in place, input ", input_inside ? "inside" : "outside", " the output (", n,
            " ranks)"),
        std::vector<float>(flat, flat + count * size_t(n)),
        [&](size_t i) { return double(i / count * 1000 + (i % count) % 997); }, DType::f32);
  }
  {
    // The inputs in the region, the output in private memory: each rank
    // reads the others' inputs where they lie. Twice, the input changed in
    // between (nobody may still be reading the first).
    for (int round = 0; round < 2; ++round) {
      float* in = flat + 3;  // the same odd offset on every rank
      for (size_t i = 0; i < count; ++i) in[i] = float(comm.rank() * 1000 + int(i % 997) + round);
      std::vector<float> gathered(count * size_t(n), -1.0f);
      allgather(comm, in, gathered.data(), count * sizeof(float), shared);
      expect(
          cat("allgather reading the inputs in place, round ", round, " (", n, " ranks)"), gathered,
          [&](size_t i) { return double(i / count * 1000 + (i % count) % 997 + size_t(round)); },
          DType::f32);
    }
  }
  std::vector<float> ordinary = make_input<float>(comm.rank(), 3 * size_t(n)), out(3);
  expect_error("a shared_region reduce_scatter outside any region", "lies in no shared region",
               [&] { reduce_scatter(comm, ordinary.data(), out.data(), 3, DType::f32, shared); });
  check_reduce_scatter(comm, 13);
}

void check_reduce_scatter(Communicator& comm, size_t count) {
  const int n = comm.size();
  std::vector<float> input = make_input<float>(comm.rank(), count * size_t(n)), output(count);
  reduce_scatter(comm, input.data(), output.data(), count, DType::f32,
                 {.op = ReduceOp::sum, .segment_bytes = 32});
  size_t first = count * size_t(comm.rank());
  expect(
      cat("reduce_scatter count ", count), output,
      [&](size_t i) { return expected_reduction(ReduceOp::sum, n, first + i); }, DType::f32);
}

void check_allgather(Communicator& comm, size_t count) {
  const int n = comm.size();
  std::vector<float> input(count), output(count * size_t(n));
  for (size_t i = 0; i < count; ++i) input[i] = float(comm.rank() * 1000 + int(i));
  allgather(comm, input.data(), output.data(), count * sizeof(float), {.segment_bytes = 24});
  expect(
      cat("allgather count ", count), output,
      [&](size_t i) { return double(i / count * 1000 + i % count); }, DType::f32);
}

void check_broadcast(Communicator& comm, size_t count, size_t segment_bytes) {
  for (int root = 0; root < comm.size(); ++root) {
    std::vector<float> data(count, -1.0f);
    if (comm.rank() == root)
      for (size_t i = 0; i < count; ++i) data[i] = float(root * 100 + int(i % 50));
    broadcast(comm, data.data(), count * sizeof(float), root, {.segment_bytes = segment_bytes});
    expect(
        cat("broadcast from ", root, " count ", count, " segment ", segment_bytes), data,
        [&](size_t i) { return double(root * 100 + int(i % 50)); }, DType::f32);
  }
}

// Splits into even and odd world ranks, ordered backwards, and reduces in each
// group at once (their tags must not mix).
void check_split(Communicator& world) {
  auto group = world.split(world.rank() % 2, -world.rank());
  const int n = world.size();
  int members = (n + 1 - world.rank() % 2) / 2;
  ++g_checks;
  if (group->size() != members ||
      group->world_rank(0) != (n - 1) - ((n - 1) % 2 != world.rank() % 2)) {
    std::printf("rank %d: split: size %d (expected %d), first member %d\n", g_rank, group->size(),
                members, group->world_rank(0));
    ++g_failures;
  }
  std::vector<float> data = make_input<float>(world.rank(), 37);
  allreduce(*group, data.data(), data.size(), DType::f32,
            {.op = ReduceOp::sum, .segment_bytes = 16});
  double rank_sum = 0;
  for (int r = world.rank() % 2; r < n; r += 2) rank_sum += r + 1;
  expect(
      "allreduce in split group", data,
      [&](size_t i) { return rank_sum + members * double(i % 7); }, DType::f32);
  auto none = world.split(world.rank() == 0 ? 0 : -1, 0);
  ++g_checks;
  if ((world.rank() == 0) != (none != nullptr)) {
    std::printf("rank %d: split with negative color returned %p\n", g_rank,
                static_cast<void*>(none.get()));
    ++g_failures;
  }
}

// Two non-blocking allreduces and a blocking one in flight together.
void check_async(Communicator& comm) {
  std::vector<float> a = make_input<float>(comm.rank(), 5000),
                     b = make_input<float>(comm.rank(), 77);
  Work wa = allreduce_async(comm, a.data(), a.size(), DType::f32,
                            {.algorithm = AllreduceAlgorithm::ring, .segment_bytes = 512});
  Tensor t = from_vector(make_input<float>(comm.rank(), 301));
  Work wt = allreduce_async(comm, t, {.op = ReduceOp::max});
  allreduce(comm, b.data(), b.size(), DType::f32, {});
  wa.wait();
  wt.wait();
  auto sum = [&](size_t i) { return expected_reduction(ReduceOp::sum, comm.size(), i); };
  expect("allreduce_async ring", a, sum, DType::f32);
  expect("allreduce during async", b, sum, DType::f32);
  expect(
      "allreduce_async tensor max", t.to_vector<float>(),
      [&](size_t i) { return expected_reduction(ReduceOp::max, comm.size(), i); }, DType::f32);
  Tensor gathered = allgather(comm, full({2, 3}, double(comm.rank())));
  expect(
      "allgather tensor", gathered.to_vector<float>(), [&](size_t i) { return double(i / 6); },
      DType::f32);
}

// all_to_all on equal blocks (empty, odd, several staging areas' worth)
// and all_to_all_v on sizes that differ per pair, some zero: element i of
// the block from rank s to rank d is s * 1e6 + d * 1e4 + i % 10000.
void check_all_to_all(Communicator& comm) {
  const int n = comm.size(), rank = comm.rank();
  auto value = [](int source, int dest, size_t i) {
    return double(source) * 1e6 + double(dest) * 1e4 + double(i % 10000);
  };
  for (size_t count : {size_t(0), size_t(13), size_t(300001)}) {
    std::vector<float> input(count * size_t(n)), output(count * size_t(n), -1.0f);
    for (size_t i = 0; i < input.size(); ++i)
      input[i] = float(value(rank, int(i / count), i % count));
    all_to_all(comm, input.data(), output.data(), count * sizeof(float));
    expect(
        cat("all_to_all count ", count, " (", n, " ranks)"), output,
        [&](size_t i) { return value(int(i / count), rank, i % count); }, DType::f32);
  }
  // Rank s sends ((s + 2d) % 3) * 1000 + d floats to rank d: zero for some pairs.
  auto count_of = [](int source, int dest) {
    return size_t((source + 2 * dest) % 3) * 1000 + size_t(dest);
  };
  std::vector<size_t> send_bytes, send_offsets, recv_bytes, recv_offsets;
  size_t sent = 0, received = 0;
  for (int r = 0; r < n; ++r) {
    send_offsets.push_back(sent * sizeof(float));
    send_bytes.push_back(count_of(rank, r) * sizeof(float));
    sent += count_of(rank, r);
    recv_offsets.push_back(received * sizeof(float));
    recv_bytes.push_back(count_of(r, rank) * sizeof(float));
    received += count_of(r, rank);
  }
  std::vector<float> input(sent), output(received, -1.0f);
  std::vector<double> expected;
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < count_of(rank, r); ++i)
      input[send_offsets[size_t(r)] / sizeof(float) + i] = float(value(rank, r, i));
    for (size_t i = 0; i < count_of(r, rank); ++i) expected.push_back(value(r, rank, i));
  }
  all_to_all_v(comm, input.data(), send_bytes, send_offsets, output.data(), recv_bytes,
               recv_offsets);
  expect(
      cat("all_to_all_v (", n, " ranks)"), output, [&](size_t i) { return expected[i]; },
      DType::f32);
}

int run_collectives(Communicator& world) {
  check_all_allreduces<float>(world);
  check_all_allreduces<bf16>(world);
  check_all_allreduces<f16>(world);
  check_in_place_allreduces<float>(world);
  check_in_place_allreduces<bf16>(world);
  check_same_bits_everywhere(world);
  check_shared_region_scatter_gather(world);
  for (size_t count : {size_t(1), size_t(13), size_t(300)}) {
    check_reduce_scatter(world, count);
    check_allgather(world, count);
    check_broadcast(world, count, size_t(1) << 20);
    check_broadcast(world, count, 36);
  }
  barrier(world);
  check_split(world);
  check_async(world);
  check_all_to_all(world);
  barrier(world);
  return testing::report_checks();
}

// The victim dies (SIGKILL) or hangs (sleeps through three timeouts) after a
// first allreduce; the others keep reducing and must get an Error. algorithm:
// ring (or another point-to-point one by name: tree, butterfly, ...),
// shm-staged, shm-pipelined, shm-direct or shm-in-place.
int run_victim(Communicator& world, int victim, int timeout_ms, bool hang,
               const std::string& algorithm) {
  const size_t count = 4096;
  std::vector<float> private_data(count, 1.0f);
  // shm-in-place: the buffer lies in a shared region, reduced where it lies.
  std::shared_ptr<ShmRegion> region =
      algorithm == "shm-in-place" ? world.share_memory(count * sizeof(float)) : nullptr;
  float* data = region ? reinterpret_cast<float*>(region->local()) : private_data.data();
  std::fill(data, data + count, 1.0f);
  AllreduceOptions o{
      .algorithm = AllreduceAlgorithm::ring, .segment_bytes = 1024, .timeout = Millis(timeout_ms)};
  if (algorithm.rfind("shm-", 0) != 0) {
    o.algorithm = parse_allreduce_algorithm(algorithm).value_or(AllreduceAlgorithm::ring);
  } else {
    o.algorithm = AllreduceAlgorithm::shm;
    o.staged_bytes = algorithm == "shm-staged" ? count * sizeof(float) : 0;
    o.cross_memory = algorithm == "shm-direct";
  }
  allreduce(world, data, count, DType::f32, o);
  if (world.rank() == victim && !hang) ::raise(SIGKILL);
  if (world.rank() == victim) {
    std::this_thread::sleep_for(Millis(3 * timeout_ms));
    return 5;
  }
  auto start = std::chrono::steady_clock::now();
  try {
    for (int i = 0; i < 1000; ++i) allreduce(world, data, count, DType::f32, o);
  } catch (const Error& e) {
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("rank %d: caught after %.2f s: %s\n", g_rank, seconds, e.what());
    return 3;
  }
  std::printf("rank %d: no error although rank %d %s\n", g_rank, victim, hang ? "hung" : "died");
  return 1;
}

// The failing rank crashes (no cleanup); the others idle until the launcher stops them.
int run_fail(Communicator& world, int failing, int code) {
  if (world.rank() == failing) std::_Exit(code);
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string scenario = argc > 1 ? argv[1] : "collectives";
  try {
    Bootstrap boot = detect_bootstrap();
    g_rank = boot.rank;
    CommOptions options{.timeout = Millis(60000), .connect_timeout = Millis(30000)};
    options.shared_memory = !(argc > 2 && std::string(argv[argc - 1]) == "no-shm");
    auto world = init_world(boot, options);
    if (scenario == "collectives") return run_collectives(*world);
    if (scenario == "p2p") return run_p2p(*world);
    if (scenario == "traffic") return run_traffic(*world, options.shared_memory);
    if (scenario == "algorithms")
      return run_algorithms(*world, argc > 2 && std::string(argv[2]) == "full");
    if (scenario == "p2p-kill" && argc == 3) return run_p2p_victim(*world, std::atoi(argv[2]));
    if ((scenario == "kill" || scenario == "hang") && (argc == 4 || argc == 5))
      return run_victim(*world, std::atoi(argv[2]), std::atoi(argv[3]), scenario == "hang",
                        argc == 5 ? argv[4] : "ring");
    if (scenario == "fail" && argc == 4)
      return run_fail(*world, std::atoi(argv[2]), std::atoi(argv[3]));
    std::fprintf(
        stderr,
        "usage: comm_worker collectives | kill|hang VICTIM TIMEOUT_MS [ALGORITHM] | fail RANK "
        "CODE | algorithms [full] [no-shm] | p2p [no-shm] | p2p-kill VICTIM | traffic "
        "[no-shm]\n");
    return 2;
  } catch (const Error& e) {
    std::printf("rank %d: error: %s\n", g_rank, e.what());
    return 4;
  }
}
