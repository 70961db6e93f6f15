// Shared regions: memory that every rank of a communicator on one host maps
// for every other rank, so a collective on a buffer inside one reads and
// writes the peers' copies where they lie, with no staging copies
// (comm/allreduce_shm.cpp, "in place"). Data parallelism keeps its gradient
// buckets in one (parallel/ddp.h): an allreduce of a bucket then moves each
// byte once in and once out of every rank's memory instead of five times.
//
// Each rank's part is a memfd of its own; the peers open it through
// /proc/<pid>/fd/<fd> (the same permission as the channel's cross-memory
// probe) and map it, keeping the descriptor for map_side_by_side; nothing
// outlives the processes.
// Creation is collective and all-or-nothing: when any rank cannot map every
// part, every rank gets null and the caller keeps ordinary memory.
//
//   std::shared_ptr<ShmRegion> region = comm.share_memory(bytes);  // collective; may be null
//   float* grads = reinterpret_cast<float*>(region->local());
//   allreduce(comm, grads, count, DType::f32, {.op = ReduceOp::avg});  // reads peers in place
//
// Glossary: part = one rank's `bytes` of the region; local() = this rank's
// part; of(r) = rank r's part as mapped here; id = the region's number on its
// communicator (1, 2, ...), equal on every rank because creation is collective.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/store.h"

namespace trainer::comm {

class ShmRegion {
 public:
  // Collective over members (pids[i] the process of members[i], this rank at
  // index rank); key is a store prefix unique to this creation. Returns null
  // on every rank when any rank failed, with this rank's reason in *why.
  static std::shared_ptr<ShmRegion> create(Store& store, const std::vector<long>& pids, int rank,
                                           const std::string& key, uint64_t id, size_t bytes,
                                           std::string* why);
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  // This process's parts of every region alive now, in bytes (the memory
  // the CPU allocator does not count: data parallelism's buckets).
  static size_t local_bytes_in_use();

  uint64_t id() const { return id_; }
  size_t bytes() const { return bytes_; }
  char* local() const { return parts_[size_t(rank_)]; }
  char* of(int rank) const { return parts_[size_t(rank)]; }
  // Whether [data, data + bytes) lies inside local().
  bool contains(const void* data, size_t bytes) const;
  // Every rank's [offset, offset + bytes) of its part, side by side in one
  // read-only mapping (rank r's at r * bytes): the blocks of an all-gather
  // where they lie, with nothing copied. offset and bytes are multiples of
  // the page size. Null when the mapping fails; unmapped with the region.
  const char* map_side_by_side(size_t offset, size_t bytes);
  static size_t page_size();
  size_t offset_of(const void* data) const {
    return size_t(static_cast<const char*>(data) - local());
  }

 private:
  ShmRegion(uint64_t id, size_t bytes, int rank, int size);

  uint64_t id_;
  size_t bytes_;
  int rank_;
  std::vector<char*> parts_;  // every rank's part, mapped here (null where mapping failed)
  std::vector<int> fds_;      // every rank's memfd, open here (-1 where opening failed)
  std::vector<std::pair<char*, size_t>> side_by_side_;  // map_side_by_side's mappings
};

}  // namespace trainer::comm
