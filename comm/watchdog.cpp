#include "comm/watchdog.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <set>
#include <thread>

namespace trainer::comm::watchdog {

namespace {

constexpr uint32_t kMagic = 0x57444f47;  // "WDOG"
constexpr uint32_t kVersion = 1;

struct OpRecord {
  char name[48];
  uint32_t comm, seq;
  int32_t peer;
  uint32_t pad;
  int64_t since_ns;
  uint64_t owner;  // the Wait that wrote it (0: none)
};

// The file layout, the same in the rank and the launcher (one binary).
// Writers hold g_mutex and make generation odd while they write, so a reader
// in another process retries until it reads an even, unchanged generation.
struct Record {
  uint32_t magic, version;
  int32_t rank, pid;
  char host[64];
  std::atomic<uint32_t> generation;
  uint32_t pad;
  std::atomic<int64_t> heartbeat_ns;
  uint64_t completed;
  OpRecord last, waiting;
};
static_assert(std::atomic<int64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

std::mutex g_mutex;  // writers of the record
Record g_memory{};   // the record without a status file
Record* g_record = &g_memory;
std::atomic<uint64_t> g_next_wait{1};
std::once_flag g_started;

void copy_name(char (&dst)[48], const char* src) {
  std::strncpy(dst, src ? src : "", sizeof dst - 1);
  dst[sizeof dst - 1] = '\0';
}

// Maps the status file of this rank; null when it cannot (the record then
// stays in memory and the launcher sees no file: it reports that).
Record* map_status_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return nullptr;
  if (::ftruncate(fd, sizeof(Record)) != 0) {
    ::close(fd);
    return nullptr;
  }
  void* p = ::mmap(nullptr, sizeof(Record), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  return p == MAP_FAILED ? nullptr : static_cast<Record*>(p);
}

void heartbeat(Record* record, int interval_ms) {
  for (;;) {
    record->heartbeat_ns.store(monotonic_ns(), std::memory_order_relaxed);
    std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
  }
}

std::string seconds(int64_t ns) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", double(ns) / 1e9);
  return text;
}

std::string op_text(const Op& op) {
  return cat(op.name, " #", op.seq, " of communicator ", op.comm);
}

}  // namespace

int64_t monotonic_ns() {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

void start(const Bootstrap& boot) {
  std::call_once(g_started, [&] {
    Record* record = &g_memory;
    if (!boot.status_dir.empty())
      if (Record* mapped = map_status_file(status_path(boot.status_dir, boot.rank)))
        record = mapped;
    std::lock_guard<std::mutex> lock(g_mutex);
    if (record != &g_memory) {  // what was recorded before, carried over
      record->completed = g_memory.completed;
      record->last = g_memory.last;
      record->waiting = g_memory.waiting;
    }
    record->rank = boot.rank;
    record->pid = int32_t(::getpid());
    ::gethostname(record->host, sizeof record->host - 1);
    record->heartbeat_ns.store(monotonic_ns());
    record->version = kVersion;
    std::atomic_thread_fence(std::memory_order_release);
    record->magic = kMagic;
    g_record = record;
    if (record != &g_memory)
      std::thread(heartbeat, record, std::max(10, boot.heartbeat_ms)).detach();
  });
}

Wait::Wait(const char* op, uint32_t comm, uint32_t seq, int peer)
    : id_(g_next_wait.fetch_add(1, std::memory_order_relaxed)) {
  std::lock_guard<std::mutex> lock(g_mutex);
  Record& r = *g_record;
  r.generation.fetch_add(1, std::memory_order_acq_rel);
  copy_name(r.waiting.name, op);
  r.waiting.comm = comm;
  r.waiting.seq = seq;
  r.waiting.peer = peer;
  r.waiting.since_ns = monotonic_ns();
  r.waiting.owner = id_;
  r.generation.fetch_add(1, std::memory_order_release);
}

void Wait::done() {
  std::lock_guard<std::mutex> lock(g_mutex);
  Record& r = *g_record;
  r.generation.fetch_add(1, std::memory_order_acq_rel);
  // Another thread's wait may have replaced this one's record: it stays.
  if (r.waiting.owner == id_) {
    r.last = r.waiting;
    r.waiting = OpRecord{};
  }
  ++r.completed;
  r.generation.fetch_add(1, std::memory_order_release);
}

void completed(const char* op, uint32_t comm, uint32_t seq) {
  std::lock_guard<std::mutex> lock(g_mutex);
  Record& r = *g_record;
  r.generation.fetch_add(1, std::memory_order_acq_rel);
  copy_name(r.last.name, op);
  r.last.comm = comm;
  r.last.seq = seq;
  r.last.peer = -1;
  r.last.owner = 0;
  ++r.completed;
  r.generation.fetch_add(1, std::memory_order_release);
}

std::string describe() {
  std::lock_guard<std::mutex> lock(g_mutex);
  const OpRecord& last = g_record->last;
  if (last.name[0] == '\0') return "no operation completed yet";
  return cat("last completed: ", last.name, " #", last.seq, " of communicator ", last.comm);
}

std::string status_path(const std::string& dir, int rank) { return cat(dir, "/rank-", rank); }

std::optional<Status> read_status(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return std::nullopt;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || size_t(st.st_size) < sizeof(Record)) {
    ::close(fd);
    return std::nullopt;
  }
  void* p = ::mmap(nullptr, sizeof(Record), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return std::nullopt;
  const Record& r = *static_cast<const Record*>(p);
  std::optional<Status> out;
  for (int attempt = 0; attempt < 1000 && !out; ++attempt) {
    const uint32_t before = r.generation.load(std::memory_order_acquire);
    if (before % 2) continue;
    if (r.magic != kMagic || r.version != kVersion) break;
    Status s;
    s.rank = r.rank;
    s.pid = r.pid;
    s.host.assign(r.host, strnlen(r.host, sizeof r.host));
    s.heartbeat_ns = r.heartbeat_ns.load(std::memory_order_relaxed);
    s.completed = r.completed;
    for (auto [from, to] : {std::pair{&r.last, &s.last}, std::pair{&r.waiting, &s.waiting}}) {
      to->name.assign(from->name, strnlen(from->name, sizeof from->name));
      to->comm = from->comm;
      to->seq = from->seq;
      to->peer = from->peer;
      to->since_ns = from->since_ns;
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (r.generation.load(std::memory_order_acquire) == before) out = s;
  }
  ::munmap(p, sizeof(Record));
  return out;
}

std::vector<std::string> report(const std::vector<Status>& ranks, int64_t now_ns,
                                int64_t stale_ns) {
  std::vector<std::string> lines;
  std::set<int> known, waiting, waited_on;
  for (const Status& s : ranks) {
    known.insert(s.rank);
    std::string line = cat("rank ", s.rank, " on ", s.host, " (pid ", s.pid, "): ");
    const bool stale = stale_ns > 0 && now_ns - s.heartbeat_ns > stale_ns;
    if (stale)
      line += cat("not running: no heartbeat for ", seconds(now_ns - s.heartbeat_ns), " s; ");
    line +=
        s.last.name.empty() ? "no operation completed" : cat("last completed ", op_text(s.last));
    if (s.waiting.name.empty()) {
      line += "; waiting on nothing";
    } else {
      if (!stale) waiting.insert(s.rank);  // a stopped rank waits on nobody
      waited_on.insert(s.waiting.peer);
      line += cat("; waiting ", seconds(now_ns - s.waiting.since_ns), " s in ", op_text(s.waiting),
                  " for rank ", s.waiting.peer);
    }
    lines.push_back(line);
  }
  // A rank others wait on that waits on nothing itself is where the job
  // stopped; one of another host is named too (its launcher says more).
  std::string never;
  for (int r : waited_on)
    if (!waiting.count(r))
      never += cat(never.empty() ? "" : ", ", r, known.count(r) ? "" : " (of another node)");
  if (!never.empty())
    lines.push_back(
        cat("never arrived: ", never, " (waited on by the ranks above, and waiting on nothing)"));
  return lines;
}

}  // namespace trainer::comm::watchdog
