#include "comm/store_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "comm/log.h"
#include "comm/store.h"

namespace trainer::comm {

namespace {

using Clock = std::chrono::steady_clock;
using namespace store_wire;

// Reads the fields of one frame body; any short read marks it malformed.
class Reader {
 public:
  explicit Reader(std::string_view body) : rest_(body) {}
  bool ok() const { return ok_; }
  bool done() const { return ok_ && rest_.empty(); }
  uint8_t u8() { return uint8_t(take(1)[0]); }
  uint32_t u32() {
    std::string_view b = take(4);
    uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | uint8_t(b[i]);
    return v;
  }
  int64_t i64() {
    uint64_t lo = u32(), hi = u32();
    return int64_t((hi << 32) | lo);
  }
  std::string str() {
    uint32_t n = u32();
    return std::string(take(n));
  }

 private:
  std::string_view take(size_t n) {
    static const char zeros[8] = {};
    if (!ok_ || rest_.size() < n) {
      ok_ = false;
      return std::string_view(zeros, n <= 8 ? n : 0);
    }
    std::string_view v = rest_.substr(0, n);
    rest_.remove_prefix(n);
    return v;
  }
  std::string_view rest_;
  bool ok_ = true;
};

struct PendingGet {
  std::string key;
  Clock::time_point deadline;
};

struct Connection {
  int fd = -1;
  bool authenticated = false;
  int rank = -1;
  Clock::time_point hello_deadline;
  std::string in, out;
  std::optional<PendingGet> pending;
  bool closing = false;  // drop once `out` is flushed
};

std::string reply(Status status, const std::string& payload) {
  std::string body;
  put_u8(body, status);
  put_str(body, payload);
  return frame(body);
}

class ServerState {
 public:
  explicit ServerState(const StoreServerOptions& options) : options_(options) {}

  void accept_from(int listen_fd) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    Connection c;
    c.fd = fd;
    c.hello_deadline = Clock::now() + options_.hello_timeout;
    conns_.push_back(std::move(c));
  }

  // Reads what is available and handles every complete frame.
  void on_readable(Connection& c) {
    char buf[65536];
    for (;;) {
      ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
      if (n > 0) {
        c.in.append(buf, size_t(n));
        if (c.in.size() > options_.max_frame_bytes + 4 + sizeof(buf)) break;
        continue;
      }
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
        return drop(c, "closed");
      if (errno == EINTR) continue;
      break;
    }
    while (!c.closing && c.fd >= 0 && c.in.size() >= 4) {
      uint32_t len = Reader(std::string_view(c.in).substr(0, 4)).u32();
      if (len > options_.max_frame_bytes) return drop(c, cat("sent a frame of ", len, " bytes"));
      if (c.in.size() < 4 + size_t(len)) break;
      if (c.pending) return drop(c, "sent a request while its get() was pending");
      std::string body = c.in.substr(4, len);
      c.in.erase(0, 4 + size_t(len));
      handle(c, body);
    }
  }

