// The collective algorithms behind comm/collectives.h, one file each, written
// over OpChannel: the send/recv of one operation of one communicator (its
// tags carry the communicator id, the operation's sequence number and a
// message index chosen by the algorithm). Each waits with the operation's
// timeout and errors name the peer (Request::wait).
//
//   allreduce_ring.cpp                 reduce-scatter then all-gather, segmented and pipelined;
//                                      its two phases also serve reduce_scatter and allgather
//   allreduce_recursive_doubling.cpp   log2(n) full-buffer exchanges, for small messages
//   allreduce_butterfly.cpp            recursive halving then doubling (Rabenseifner)
//   allreduce_tree.cpp                 binary-tree reduce then broadcast, segmented and pipelined
//   allreduce_all_to_all.cpp           every rank sends its buffer to every other and reduces all
//   allreduce_master_worker.cpp        gather to rank 0, reduce there, send the result to all
//   allreduce_round_robin.cpp          rank t in turn gathers, reduces and sends out block t
//   allreduce_shm.cpp                  ranks on one host, over comm/shm_channel.h instead
//   all_to_all.cpp                     all-to-all: pairwise steps, or through comm/shm_channel.h
//   broadcast_binomial.cpp             binomial tree from the root, segmented and pipelined
//   barrier_dissemination.cpp          log2(n) rounds of empty messages
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "comm/reduce.h"
#include "comm/shm_channel.h"

namespace trainer::comm {

// Elements [begin, begin + count) of a buffer.
struct Range {
  size_t begin = 0, count = 0;
};

// Part i of `whole` cut into `parts` nearly equal parts (the first count % parts are one longer).
inline Range part_of(Range whole, int parts, int i) {
  size_t base = whole.count / size_t(parts), extra = whole.count % size_t(parts);
  return {whole.begin + base * size_t(i) + std::min<size_t>(size_t(i), extra),
          base + (size_t(i) < extra ? 1 : 0)};
}

class OpChannel {
 public:
  OpChannel(Communicator& comm, uint32_t seq, const char* op, Millis timeout)
      : comm_(comm), seq_(seq), op_(op), timeout_(timeout) {}

  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }

  Request isend(int peer, uint32_t message, const void* data, size_t bytes) {
    return comm_.transport().isend(comm_.world_rank(peer),
                                   tag(message, comm_.world_rank(comm_.rank())), data, bytes, op_);
  }
  Request irecv(int peer, uint32_t message, void* data, size_t bytes) {
    return comm_.transport().irecv(comm_.world_rank(peer), tag(message, comm_.world_rank(peer)),
                                   data, bytes, op_);
  }
  // Each wait may last the timeout without progress.
  void wait(Request& r) const { r.wait(timeout_); }
  void wait_all(std::vector<Request>& requests) const {
    for (Request& r : requests) wait(r);
    requests.clear();
  }

 private:
  uint64_t tag(uint32_t message, int source_world_rank) const {
    return make_tag(comm_.id(), TagKind::collective, seq_, message, source_world_rank);
  }

  Communicator& comm_;
  uint32_t seq_;
  const char* op_;
  Millis timeout_;
};

// How many segments of at most segment_bytes cut count elements (at least
// one, at most count, so that no segment is empty when count > 0). At most
// kMaxSegments, larger segments beyond: the algorithms number two messages
// per segment, and a tag holds 2^kTagMessageBits message numbers.
inline constexpr size_t kMaxSegments = size_t(1) << (kTagMessageBits - 2);
inline int segment_count(size_t count, size_t element_bytes, size_t segment_bytes) {
  const size_t bytes = count * element_bytes;
  const size_t segments = (bytes + segment_bytes - 1) / segment_bytes;
  return int(std::clamp<size_t>(segments, 1, std::min(kMaxSegments, std::max<size_t>(count, 1))));
}

// A buffer of count elements cut into segments (segment_count) for the
// segmented algorithms: seg.range(j), seg.at(range), seg.bytes(range).
struct Segments {
  Segments(void* data, size_t count, size_t element_bytes, size_t segment_bytes)
      : base(static_cast<char*>(data)),
        count(count),
        element_bytes(element_bytes),
        n(segment_count(count, element_bytes, segment_bytes)) {}
  Range range(int j) const { return part_of({0, count}, n, j); }
  char* at(Range r) const { return base + r.begin * element_bytes; }
  size_t bytes(Range r) const { return r.count * element_bytes; }

