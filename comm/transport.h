// The UCX transport: one UCP context and worker per process, an endpoint to
// every other rank, and non-blocking tagged send/recv returning Requests.
//
// Worker addresses and process identities (host, boot, pid namespace, pid)
// are exchanged through the rendezvous store. A peer on another host gets an
// endpoint with UCX peer error handling: when UCX reports it unreachable (its
// process died, its socket closed) it is marked failed. UCX 1.13's
// shared-memory transports (posix/sysv fifos, cma) cannot report a dead peer,
// and asking for peer error handling would push local traffic onto TCP over
// loopback; so a peer on this host gets a shared-memory endpoint without it,
// and the transport watches the peer's process itself through a pidfd, polled
// every few milliseconds while a request waits. Either way every request
// involving a failed peer ends in an Error naming the rank. Nothing
// progresses in the background:
// Request::test() and wait() drive ucp_worker_progress. Calls into UCX are
// serialised by one mutex, so a communicator's progress thread and the
// caller's thread may share the transport. A world of one process creates no
// UCX objects at all.
//
// Tags (64 bits) are partitioned so concurrent operations never match each
// other; receives match the whole tag:
//   [63..52] communicator id  [51] kind (collective / point-to-point)
//   [50..36] operation sequence  [35..20] message index  [19..0] source world rank
// where a point-to-point message has its P2PTag in [50..20] instead (comm/p2p.h).
//
//   Request r = transport.irecv(peer, make_tag(comm, TagKind::collective, seq, 0, peer), buf,
//   bytes, "allreduce(ring)"); Request s = transport.isend(peer, make_tag(comm,
//   TagKind::collective, seq, 0, me), data, bytes, "allreduce(ring)"); s.wait(timeout);
//   r.wait(timeout);   // Error: "rank 1: allreduce(ring): rank 2 ... "
#pragma once

#include <poll.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/store.h"

namespace trainer::comm {

using Clock = std::chrono::steady_clock;

constexpr int kTagCommBits = 12;
constexpr int kTagSeqBits = 15;
constexpr int kTagMessageBits = 16;
constexpr int kTagRankBits = 20;
constexpr uint32_t kMaxCommunicators = 1u << kTagCommBits;

enum class TagKind : uint32_t { collective = 0, point_to_point = 1 };

// Sequence and message index wrap: only operations 2^15 apart share a tag.
inline uint64_t make_tag(uint32_t comm_id, TagKind kind, uint32_t seq, uint32_t message,
                         int source_world_rank) {
  constexpr uint64_t seq_mask = (1ull << kTagSeqBits) - 1, msg_mask = (1ull << kTagMessageBits) - 1;
  constexpr int msg_shift = kTagRankBits, seq_shift = msg_shift + kTagMessageBits,
                kind_shift = seq_shift + kTagSeqBits;
  return (uint64_t(comm_id) << (kind_shift + 1)) | (uint64_t(kind) << kind_shift) |
         ((seq & seq_mask) << seq_shift) | ((message & msg_mask) << msg_shift) |
         uint64_t(source_world_rank);
}

class Transport;

// Whether this process's UCX can move CUDA memory itself (ucp_context_query
// lists UCS_MEMORY_TYPE_CUDA: UCX built with CUDA and its cuda transports
// loadable). Probed once, with a context of its own.
bool ucx_supports_cuda_memory();

// A pending send or receive. Move-only. Destroying one that is still pending
// cancels it (receives) or lets it finish unobserved (sends): only do that
// when the operation failed, and keep the buffer alive until the transport is
// gone.
class Request {
 public:
  Request() = default;
  Request(Request&& other) noexcept { *this = std::move(other); }
  Request& operator=(Request&& other) noexcept;
  ~Request() { release(); }

  // Progresses the worker once; true when complete. Error when the peer failed.
  bool test();
  // Progresses until complete; Error naming the peer and the operation when the
  // peer fails or `timeout` passes.
  void wait(Millis timeout);
  bool pending() const { return ucx_ != nullptr; }

 private:
  friend class Transport;
  void release();
  [[noreturn]] void fail(const std::string& why);

  Transport* transport_ = nullptr;
  void* ucx_ = nullptr;  // the UCP request while pending
  int peer_ = -1;
  uint64_t tag_ = 0;
  bool is_send_ = false;
  size_t bytes_ = 0;
  const char* op_ = "";
};

class Transport {
 public:
  // Publishes this worker's address in the store, connects to every other
  // rank and meets them at a store barrier. store may be null for world size 1.
  // detect_peer_failure: see CommOptions.
  Transport(Store* store, int rank, int world_size, bool detect_peer_failure = true);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // `op` names the operation in errors; it must outlive the request (a literal).
  Request isend(int peer, uint64_t tag, const void* data, size_t bytes, const char* op);
  Request irecv(int peer, uint64_t tag, void* data, size_t bytes, const char* op);

  // One pass of ucp_worker_progress; true when it did something.
  bool progress();
  // Empty while the peer is healthy, else what failed (UCX's report, or the
  // exit of a local peer's process).
  std::string peer_failure(int peer) const;
  // True for this rank and for peers on this host (same kernel and pid
  // namespace): shared memory and cross-memory attach reach them.
  bool is_local(int peer) const;
  // The process id of a local peer (this rank: its own).
  long pid(int peer) const;
  // For an error about a silent peer: a peer on another host is probed (a
  // TCP connection attempt to its host: refused or accepted means the host
  // answers, no answer within a second means the link or the host is down);
  // a local one is said to be hung or dead. One clause, no trailing period.
  std::string reachability(int peer) const;
  // Polls a local peer's pidfd now (waits outside UCX, such as the shared-memory
  // channel's, call this) and returns peer_failure(peer).
  std::string poll_peer(int peer);

 private:
  friend class Request;
  struct Peer;
  struct Ucx;

  // Polls the pidfds of the local peers, at most once per kLivenessInterval
  // (looking at the clock every kLivenessSampling calls); the caller holds mutex_.
  void check_liveness_locked();
  // Blocks until the worker has events, a local peer exits, a short sleep
  // passes or the deadline comes (see Request::wait).
  void sleep_until_event(Clock::time_point deadline);
  // Appends a POLLIN entry for each local peer not yet known to have exited
  // to fds, and the peer to watched (when given), in the same order.
  void watch_local_peers(std::vector<pollfd>& fds, std::vector<Peer*>* watched) const;

  int rank_;
  int world_size_;
  std::unique_ptr<Ucx> ucx_;
  std::vector<std::unique_ptr<Peer>> peers_;
  Clock::time_point last_liveness_check_{};
  uint32_t liveness_calls_ = 0;
  mutable std::mutex mutex_;
};

}  // namespace trainer::comm
