// The watchdog: what this rank is doing in communication, kept where its
// launcher can read it, and a heartbeat that says it is still scheduled.
//
// Every wait of a collective or point-to-point operation (transport requests,
// the shared-memory channel's stages) records the operation it belongs to
// (name, communicator id, number: a collective's sequence number on its
// communicator, or on the shared-memory channel its ticket; a
// point-to-point message's micro-batch) and the world rank it waits on;
// when the wait completes, the operation becomes the rank's last completed
// one. A timed-out wait quotes that record in its error. Under
// `trainer launch` (Bootstrap::status_dir set) the record lives in a small
// file of the launcher's status directory, status_path(dir, rank), that a
// thread of the rank stamps with a heartbeat every heartbeat_ms. The launcher
// reads the files to name a rank that stops being scheduled (SIGSTOP, a
// frozen VM) within its heartbeat timeout, and, when the job fails, to print
// one line per rank: host, last completed operation, the operation it waits
// in and for whom, and the ranks that never arrived. The heartbeat and the
// rank's identity are always readable; the operation fields are not when the
// rank stopped in the middle of updating them (Status::ops_consistent).
//
//   watchdog::start(boot);                                  // init_world does this
//   watchdog::Wait w("allreduce(ring)", comm_id, seq, peer);  // around a wait
//   ...; w.done();
//   std::optional<watchdog::Status> s = watchdog::read_status(watchdog::status_path(dir, 3));
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/bootstrap.h"

namespace trainer::comm::watchdog {

// Nanoseconds of CLOCK_MONOTONIC (comparable between processes of one host).
int64_t monotonic_ns();

// Opens this rank's status file (when boot.status_dir is set) and starts the
// heartbeat. Idempotent; without a status directory the record stays in memory.
void start(const Bootstrap& boot);

// One wait of an operation. Records the operation as waited on from
// construction; done() makes it the last completed one. A Wait destroyed
// without done() (the wait threw) leaves the record as it was: the rank
// died waiting there.
class Wait {
 public:
  Wait(const char* op, uint32_t comm, uint32_t seq, int peer);
  ~Wait() = default;
  Wait(const Wait&) = delete;
  Wait& operator=(const Wait&) = delete;
  void done();

 private:
  uint64_t id_;
};

// An operation that completed without waiting (or whose waits are done).
void completed(const char* op, uint32_t comm, uint32_t seq);

// "last completed: allreduce(ring) #57 of communicator 0" (or "no operation
// completed yet"), for errors.
std::string describe();

// An operation as the launcher sees it.
struct Op {
  std::string name;  // empty: none
  uint32_t comm = 0, seq = 0;
  int peer = -1;
  int64_t since_ns = 0;  // when the wait began
};

// A rank's status file, read by the launcher.
struct Status {
  int rank = -1;
  long pid = 0;
  std::string host;
  int64_t heartbeat_ns = 0;  // the last heartbeat (0: none yet)
  // False when the rank was in the middle of updating its operation fields
  // at every try of the reader (it was stopped there): completed, last and
  // waiting are then unknown and left empty.
  bool ops_consistent = true;
  uint64_t completed = 0;  // waits completed
  Op last, waiting;
  // Not in the file: the launcher sets it for a rank a signal ended (the
  // record is what it left; what it waited on is not why it ended).
  bool killed = false;
};

std::string status_path(const std::string& dir, int rank);
// nullopt when the file is missing, short or not a status file yet. Never
// blocks: a record whose operation fields stay mid-update for about a
// millisecond comes back with ops_consistent false, its heartbeat read.
std::optional<Status> read_status(const std::string& path);

// The status file's layout, the same in the rank and the launcher (one
// binary). rank, pid and host are written once, before magic; heartbeat_ns
// by the heartbeat thread alone, at any time. The operation fields
// (completed, last, waiting) change under the writers' mutex with generation
// odd meanwhile, so a reader in another process takes them as of an even,
// unchanged generation; a rank stopped (SIGSTOP, a frozen VM) inside an
// update leaves generation odd for good.
struct StatusOpRecord {
  char name[48];  // NUL-terminated by the writer; readers bound it all the same
  uint32_t comm, seq;
  int32_t peer;
  uint32_t pad;
  int64_t since_ns;
  uint64_t owner;  // the Wait that wrote it (0: none)
};
struct StatusRecord {
  static constexpr uint32_t kMagic = 0x57444f47;  // "WDOG"
  static constexpr uint32_t kVersion = 1;
  uint32_t magic, version;
  int32_t rank, pid;
  char host[64];  // as name
  std::atomic<uint32_t> generation;
  uint32_t pad;
  std::atomic<int64_t> heartbeat_ns;
  uint64_t completed;
  StatusOpRecord last, waiting;
};
static_assert(std::atomic<int64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

// Lines describing the ranks (one each, then the ranks that never arrived:
// those waited on that wait on nothing themselves, or were killed), for the
// launcher. stale_ns: ranks whose heartbeat is older than this are reported
// as not running; now_ns: the reader's clock.
std::vector<std::string> report(const std::vector<Status>& ranks, int64_t now_ns, int64_t stale_ns);

}  // namespace trainer::comm::watchdog
