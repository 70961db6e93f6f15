#include "comm/transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "comm/log.h"
#include "comm/p2p.h"
#include "comm/traffic.h"
#include "comm/watchdog.h"
#include "core/check.h"

#define UCS_CHECK(expr)                                             \
  do {                                                              \
    ucs_status_t ucs_status_ = (expr);                              \
    CHECK(ucs_status_ == UCS_OK) << ucs_status_string(ucs_status_); \
  } while (0)

namespace trainer::comm {

namespace {
// A waiting thread first spins on progress (a message from a running peer
// arrives within microseconds), yielding its core after kSpinsBeforeYield idle
// passes (with more ranks than cores, spinning would starve the peer we wait
// for), and after kSpinTime sleeps on the worker's event fd together with the
// local peers' pidfds. Sleeping rather than yield-spinning matters on a busy
// machine: a spinning process uses up its share of the CPU and is scheduled
// late when the data arrives, a sleeping one is woken at once. A sleep lasts
// at most kMaxSleep, since another thread progressing the same worker may
// take the event meant for this one.
constexpr int kSpinsBeforeYield = 16;
constexpr std::chrono::microseconds kSpinTime{50};
constexpr Millis kMaxSleep{2};
// How long closing the endpoints may take at shutdown.
constexpr Millis kCloseTimeout{2000};
// How often a waiting request polls the local peers' pidfds: a dead local
// peer is reported this soon; one poll(2) costs about a microsecond.
constexpr std::chrono::microseconds kLivenessInterval{2000};
constexpr uint32_t kLivenessSampling = 32;  // every how many in-progress tests look at the clock

std::string first_line_of(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Processes with equal identities share a kernel (boot id) and a pid
// namespace, so one can watch the other by pid and UCX can reach it through
// shared memory and cma.
std::string process_identity() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  char ns[128] = {};
  ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  return cat(host, " ", first_line_of("/proc/sys/kernel/random/boot_id"), " ",
             n > 0 ? std::string(ns, size_t(n)) : std::string("?"));
}

// A pidfd of pid (readable once the process has exited), or -1.
int open_pidfd(long pid) {
#ifdef SYS_pidfd_open
  return int(::syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  return -1;
#endif
}

// The UCX transports of an endpoint's lanes, each once, in lane order, e.g.
// "posix/memory, cma/memory" or "tcp/eth0". UCX 1.13 has no query for them
// (ucp_ep_query reports names and socket addresses only), so they are read
// from ucp_ep_print_info's lines "lane[0]:  2:posix/memory.0 md[2] ...".
std::string endpoint_transports(ucp_ep_h ep) {
  char* text = nullptr;
  size_t size = 0;
  FILE* stream = ::open_memstream(&text, &size);
  if (!stream) return "unknown";
  ucp_ep_print_info(ep, stream);
  std::fclose(stream);
  std::istringstream lines(std::string(text, size));
  std::free(text);
  std::vector<std::string> transports;
  for (std::string line; std::getline(lines, line);) {
    const size_t lane = line.find("lane[");
    const size_t colon = lane == std::string::npos ? lane : line.find("]:", lane);
    if (colon == std::string::npos) continue;
    std::string resource;  // "2:posix/memory.0": resource index, transport/device.path index
    std::istringstream(line.substr(colon + 2)) >> resource;
    resource = resource.substr(resource.find(':') + 1);
    resource = resource.substr(0, resource.rfind('.'));
    if (!resource.empty() &&
        std::find(transports.begin(), transports.end(), resource) == transports.end())
      transports.push_back(resource);
  }
  std::string joined;
  for (const std::string& t : transports) joined += cat(joined.empty() ? "" : ", ", t);
  return joined.empty() ? "unknown" : joined;
}
}  // namespace

bool ucx_supports_cuda_memory() {
  static const bool supported = [] {
    ucp_config_t* config = nullptr;
    if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return false;
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG;
    ucp_context_h context = nullptr;
    ucs_status_t status = ucp_init(&params, config, &context);
    ucp_config_release(config);
    if (status != UCS_OK) return false;
    ucp_context_attr_t attr{};
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    bool cuda = ucp_context_query(context, &attr) == UCS_OK &&
                (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
    ucp_cleanup(context);
    return cuda;
  }();
  return supported;
}

struct Transport::Ucx {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int event_fd = -1;  // the worker's wakeup fd; -1: waiting threads yield instead
};

struct Transport::Peer {
  ~Peer() {
    if (pidfd >= 0) ::close(pidfd);
  }
  int rank = -1;
  ucp_ep_h ep = nullptr;
  long pid = 0;
  bool local = false;               // same host, kernel and pid namespace
  std::string host_address;         // where its host is reached (its store connection's address)
  int pidfd = -1;                   // local peers: watched for exit
  std::atomic<int> status{UCS_OK};  // set by the error callback (remote peers)
  std::atomic<bool> exited{false};  // set by check_liveness_locked (local peers)
  std::atomic<bool> silent{false};  // a wait on it timed out: its endpoint is closed by force

  bool failed() const { return exited.load() || status.load() != UCS_OK; }
};

namespace {
void on_peer_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* peer = static_cast<std::atomic<int>*>(arg);
  peer->store(int(status));
}
}  // namespace

Transport::Transport(Store* store, int rank, int world_size, bool detect_peer_failure)
    : rank_(rank), world_size_(world_size) {
  CHECK(rank >= 0 && rank < world_size) << rank << " of " << world_size;
  CHECK(world_size <= (1 << kTagRankBits)) << world_size;
  if (world_size == 1) return;
  CHECK(store != nullptr) << "a world of " << world_size << " ranks needs the store";

  ucx_ = std::make_unique<Ucx>();
  ucp_config_t* config = nullptr;
  UCS_CHECK(ucp_config_read(nullptr, nullptr, &config));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  UCS_CHECK(ucp_init(&params, config, &ucx_->context));
  ucp_config_release(config);

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // our mutex serialises every call
  UCS_CHECK(ucp_worker_create(ucx_->context, &wparams, &ucx_->worker));
  if (ucp_worker_get_efd(ucx_->worker, &ucx_->event_fd) != UCS_OK) ucx_->event_fd = -1;

  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  UCS_CHECK(ucp_worker_get_address(ucx_->worker, &address, &address_bytes));
  store->set(cat("ucx/address/", rank),
             std::string(reinterpret_cast<const char*>(address), address_bytes));
  ucp_worker_release_address(ucx_->worker, address);
  const std::string identity = process_identity();
  store->set(cat("ucx/process/", rank), cat(long(::getpid()), " ", identity));
  store->set(cat("ucx/host/", rank), store->local_address());

  peers_.resize(world_size);
  int local = 0;
  for (int p = 0; p < world_size; ++p) {
    if (p == rank) continue;
    std::string remote = store->get(cat("ucx/address/", p));
    auto peer = std::make_unique<Peer>();
    peer->rank = p;
    std::istringstream process(store->get(cat("ucx/process/", p)));
    std::string peer_identity;
    process >> peer->pid;
    std::getline(process >> std::ws, peer_identity);
    // The peer is alive until it passes the barrier below, so the pidfd is its.
    peer->local = peer_identity == identity;
    peer->host_address = store->get(cat("ucx/host/", p));
    if (detect_peer_failure && peer->local) peer->pidfd = open_pidfd(peer->pid);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(remote.data());
    ep.err_mode = detect_peer_failure && peer->pidfd < 0 ? UCP_ERR_HANDLING_MODE_PEER
                                                         : UCP_ERR_HANDLING_MODE_NONE;
    ep.err_handler.cb = on_peer_error;
    ep.err_handler.arg = &peer->status;
    UCS_CHECK(ucp_ep_create(ucx_->worker, &ep, &peer->ep));
    local += peer->pidfd >= 0;
    peers_[p] = std::move(peer);
  }
  store->barrier("ucx/wired", world_size);
  COMM_LOG(LogLevel::debug, "transport: connected to ", world_size - 1, " peers, ", local,
           " of them local (shared memory, watched by pidfd)");
  // Which transport carries each pair's traffic (the multi-host tests read these lines).
  for (const auto& peer : peers_)
    if (peer)
      COMM_LOG(LogLevel::debug, "transport: rank ", peer->rank, " on ",
               peer->local ? "this host" : "another host", " over ", endpoint_transports(peer->ep));
}

Transport::~Transport() {
  if (!ucx_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<ucs_status_ptr_t> closing;
  for (auto& peer : peers_) {
    if (!peer) continue;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // A failed (or silent) endpoint cannot be flushed; a healthy one may
    // still hold our last sends.
    param.flags = peer->failed() || peer->silent.load() ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t req = ucp_ep_close_nbx(peer->ep, &param);
    if (UCS_PTR_IS_PTR(req)) closing.push_back(req);
  }
  Clock::time_point deadline = Clock::now() + kCloseTimeout;
  bool closed = true;
  for (void* req : closing) {
    while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < deadline)
      ucp_worker_progress(ucx_->worker);
    closed = closed && ucp_request_check_status(req) != UCS_INPROGRESS;
    ucp_request_free(req);
  }
  // An endpoint that could not close still holds requests, and destroying
  // the worker under it aborts (UCX asserts): the process is ending, so
  // leave them to the kernel.
  if (!closed) return;
  ucp_worker_destroy(ucx_->worker);
  ucp_cleanup(ucx_->context);
}

Request Transport::isend(int peer, uint64_t tag, const void* data, size_t bytes, const char* op) {
  CHECK(peer >= 0 && peer < world_size_ && peer != rank_) << "send to rank " << peer;
  Request r;
  r.transport_ = this;
  r.peer_ = peer;
  r.tag_ = tag;
  r.is_send_ = true;
  r.bytes_ = bytes;
  r.op_ = op;
  if (std::string failure = peer_failure(peer); !failure.empty())
    r.fail(cat("cannot send: the peer failed: ", failure));
  ucp_request_param_t param{};
  ucs_status_ptr_t req;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    req = ucp_tag_send_nbx(peers_[peer]->ep, data, bytes, tag, &param);
  }
  if (UCS_PTR_IS_ERR(req)) r.fail(cat("send failed: ", ucs_status_string(UCS_PTR_STATUS(req))));
  count_traffic(TrafficKind::transport, bytes);
  if (!peers_[peer]->local) count_traffic(TrafficKind::network, bytes);
  r.ucx_ = req;  // null: completed immediately
  return r;
}

Request Transport::irecv(int peer, uint64_t tag, void* data, size_t bytes, const char* op) {
  CHECK(peer >= 0 && peer < world_size_ && peer != rank_) << "receive from rank " << peer;
  Request r;
  r.transport_ = this;
  r.peer_ = peer;
  r.tag_ = tag;
  r.bytes_ = bytes;
  r.op_ = op;
  // Always a request, so test() reads the received length from it.
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  ucs_status_ptr_t req;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    req = ucp_tag_recv_nbx(ucx_->worker, data, bytes, tag, ~ucp_tag_t(0), &param);
  }
  if (UCS_PTR_IS_ERR(req)) r.fail(cat("receive failed: ", ucs_status_string(UCS_PTR_STATUS(req))));
  r.ucx_ = req;
  return r;
}

