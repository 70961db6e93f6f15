// Allreduce among ranks of one host over the shared-memory channel
// (comm/shm_channel.h), in one of five ways:
//
// staged (small): every rank copies its buffer into its staging area and
//   publishes phase 1; once all have, each rank folds the areas in rank order
//   (0, 1, ..., n-1) into its buffer, so all ranks compute the same bits. One
//   synchronisation; a rank reuses its area two operations later, after every
//   peer has moved past the operation that read it (wait_previous).
// pair (large, 2 ranks): the buffer moves in blocks (block_bytes, as
//   below), alternating between a rank's two areas; per block each rank
//   copies its block into its area (phase "copied"), then adds the peer's
//   area and its block into its block with rank 0's operand first (the same
//   call on both ranks, so the same bits, NaN payloads included). One wait
//   and two passes per block against pipelined's two waits and four passes;
//   each rank does the whole block's arithmetic, which costs less than the
//   copies it saves (bench_allreduce at 256 MiB: 0.36-0.40 of the copy bound
//   alternated with 0.44-0.52). A block's area is written again two blocks
//   later, when the peer has announced the block in between (and so has
//   finished adding this one). The copy into the area reads the whole buffer
//   from memory once, which on its own takes about the copy bound's time.
// pipelined (large, 3 or more ranks): the buffer moves in blocks (block_bytes:
//   a whole 1 MiB staging area up to 64 MiB, fewer steps; a quarter above,
//   so a block, its area and the peer's stay in L2 while a large buffer
//   streams through), alternating between a rank's two areas. Per block: every rank
//   copies its block into its area (phase "copied"); rank r folds sub-block r
//   of all areas in rank order into its buffer and copies the result into its area
//   (phase "reduced"); every rank copies each sub-block from its owner's area
//   into its buffer. Memory traffic is one copy of the buffer in and one out,
//   the reduction runs on cache-resident areas. A block's area is written
//   again two blocks later, when every peer has copied the block in between
//   (and so has finished copying out of it).
// direct (large, with cross_memory): the buffer is cut into n chunks, chunk r
//   owned by rank r. Phase 1: every rank posts its buffer's address; rank r
//   reads chunk r of each peer's buffer by cross-memory attach
//   (process_vm_readv), kShmPieceBytes at a time, and adds it into its own chunk;
//   phase 2: rank r copies chunk p of rank p straight into place; phase 3:
//   nobody returns (and lets its caller change the buffer) while a peer may
//   still read it. Fewer copies, but the kernel's copy runs at about half the
//   speed of memcpy here.
// in place (large, every rank's buffer at the same offset of a shared region,
//   comm/shm_region.h): the buffer is cut into n chunks, chunk r owned by
//   rank r. Phase 1: every rank's buffer is final; rank r folds chunk r of
//   every rank's buffer in rank order, kShmPieceBytes at a time into a scratch
//   piece, and copies the piece into every rank's buffer (on 2 ranks in one
//   pass: each element read from both buffers, reduced and stored into both,
//   no piece); phase 2: every chunk is written everywhere. Each byte moves
//   once in and once out of each rank's memory, against five times through
//   the staging areas, and there are two waits instead of two per block.
//   Non-temporal stores measured slower here (0.5-0.7 of the copy bound at
//   256 MiB against 0.8-0.9), so the stores are ordinary.
#include <cstring>

#include "comm/algorithms.h"
#include "comm/log.h"

