// Communicators: a group of ranks with its own tag space. init_world()
// connects every process of the job (store, UCX transport) and returns the
// world communicator; split(color, key) makes the sub-groups that carry the
// data-, pipeline- and tensor-parallel traffic. Collectives live in
// comm/collectives.h; this header owns membership, ids, sequence numbers,
// point-to-point messages (tags and routing: comm/p2p.h) and the progress
// thread of non-blocking work.
//
//   auto world = init_world(detect_bootstrap(), {.timeout = Millis(60000)});
//   auto tp = world->split(world->rank() / 4, world->rank());   // groups of 4
//   Work w = tp->send(t, /*peer=*/1, {.micro_batch = 7});
//   w.wait();
//
// Glossary: rank = index in this communicator, world rank = index in the job,
// size = ranks in this communicator, id = the communicator's field of the tag
// (unique among the communicators of each process), seq = per-communicator
// operation counter (every rank issues operations in the same order).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "comm/bootstrap.h"
#include "comm/p2p.h"
#include "comm/shm_channel.h"
#include "comm/transport.h"
#include "comm/work.h"
#include "core/tensor.h"

namespace trainer::comm {

struct CommOptions {
  Millis timeout{300000};          // each wait of an operation without progress
  Millis connect_timeout{120000};  // reaching the store and the address exchange
  // A dead peer is reported within milliseconds: a peer on another host
  // through UCX peer error handling (TCP, or whatever the network offers), a
  // peer on this host by watching its process (pidfd) while its traffic runs
  // over shared memory (see comm/transport.h). false turns both off, leaving
  // dead peers to the timeout.
  bool detect_peer_failure = true;
  // Collectives of a communicator whose members all run on this host go
  // through a shared-memory channel (comm/shm_channel.h); false keeps them on UCX.
  bool shared_memory = true;
};

class ProgressThread;
struct World;

class Communicator {
 public:
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return int(members_.size()); }
  int world_rank(int rank) const { return members_[rank]; }
  uint32_t id() const { return id_; }
  const CommOptions& options() const { return options_; }
  Transport& transport() const;

  // Ranks passing the same color form a communicator, ordered by (key, rank
  // in this one); a negative color joins none and gets nullptr. Collective
  // over this communicator.
  std::shared_ptr<Communicator> split(int color, int key);

  // Point-to-point (comm/p2p.h), non-blocking: the message is posted before
  // these return; Work::wait() completes it. tensor: contiguous, on the CPU
  // (or a GPU where UCX moves CUDA memory, ucx_supports_cuda_memory()), kept
  // alive by the Work; recv fills it in place with the peer's send of the same
  // tag, which must have the same byte count. Error for a peer out of range or
  // this rank, a tag field out of range or a tensor that does not qualify;
  // wait() throws one naming the peer (and its world rank) and the tag when
  // the peer died, sent another size, or nothing came within the timeout.
  Work send(const Tensor& tensor, int peer, const P2PTag& tag, const P2POptions& options = {});
  Work recv(const Tensor& tensor, int peer, const P2PTag& tag, const P2POptions& options = {});

  // ---- used by the collectives ----
  // The sequence number of the next operation; taken when it is issued.
  uint32_t next_seq() { return seq_.fetch_add(1); }
  // Runs fn on this communicator's progress thread after the work queued before it.
  Work enqueue(std::function<void()> fn);
  // The shared-memory channel when every member runs on this host (and
  // options().shared_memory), else null. Created on the first call, which is
  // collective: every rank makes it at the same point of its issue order.
  ShmChannel* shm();
  // Collective: a shared region (comm/shm_region.h) of bytes per rank that
  // every member maps, registered with the shared-memory channel so that
  // collectives on buffers inside it run in place. Null (on every rank)
  // without a channel or when a rank cannot map it: use ordinary memory then.
  std::shared_ptr<ShmRegion> share_memory(size_t bytes);

 private:
  friend std::shared_ptr<Communicator> init_world(const Bootstrap& boot,
                                                  const CommOptions& options);
  Communicator(std::shared_ptr<World> world, uint32_t id, std::vector<int> members, int rank,
               const CommOptions& options);

  std::shared_ptr<World> world_;
  uint32_t id_;
  std::vector<int> members_;  // world rank of each rank
  int rank_;
  CommOptions options_;
  std::atomic<uint32_t> seq_{0};
  std::mutex shm_mutex_;
  bool shm_created_ = false;
  uint64_t regions_created_ = 0;
  std::unique_ptr<ShmChannel> shm_;  // before progress_: outlives the thread that may use it
  std::unique_ptr<ProgressThread> progress_;
};

// Connects this process to the job described by boot (rank 0 serves the store).
std::shared_ptr<Communicator> init_world(const Bootstrap& boot, const CommOptions& options = {});

}  // namespace trainer::comm