bool Transport::progress() {
  if (!ucx_) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  return ucp_worker_progress(ucx_->worker) != 0;
}

std::string Transport::peer_failure(int peer) const {
  const Peer* p = peers_.empty() ? nullptr : peers_[peer].get();
  if (!p) return "";
  if (p->exited.load()) return cat("its process, pid ", p->pid, ", exited");
  int status = p->status.load();
  return status == UCS_OK ? ""
                          : cat("UCX reports ", ucs_status_string(ucs_status_t(status)),
                                "; its process probably died");
}

bool Transport::is_local(int peer) const {
  return peer == rank_ || (!peers_.empty() && peers_[peer]->local);
}

namespace {

// Whether host answers a TCP connection attempt within timeout: a refusal
// (no one listens on the port) answers as much as an acceptance does.
bool host_answers(const std::string& host, int timeout_ms) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(1);  // tcpmux: nearly always closed, so refused at once
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) return true;  // not IPv4: unknown
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;
  bool answered = false;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 ||
      errno == ECONNREFUSED) {
    answered = true;
  } else if (errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    int error = 0;
    socklen_t len = sizeof error;
    answered = ::poll(&p, 1, timeout_ms) == 1 &&
               ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 &&
               (error == 0 || error == ECONNREFUSED);
  }
  ::close(fd);
  return answered;
}

}  // namespace

