#include "comm/collectives.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/algorithms.h"
#include "comm/alpha_beta.h"
#include "comm/log.h"
#include "comm/traffic.h"

namespace trainer::comm {

namespace {

using Task = std::function<void()>;

Millis timeout_of(const Communicator& comm, Millis timeout) {
  return timeout.count() > 0 ? timeout : comm.options().timeout;
}

void check_reducible(DType dtype, size_t segment_bytes) {
  CHECK(is_floating(dtype)) << "reductions take f32, bf16, f16 or f64, not " << dtype;
  CHECK(segment_bytes > 0) << "segment_bytes must be positive";
}

void check_cpu_contiguous(const Tensor& t, const char* what) {
  CHECK(t.defined() && t.device().is_cpu() && t.is_contiguous())
      << what << " takes a contiguous CPU tensor, got " << (t.defined() ? t.str() : "undefined");
}

// What `automatic` means on a communicator without the shm channel: the
// model's fastest (measured on first use, collectively: every rank gets here
// at the same point of its issue order), or the size rule.
AllreduceAlgorithm automatic_choice(Communicator& comm, size_t bytes, const AllreduceOptions& o,
                                    double* predicted_seconds) {
  if (!o.cost_model || comm.size() == 1)
    return bytes <= o.small_message_bytes ? AllreduceAlgorithm::recursive_doubling
                                          : AllreduceAlgorithm::ring;
  const LinkModel& model = link_model(comm);
  AllreduceAlgorithm choice = choose_allreduce(comm.size(), bytes, o.segment_bytes, model);
  *predicted_seconds = predict_allreduce(choice, comm.size(), bytes, o.segment_bytes, model);
  return choice;
}

// Runs one allreduce over point-to-point messages with the chosen algorithm.
void run_allreduce(OpChannel& ch, AllreduceAlgorithm algorithm, void* data, size_t count,
                   DType dtype, const AllreduceOptions& o) {
  switch (algorithm) {
    case AllreduceAlgorithm::ring:
      return allreduce_ring(ch, data, count, dtype, o.op, o.segment_bytes, o.reducer.get());
    case AllreduceAlgorithm::recursive_doubling:
      return allreduce_recursive_doubling(ch, data, count, dtype, o.op);
    case AllreduceAlgorithm::tree:
      return allreduce_tree(ch, data, count, dtype, o.op, o.segment_bytes);
    case AllreduceAlgorithm::butterfly:
      return allreduce_butterfly(ch, data, count, dtype, o.op);
    case AllreduceAlgorithm::all_to_all:
      return allreduce_all_to_all(ch, data, count, dtype, o.op, o.segment_bytes);
    case AllreduceAlgorithm::master_worker:
      return allreduce_master_worker(ch, data, count, dtype, o.op, o.segment_bytes);
    case AllreduceAlgorithm::round_robin:
      return allreduce_round_robin(ch, data, count, dtype, o.op);
    case AllreduceAlgorithm::automatic:
    case AllreduceAlgorithm::shm:
      break;
  }
  CHECK(false) << "allreduce: no point-to-point algorithm " << algorithm_name(algorithm);
}

// The operation name errors carry: "allreduce(butterfly)".
const char* allreduce_op_name(AllreduceAlgorithm algorithm) {
  switch (algorithm) {
    case AllreduceAlgorithm::ring:
      return "allreduce(ring)";
    case AllreduceAlgorithm::recursive_doubling:
      return "allreduce(recursive doubling)";
    case AllreduceAlgorithm::tree:
      return "allreduce(tree)";
    case AllreduceAlgorithm::butterfly:
      return "allreduce(butterfly)";
    case AllreduceAlgorithm::all_to_all:
      return "allreduce(all-to-all)";
    case AllreduceAlgorithm::master_worker:
      return "allreduce(master-worker)";
    case AllreduceAlgorithm::round_robin:
      return "allreduce(round-robin)";
    case AllreduceAlgorithm::automatic:
    case AllreduceAlgorithm::shm:
      break;
  }
  return "allreduce(shm)";
}

// Each *_task validates, takes the sequence number (so the order of issue is
// the order on the wire) and returns the work, run inline or on the progress thread.
Task allreduce_task(Communicator& comm, void* data, size_t count, DType dtype,
                    const AllreduceOptions& o) {
  check_reducible(dtype, o.segment_bytes);
  const uint32_t seq = comm.next_seq();
  const size_t bytes = count * dtype_size(dtype);
  count_traffic(TrafficKind::allreduce, allreduce_bus_bytes(comm.size(), bytes));
  AllreduceAlgorithm algorithm = o.reducer ? AllreduceAlgorithm::ring : o.algorithm;
  ShmChannel* shm = nullptr;
  uint64_t ticket = 0;
  double predicted_seconds = -1;
  if (algorithm == AllreduceAlgorithm::automatic || algorithm == AllreduceAlgorithm::shm) {
    shm = comm.size() > 1 ? comm.shm() : nullptr;
    if (shm) {
      algorithm = AllreduceAlgorithm::shm;
      ticket = shm->take_ticket();
    } else {
      algorithm = automatic_choice(comm, bytes, o, &predicted_seconds);
    }
  }
  COMM_LOG(LogLevel::debug, "allreduce #", seq, " on communicator ", comm.id(), " (", comm.size(),
           " ranks): ", count, " x ", dtype, ", ", reduce_op_name(o.op), ", ",
           algorithm_name(algorithm),
           predicted_seconds >= 0 ? cat(" (model: ", predicted_seconds * 1e6, " us)") : "");
  Millis timeout = timeout_of(comm, o.timeout);
  return [&comm, data, count, dtype, o, seq, algorithm, shm, ticket, timeout] {
    if (algorithm == AllreduceAlgorithm::shm) {
      allreduce_shm(*shm, ticket, "allreduce(shm)", timeout, data, count, dtype, o.op,
                    o.staged_bytes, o.cross_memory);
      return;
    }
    OpChannel ch(comm, seq, allreduce_op_name(algorithm), timeout);
    run_allreduce(ch, algorithm, data, count, dtype, o);
  };
}

// The shared-memory channel and a ticket on it when o asks for the in-place
// way and the channel exists (the same on every rank); else null.
std::pair<ShmChannel*, uint64_t> shared_region_channel(Communicator& comm,
                                                       const CollectiveOptions& o) {
  ShmChannel* shm = o.shared_region && comm.size() > 1 ? comm.shm() : nullptr;
  return {shm, shm ? shm->take_ticket() : 0};
}

Task reduce_scatter_task(Communicator& comm, const void* input, void* output, size_t count,
                         DType dtype, const CollectiveOptions& o) {
  check_reducible(dtype, o.segment_bytes);
  const uint32_t seq = comm.next_seq();
  count_traffic(
      TrafficKind::reduce_scatter,
      scatter_gather_bus_bytes(comm.size(), uint64_t(comm.size()) * count * dtype_size(dtype)));
  const auto [shm, ticket] = shared_region_channel(comm, o);
  COMM_LOG(LogLevel::debug, "reduce_scatter #", seq, " on communicator ", comm.id(), ": ", count,
           " x ", dtype, " per rank, ", reduce_op_name(o.op), shm ? ", shm in place" : ", ring");
  Millis timeout = timeout_of(comm, o.timeout);
  if (shm)
    return [shm, ticket, input, output, count, dtype, o, timeout] {
      reduce_scatter_shm(*shm, ticket, timeout, input, output, count, dtype, o.op);
    };
  return [&comm, input, output, count, dtype, o, seq, timeout] {
    const size_t bytes = count * dtype_size(dtype);
    // Uninitialised: the copy of the input fills it (the ring's own scratch is thread_scratch).
    std::unique_ptr<char[]> work(new char[bytes * size_t(comm.size())]);
    std::memcpy(work.get(), input, bytes * size_t(comm.size()));
    OpChannel ch(comm, seq, "reduce_scatter(ring)", timeout);
    reduce_scatter_ring(ch, work.get(), count, dtype, o.op, o.segment_bytes);
    std::memcpy(output, work.get() + bytes * size_t(comm.rank()), bytes);
  };
}

Task allgather_task(Communicator& comm, const void* input, void* output, size_t bytes,
                    const CollectiveOptions& o) {
  CHECK(o.segment_bytes > 0) << "segment_bytes must be positive";
  const uint32_t seq = comm.next_seq();
  count_traffic(TrafficKind::allgather,
                scatter_gather_bus_bytes(comm.size(), uint64_t(comm.size()) * bytes));
  const auto [shm, ticket] = shared_region_channel(comm, o);
  COMM_LOG(LogLevel::debug, "allgather #", seq, " on communicator ", comm.id(), ": ", bytes,
           " bytes per rank", shm ? ", shm in place" : ", ring");
  Millis timeout = timeout_of(comm, o.timeout);
  if (shm)
    return [shm, ticket, input, output, bytes, timeout] {
      all_gather_shm(*shm, ticket, timeout, input, output, bytes);
    };
  return [&comm, input, output, bytes, o, seq, timeout] {
    std::memmove(static_cast<char*>(output) + bytes * size_t(comm.rank()), input, bytes);
    OpChannel ch(comm, seq, "allgather(ring)", timeout);
    all_gather_ring(ch, output, bytes, o.segment_bytes);
  };
}

Task broadcast_task(Communicator& comm, void* data, size_t bytes, int root,
                    const CollectiveOptions& o) {
  CHECK(root >= 0 && root < comm.size()) << "broadcast root " << root << " of " << comm.size();
  CHECK(o.segment_bytes > 0) << "segment_bytes must be positive";
  const uint32_t seq = comm.next_seq();
  count_traffic(TrafficKind::broadcast, comm.size() > 1 ? bytes : 0);
  COMM_LOG(LogLevel::debug, "broadcast #", seq, " on communicator ", comm.id(), ": ", bytes,
           " bytes from ", root, ", binomial tree");
  Millis timeout = timeout_of(comm, o.timeout);
  return [&comm, data, bytes, root, o, seq, timeout] {
    OpChannel ch(comm, seq, "broadcast(binomial)", timeout);
    broadcast_binomial(ch, data, bytes, root, o.segment_bytes);
  };
}

// The world rank of each rank of comm, for the messages of errors.
std::vector<int> world_ranks_of(const Communicator& comm) {
  std::vector<int> world(size_t(comm.size()));
  for (int r = 0; r < comm.size(); ++r) world[size_t(r)] = comm.world_rank(r);
  return world;
}

// The bytes [first, last) that a layout's non-empty blocks span in their buffer.
std::pair<size_t, size_t> span_of(const BlockLayout& layout) {
  size_t first = SIZE_MAX, last = 0;
  for (size_t r = 0; r < layout.bytes.size(); ++r)
    if (layout.bytes[r] > 0) {
      first = std::min(first, layout.offsets[r]);
      last = std::max(last, layout.offsets[r] + layout.bytes[r]);
    }
  return {first, last};
}

// A layout of n blocks of `bytes` each, back to back.
BlockLayout equal_blocks(int n, size_t bytes) {
  BlockLayout layout{std::vector<size_t>(size_t(n), bytes), std::vector<size_t>(size_t(n))};
  for (size_t r = 0; r < size_t(n); ++r) layout.offsets[r] = r * bytes;
  return layout;
}

// verify_sizes: the pairwise way exchanges every rank's sizes before the
// data (all_to_all_v's raw form; the shared-memory way always checks them).
Task all_to_all_task(Communicator& comm, const void* input, BlockLayout send, void* output,
                     BlockLayout receive, bool verify_sizes, const CollectiveOptions& o) {
  const int n = comm.size();
  const char* op = verify_sizes ? "all_to_all_v" : "all_to_all";
  for (const auto* sizes : {&send.bytes, &send.offsets, &receive.bytes, &receive.offsets})
    CHECK(sizes->size() == size_t(n)) << op << ": a size or offset list has " << sizes->size()
                                      << " entries for " << n << " ranks";
  const auto [in_first, in_last] = span_of(send);
  const auto [out_first, out_last] = span_of(receive);
  const char* in = static_cast<const char*>(input);
  const char* out = static_cast<const char*>(output);
  CHECK(in_first >= in_last || out_first >= out_last || in + in_last <= out + out_first ||
        out + out_last <= in + in_first)
      << op << ": the input and the output overlap";
  const uint32_t seq = comm.next_seq();
  uint64_t to_others = 0;
  for (int r = 0; r < n; ++r)
    if (r != comm.rank()) to_others += send.bytes[size_t(r)];
  count_traffic(TrafficKind::all_to_all, to_others);
  ShmChannel* shm = n > 1 ? comm.shm() : nullptr;
  const uint64_t ticket = shm ? shm->take_ticket() : 0;
  COMM_LOG(LogLevel::debug, op, " #", seq, " on communicator ", comm.id(), " (", n,
           " ranks): ", to_others, " bytes to the other ranks, ", shm ? "shm" : "pairwise");
  const Millis timeout = timeout_of(comm, o.timeout);
  std::vector<int> world = world_ranks_of(comm);
  if (shm)
    return [shm, ticket, timeout, input, send = std::move(send), output,
            receive = std::move(receive), staged = o.staged_bytes, world = std::move(world)] {
      all_to_all_shm(*shm, ticket, timeout, input, send, output, receive, staged, world);
    };
  return [&comm, seq, timeout, input, send = std::move(send), output, receive = std::move(receive),
          in_flight = o.steps_in_flight, verify_sizes, world = std::move(world)] {
    OpChannel ch(comm, seq, verify_sizes ? "all_to_all_v(pairwise)" : "all_to_all(pairwise)",
                 timeout);
    all_to_all_pairwise(ch, input, send, output, receive, in_flight, verify_sizes, world);
  };
}

// Moves the task into the progress thread together with what must stay alive.
Work enqueue_keeping(Communicator& comm, Task task, const Tensor& keep) {
  return comm.enqueue([task = std::move(task), keep] { task(); });
}

}  // namespace

std::string_view algorithm_name(AllreduceAlgorithm algorithm) {
  switch (algorithm) {
    case AllreduceAlgorithm::automatic:
      return "automatic";
    case AllreduceAlgorithm::ring:
      return "ring";
    case AllreduceAlgorithm::recursive_doubling:
      return "recursive doubling";
    case AllreduceAlgorithm::shm:
      return "shm";
    case AllreduceAlgorithm::tree:
      return "tree";
    case AllreduceAlgorithm::butterfly:
      return "butterfly";
    case AllreduceAlgorithm::all_to_all:
      return "all-to-all";
    case AllreduceAlgorithm::master_worker:
      return "master-worker";
    case AllreduceAlgorithm::round_robin:
      return "round-robin";
  }
  return "?";
}

namespace {
constexpr std::pair<AllreduceAlgorithm, std::string_view> kAlgorithmKeys[] = {
    {AllreduceAlgorithm::automatic, "auto"},
    {AllreduceAlgorithm::ring, "ring"},
    {AllreduceAlgorithm::recursive_doubling, "recursive_doubling"},
    {AllreduceAlgorithm::tree, "tree"},
    {AllreduceAlgorithm::butterfly, "butterfly"},
    {AllreduceAlgorithm::all_to_all, "all_to_all"},
    {AllreduceAlgorithm::master_worker, "master_worker"},
    {AllreduceAlgorithm::round_robin, "round_robin"},
    {AllreduceAlgorithm::shm, "shm"},
};
}  // namespace

std::string_view algorithm_key(AllreduceAlgorithm algorithm) {
  for (const auto& [a, key] : kAlgorithmKeys)
    if (a == algorithm) return key;
  return "?";
}

std::optional<AllreduceAlgorithm> parse_allreduce_algorithm(std::string_view key) {
  std::string name(key);
  std::replace(name.begin(), name.end(), '-', '_');
  if (name == "automatic") name = "auto";
  for (const auto& [a, k] : kAlgorithmKeys)
    if (k == name) return a;
  return std::nullopt;
}

void allreduce(Communicator& comm, void* data, size_t count, DType dtype,
               const AllreduceOptions& options) {
  allreduce_task(comm, data, count, dtype, options)();
}
void reduce_scatter(Communicator& comm, const void* input, void* output, size_t count, DType dtype,
                    const CollectiveOptions& options) {
  reduce_scatter_task(comm, input, output, count, dtype, options)();
}
void allgather(Communicator& comm, const void* input, void* output, size_t bytes,
               const CollectiveOptions& options) {
  allgather_task(comm, input, output, bytes, options)();
}
void broadcast(Communicator& comm, void* data, size_t bytes, int root,
               const CollectiveOptions& options) {
  broadcast_task(comm, data, bytes, root, options)();
}
void barrier(Communicator& comm, const CollectiveOptions& options) {
  OpChannel ch(comm, comm.next_seq(), "barrier", timeout_of(comm, options.timeout));
  barrier_dissemination(ch);
}

void all_to_all(Communicator& comm, const void* input, void* output, size_t bytes,
                const CollectiveOptions& options) {
  all_to_all_task(comm, input, equal_blocks(comm.size(), bytes), output,
                  equal_blocks(comm.size(), bytes), false, options)();
}
void all_to_all_v(Communicator& comm, const void* input, const std::vector<size_t>& send_bytes,
                  const std::vector<size_t>& send_offsets, void* output,
                  const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                  const CollectiveOptions& options) {
  all_to_all_task(comm, input, {send_bytes, send_offsets}, output, {recv_bytes, recv_offsets}, true,
                  options)();
}

Work allreduce_async(Communicator& comm, void* data, size_t count, DType dtype,
                     const AllreduceOptions& options) {
  return comm.enqueue(allreduce_task(comm, data, count, dtype, options));
}
Work reduce_scatter_async(Communicator& comm, const void* input, void* output, size_t count,
                          DType dtype, const CollectiveOptions& options) {
  return comm.enqueue(reduce_scatter_task(comm, input, output, count, dtype, options));
}
Work allgather_async(Communicator& comm, const void* input, void* output, size_t bytes,
                     const CollectiveOptions& options) {
  return comm.enqueue(allgather_task(comm, input, output, bytes, options));
}
Work broadcast_async(Communicator& comm, void* data, size_t bytes, int root,
                     const CollectiveOptions& options) {
  return comm.enqueue(broadcast_task(comm, data, bytes, root, options));
}

Work all_to_all_async(Communicator& comm, const void* input, void* output, size_t bytes,
                      const CollectiveOptions& options) {
  return comm.enqueue(all_to_all_task(comm, input, equal_blocks(comm.size(), bytes), output,
                                      equal_blocks(comm.size(), bytes), false, options));
}

void allreduce(Communicator& comm, const Tensor& t, const AllreduceOptions& options) {
  check_cpu_contiguous(t, "allreduce");
  allreduce(comm, t.data_ptr(), size_t(t.numel()), t.dtype(), options);
}

Work allreduce_async(Communicator& comm, const Tensor& t, const AllreduceOptions& options) {
  check_cpu_contiguous(t, "allreduce_async");
  return enqueue_keeping(
      comm, allreduce_task(comm, t.data_ptr(), size_t(t.numel()), t.dtype(), options), t);
}

Tensor reduce_scatter(Communicator& comm, const Tensor& input, const CollectiveOptions& options) {
  check_cpu_contiguous(input, "reduce_scatter");
  CHECK(input.dim() >= 1 && input.size(0) % comm.size() == 0)
      << "reduce_scatter: dim 0 of " << input.shape_str() << " is not a multiple of "
      << comm.size();
  Shape shape = input.shape();
  shape[0] /= comm.size();
  Tensor out = empty(shape, input.dtype());
  reduce_scatter(comm, input.data_ptr(), out.data_ptr(), size_t(out.numel()), input.dtype(),
                 options);
  return out;
}

Tensor allgather(Communicator& comm, const Tensor& input, const CollectiveOptions& options) {
  check_cpu_contiguous(input, "allgather");
  CHECK(input.dim() >= 1) << "allgather takes a tensor of at least one dim";
  Shape shape = input.shape();
  shape[0] *= comm.size();
  Tensor out = empty(shape, input.dtype());
  allgather(comm, input.data_ptr(), out.data_ptr(), input.nbytes(), options);
  return out;
}

void broadcast(Communicator& comm, const Tensor& t, int root, const CollectiveOptions& options) {
  check_cpu_contiguous(t, "broadcast");
  broadcast(comm, t.data_ptr(), t.nbytes(), root, options);
}

Tensor all_to_all(Communicator& comm, const Tensor& input, const CollectiveOptions& options) {
  check_cpu_contiguous(input, "all_to_all");
  CHECK(input.dim() >= 1 && input.size(0) % comm.size() == 0)
      << "all_to_all: dim 0 of " << input.shape_str() << " is not a multiple of " << comm.size();
  Tensor out = empty(input.shape(), input.dtype());
  all_to_all(comm, input.data_ptr(), out.data_ptr(), input.nbytes() / size_t(comm.size()), options);
  return out;
}

Tensor all_to_all_v(Communicator& comm, const Tensor& input,
                    const std::vector<int64_t>& send_counts, std::vector<int64_t>* recv_counts,
                    const CollectiveOptions& options) {
  check_cpu_contiguous(input, "all_to_all_v");
  const int n = comm.size();
  CHECK(input.dim() >= 1) << "all_to_all_v takes a tensor of at least one dim";
  CHECK(send_counts.size() == size_t(n))
      << "all_to_all_v: " << send_counts.size() << " send counts for " << n << " ranks";
  int64_t rows = 0;
  for (int64_t count : send_counts) {
    CHECK(count >= 0) << "all_to_all_v: a negative send count, " << count;
    rows += count;
  }
  CHECK(rows == input.size(0)) << "all_to_all_v: the send counts add up to " << rows
                               << " rows, the input " << input.shape_str() << " has "
                               << input.size(0);
  std::vector<int64_t> received(static_cast<size_t>(n));
  all_to_all(comm, send_counts.data(), received.data(), sizeof(int64_t), options);
  Shape shape = input.shape();
  size_t row_bytes = dtype_size(input.dtype());
  for (size_t d = 1; d < shape.size(); ++d) row_bytes *= size_t(shape[d]);
  // Block r: the rows for (or from) rank r, after those of ranks 0 .. r-1.
  auto layout = [&](const std::vector<int64_t>& counts) {
    BlockLayout blocks{std::vector<size_t>(size_t(n)), std::vector<size_t>(size_t(n))};
    size_t at = 0;
    for (size_t r = 0; r < size_t(n); ++r) {
      blocks.bytes[r] = size_t(counts[r]) * row_bytes;
      blocks.offsets[r] = at;
      at += blocks.bytes[r];
    }
    return blocks;
  };
  shape[0] = 0;
  for (int64_t count : received) shape[0] += count;
  Tensor out = empty(shape, input.dtype());
  // The sizes follow from the exchanged counts: no second check.
  all_to_all_task(comm, input.data_ptr(), layout(send_counts), out.data_ptr(), layout(received),
                  false, options)();
  if (recv_counts) *recv_counts = std::move(received);
  return out;
}

}  // namespace trainer::comm
