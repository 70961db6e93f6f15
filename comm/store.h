// The rendezvous store: a small TCP key-value server on rank 0 that every
// rank connects to, used to exchange UCX worker addresses and to meet at
// setup barriers.
//
// Protocol: length-prefixed frames (u32 little-endian body length, then an
// op byte and its fields). A client's first frame is HELLO with the job
// token; the server answers every request with a status byte and a payload.
// A connection that sends a wrong token, an unknown op, a malformed or an
// oversized frame, or nothing within hello_timeout is closed; the job and the
// other clients are not affected. get() waits for the key on the server, up to
// a timeout; add() is an atomic counter.
//
//   Store store({.host = boot.master_addr, .port = boot.master_port,
//                .token = boot.job_token, .rank = boot.rank, .serve = boot.rank == 0});
//   store.set("addr/3", bytes);
//   std::string peer = store.get("addr/5");   // waits until rank 5 has set it
//   store.barrier("wired", world_size);
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace trainer::comm {

using Millis = std::chrono::milliseconds;

struct StoreOptions {
  std::string host = "127.0.0.1";
  int port = 0;                   // serve: 0 picks a free port (see Store::port())
  std::string token;              // the job token every client presents
  int rank = 0;                   // named in errors
  bool serve = false;             // this process hosts the server (rank 0)
  Millis connect_timeout{60000};  // how long to retry connecting to the server
  Millis timeout{300000};         // get() and barrier() waits
  Millis hello_timeout{10000};    // the server drops clients silent for this long before HELLO
  size_t max_frame_bytes = 1 << 20;
};

class StoreServer;

class Store {
 public:
  explicit Store(const StoreOptions& options);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  void set(const std::string& key, const std::string& value);
  // Waits until the key exists; Error naming the rank and key after the timeout.
  std::string get(const std::string& key);
  std::string get(const std::string& key, Millis timeout);
  // Adds delta to the integer at key (0 when absent) and returns the new value.
  int64_t add(const std::string& key, int64_t delta);
  // Returns once `count` ranks have called barrier(name, count).
  void barrier(const std::string& name, int count);

  int port() const { return port_; }
  const StoreOptions& options() const { return options_; }
  // This host's address on the connection to the server (the interface the
  // other hosts reach it by), e.g. "10.201.0.2"; empty when unknown.
  std::string local_address() const;

 private:
  std::string request(const std::string& body, Millis reply_timeout, const std::string& what);

  StoreOptions options_;
  std::unique_ptr<StoreServer> server_;
  int port_ = 0;
  int fd_ = -1;
  std::mutex mutex_;  // one request at a time on the connection
};

// Frame helpers, shared by client, server and the tests that send garbage.
namespace store_wire {
enum Op : uint8_t { kHello = 1, kSet = 2, kGet = 3, kAdd = 4 };
enum Status : uint8_t { kOk = 0, kFailed = 1 };
void put_u8(std::string& out, uint8_t v);
void put_u32(std::string& out, uint32_t v);
void put_i64(std::string& out, int64_t v);
void put_str(std::string& out, const std::string& s);
// Prefixes body with its length.
std::string frame(const std::string& body);
}  // namespace store_wire

}  // namespace trainer::comm