std::string Transport::reachability(int peer) const {
  const Peer* p = peers_.empty() || peer == rank_ ? nullptr : peers_[peer].get();
  if (!p || p->local || p->host_address.empty())
    return "the peer is hung or dead, or the ranks issued operations in different orders";
  if (host_answers(p->host_address, 1000))
    return cat("its host ", p->host_address,
               " answers, so the peer is hung or stopped, or the ranks issued operations in "
               "different orders");
  return cat("its host ", p->host_address,
             " does not answer: the network link to it is down, or the host is");
}

long Transport::pid(int peer) const { return peer == rank_ ? long(::getpid()) : peers_[peer]->pid; }

std::string Transport::poll_peer(int peer) {
  Peer* p = peers_.empty() || peer == rank_ ? nullptr : peers_[peer].get();
  if (!p) return "";
  if (p->pidfd >= 0 && !p->exited.load()) {
    pollfd fd{p->pidfd, POLLIN, 0};
    if (::poll(&fd, 1, 0) > 0 && (fd.revents & (POLLIN | POLLHUP | POLLERR))) p->exited.store(true);
  }
  return peer_failure(peer);
}

void Transport::sleep_until_event(Clock::time_point deadline) {
  if (ucx_->event_fd < 0) {
    std::this_thread::yield();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Busy: events arrived since the last progress; the caller progresses again.
    if (ucp_worker_arm(ucx_->worker) != UCS_OK) return;
  }
  std::vector<pollfd> fds{{ucx_->event_fd, POLLIN, 0}};
  watch_local_peers(fds, nullptr);
  auto left = std::chrono::ceil<Millis>(deadline - Clock::now());
  ::poll(fds.data(), fds.size(), int(std::clamp(left, Millis(0), kMaxSleep).count()));
}

