// All-to-all: rank r's block for rank p lands in rank p's output at the
// place p gives for rank r (comm/collectives.h: all_to_all, all_to_all_v).
// The block a rank keeps is a local copy; the others move one of two ways.
//
// pairwise (ranks on several hosts, or without the shared-memory channel):
//   in step i = 1 .. n-1 rank r sends its block for r+i and receives the
//   block of r-i, so every step pairs each rank with one sender and one
//   receiver and no rank is everyone's first target; `in_flight` steps are
//   posted at once, the next one as soon as the oldest has completed. With
//   verify_sizes (all_to_all_v's raw form), a first round sends every peer
//   this rank's send and receive sizes, so every rank checks the whole size
//   matrix before any data moves: a mismatch is the same Error everywhere,
//   not a truncated message on one rank and a timeout on the others.
// shm (every rank on this host): phase 1, each rank writes a header into its
//   staging area (per destination: where its block lies, its send size and
//   the size it expects back) and, when its blocks for the others fit,
//   the blocks themselves; every rank reads every header and checks the size
//   matrix, then copies its block out of each peer's staging area, or reads
//   it from the peer's input by cross-memory attach (process_vm_readv) when
//   that peer's blocks did not fit. Phase 2, only when some rank was read
//   in place: nobody returns (and lets its caller change the input) while a
//   peer may still read it. A staged exchange costs one synchronisation and
//   two memcpys per byte; a read in place one kernel copy and two.
#include <cstring>
#include <deque>

#include "comm/algorithms.h"
#include "comm/log.h"

namespace trainer::comm {

namespace {

// The first pair (a, b) whose send size a -> b differs from what b expects
// from a, in a fixed order, so that every rank reports the same one.
// sends[a * n + b] / receives[b * n + a]: the sizes rank a sends to b and b expects from a.
void check_size_matrix(const std::vector<uint64_t>& sends, const std::vector<uint64_t>& receives,
                       const std::vector<int>& world_ranks, int rank, const char* op) {
  const size_t n = world_ranks.size();
  for (size_t a = 0; a < n; ++a)
    for (size_t b = 0; b < n; ++b)
      if (sends[a * n + b] != receives[b * n + a])
        throw Error(cat("rank ", world_ranks[size_t(rank)], ": ", op, ": rank ", world_ranks[a],
                        " sends ", sends[a * n + b], " bytes to rank ", world_ranks[b],
                        ", which expects ", receives[b * n + a],
                        " bytes from it; every rank's send_bytes[r] must equal rank r's "
                        "recv_bytes[that rank]"));
}

void copy_own_block(int rank, const char* input, const BlockLayout& send, char* output,
                    const BlockLayout& receive) {
  const size_t r = size_t(rank);
  if (send.bytes[r] > 0)
    std::memcpy(output + receive.offsets[r], input + send.offsets[r], send.bytes[r]);
}

// The pairwise first round: every rank learns every rank's send and receive sizes.
void exchange_sizes(OpChannel& ch, const BlockLayout& send, const BlockLayout& receive,
                    const std::vector<int>& world_ranks) {
  const int n = ch.size(), rank = ch.rank();
  // Row a: rank a's send sizes, then its receive sizes.
  std::vector<uint64_t> rows(size_t(n) * 2 * size_t(n));
  auto row = [&](int a) { return rows.data() + size_t(a) * 2 * size_t(n); };
  std::copy(send.bytes.begin(), send.bytes.end(), row(rank));
  std::copy(receive.bytes.begin(), receive.bytes.end(), row(rank) + n);
  const size_t row_bytes = 2 * size_t(n) * sizeof(uint64_t);
  std::vector<Request> requests;
  for (int i = 1; i < n; ++i) {
    const int from = (rank - i + n) % n, to = (rank + i) % n;
    requests.push_back(ch.irecv(from, 1, row(from), row_bytes));
    requests.push_back(ch.isend(to, 1, row(rank), row_bytes));
  }
  ch.wait_all(requests);
  std::vector<uint64_t> sends(size_t(n) * size_t(n)), receives(size_t(n) * size_t(n));
  for (int a = 0; a < n; ++a) {
    std::copy(row(a), row(a) + n, sends.begin() + a * n);
    std::copy(row(a) + n, row(a) + 2 * n, receives.begin() + a * n);
  }
  check_size_matrix(sends, receives, world_ranks, rank, "all_to_all_v");
}

}  // namespace

void all_to_all_pairwise(OpChannel& ch, const void* input, const BlockLayout& send, void* output,
                         const BlockLayout& receive, int in_flight, bool verify_sizes,
                         const std::vector<int>& world_ranks) {
  const int n = ch.size(), rank = ch.rank();
  const char* in = static_cast<const char*>(input);
  char* out = static_cast<char*>(output);
  if (verify_sizes && n > 1) exchange_sizes(ch, send, receive, world_ranks);
  copy_own_block(rank, in, send, out, receive);

  // Step i's receive from rank - i and send to rank + i (message 0).
  std::deque<std::vector<Request>> posted;
  auto post = [&](int i) {
    const size_t from = size_t((rank - i + n) % n), to = size_t((rank + i) % n);
    std::vector<Request> step;
    step.push_back(ch.irecv(int(from), 0, out + receive.offsets[from], receive.bytes[from]));
    step.push_back(ch.isend(int(to), 0, in + send.offsets[to], send.bytes[to]));
    posted.push_back(std::move(step));
  };
  const int window = std::max(1, in_flight);
  int next = 1;
  for (; next < n && next <= window; ++next) post(next);
  while (!posted.empty()) {
    ch.wait_all(posted.front());
    posted.pop_front();
    if (next < n) post(next++);
  }
}

namespace {

// A rank's header in its staging area: whether its blocks for the others
// are staged, then per destination where the block lies (in the staging
// area, or in the posted input), its size and the size expected back.
struct ShmHeader {
  static size_t bytes(int n) { return (1 + 3 * size_t(n)) * sizeof(uint64_t); }
  // The data after the header starts on a cache line.
  static size_t data_offset(int n) { return (bytes(n) + 63) / 64 * 64; }

