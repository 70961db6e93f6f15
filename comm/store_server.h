// The server half of the rendezvous store (see comm/store.h for the protocol):
// one thread polling the listening socket and every client connection.
// Requests are handled in arrival order; a get() on a missing key parks the
// connection until the key is set or its deadline passes.
#pragma once

#include <chrono>
#include <string>
#include <thread>

namespace trainer::comm {

struct StoreServerOptions {
  int port = 0;  // 0: any free port
  std::string token;
  std::chrono::milliseconds hello_timeout{10000};
  size_t max_frame_bytes = 1 << 20;
};

class StoreServer {
 public:
  explicit StoreServer(const StoreServerOptions& options);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }

 private:
  void serve();

  StoreServerOptions options_;
  int listen_fd_ = -1;
  int wake_fds_[2] = {-1, -1};  // a byte on wake_fds_[1] stops serve()
  int port_ = 0;
  std::thread thread_;
};

}  // namespace trainer::comm
