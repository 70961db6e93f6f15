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

std::mutex g_mutex;       // writers of the record
StatusRecord g_memory{};  // the record without a status file
StatusRecord* g_record = &g_memory;
std::atomic<uint64_t> g_next_wait{1};
std::once_flag g_started;

void copy_name(char (&dst)[48], const char* src) {
  std::strncpy(dst, src ? src : "", sizeof dst - 1);
  dst[sizeof dst - 1] = '\0';
}

// Maps the status file of this rank; null when it cannot (the record then
// stays in memory and the launcher sees no file: it reports that).
StatusRecord* map_status_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return nullptr;
  if (::ftruncate(fd, sizeof(StatusRecord)) != 0) {
    ::close(fd);
    return nullptr;
  }
  void* p = ::mmap(nullptr, sizeof(StatusRecord), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  return p == MAP_FAILED ? nullptr : static_cast<StatusRecord*>(p);
}

void heartbeat(StatusRecord* record, int interval_ms) {
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

Op read_op(const StatusOpRecord& from) {
  return {std::string(from.name, strnlen(from.name, sizeof from.name)), from.comm, from.seq,
          from.peer, from.since_ns};
}

// Reads the operation fields of r into s as of one even, unchanged
// generation. False (s's left as they were) when none came within about a
// millisecond: the writer is stopped inside an update, or was descheduled
// there all that time; the reader never waits longer.
bool read_ops(const StatusRecord& r, Status& s) {
  constexpr int kSpins = 100;  // an update takes well under a microsecond
  constexpr int64_t kPatienceNs = 1000000;
  const int64_t give_up = monotonic_ns() + kPatienceNs;
  for (int attempt = 0;; ++attempt) {
    if (attempt >= kSpins) {
      if (monotonic_ns() > give_up) return false;
      std::this_thread::yield();  // a descheduled writer may finish
    }
    const uint32_t before = r.generation.load(std::memory_order_acquire);
    if (before % 2) continue;
    const uint64_t completed = r.completed;
    Op last = read_op(r.last), waiting = read_op(r.waiting);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (r.generation.load(std::memory_order_relaxed) != before) continue;
    s.completed = completed;
    s.last = std::move(last);
    s.waiting = std::move(waiting);
    return true;
  }
}

}  // namespace

int64_t monotonic_ns() {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

void start(const Bootstrap& boot) {
  std::call_once(g_started, [&] {
    StatusRecord* record = &g_memory;
    if (!boot.status_dir.empty())
      if (StatusRecord* mapped = map_status_file(status_path(boot.status_dir, boot.rank)))
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
    record->version = StatusRecord::kVersion;
    std::atomic_thread_fence(std::memory_order_release);
    record->magic = StatusRecord::kMagic;
    g_record = record;
    if (record != &g_memory)
      std::thread(heartbeat, record, std::max(10, boot.heartbeat_ms)).detach();
  });
}

Wait::Wait(const char* op, uint32_t comm, uint32_t seq, int peer)
    : id_(g_next_wait.fetch_add(1, std::memory_order_relaxed)) {
  std::lock_guard<std::mutex> lock(g_mutex);
  StatusRecord& r = *g_record;
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
  StatusRecord& r = *g_record;
  r.generation.fetch_add(1, std::memory_order_acq_rel);
  // Another thread's wait may have replaced this one's record: it stays.
  if (r.waiting.owner == id_) {
    r.last = r.waiting;
    r.waiting = StatusOpRecord{};
  }
  ++r.completed;
  r.generation.fetch_add(1, std::memory_order_release);
}

void completed(const char* op, uint32_t comm, uint32_t seq) {
  std::lock_guard<std::mutex> lock(g_mutex);
  StatusRecord& r = *g_record;
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
  const StatusOpRecord& last = g_record->last;
  if (last.name[0] == '\0') return "no operation completed yet";
  return cat("last completed: ", last.name, " #", last.seq, " of communicator ", last.comm);
}

std::string status_path(const std::string& dir, int rank) { return cat(dir, "/rank-", rank); }

std::optional<Status> read_status(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return std::nullopt;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || size_t(st.st_size) < sizeof(StatusRecord)) {
    ::close(fd);
    return std::nullopt;
  }
  void* p = ::mmap(nullptr, sizeof(StatusRecord), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return std::nullopt;
  const StatusRecord& r = *static_cast<const StatusRecord*>(p);
  std::optional<Status> out;
  if (r.magic == StatusRecord::kMagic && r.version == StatusRecord::kVersion) {
    std::atomic_thread_fence(std::memory_order_acquire);  // what start() wrote before magic
    Status s;
    s.rank = r.rank;
    s.pid = r.pid;
    s.host.assign(r.host, strnlen(r.host, sizeof r.host));
    s.heartbeat_ns = r.heartbeat_ns.load(std::memory_order_relaxed);
    s.ops_consistent = read_ops(r, s);
    out = std::move(s);
  }
  ::munmap(p, sizeof(StatusRecord));
  return out;
}

std::vector<std::string> report(const std::vector<Status>& ranks, int64_t now_ns,
                                int64_t stale_ns) {
  std::vector<std::string> lines;
  std::set<int> known, waiting, waited_on, unknown;
  for (const Status& s : ranks) {
    known.insert(s.rank);
    std::string line = cat("rank ", s.rank, " on ", s.host, " (pid ", s.pid, "): ");
    const bool stale = !s.killed && stale_ns > 0 && now_ns - s.heartbeat_ns > stale_ns;
    if (s.killed) line += "killed by a signal; ";
    if (stale)
      line += cat("not running: no heartbeat for ", seconds(now_ns - s.heartbeat_ns), " s; ");
    if (!s.ops_consistent) {
      // A stopped rank is where the job stopped, whatever it was doing; a
      // running one may be waiting on anyone: it is not named below.
      if (!stale && !s.killed) unknown.insert(s.rank);
      line += s.killed ? "killed in the middle of updating its operation record"
              : stale  ? "stopped in the middle of updating its operation record"
                       : "its operation record was being updated at every read";
      line += ": last completed and waited-on operations unknown";
      lines.push_back(line);
      continue;
    }
    line +=
        s.last.name.empty() ? "no operation completed" : cat("last completed ", op_text(s.last));
    if (s.waiting.name.empty()) {
      line += "; waiting on nothing";
    } else if (s.killed) {
      // Killed while it waited: the one it waited on is not why.
      line += cat("; was waiting in ", op_text(s.waiting), " for rank ", s.waiting.peer);
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
    if (!waiting.count(r) && !unknown.count(r))
      never += cat(never.empty() ? "" : ", ", r, known.count(r) ? "" : " (of another node)");
  if (!never.empty())
    lines.push_back(
        cat("never arrived: ", never, " (waited on by the ranks above, and waiting on nothing)"));
  return lines;
}

}  // namespace trainer::comm::watchdog
