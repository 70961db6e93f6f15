#include "comm/store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "comm/log.h"
#include "comm/store_server.h"
#include "core/check.h"

namespace trainer::comm {

namespace store_wire {
void put_u8(std::string& out, uint8_t v) { out.push_back(char(v)); }
void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}
void put_i64(std::string& out, int64_t v) {
  put_u32(out, uint32_t(uint64_t(v) & 0xffffffffu));
  put_u32(out, uint32_t(uint64_t(v) >> 32));
}
void put_str(std::string& out, const std::string& s) {
  put_u32(out, uint32_t(s.size()));
  out += s;
}
std::string frame(const std::string& body) {
  std::string out;
  put_u32(out, uint32_t(body.size()));
  return out + body;
}
}  // namespace store_wire

namespace {

using Clock = std::chrono::steady_clock;
using namespace store_wire;

// A server that answers a get() at its deadline needs a moment to reach us.
constexpr Millis kReplyMargin{5000};

int remaining_ms(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
  return ms < 0 ? 0 : int(std::min<int64_t>(ms, 1 << 30));
}

// One connection attempt with a deadline; -1 when refused or timed out.
int try_connect(const addrinfo* ai, Clock::time_point deadline) {
  int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) return -1;
  if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) return ::close(fd), -1;
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof(err);
    if (::poll(&p, 1, remaining_ms(deadline)) != 1 ||
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)
      return ::close(fd), -1;
  }
  int flags = 0;  // back to blocking; every read and write below polls with a deadline first
  ::ioctl(fd, FIONBIO, &flags);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

bool write_all(int fd, const std::string& data, Clock::time_point deadline) {
  size_t done = 0;
  while (done < data.size()) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, remaining_ms(deadline)) != 1) return false;
    ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += size_t(n);
  }
  return true;
}

bool read_exact(int fd, char* out, size_t bytes, Clock::time_point deadline) {
  size_t done = 0;
  while (done < bytes) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, remaining_ms(deadline)) != 1) return false;
    ssize_t n = ::recv(fd, out + done, bytes - done, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += size_t(n);
  }
  return true;
}

}  // namespace

Store::Store(const StoreOptions& options) : options_(options), port_(options.port) {
  if (options_.serve) {
    server_ = std::make_unique<StoreServer>(StoreServerOptions{
        options_.port, options_.token, options_.hello_timeout, options_.max_frame_bytes});
    port_ = server_->port();
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  Clock::time_point deadline = Clock::now() + options_.connect_timeout;
  std::string where = cat(options_.host, ":", port_);
  std::string hello;
  put_u8(hello, kHello);
  put_str(hello, options_.token);
  put_u32(hello, uint32_t(options_.rank));
  // The server may not be up yet (rank 0 starts last), or a restarted rank
  // may reach the last start's store as it closes: retry until the deadline.
  for (Millis backoff{10};; backoff = std::min(backoff * 2, Millis(500))) {
    addrinfo* res = nullptr;
    if (::getaddrinfo(options_.host.c_str(), std::to_string(port_).c_str(), &hints, &res) == 0) {
      for (addrinfo* ai = res; ai && fd_ < 0; ai = ai->ai_next) fd_ = try_connect(ai, deadline);
      ::freeaddrinfo(res);
    }
    if (fd_ >= 0) {
      try {
        request(hello, options_.connect_timeout, cat("joining the store at ", where));
        return;
      } catch (const Error&) {
        // A refusal (the connection stays open) is final; a closed one is retried.
        if (fd_ >= 0 || Clock::now() + backoff >= deadline) throw;
      }
    }
    if (Clock::now() + backoff >= deadline)
      throw Error(cat("rank ", options_.rank, ": cannot connect to the store at ", where,
                      " within ", options_.connect_timeout.count(),
                      " ms; is rank 0 running and MASTER_ADDR/MASTER_PORT right?"));
    std::this_thread::sleep_for(backoff);
  }
}

Store::~Store() {
  if (fd_ >= 0) ::close(fd_);
}

std::string Store::request(const std::string& body, Millis reply_timeout, const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fd_ < 0)
    throw Error(cat("rank ", options_.rank, ": the store connection is closed (", what, ")"));
  Clock::time_point deadline = Clock::now() + reply_timeout + kReplyMargin;
  char header[4];
  if (!write_all(fd_, frame(body), deadline) || !read_exact(fd_, header, 4, deadline)) {
    ::close(fd_);
    fd_ = -1;
    throw Error(cat("rank ", options_.rank, ": the store at ", options_.host, ":", port_,
                    " closed the connection or did not answer while ", what,
                    " (rank 0 died, or the job token differs from rank 0's)"));
  }
  uint32_t len = 0;
  for (int i = 3; i >= 0; --i) len = (len << 8) | uint8_t(header[i]);
  std::string reply(len, '\0');
  if (len < 5 || len > options_.max_frame_bytes + 16 ||
      !read_exact(fd_, reply.data(), len, deadline)) {
    ::close(fd_);
    fd_ = -1;
    throw Error(cat("rank ", options_.rank, ": malformed reply from the store while ", what));
  }
  uint8_t status = uint8_t(reply[0]);
  std::string payload = reply.substr(5);
  if (status != kOk)
    throw Error(cat("rank ", options_.rank, ": the store refused ", what, ": ", payload));
  return payload;
}

void Store::set(const std::string& key, const std::string& value) {
  std::string body;
  put_u8(body, kSet);
  put_str(body, key);
  put_str(body, value);
  request(body, options_.timeout, cat("setting key '", key, "'"));
}

std::string Store::get(const std::string& key) { return get(key, options_.timeout); }

std::string Store::get(const std::string& key, Millis timeout) {
  std::string body;
  put_u8(body, kGet);
  put_str(body, key);
  put_u32(body, uint32_t(std::min<int64_t>(timeout.count(), UINT32_MAX)));
  return request(body, timeout,
                 cat("getting key '", key, "' (waited up to ", timeout.count(), " ms)"));
}

int64_t Store::add(const std::string& key, int64_t delta) {
  std::string body;
  put_u8(body, kAdd);
  put_str(body, key);
  put_i64(body, delta);
  return std::stoll(request(body, options_.timeout, cat("adding to key '", key, "'")));
}

void Store::barrier(const std::string& name, int count) {
  std::string key = cat("barrier/", name);
  if (add(key, 1) == count) set(key + "/open", "1");
  get(key + "/open");
}

std::string Store::local_address() const {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (fd_ < 0 || ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "";
  char text[INET6_ADDRSTRLEN] = {};
  const void* ip =
      addr.ss_family == AF_INET
          ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&addr)->sin_addr)
          : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr);
  return ::inet_ntop(addr.ss_family, ip, text, sizeof text) ? text : "";
}

}  // namespace trainer::comm
