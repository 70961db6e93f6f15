// Collectives over a communicator, on raw CPU buffers or CPU tensors
// (contiguous). Reductions take f32, bf16 or f16 (and f64) with sum, avg or
// max; allgather, broadcast and all-to-all move bytes of any dtype. Every rank of the
// communicator calls the same collectives in the same order with the same
// counts. The public calls validate, pack the options and pick the algorithm
// (logged at debug level); the algorithms live in comm/allreduce_ring.cpp and
// its siblings (see comm/algorithms.h). Each call adds its bytes to this
// process's traffic counters when issued (comm/traffic.h).
//
// The *_async variants return a Work handle and run on the communicator's
// progress thread, so the caller can compute meanwhile; buffers (tensors are
// kept alive by the handle) must not be touched until wait().
//
//   allreduce(*world, grad, {.op = ReduceOp::avg});
//   Work w = allreduce_async(*dp, bucket, {.algorithm = AllreduceAlgorithm::ring});
//   allreduce(*dp, grad, {.algorithm = *parse_allreduce_algorithm("butterfly")});
//   Tensor shard = reduce_scatter(*dp, flat, {.op = ReduceOp::sum});   // [n*k] -> [k]
//   Tensor all = allgather(*dp, shard);                                // [k] -> [n*k]
//   Tensor heads = all_to_all(*cp, qkv);           // block r of dim 0 to rank r: [n*k] -> [n*k]
//   std::vector<int64_t> got;
//   Tensor tokens = all_to_all_v(*ep, routed, rows_per_expert_rank, &got);  // MoE dispatch
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "comm/communicator.h"
#include "comm/reduce.h"
#include "core/tensor.h"

