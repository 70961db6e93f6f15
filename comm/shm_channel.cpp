#include "comm/shm_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstring>
#include <exception>
#include <thread>

#include "comm/log.h"
#include "comm/watchdog.h"
#include "core/check.h"

namespace trainer::comm {

namespace {

// A waiting rank checks the peer's stage kSpinChecks times (a running peer
// answers within a microsecond or two), then yields its core until
// kYieldTime has passed, then sleeps on the peer's stage word, at most
// kMaxSleep at a time so that it polls the peer's process at least that
// often. Measured on the loaded 2-core machine, spinning longer makes small
// allreduces several times slower (the spinner holds the core its peer
// needs); as in the transport, a sleeper is woken as soon as the peer publishes.
constexpr int kSpinChecks = 64;
constexpr std::chrono::microseconds kYieldTime{20};
constexpr std::chrono::microseconds kMaxSleep{1000};
constexpr std::chrono::microseconds kLivenessInterval{1000};
constexpr uint64_t kProbeValue = 0x7472616e6572636dull;  // what the cross-memory probe reads

// The stage a rank reaches in phase p of the operation with ticket t; wraps,
// compared by signed difference: the ranks are at most two operations apart,
// far from the 2^15 operations at which stages would meet.
uint32_t stage_of(uint64_t ticket, uint32_t phase) {
  return uint32_t(ticket * (uint64_t(ShmChannel::kMaxPhase) + 1) + phase);
}
bool reached(uint32_t stage, uint32_t target) { return int32_t(stage - target) >= 0; }

void futex_wait(std::atomic<uint32_t>* word, uint32_t value, std::chrono::microseconds timeout) {
  timespec ts{0, long(timeout.count()) * 1000};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, value, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Reads bytes at remote in process pid into dst; 0 or the errno.
int read_process(long pid, uint64_t remote, void* dst, size_t bytes) {
  char* out = static_cast<char*>(dst);
  while (bytes > 0) {
    iovec local_iov{out, bytes}, remote_iov{reinterpret_cast<void*>(remote), bytes};
    ssize_t n = ::process_vm_readv(pid_t(pid), &local_iov, 1, &remote_iov, 1, 0);
    if (n <= 0) return n < 0 ? errno : EFAULT;
    out += n;
    remote += uint64_t(n);
    bytes -= size_t(n);
  }
  return 0;
}

size_t round_up(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }

}  // namespace

// One rank's control block; written by its rank, read by the others.
struct alignas(64) ShmChannel::Slot {
  std::atomic<uint32_t> stage;     // stage_of(ticket, phase) reached
  std::atomic<uint32_t> sleepers;  // peers sleeping on stage (wake them after publishing)
  // The rank's buffer and its size in the operations of even and odd tickets:
  // a staged operation finishes without waiting for its readers, so the
  // rank may post the next one while a peer still checks this one's size.
  std::atomic<uint64_t> address[2];
  std::atomic<uint64_t> bytes[2];
  // Where the buffer lies in a shared region: the offset and the region's id (0: none).
  std::atomic<uint64_t> region_offset[2];
  std::atomic<uint32_t> region[2];
  // Read once, at setup, so they may spill into a second cache line.
  uint64_t probe;          // kProbeValue, read by the peers' probe
  uint64_t probe_address;  // where probe lives in the rank's address space
};

ShmChannel::ShmChannel(Transport& transport, std::vector<int> members, int rank)
    : transport_(transport), members_(std::move(members)), rank_(rank) {
  for (int world : members_) pids_.push_back(transport_.pid(world));
}

ShmChannel::~ShmChannel() {
  if (base_) ::munmap(base_, bytes_);
}

ShmChannel::Slot& ShmChannel::slot(int r) const {
  // Everything a peer reads in every operation (stage, bytes, region) shares
  // one cache line: a line more per operation costs a transfer between cores.
  static_assert(offsetof(Slot, probe) == 64, "the per-operation fields fill one cache line");
  return static_cast<Slot*>(base_)[r];
}

std::unique_ptr<ShmChannel> ShmChannel::create(Store& store, Transport& transport,
                                               const std::vector<int>& members, int rank,
                                               uint32_t comm_id) {
  const int n = int(members.size());
  if (n < 2) return nullptr;
  // Locality is symmetric (equal process identities), so every member decides alike.
  for (int world : members)
    if (!transport.is_local(world)) return nullptr;
  std::string key = cat("shm/", comm_id, "/");
  for (int world : members) key += cat(world, ",");

  std::unique_ptr<ShmChannel> channel(new ShmChannel(transport, members, rank));
  channel->comm_id_ = comm_id;
  const size_t slots_bytes = round_up(sizeof(Slot) * size_t(n), 4096);
  channel->bytes_ = slots_bytes + size_t(n) * 2 * kStagingBytes;
  // Rank 0's memfd, which the peers open through /proc (as shared regions'
  // parts are): no name in /dev/shm, so nothing outlives the processes, even
  // a rank 0 killed before every peer has opened it.
  int fd = -1;
  std::string why;
  if (rank == 0) {
    fd = ::memfd_create("trainer-channel", MFD_CLOEXEC);
    if (fd >= 0 && ::ftruncate(fd, off_t(channel->bytes_)) != 0) {
      why = cat("cannot size a memfd to ", channel->bytes_, " bytes: ", std::strerror(errno));
      ::close(fd);
      fd = -1;
    } else if (fd < 0) {
      why = cat("memfd_create: ", std::strerror(errno));
    }
    store.set(key + "fd", std::to_string(fd));
  } else {
    const int theirs = std::stoi(store.get(key + "fd"));
    const std::string path = cat("/proc/", channel->pids_[0], "/fd/", theirs);
    if (theirs >= 0) fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (theirs >= 0 && fd < 0)
      why = cat("cannot open rank ", members[0], "'s channel memory (", path,
                "): ", std::strerror(errno));
    else if (theirs < 0)
      why = cat("rank ", members[0], " could not create the channel's memory");
  }
  if (fd >= 0) {
    void* base = ::mmap(nullptr, channel->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base != MAP_FAILED)
      channel->base_ = base;
    else
      why = cat("cannot map the channel's memory: ", std::strerror(errno));
  }
  if (channel->base_) {
    Slot& mine = channel->slot(rank);
    mine.stage.store(stage_of(0, kMaxPhase));  // as if a ticket 0 had finished
    mine.sleepers.store(0);
    mine.probe = kProbeValue;
    mine.probe_address = reinterpret_cast<uint64_t>(&mine.probe);
  }
  store.barrier(key + "mapped", n);
  if (fd >= 0) ::close(fd);  // every peer has opened it (or given up)
  // Cross-memory attach needs ptrace permission over the peers; try it.
  for (int r = 0; r < n && channel->base_ && why.empty(); ++r) {
    uint64_t value = 0;
    if (r == rank) continue;
    int error = read_process(channel->pids_[size_t(r)], channel->slot(r).probe_address, &value,
                             sizeof(value));
    if (error || value != kProbeValue)
      why = cat("cannot read rank ", members[size_t(r)],
                "'s memory (process_vm_readv: ", error ? std::strerror(error) : "wrong value", ")");
  }
  if (!why.empty()) store.add(key + "failed", 1);
  store.barrier(key + "probed", n);
  const int64_t failed = store.add(key + "failed", 0);
  if (failed > 0) {
    // The rank that failed says why at warn level (a job that falls back to
    // UCX on one host runs several times slower); the others at debug.
    COMM_LOG(why.empty() ? LogLevel::debug : LogLevel::warn, "communicator ", comm_id,
             ": no shared-memory channel (", failed, " ranks failed",
             why.empty() ? "" : "; here: ", why, "); collectives use UCX");
    return nullptr;
  }
  COMM_LOG(LogLevel::debug, "communicator ", comm_id, ": shared-memory channel over ", n,
           " local ranks (", channel->bytes_, " bytes)");
  return channel;
}

// ---- Turn ----

ShmChannel::Turn::Turn(ShmChannel& channel, uint64_t ticket, const char* op, Millis timeout)
    : channel_(channel), ticket_(ticket), op_(op), timeout_(timeout) {
  std::unique_lock<std::mutex> lock(channel_.turn_mutex_);
  if (!channel_.turn_cv_.wait_for(lock, timeout, [&] { return channel_.turn_ == ticket; }))
    throw Error(cat("rank ", channel_.members_[size_t(channel_.rank_)], ": ", op,
                    ": the operation issued before it on this communicator did not finish within ",
                    timeout.count(), " ms"));
}

ShmChannel::Turn::~Turn() {
  if (std::uncaught_exceptions() == 0)
    watchdog::completed(op_, channel_.comm_id_, uint32_t(ticket_));
  {
    std::lock_guard<std::mutex> lock(channel_.turn_mutex_);
    channel_.turn_ = ticket_ + 1;
  }
  channel_.turn_cv_.notify_all();
}

void ShmChannel::add_region(const std::shared_ptr<ShmRegion>& region) {
  std::lock_guard<std::mutex> lock(regions_mutex_);
  std::erase_if(regions_, [](const std::weak_ptr<ShmRegion>& r) { return r.expired(); });
  regions_.push_back(region);
}

std::shared_ptr<ShmRegion> ShmChannel::find_region(const void* data, size_t bytes) {
  std::lock_guard<std::mutex> lock(regions_mutex_);
  for (const std::weak_ptr<ShmRegion>& weak : regions_)
    if (std::shared_ptr<ShmRegion> region = weak.lock(); region && region->contains(data, bytes))
      return region;
  return nullptr;
}

void ShmChannel::Turn::post(const void* data, size_t bytes, uint64_t region,
                            uint64_t region_offset) {
  Slot& mine = channel_.slot(channel_.rank_);
  const int parity = int(ticket_ % 2);
  mine.address[parity].store(reinterpret_cast<uint64_t>(data), std::memory_order_relaxed);
  mine.bytes[parity].store(bytes, std::memory_order_relaxed);
  CHECK(region <= UINT32_MAX) << "shared region id " << region;
  mine.region[parity].store(uint32_t(region), std::memory_order_relaxed);
  mine.region_offset[parity].store(region_offset, std::memory_order_relaxed);
}

void ShmChannel::Turn::publish(uint32_t phase) {
  Slot& mine = channel_.slot(channel_.rank_);
  mine.stage.store(stage_of(ticket_, phase));
  if (mine.sleepers.load() > 0) futex_wake_all(&mine.stage);
}

void ShmChannel::Turn::wait_all(uint32_t phase) {
  const Slot& mine = channel_.slot(channel_.rank_);
  for (int p = 0; p < channel_.size(); ++p) {
    if (p == channel_.rank_) continue;
    wait_stage(p, stage_of(ticket_, phase), "to reach the same step of the operation");
    if (phase != 1) continue;
    const Slot& peer = channel_.slot(p);
    const int parity = int(ticket_ % 2);
    const uint64_t theirs = peer.bytes[parity].load(std::memory_order_relaxed),
                   ours = mine.bytes[parity].load(std::memory_order_relaxed);
    if (theirs != ours)
      fail(p, cat("it passed ", theirs, " bytes, this rank ", ours,
                  "; do all ranks pass the same count?"));
    const uint64_t their_region = peer.region[parity].load(std::memory_order_relaxed),
                   our_region = mine.region[parity].load(std::memory_order_relaxed),
                   their_offset = peer.region_offset[parity].load(std::memory_order_relaxed),
                   our_offset = mine.region_offset[parity].load(std::memory_order_relaxed);
    if (their_region != our_region || their_offset != our_offset)
      fail(p, cat("its buffer lies in shared region ", their_region, " at offset ", their_offset,
                  ", this rank's in region ", our_region, " at offset ", our_offset,
                  " (0: none); every rank must place the buffer alike"));
  }
}

void ShmChannel::Turn::wait_previous() {
  for (int p = 0; p < channel_.size(); ++p)
    if (p != channel_.rank_)
      wait_stage(p, stage_of(ticket_ - 1, 1), "to finish the previous operation");
}

char* ShmChannel::Turn::area(int peer, int index) const {
  const size_t slots_bytes = round_up(sizeof(Slot) * size_t(channel_.size()), 4096);
  return static_cast<char*>(channel_.base_) + slots_bytes +
         (size_t(peer) * 2 + size_t(index)) * kStagingBytes;
}

void ShmChannel::Turn::read_peer(int peer, size_t offset, void* dst, size_t bytes) const {
  if (bytes == 0) return;
  const uint64_t remote =
      channel_.slot(peer).address[ticket_ % 2].load(std::memory_order_relaxed) + offset;
  int error = read_process(channel_.pids_[size_t(peer)], remote, dst, bytes);
  if (error == ESRCH)
    fail(peer, cat("its process, pid ", channel_.pids_[size_t(peer)], ", exited"));
  if (error) fail(peer, cat("reading ", bytes, " bytes of its buffer: ", std::strerror(error)));
}

void ShmChannel::Turn::wait_stage(int peer, uint32_t target, const char* what) {
  Slot& s = channel_.slot(peer);
  if (reached(s.stage.load(std::memory_order_acquire), target)) return;
  const Clock::time_point start = Clock::now(), deadline = start + timeout_;
  Clock::time_point last_poll = start;
  const int world_peer = channel_.members_[size_t(peer)];
  watchdog::Wait watch(op_, channel_.comm_id_, uint32_t(ticket_), world_peer);
  for (;;) {
    for (int i = 0; i < kSpinChecks; ++i) {
      if (reached(s.stage.load(std::memory_order_acquire), target)) return watch.done();
      __builtin_ia32_pause();
    }
    const Clock::time_point now = Clock::now();
    if (now - last_poll >= kLivenessInterval) {
      last_poll = now;
      if (std::string failure = channel_.transport_.poll_peer(world_peer); !failure.empty())
        fail(peer, cat("waiting for it ", what, ": ", failure));
    }
    if (now >= deadline)
      fail(peer, cat("waiting for it ", what, ": timed out after ", timeout_.count(),
                     " ms; the peer is hung or dead, or the ranks issued operations in different "
                     "orders; ",
                     watchdog::describe()));
    if (now - start < kYieldTime) {
      std::this_thread::yield();
      continue;
    }
    s.sleepers.fetch_add(1);
    const uint32_t stage = s.stage.load();
    if (!reached(stage, target)) futex_wait(&s.stage, stage, kMaxSleep);
    s.sleepers.fetch_sub(1);
  }
}

void ShmChannel::Turn::fail(int peer, const std::string& why) const {
  throw Error(cat("rank ", channel_.members_[size_t(channel_.rank_)], ": ", op_, ": rank ",
                  channel_.members_[size_t(peer)], " (", why, ")"));
}

}  // namespace trainer::comm