  char* base;
  size_t count, element_bytes;
  int n;  // segments
};

// A world that is not a power of two, folded onto one (Thakur, Rabenseifner
// and Gropp): of the first 2*rem ranks (rem = n - 2^floor(log2 n)) each even
// one hands its buffer to the odd one after it and sits out (virtual rank
// -1); the others are renumbered 0..pof2-1.
struct PowerOfTwoFold {
  explicit PowerOfTwoFold(int n, int rank) : rank(rank) {
    while (pof2 * 2 <= n) pof2 *= 2;
    rem = n - pof2;
    vrank = rank < 2 * rem ? (rank % 2 ? rank / 2 : -1) : rank - rem;
  }
  int real(int virtual_rank) const {
    return virtual_rank < rem ? virtual_rank * 2 + 1 : virtual_rank + rem;
  }
  bool sits_out() const { return vrank < 0; }
  // Before: the even ranks of the first 2*rem hand their buffer over
  // (message `message`); the odd ones reduce it into theirs (received: scratch).
  void fold(OpChannel& ch, uint32_t message, void* data, void* received, size_t count, DType dtype,
            ReduceOp op) const;
  // After: the odd ones hand the result back.
  void unfold(OpChannel& ch, uint32_t message, void* data, size_t bytes) const;

  int rank, pof2 = 1, rem = 0, vrank = -1;
};

// This thread's scratch buffer, at least `bytes` long, uninitialised: the
// receives that are reduced afterwards land here. It grows and is kept, so a
// collective repeated on buffers of the same size touches no fresh pages (a
// fresh allocation would cost a page fault per 4 KiB on every call). The
// algorithms of one thread run one at a time, so one buffer serves them all.
inline char* thread_scratch(size_t bytes) {
  thread_local std::unique_ptr<char[]> buffer;
  thread_local size_t capacity = 0;
  if (bytes > capacity) {
    buffer.reset();
    buffer.reset(new char[bytes]);
    capacity = bytes;
  }
  return buffer.get();
}

// The shared-memory ways that read peers' buffers where they lie work in
// pieces small enough that a piece and the matching part of this rank's
// buffer stay in L2 between the read and the reduction.
inline constexpr size_t kShmPieceBytes = size_t(256) << 10;

// Calls fn(begin, count, scratch) over range in pieces of at most
// kShmPieceBytes, scratch being one piece of this thread's scratch.
template <class Fn>
void for_each_piece(Range range, size_t element_bytes, Fn&& fn) {
  const size_t piece_count = std::max<size_t>(1, kShmPieceBytes / element_bytes);
  char* scratch = thread_scratch(piece_count * element_bytes);
  for (size_t begin = range.begin; begin < range.begin + range.count; begin += piece_count)
    fn(begin, std::min(piece_count, range.begin + range.count - begin), scratch);
}

// piece = the count elements at byte `at` of every rank's part of region,
// folded in rank order (the same bits on every rank), avg scaled by 1/n.
inline void fold_region_piece(char* piece, const ShmRegion& region, int n, size_t at, size_t count,
                              DType dtype, ReduceOp op) {
  reduce_pair(piece, region.of(0) + at, region.of(1) + at, count, dtype, op);  // n >= 2
  for (int p = 2; p < n; ++p) reduce_into(piece, region.of(p) + at, count, dtype, op);
  if (op == ReduceOp::avg) scale(piece, count, dtype, 1.0 / n);
}

struct Reducer;  // comm/collectives.h

// In place on count elements of dtype at data; every rank ends with the reduction.
// reducer (optional): its arithmetic and scratch instead of the host's.
void allreduce_ring(OpChannel& ch, void* data, size_t count, DType dtype, ReduceOp op,
                    size_t segment_bytes, const Reducer* reducer = nullptr);
void allreduce_recursive_doubling(OpChannel& ch, void* data, size_t count, DType dtype,
                                  ReduceOp op);
// Recursive halving (a reduce-scatter: log2(p) exchanges of halving parts)
// then recursive doubling (an all-gather) over the folded power of two p.
void allreduce_butterfly(OpChannel& ch, void* data, size_t count, DType dtype, ReduceOp op);
// Binary tree rooted at rank 0: segments of at most segment_bytes are reduced
// up and broadcast down as a pipeline.
void allreduce_tree(OpChannel& ch, void* data, size_t count, DType dtype, ReduceOp op,
                    size_t segment_bytes);