namespace trainer::comm {

namespace {

void allreduce_staged(ShmChannel::Turn& turn, int n, int rank, char* data, size_t count,
                      DType dtype, ReduceOp op) {
  const size_t bytes = count * dtype_size(dtype);
  turn.wait_previous();
  // An empty buffer still takes part: the stages keep every rank in step.
  if (bytes > 0) std::memcpy(turn.staging(rank), data, bytes);
  turn.post(data, bytes);
  turn.publish(1);
  turn.wait_all(1);
  if (rank != 0 && bytes > 0) std::memcpy(data, turn.staging(0), bytes);
  for (int p = 1; p < n; ++p) reduce_into(data, turn.staging(p), count, dtype, op);
  if (op == ReduceOp::avg) scale(data, count, dtype, 1.0 / n);
}

void allreduce_direct(ShmChannel::Turn& turn, int n, int rank, char* data, size_t count,
                      DType dtype, ReduceOp op) {
  const size_t element_bytes = dtype_size(dtype);
  turn.post(data, count * element_bytes);
  turn.publish(1);
  turn.wait_all(1);

  const Range mine = part_of({0, count}, n, rank);
  for_each_piece(mine, element_bytes, [&](size_t begin, size_t pc, char* scratch) {
    for (int p = 0; p < n; ++p) {
      if (p == rank) continue;
      turn.read_peer(p, begin * element_bytes, scratch, pc * element_bytes);
      reduce_into(data + begin * element_bytes, scratch, pc, dtype, op);
    }
  });
  if (op == ReduceOp::avg) scale(data + mine.begin * element_bytes, mine.count, dtype, 1.0 / n);
  turn.publish(2);
  turn.wait_all(2);

  for (int p = 0; p < n; ++p) {
    if (p == rank) continue;
    const Range theirs = part_of({0, count}, n, p);
    turn.read_peer(p, theirs.begin * element_bytes, data + theirs.begin * element_bytes,
                   theirs.count * element_bytes);
  }
  turn.publish(3);
  turn.wait_all(3);
}

void allreduce_in_place(ShmChannel::Turn& turn, const ShmRegion& region, int n, int rank,
                        char* data, size_t count, DType dtype, ReduceOp op) {
  const size_t element_bytes = dtype_size(dtype), offset = region.offset_of(data);
  turn.post(data, count * element_bytes, region.id(), offset);
  turn.publish(1);
  turn.wait_all(1);

  const Range mine = part_of({0, count}, n, rank);
  for_each_piece(mine, element_bytes, [&](size_t begin, size_t pc, char* piece) {
    const size_t at = offset + begin * element_bytes, piece_bytes = pc * element_bytes;
    if (n == 2) {  // straight from both buffers into both, no scratch piece
      reduce_pair_to_both(region.of(0) + at, region.of(1) + at, region.of(0) + at,
                          region.of(1) + at, pc, dtype, op, 0.5);
      return;
    }
    fold_region_piece(piece, region, n, at, pc, dtype, op);
    for (int p = 0; p < n; ++p) std::memcpy(region.of(p) + at, piece, piece_bytes);
  });
  turn.publish(2);
  turn.wait_all(2);
}

// Every block costs two waits for all peers. Measured on 2 ranks, 1 MiB
// against 256 KiB blocks: alone (bench_allreduce, alternated) 1.3-2x faster
// from 1 to 8 MiB, even at 16-32 MiB, 10-15% slower at 256 MiB; overlapped
// with backward on busy cores (bench_dp --trace), where each wait costs a
// scheduling delay, ResNet-18's 28 MB bucket took 104-110 ms against
// 160-179, and the wait after backward fell from ~9 ms to ~2 ms.
size_t block_bytes(size_t bytes) {
  return bytes <= ShmChannel::kWholeAreaMaxBytes ? ShmChannel::kStagingBytes
                                                 : ShmChannel::kStagingBytes / 4;
}

// count elements cut into blocks of block_bytes.
struct Blocks {
  size_t per_block, number, count;
  Range at(size_t k) const { return {k * per_block, std::min(per_block, count - k * per_block)}; }
};

// Posts the buffer (phase 1) and waits until every peer has: each has then
// finished the previous operation, so the staging areas are free.
Blocks start_blocks(ShmChannel::Turn& turn, char* data, size_t count, size_t element_bytes) {
  const size_t per_block = block_bytes(count * element_bytes) / element_bytes;
  turn.post(data, count * element_bytes);
  turn.publish(1);
  turn.wait_all(1);
  return {per_block, (count + per_block - 1) / per_block, count};
}

// Phases: 1 posted; block k: 2 + k copied; 2 + blocks done.
void allreduce_pair(ShmChannel::Turn& turn, int rank, char* data, size_t count, DType dtype,
                    ReduceOp op) {
  const size_t element_bytes = dtype_size(dtype);
  const Blocks blocks = start_blocks(turn, data, count, element_bytes);
  for (size_t k = 0; k < blocks.number; ++k) {
    const Range block = blocks.at(k);
    const int index = int(k % 2);
    const uint32_t copied = uint32_t(2 + k);
    char* mine = data + block.begin * element_bytes;
    std::memcpy(turn.area(rank, index), mine, block.count * element_bytes);
    turn.publish(copied);
    turn.wait_all(copied);
    const char* peer = turn.area(1 - rank, index);
    reduce_pair(mine, rank == 0 ? mine : peer, rank == 0 ? peer : mine, block.count, dtype, op);
    if (op == ReduceOp::avg) scale(mine, block.count, dtype, 0.5);
  }
  const uint32_t done = uint32_t(2 + blocks.number);
  turn.publish(done);
  turn.wait_all(done);
}

// Phases: 1 posted; block k: 2 + 2k copied, 3 + 2k reduced; 2 + 2 * blocks done.
void allreduce_pipelined(ShmChannel::Turn& turn, int n, int rank, char* data, size_t count,
                         DType dtype, ReduceOp op) {
  const size_t element_bytes = dtype_size(dtype);
  const Blocks blocks = start_blocks(turn, data, count, element_bytes);
  for (size_t k = 0; k < blocks.number; ++k) {
    const Range block = blocks.at(k);
    const int index = int(k % 2);
    const uint32_t copied = uint32_t(2 + 2 * k), reduced = copied + 1;
    char* mine = turn.area(rank, index);
    std::memcpy(mine, data + block.begin * element_bytes, block.count * element_bytes);
    turn.publish(copied);
    turn.wait_all(copied);

    const Range sub = part_of({0, block.count}, n, rank);
    const size_t offset = sub.begin * element_bytes, sub_bytes = sub.count * element_bytes;
    char* out = data + (block.begin + sub.begin) * element_bytes;
    reduce_pair(out, turn.area(0, index) + offset, turn.area(1, index) + offset, sub.count, dtype,
                op);
    for (int p = 2; p < n; ++p)
      reduce_into(out, turn.area(p, index) + offset, sub.count, dtype, op);
    if (op == ReduceOp::avg) scale(out, sub.count, dtype, 1.0 / n);
    std::memcpy(mine + offset, out, sub_bytes);
    turn.publish(reduced);
    turn.wait_all(reduced);

    for (int p = 0; p < n; ++p) {
      if (p == rank) continue;
      const Range theirs = part_of({0, block.count}, n, p);
      std::memcpy(data + (block.begin + theirs.begin) * element_bytes,
                  turn.area(p, index) + theirs.begin * element_bytes, theirs.count * element_bytes);
    }
  }
  const uint32_t done = uint32_t(2 + 2 * blocks.number);
  turn.publish(done);
  turn.wait_all(done);
}

}  // namespace

void allreduce_shm(ShmChannel& ch, uint64_t ticket, const char* op_name, Millis timeout, void* data,
                   size_t count, DType dtype, ReduceOp op, size_t staged_bytes, bool cross_memory) {
  ShmChannel::Turn turn(ch, ticket, op_name, timeout);
  const size_t bytes = count * dtype_size(dtype);
  const size_t blocks = (bytes + block_bytes(bytes) - 1) / block_bytes(bytes);
  const int n = ch.size(), rank = ch.rank();
  char* d = static_cast<char*>(data);
  if (bytes <= std::min(staged_bytes, ShmChannel::kStagingBytes)) {
    COMM_LOG(LogLevel::debug, "allreduce shm: ", count, " x ", dtype, ", staged");
    return allreduce_staged(turn, n, rank, d, count, dtype, op);
  }
  // Held for the operation: the region stays mapped while peers' copies are used.
  if (const std::shared_ptr<ShmRegion> region = ch.find_region(data, bytes)) {
    COMM_LOG(LogLevel::debug, "allreduce shm: ", count, " x ", dtype, ", in place");
    return allreduce_in_place(turn, *region, n, rank, d, count, dtype, op);
  }
  if (cross_memory || 2 + 2 * blocks > ShmChannel::kMaxPhase) {
    COMM_LOG(LogLevel::debug, "allreduce shm: ", count, " x ", dtype, ", direct");
    return allreduce_direct(turn, n, rank, d, count, dtype, op);
  }
  COMM_LOG(LogLevel::debug, "allreduce shm: ", count, " x ", dtype,
           n == 2 ? ", pair" : ", pipelined");
  if (n == 2) return allreduce_pair(turn, rank, d, count, dtype, op);
  allreduce_pipelined(turn, n, rank, d, count, dtype, op);
}

}  // namespace trainer::comm
