// libFuzzer target: the rendezvous store's server (comm/store_server.h). Each
// input is the byte stream of one client connection to a server in this
// process: frames with or without the job token, garbage, lengths past the
// limit. Whatever it sends, the server must go on serving: a well-behaved
// client then sets and reads back a key.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "comm/store.h"

namespace {

trainer::comm::Store& server() {
  // The token "fuzz" (the seeds hold HELLO frames with it), short waits.
  static std::unique_ptr<trainer::comm::Store> store = [] {
    trainer::comm::StoreOptions o;
    o.token = "fuzz";
    o.serve = true;
    o.hello_timeout = std::chrono::milliseconds(200);
    o.timeout = std::chrono::milliseconds(10000);  // a hung server, not a busy machine
    return std::make_unique<trainer::comm::Store>(o);
  }();
  return *store;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  trainer::comm::Store& store = server();
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) std::abort();
  // Each connection from the next of 4096 loopback addresses: a connection
  // the server closes leaves its port in TIME_WAIT for a minute, and at
  // thousands of inputs a second one address's ephemeral ports run out
  // (after ~80k inputs connect then blocks, and fails).
  static uint32_t next_source = 0;
  sockaddr_in source{};
  source.sin_family = AF_INET;
  source.sin_addr.s_addr = htonl(0x7f000001u + 1 + (next_source++ % 4096));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&source), sizeof source) != 0) {
    std::perror("fuzz_store: bind a loopback source address");
    std::abort();
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(uint16_t(store.port()));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    // libFuzzer's timers may interrupt it: the connection goes on, wait for it.
    int error = errno;
    pollfd p{fd, POLLOUT, 0};
    socklen_t len = sizeof error;
    if (error == EINTR && ::poll(&p, 1, 2000) == 1)
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
    if (error != 0 && error != EINTR) {
      errno = error;
      std::perror("fuzz_store: connect to the store");
      std::abort();
    }
  }
  for (size_t sent = 0; sent < size;) {
    const ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server dropped us: fine
    sent += size_t(n);
  }
  ::shutdown(fd, SHUT_WR);
  // Read what it answers until it closes or goes quiet.
  char reply[4096];
  for (pollfd p{fd, POLLIN, 0}; ::poll(&p, 1, 50) == 1;)
    if (::recv(fd, reply, sizeof reply, 0) <= 0) break;
  ::close(fd);
  // Still serving.
  store.set("fuzz/alive", "yes");
  if (store.get("fuzz/alive", std::chrono::milliseconds(10000)) != "yes") std::abort();
  return 0;
}
