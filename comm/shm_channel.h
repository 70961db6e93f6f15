// The shared-memory channel of a communicator whose members all run on this
// host: one block of shared memory per communicator holding a control slot per
// rank (a stage counter other ranks wait on, the address and size of the
// rank's buffer in the current operation) and two staging areas per rank for
// small messages. Large data moves by cross-memory attach (process_vm_readv)
// straight from the peer's buffer, so a reduce-scatter step reads the peer's
// chunk and adds it into ours in one pass, and an all-gather step copies once.
//
// Setup is collective: rank 0 of the communicator creates the block (a
// memfd) and publishes its descriptor through the store; every rank opens it
// through /proc/<pid>/fd, maps it and probes that it may read its peers'
// memory (ptrace rules can forbid both). The block has no name, so a crash
// leaves nothing behind. Every rank uses the channel only if all of them can.
//
// Operations take a ticket when they are issued (issue order is the same on
// every rank) and run strictly in ticket order, so a blocking collective and a
// non-blocking one on the progress thread never interleave on the segment.
// An operation with ticket t moves each rank's stage through
// stage(t, phase), phases counted up from 1 by the algorithm; a rank waits for a peer's stage by
// spinning briefly, then sleeping on a futex in the segment, and polls the peer's process (pidfd,
// see Transport::poll_peer) meanwhile: a dead peer is an Error naming it and
// the operation, a silent one a timeout, never a hang.
//
//   ShmChannel* shm = comm.shm();          // null unless every member is local
//   ShmChannel::Turn turn(*shm, ticket, "allreduce(shm)", timeout);
//   turn.publish(1); turn.wait_all(1);     // every rank has posted its buffer
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/shm_region.h"
#include "comm/store.h"
#include "comm/transport.h"

namespace trainer::comm {

class ShmChannel {
 public:
  // Bytes of each of a rank's two staging areas.
  static constexpr size_t kStagingBytes = size_t(1) << 20;
  // The pipelined allreduce moves whole areas up to this many bytes, quarter
  // areas above (comm/allreduce_shm.cpp).
  static constexpr size_t kWholeAreaMaxBytes = size_t(64) << 20;
  // Phases of one operation: 1 .. kMaxPhase.
  static constexpr uint32_t kMaxPhase = 65535;

  // Collective over members (world ranks, this one at index rank). Returns
  // null when shared memory cannot be used by every member (then all get null).
  static std::unique_ptr<ShmChannel> create(Store& store, Transport& transport,
                                            const std::vector<int>& members, int rank,
                                            uint32_t comm_id);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  int rank() const { return rank_; }
  int size() const { return int(members_.size()); }
  // Taken when an operation is issued; operations run in ticket order.
  uint64_t take_ticket() { return next_ticket_.fetch_add(1) + 1; }
  // The process of rank r.
  long pid(int r) const { return pids_[size_t(r)]; }

  // Shared regions (comm/shm_region.h) of this communicator: an operation on
  // a buffer inside one reads the peers' buffers where they lie. The channel
  // holds them weakly: a region lives as long as its users keep it.
  void add_region(const std::shared_ptr<ShmRegion>& region);
  // The live region whose local part holds [data, data + bytes), or null.
  std::shared_ptr<ShmRegion> find_region(const void* data, size_t bytes);

  // One operation's hold on the channel, from waiting for its turn to the end.
  class Turn {
   public:
    Turn(ShmChannel& channel, uint64_t ticket, const char* op, Millis timeout);
    ~Turn();
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;

    uint64_t ticket() const { return ticket_; }
    // Announces this rank's buffer for the operation (read by peers through
    // read_peer once they see phase >= 1), the operation's byte count and
    // where the buffer lies in a shared region (region id 0: in none).
    void post(const void* data, size_t bytes, uint64_t region = 0, uint64_t region_offset = 0);
    // Sets this rank's stage to (ticket, phase), phase <= kMaxPhase, and wakes sleeping peers.
    void publish(uint32_t phase);
    // Waits until every peer's stage reaches (ticket, phase); for phase 1 also
    // checks that every peer posted the same byte count and region placement.
    void wait_all(uint32_t phase);
    // Waits until every peer has finished the operation before this one
    // (reached phase 1 of this ticket - 1), so this rank's staging area of
    // parity ticket % 2 is free again.
    void wait_previous();

    // Staging area index (0 or 1) of peer (or this rank), kStagingBytes long.
    char* area(int peer, int index) const;
    // The area of this ticket's parity, which wait_previous frees.
    char* staging(int peer) const { return area(peer, int(ticket_ % 2)); }
    // Copies bytes at offset of the buffer peer posted into dst.
    void read_peer(int peer, size_t offset, void* dst, size_t bytes) const;

   private:
    void wait_stage(int peer, uint32_t target, const char* what);
    [[noreturn]] void fail(int peer, const std::string& why) const;

    ShmChannel& channel_;
    uint64_t ticket_;
    const char* op_;
    Millis timeout_;
  };

 private:
  struct Slot;
  ShmChannel(Transport& transport, std::vector<int> members, int rank);
  Slot& slot(int r) const;

  Transport& transport_;
  std::vector<int> members_;  // world rank of each rank
  int rank_;
  uint32_t comm_id_ = 0;  // of the communicator, named by the watchdog
  void* base_ = nullptr;  // the mapped segment
  size_t bytes_ = 0;
  std::vector<long> pids_;
  std::atomic<uint64_t> next_ticket_{0};
  // Tickets run in order: the one whose turn it is.
  std::mutex turn_mutex_;
  std::condition_variable turn_cv_;
  uint64_t turn_ = 1;
  std::mutex regions_mutex_;
  std::vector<std::weak_ptr<ShmRegion>> regions_;
};

}  // namespace trainer::comm