namespace trainer::comm {

// automatic: shm when every rank of the communicator runs on this host, else
// the algorithm the alpha-beta model measured on this machine predicts
// fastest (comm/alpha_beta.h; with AllreduceOptions::cost_model false:
// recursive doubling up to small_message_bytes and ring above). shm where the
// channel is unavailable falls back to that choice. The others run over
// point-to-point messages whatever the hosts (comm/algorithms.h):
//   ring                reduce-scatter then all-gather around a ring, pipelined
//   recursive_doubling  log2(n) whole-buffer exchanges
//   tree                binary-tree reduce then broadcast, pipelined in segments
//   butterfly           recursive halving then doubling (Rabenseifner)
//   all_to_all          everyone sends everything to everyone
//   master_worker       gather to rank 0, reduce, send back
//   round_robin         rank t in turn reduces and sends out block t
enum class AllreduceAlgorithm {
  automatic,
  ring,
  recursive_doubling,
  shm,
  tree,
  butterfly,
  all_to_all,
  master_worker,
  round_robin
};

// The ring allreduce's arithmetic and receive scratch, for buffers the host
// may not touch (GPU memory handed to a transport that moves it, e.g. UCX
// built with CUDA): each function runs on the progress thread and returns
// once its result is in memory. Unset members: the host's (comm/reduce.h,
// the thread's scratch).
struct Reducer {
  // dst[i] = dst[i] (op) src[i] for i < count (op sum, avg as sum, or max).
  std::function<void(void* dst, const void* src, size_t count, DType dtype, ReduceOp op)> reduce;
  // data[i] *= factor (avg's final scaling).
  std::function<void(void* data, size_t count, DType dtype, double factor)> scale;
  // Receive scratch of at least bytes, in the memory the data lives in; kept
  // until the collective ends.
  std::function<std::shared_ptr<void>(size_t bytes)> scratch;
};

struct AllreduceOptions {
  ReduceOp op = ReduceOp::sum;
  AllreduceAlgorithm algorithm = AllreduceAlgorithm::automatic;
  // The pipeline unit of ring, tree, all-to-all and master-worker.
  size_t segment_bytes = 1 << 20;
  // automatic without the shm channel: choose by the alpha-beta model
  // (comm/alpha_beta.h, measured on the communicator's first such allreduce);
  // false: recursive doubling up to small_message_bytes, ring above.
  bool cost_model = true;
  size_t small_message_bytes = 64 << 10;
  // shm: messages up to this size (at most ShmChannel::kStagingBytes) are
  // staged through the segment, larger ones read from the peers' buffers.
  size_t staged_bytes = 64 << 10;
  // shm above staged_bytes: read the peers' buffers by cross-memory attach
  // (process_vm_readv) instead of pipelining blocks through the segment.
  bool cross_memory = false;
  Millis timeout{0};  // per wait without progress; 0: the communicator's
  // Set: the ring (whatever `algorithm` says), reducing with it.
  std::shared_ptr<const Reducer> reducer{};
};

struct CollectiveOptions {
  ReduceOp op = ReduceOp::sum;     // reduce_scatter
  size_t segment_bytes = 1 << 20;  // reduce_scatter, allgather, broadcast: the pipeline unit
  Millis timeout{0};               // 0: the communicator's
  // reduce_scatter's input, allgather's output (or its input: each rank
  // then reads the others' where they lie) lie at the same offset of a
  // shared region (Communicator::share_memory) on every rank: they run in
  // place over the shared-memory channel. Every rank passes the same value;
  // without a channel (ranks on several hosts) the ring runs as usual.
  bool shared_region = false;
  // all_to_all over the shared-memory channel: a rank whose blocks for the
  // others fit in this many bytes (at most ShmChannel::kStagingBytes, less a
  // small header) stages them through the segment, one synchronisation and
  // two memcpys per byte; larger ones are read from its input in place by
  // cross-memory attach, one kernel copy and two synchronisations. 8 KiB:
  // where the read in place overtook staging at 2 ranks on an idle machine
  // (docs/benchmarks.md "All-to-all").
  size_t staged_bytes = size_t(8) << 10;
  // all_to_all over the transport: pairwise steps posted at once.
  int steps_in_flight = 4;
};

// ---- raw buffers ----
// data: count elements, reduced in place.
void allreduce(Communicator& comm, void* data, size_t count, DType dtype,
               const AllreduceOptions& options = {});
// input: size() * count elements; output: count elements, block rank() of the reduction.
void reduce_scatter(Communicator& comm, const void* input, void* output, size_t count, DType dtype,
                    const CollectiveOptions& options = {});
// input: bytes; output: size() * bytes, block r from rank r.
void allgather(Communicator& comm, const void* input, void* output, size_t bytes,
               const CollectiveOptions& options = {});
void broadcast(Communicator& comm, void* data, size_t bytes, int root,
               const CollectiveOptions& options = {});
void barrier(Communicator& comm, const CollectiveOptions& options = {});
// input: size() blocks of bytes, block r goes to rank r; output: size()
// blocks of bytes, block r came from rank r (block rank() is a local copy).
// input and output must not overlap.
void all_to_all(Communicator& comm, const void* input, void* output, size_t bytes,
                const CollectiveOptions& options = {});
// Variable sizes (MPI_Alltoallv): send_bytes[r] bytes at input +
// send_offsets[r] go to rank r; recv_bytes[r] bytes from rank r land at
// output + recv_offsets[r]. Every rank's send_bytes[r] must equal rank r's
// recv_bytes[this rank]: a mismatch is an Error on every rank naming both
// ranks and sizes (checked before any data moves). Zero sizes are normal.
void all_to_all_v(Communicator& comm, const void* input, const std::vector<size_t>& send_bytes,
                  const std::vector<size_t>& send_offsets, void* output,
                  const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                  const CollectiveOptions& options = {});

Work allreduce_async(Communicator& comm, void* data, size_t count, DType dtype,
                     const AllreduceOptions& options = {});
Work reduce_scatter_async(Communicator& comm, const void* input, void* output, size_t count,
                          DType dtype, const CollectiveOptions& options = {});
Work allgather_async(Communicator& comm, const void* input, void* output, size_t bytes,
                     const CollectiveOptions& options = {});
Work broadcast_async(Communicator& comm, void* data, size_t bytes, int root,
                     const CollectiveOptions& options = {});
Work all_to_all_async(Communicator& comm, const void* input, void* output, size_t bytes,
                      const CollectiveOptions& options = {});

// ---- CPU tensors (contiguous) ----
void allreduce(Communicator& comm, const Tensor& t, const AllreduceOptions& options = {});
Work allreduce_async(Communicator& comm, const Tensor& t, const AllreduceOptions& options = {});
// [size() * k, ...] -> [k, ...]
Tensor reduce_scatter(Communicator& comm, const Tensor& input,
                      const CollectiveOptions& options = {});
// [k, ...] -> [size() * k, ...]
Tensor allgather(Communicator& comm, const Tensor& input, const CollectiveOptions& options = {});
void broadcast(Communicator& comm, const Tensor& t, int root,
               const CollectiveOptions& options = {});
// [size() * k, ...] -> [size() * k, ...]: block r of dim 0 goes to rank r,
// block r of the result came from rank r.
Tensor all_to_all(Communicator& comm, const Tensor& input, const CollectiveOptions& options = {});
// Rows of dim 0: the first send_counts[0] rows go to rank 0, the next
// send_counts[1] to rank 1, ...; the receive counts are exchanged first (an
// all_to_all of one int64 per rank) and returned in *recv_counts when not
// null; the result is [sum(recv counts), ...] with rank 0's rows first.
Tensor all_to_all_v(Communicator& comm, const Tensor& input,
                    const std::vector<int64_t>& send_counts,
                    std::vector<int64_t>* recv_counts = nullptr,
                    const CollectiveOptions& options = {});

// "recursive doubling", "all-to-all", ... (for logs and tables).
std::string_view algorithm_name(AllreduceAlgorithm algorithm);
// The names recipes and command lines use: "auto", "ring", "recursive_doubling",
// "tree", "butterfly", "all_to_all", "master_worker", "round_robin", "shm".
std::string_view algorithm_key(AllreduceAlgorithm algorithm);
// The algorithm of a key (hyphens read as underscores, "automatic" as
// "auto"); nullopt for an unknown name.
std::optional<AllreduceAlgorithm> parse_allreduce_algorithm(std::string_view key);

}  // namespace trainer::comm