void Transport::watch_local_peers(std::vector<pollfd>& fds, std::vector<Peer*>* watched) const {
  for (const auto& peer : peers_) {
    if (!peer || peer->pidfd < 0 || peer->exited.load()) continue;
    fds.push_back({peer->pidfd, POLLIN, 0});
    if (watched) watched->push_back(peer.get());
  }
}

void Transport::check_liveness_locked() {
  // Reading the clock on every test() of a spinning wait would cost more than the progress.
  if (++liveness_calls_ % kLivenessSampling != 0) return;
  Clock::time_point now = Clock::now();
  if (now - last_liveness_check_ < kLivenessInterval) return;
  last_liveness_check_ = now;
  std::vector<pollfd> fds;
  std::vector<Peer*> watched;
  watch_local_peers(fds, &watched);
  if (fds.empty() || ::poll(fds.data(), fds.size(), 0) <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i)
    if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) watched[i]->exited.store(true);
}

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    release();
    transport_ = other.transport_;
    ucx_ = other.ucx_;
    peer_ = other.peer_;
    tag_ = other.tag_;
    is_send_ = other.is_send_;
    bytes_ = other.bytes_;
    op_ = other.op_;
    other.ucx_ = nullptr;
  }
  return *this;
}

void Request::release() {
  if (!ucx_) return;
  std::lock_guard<std::mutex> lock(transport_->mutex_);
  if (ucp_request_check_status(ucx_) == UCS_INPROGRESS && !is_send_)
    ucp_request_cancel(transport_->ucx_->worker, ucx_);
  ucp_request_free(ucx_);
  ucx_ = nullptr;
}