// Every rank sends every segment (of at most segment_bytes) to every other
// and reduces all n copies itself, in rank order (the same bits everywhere).
void allreduce_all_to_all(OpChannel& ch, void* data, size_t count, DType dtype, ReduceOp op,
                          size_t segment_bytes);
// Every rank sends its segments to rank 0, which reduces and sends the result
// to every rank: rank 0's link carries 2(n-1) buffers.
void allreduce_master_worker(OpChannel& ch, void* data, size_t count, DType dtype, ReduceOp op,
                             size_t segment_bytes);
// Block t (of n) is gathered to rank t; in turn t = 0..n-1, rank t reduces it
// and sends the result to every rank.
void allreduce_round_robin(OpChannel& ch, void* data, size_t count, DType dtype, ReduceOp op);

// The same over the shared-memory channel, as the operation with this ticket
// (taken at issue). Up to staged_bytes (capped at ShmChannel::kStagingBytes)
// every rank copies its buffer into its staging area and reduces all of them;
// larger buffers are reduced block by block through the staging areas, or
// with cross_memory straight from the peers' memory.
void allreduce_shm(ShmChannel& ch, uint64_t ticket, const char* op_name, Millis timeout, void* data,
                   size_t count, DType dtype, ReduceOp op, size_t staged_bytes, bool cross_memory);

// The ring's phases on data split into size() equal chunks of chunk_count elements:
// afterwards rank r holds chunk r reduced over all ranks (avg: scaled by 1/size)...
void reduce_scatter_ring(OpChannel& ch, void* data, size_t chunk_count, DType dtype, ReduceOp op,
                         size_t segment_bytes);
// ...and, given chunk r on rank r, every rank holds every chunk (chunks of chunk_bytes bytes).
void all_gather_ring(OpChannel& ch, void* data, size_t chunk_bytes, size_t segment_bytes);

// reduce_scatter and all-gather over the shared-memory channel, in place
// (comm/shm_region_collectives.cpp): the input of the one and the output of
// the other lie at the same offset of a shared region on every rank, so rank
// r reads block r of every rank's input where it lies, or writes its block
// into every rank's output. An all-gather whose inputs lie in the region
// and outputs do not reads every rank's input where it lies instead. Throws
// Error when the buffer lies in no region.
void reduce_scatter_shm(ShmChannel& ch, uint64_t ticket, Millis timeout, const void* input,
                        void* output, size_t count, DType dtype, ReduceOp op);
void all_gather_shm(ShmChannel& ch, uint64_t ticket, Millis timeout, const void* input,
                    void* output, size_t bytes);

// Where the blocks of an all-to-all lie: block r is bytes[r] bytes at
// offsets[r] of the buffer (one entry per rank).
struct BlockLayout {
  std::vector<size_t> bytes, offsets;
};

// All-to-all (comm/all_to_all.cpp): send's block r of input goes to rank r,
// which puts it at receive's block `rank` of its output. Pairwise over the
// transport, in_flight steps posted at once; verify_sizes first exchanges
// every rank's sizes so that a mismatch is the same Error on every rank
// (world_ranks: each rank's world rank, for messages).
void all_to_all_pairwise(OpChannel& ch, const void* input, const BlockLayout& send, void* output,
                         const BlockLayout& receive, int in_flight, bool verify_sizes,
                         const std::vector<int>& world_ranks);
// The same over the shared-memory channel, always checking the sizes: a
// rank whose blocks for the others fit in staged_bytes (capped at
// ShmChannel::kStagingBytes) stages them, the others' are read in place.
void all_to_all_shm(ShmChannel& ch, uint64_t ticket, Millis timeout, const void* input,
                    const BlockLayout& send, void* output, const BlockLayout& receive,
                    size_t staged_bytes, const std::vector<int>& world_ranks);

// Segments of at most segment_bytes are forwarded down the tree as they arrive.
void broadcast_binomial(OpChannel& ch, void* data, size_t bytes, int root, size_t segment_bytes);
void barrier_dissemination(OpChannel& ch);

}  // namespace trainer::comm