  explicit ShmHeader(char* area) : words(reinterpret_cast<uint64_t*>(area)) {}
  uint64_t& staged() const { return words[0]; }
  uint64_t& where(int r) const { return words[1 + 3 * size_t(r)]; }
  uint64_t& send_bytes(int r) const { return words[2 + 3 * size_t(r)]; }
  uint64_t& receive_bytes(int r) const { return words[3 + 3 * size_t(r)]; }

  uint64_t* words;
};

}  // namespace

void all_to_all_shm(ShmChannel& ch, uint64_t ticket, Millis timeout, const void* input,
                    const BlockLayout& send, void* output, const BlockLayout& receive,
                    size_t staged_bytes, const std::vector<int>& world_ranks) {
  const char* op = "all_to_all(shm)";
  ShmChannel::Turn turn(ch, ticket, op, timeout);
  const int n = ch.size(), rank = ch.rank();
  const char* in = static_cast<const char*>(input);
  char* out = static_cast<char*>(output);

  size_t to_others = 0;
  for (int r = 0; r < n; ++r)
    if (r != rank) to_others += send.bytes[size_t(r)];
  const size_t data_offset = ShmHeader::data_offset(n);
  const bool staged = data_offset + to_others <= std::min(staged_bytes, ShmChannel::kStagingBytes);
  turn.wait_previous();  // the staging area of this ticket's parity is free
  char* area = turn.staging(rank);
  const ShmHeader mine(area);
  mine.staged() = staged;
  size_t at = data_offset;
  for (int r = 0; r < n; ++r) {
    const size_t bytes = send.bytes[size_t(r)];
    mine.send_bytes(r) = bytes;
    mine.receive_bytes(r) = receive.bytes[size_t(r)];
    mine.where(r) = staged && r != rank ? at : send.offsets[size_t(r)];
    if (staged && r != rank && bytes > 0)
      std::memcpy(area + at, in + send.offsets[size_t(r)], bytes);
    if (staged && r != rank) at += bytes;
  }
  // The sizes differ from rank to rank: the headers carry them (and the
  // matrix check below replaces the channel's equal-size check).
  turn.post(input, 0);
  turn.publish(1);
  turn.wait_all(1);

  std::vector<uint64_t> sends(size_t(n) * size_t(n)), receives(size_t(n) * size_t(n));
  bool read_in_place = false;
  for (int p = 0; p < n; ++p) {
    const ShmHeader theirs(turn.staging(p));
    read_in_place |= !theirs.staged();
    for (int r = 0; r < n; ++r) {
      sends[size_t(p) * size_t(n) + size_t(r)] = theirs.send_bytes(r);
      receives[size_t(p) * size_t(n) + size_t(r)] = theirs.receive_bytes(r);
    }
  }
  check_size_matrix(sends, receives, world_ranks, rank, op);
  COMM_LOG(LogLevel::debug, "all_to_all shm: ", to_others, " bytes to the other ranks, ",
           read_in_place ? "some read in place (cross-memory attach)" : "staged");

  copy_own_block(rank, in, send, out, receive);
  for (int i = 1; i < n; ++i) {
    const int p = (rank - i + n) % n;
    const ShmHeader theirs(turn.staging(p));
    const size_t bytes = receive.bytes[size_t(p)];
    char* dst = out + receive.offsets[size_t(p)];
    if (theirs.staged() && bytes > 0)
      std::memcpy(dst, turn.staging(p) + theirs.where(rank), bytes);
    else if (!theirs.staged())
      turn.read_peer(p, theirs.where(rank), dst, bytes);
  }
  if (read_in_place) {
    turn.publish(2);
    turn.wait_all(2);
  }
}

}  // namespace trainer::comm