void Request::fail(const std::string& why) {
  release();
  // A rank stuck behind a dead one waits on a healthy peer: name the dead ones too.
  std::string failed;
  for (int p = 0; p < transport_->world_size_; ++p) {
    std::string failure = p == peer_ ? "" : transport_->peer_failure(p);
    if (!failure.empty())
      failed += cat(failed.empty() ? "; failed peers: " : ", ", "rank ", p, " (", failure, ")");
  }
  throw Error(cat("rank ", transport_->rank_, ": ", op_, ": ",
                  is_send_ ? "send to" : "receive from", " rank ", peer_, " (", bytes_,
                  " bytes): ", why, failed));
}

bool Request::test() {
  if (!ucx_) return true;
  ucs_status_t status;
  size_t length = bytes_;
  {
    std::lock_guard<std::mutex> lock(transport_->mutex_);
    ucp_worker_progress(transport_->ucx_->worker);
    if (is_send_) {
      status = ucp_request_check_status(ucx_);
    } else {
      ucp_tag_recv_info_t info{};
      status = ucp_tag_recv_request_test(ucx_, &info);
      length = info.length;
    }
    if (status == UCS_INPROGRESS) transport_->check_liveness_locked();
  }
  if (status == UCS_INPROGRESS) {
    std::string failure = transport_->peer_failure(peer_);
    if (!failure.empty()) fail(cat("the peer failed: ", failure));
    return false;
  }
  if (status == UCS_ERR_MESSAGE_TRUNCATED)
    fail(cat("the peer sent more than ", bytes_,
             " bytes (do both sides pass the same count, or one rank another order?)"));
  if (status != UCS_OK) fail(ucs_status_string(status));
  if (length != bytes_)
    fail(cat("received ", length, " bytes (do all ranks pass the same count?)"));
  std::lock_guard<std::mutex> lock(transport_->mutex_);
  ucp_request_free(ucx_);
  ucx_ = nullptr;
  return true;
}

void Request::wait(Millis timeout) {
  const Clock::time_point start = Clock::now(), deadline = start + timeout;
  // The tag's communicator and the operation's number: a collective's
  // sequence field, a point-to-point message's micro-batch (see make_tag, comm/p2p.h).
  constexpr int seq_shift = kTagRankBits + kTagMessageBits, kind_shift = seq_shift + kTagSeqBits;
  const bool p2p = (tag_ >> kind_shift) & 1;
  const uint32_t number = p2p ? uint32_t(tag_ >> (kTagRankBits + 1 + P2PTag::kStreamBits)) &
                                    ((1u << P2PTag::kMicroBatchBits) - 1)
                              : uint32_t(tag_ >> seq_shift) & ((1u << kTagSeqBits) - 1);
  watchdog::Wait watch(op_, uint32_t(tag_ >> (kind_shift + 1)), number, peer_);
  for (int idle = 0; !test(); ++idle) {
    if (idle < kSpinsBeforeYield) continue;
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      transport_->peers_[peer_]->silent.store(true);
      fail(cat("timed out after ", timeout.count(), " ms; ", transport_->reachability(peer_), "; ",
               watchdog::describe()));
    }
    if (now - start >= kSpinTime)
      transport_->sleep_until_event(deadline);
    else
      std::this_thread::yield();
  }
  watch.done();
}

}  // namespace trainer::comm