  void on_writable(Connection& c) {
    while (!c.out.empty()) {
      ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, size_t(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      return drop(c, "closed while being answered");
    }
    if (c.closing) drop(c, "refused");
  }

  // Answers gets whose deadline passed and drops clients that never said hello.
  void expire(Clock::time_point now) {
    for (Connection& c : conns_) {
      if (c.fd < 0) continue;
      if (!c.authenticated && now >= c.hello_deadline)
        drop(c, "sent no HELLO in time");
      else if (c.pending && now >= c.pending->deadline) {
        c.out += reply(kFailed, cat("timed out waiting for key '", c.pending->key, "'"));
        c.pending.reset();
      }
    }
  }

  // Milliseconds until the next deadline (capped), for poll().
  int next_timeout_ms(Clock::time_point now) const {
    Clock::time_point next = now + std::chrono::seconds(1);
    for (const Connection& c : conns_) {
      if (c.fd < 0) continue;
      if (!c.authenticated) next = std::min(next, c.hello_deadline);
      if (c.pending) next = std::min(next, c.pending->deadline);
    }
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count();
    return int(std::clamp<int64_t>(ms + 1, 0, 1000));
  }

  void sweep() {
    conns_.remove_if([](const Connection& c) { return c.fd < 0; });
  }
  std::list<Connection>& connections() { return conns_; }

  ~ServerState() {
    for (Connection& c : conns_)
      if (c.fd >= 0) ::close(c.fd);
  }

 private:
  void handle(Connection& c, const std::string& body) {
    Reader r(body);
    uint8_t op = r.u8();
    if (!c.authenticated) {
      if (op != kHello) return drop(c, "did not start with HELLO");
      std::string token = r.str();
      uint32_t rank = r.u32();
      if (!r.done()) return drop(c, "sent a malformed HELLO");
      if (token != options_.token) {
        COMM_LOG(LogLevel::warn, "store: refused a client claiming rank ", rank,
                 ": wrong job token");
        c.out += reply(kFailed, "wrong job token");
        c.closing = true;
        return;
      }
      c.authenticated = true;
      c.rank = int(rank);
      c.out += reply(kOk, "");
      return;
    }
    switch (op) {
      case kSet: {
        std::string key = r.str(), value = r.str();
        if (!r.done()) return drop(c, "sent a malformed SET");
        kv_[key] = std::move(value);
        c.out += reply(kOk, "");
        wake_waiters(key);
        return;
      }
      case kGet: {
        std::string key = r.str();
        uint32_t timeout_ms = r.u32();
        if (!r.done()) return drop(c, "sent a malformed GET");
        auto it = kv_.find(key);
        if (it != kv_.end())
          c.out += reply(kOk, it->second);
        else
          c.pending = PendingGet{key, Clock::now() + std::chrono::milliseconds(timeout_ms)};
        return;
      }
      case kAdd: {
        std::string key = r.str();
        int64_t delta = r.i64();
        if (!r.done()) return drop(c, "sent a malformed ADD");
        int64_t value = 0;
        if (auto it = kv_.find(key); it != kv_.end()) {
          char* end = nullptr;
          value = std::strtoll(it->second.c_str(), &end, 10);
          if (it->second.empty() || *end != '\0') {
            c.out += reply(kFailed, cat("key '", key, "' does not hold a counter"));
            return;
          }
        }
        if (__builtin_add_overflow(value, delta, &value)) {
          c.out += reply(kFailed,
                         cat("adding ", delta, " to the counter '", key, "' overflows 64 bits"));
          return;
        }
        kv_[key] = std::to_string(value);
        c.out += reply(kOk, kv_[key]);
        wake_waiters(key);
        return;
      }
      default:
        return drop(c, cat("sent unknown op ", int(op)));
    }
  }

  void wake_waiters(const std::string& key) {
    for (Connection& c : conns_)
      if (c.fd >= 0 && c.pending && c.pending->key == key) {
        c.out += reply(kOk, kv_[key]);
        c.pending.reset();
      }
  }

  void drop(Connection& c, const std::string& why) {
    if (c.fd < 0) return;
    if (why != "closed")
      COMM_LOG(LogLevel::warn, "store: dropped a connection (rank ", c.rank, ") that ", why);
    ::close(c.fd);
    c.fd = -1;
  }

  StoreServerOptions options_;
  std::list<Connection> conns_;
  std::unordered_map<std::string, std::string> kv_;
};

}  // namespace

StoreServer::StoreServer(const StoreServerOptions& options) : options_(options) {
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  CHECK(listen_fd_ >= 0) << "socket: " << std::strerror(errno);
  int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(uint16_t(options_.port));
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(listen_fd_, 1024) != 0) {
    int err = errno;
    ::close(listen_fd_);
    throw Error(cat("rank 0: the store cannot listen on port ", options_.port, ": ",
                    std::strerror(err), "; choose another MASTER_PORT"));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  CHECK(::pipe2(wake_fds_, O_CLOEXEC | O_NONBLOCK) == 0) << std::strerror(errno);
  thread_ = std::thread([this] { serve(); });
}

StoreServer::~StoreServer() {
  char byte = 0;
  [[maybe_unused]] ssize_t n = ::write(wake_fds_[1], &byte, 1);
  thread_.join();
  ::close(listen_fd_);
  ::close(wake_fds_[0]);
  ::close(wake_fds_[1]);
}

void StoreServer::serve() {
  ServerState state(options_);
  std::vector<pollfd> fds;
  std::vector<Connection*> owners;
  for (;;) {
    fds.assign({pollfd{wake_fds_[0], POLLIN, 0}, pollfd{listen_fd_, POLLIN, 0}});
    owners.assign(2, nullptr);
    for (Connection& c : state.connections()) {
      fds.push_back(pollfd{c.fd, short(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
      owners.push_back(&c);
    }
    int ready = ::poll(fds.data(), fds.size(), state.next_timeout_ms(Clock::now()));
    if (ready < 0 && errno != EINTR) CHECK(false) << "store poll: " << std::strerror(errno);
    if (fds[0].revents) return;
    if (fds[1].revents & POLLIN) state.accept_from(listen_fd_);
    for (size_t i = 2; i < fds.size(); ++i) {
      Connection& c = *owners[i];
      if (c.fd >= 0 && (fds[i].revents & (POLLIN | POLLHUP | POLLERR))) state.on_readable(c);
      if (c.fd >= 0 && !c.out.empty()) state.on_writable(c);
    }
    state.expire(Clock::now());
    for (Connection& c : state.connections())
      if (c.fd >= 0 && !c.out.empty()) state.on_writable(c);
    state.sweep();
  }
}

}  // namespace trainer::comm
