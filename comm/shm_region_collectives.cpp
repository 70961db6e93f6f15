// reduce_scatter and all-gather among ranks of one host whose buffers lie in
// a shared region (comm/shm_region.h), as ZeRO-1's segments do
// (parallel/zero.h). Both run over the shared-memory channel with two waits:
//
// reduce_scatter: phase 1, every rank's input is final; rank r folds block r
//   of every rank's input in rank order, kShmPieceBytes at a time, into a
//   scratch piece and copies it into its output (which may be block r of its
//   own input: each piece is read from every rank before it is written);
//   phase 2, nobody changes its input while a peer may still read it.
// all-gather: phase 1, every rank may have its output written; rank r copies
//   its input into block r of every rank's output (its own input may be that
//   block already); phase 2, every block is everywhere. When the inputs lie
//   in the region instead (ZeRO-3's shards, gathered into private memory):
//   phase 1, every input is final; rank r copies every rank's input into its
//   output; phase 2, nobody changes its input while a peer may read it.
//
// Each byte moves once in and once out of each rank's memory, against the
// ring's copy of the input plus n - 1 steps through the transport.
#include <cstring>

#include "comm/algorithms.h"
#include "comm/log.h"

namespace trainer::comm {

namespace {

// Posts the operation's buffer with its place in a shared region and waits
// until every rank has: a rank that placed its buffer otherwise makes it an
// Error on every rank (ShmChannel::Turn::wait_all), and so does a buffer
// that lies in no region on any rank. Returns the region.
std::shared_ptr<ShmRegion> post_in_region(ShmChannel& ch, ShmChannel::Turn& turn, const void* data,
                                          size_t bytes, const char* op, const char* what) {
  std::shared_ptr<ShmRegion> region = ch.find_region(data, bytes);
  turn.post(data, bytes, region ? region->id() : 0, region ? region->offset_of(data) : 0);
  turn.publish(1);
  turn.wait_all(1);
  if (!region)
    throw Error(cat("rank ", ch.rank(), ": ", op,
                    ": CollectiveOptions::shared_region is set but the ", what, " (", bytes,
                    " bytes) lies in no shared region of this communicator; allocate it with "
                    "Communicator::share_memory or leave the option off"));
  return region;
}

}  // namespace

void reduce_scatter_shm(ShmChannel& ch, uint64_t ticket, Millis timeout, const void* input,
                        void* output, size_t count, DType dtype, ReduceOp op) {
  const char* name = "reduce_scatter(shm)";
  ShmChannel::Turn turn(ch, ticket, name, timeout);
  const int n = ch.size(), rank = ch.rank();
  const size_t element_bytes = dtype_size(dtype), bytes = count * element_bytes * size_t(n);
  COMM_LOG(LogLevel::debug, "reduce_scatter shm: ", count, " x ", dtype, " per rank, in place");
  const std::shared_ptr<ShmRegion> region = post_in_region(ch, turn, input, bytes, name, "input");
  const size_t offset = region->offset_of(input);

  const size_t block = offset + size_t(rank) * count * element_bytes;
  char* out = static_cast<char*>(output);
  for_each_piece({0, count}, element_bytes, [&](size_t begin, size_t pc, char* piece) {
    const size_t at = block + begin * element_bytes;
    // On 2 ranks the fold's one reduce_pair may write where it reads
    // (comm/reduce.h), so it goes straight into the output; with more, an
    // output inside the input would be read after it was written.
    char* to = n == 2 ? out + begin * element_bytes : piece;
    fold_region_piece(to, *region, n, at, pc, dtype, op);
    if (to == piece) std::memcpy(out + begin * element_bytes, piece, pc * element_bytes);
  });
  turn.publish(2);
  turn.wait_all(2);
}

namespace {

// The all-gather whose inputs lie in a region and outputs anywhere: rank r
// copies every rank's input from where it lies into its own output.
void all_gather_pull(ShmChannel& ch, ShmChannel::Turn& turn, const void* input, void* output,
                     size_t bytes) {
  const int n = ch.size(), rank = ch.rank();
  COMM_LOG(LogLevel::debug, "allgather shm: ", bytes, " bytes per rank, read in place");
  const std::shared_ptr<ShmRegion> region =
      post_in_region(ch, turn, input, bytes, "allgather(shm)", "input");
  const size_t at = region->offset_of(input);
  char* out = static_cast<char*>(output);
  for (int p = 0; p < n; ++p) {
    const char* src = p == rank ? static_cast<const char*>(input) : region->of(p) + at;
    if (bytes > 0) std::memmove(out + size_t(p) * bytes, src, bytes);
  }
  // Nobody changes its input while a peer may still read it.
  turn.publish(2);
  turn.wait_all(2);
}

}  // namespace

void all_gather_shm(ShmChannel& ch, uint64_t ticket, Millis timeout, const void* input,
                    void* output, size_t bytes) {
  const char* name = "allgather(shm)";
  ShmChannel::Turn turn(ch, ticket, name, timeout);
  const int n = ch.size(), rank = ch.rank();
  const size_t total = bytes * size_t(n);
  // Every rank's output outside the regions and its input inside one: read
  // in place (every rank decides alike, as its buffers lie alike).
  if (!ch.find_region(output, total) && ch.find_region(input, bytes))
    return all_gather_pull(ch, turn, input, output, bytes);
  COMM_LOG(LogLevel::debug, "allgather shm: ", bytes, " bytes per rank, in place");
  const std::shared_ptr<ShmRegion> region = post_in_region(ch, turn, output, total, name, "output");
  const size_t offset = region->offset_of(output);

  const size_t at = offset + size_t(rank) * bytes;
  for (int p = 0; p < n; ++p) {
    char* dst = region->of(p) + at;
    if (dst != input && bytes > 0) std::memmove(dst, input, bytes);
  }
  turn.publish(2);
  turn.wait_all(2);
}

}  // namespace trainer::comm
