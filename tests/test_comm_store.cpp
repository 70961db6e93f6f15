// The rendezvous store in one process: a server and clients on loopback,
// clients in threads, plus raw sockets that send what a confused or hostile
// peer would.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <limits>
#include <thread>

#include "tests/testing.h"

#include "comm/store.h"

using namespace trainer;
using namespace trainer::comm;

namespace {

StoreOptions server_options() {
  StoreOptions o;
  o.token = "job-token";
  o.serve = true;
  o.port = 0;
  o.timeout = Millis(5000);
  o.hello_timeout = Millis(300);
  o.max_frame_bytes = 4096;
  return o;
}

StoreOptions client_options(const Store& server, int rank, const std::string& token = "job-token") {
  StoreOptions o = server.options();
  o.serve = false;
  o.port = server.port();
  o.rank = rank;
  o.token = token;
  o.connect_timeout = Millis(3000);
  return o;
}

// A raw TCP connection to the store.
int raw_connect(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(uint16_t(port));
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  return fd;
}

// True when the server closes the connection within the timeout.
bool closed_by_server(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  for (;;) {
    if (::poll(&p, 1, timeout_ms) != 1) return false;
    char buf[256];
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return true;  // EOF or reset
  }
}

void send_raw(int fd, const std::string& bytes) {
  REQUIRE(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == ssize_t(bytes.size()));
}

std::string hello(const std::string& token) {
  std::string body;
  store_wire::put_u8(body, store_wire::kHello);
  store_wire::put_str(body, token);
  store_wire::put_u32(body, 9);
  return store_wire::frame(body);
}

}  // namespace

TEST_CASE("store: set, get waits for the key, add counts, barrier", "[comm]") {
  Store server(server_options());
  std::atomic<int> got{0};
  std::vector<std::thread> threads;
  for (int rank = 1; rank <= 3; ++rank) {
    threads.emplace_back([&, rank] {
      Store client(client_options(server, rank));
      if (client.get("greeting") == "hello") ++got;  // set later by the server's own client
      client.add("counter", rank);
      client.barrier("b", 4);
      client.set(cat("from/", rank), std::string(1000, char('a' + rank)));
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  server.set("greeting", "hello");
  server.barrier("b", 4);
  CHECK(server.add("counter", 0) == 1 + 2 + 3);
  for (int rank = 1; rank <= 3; ++rank)
    CHECK(server.get(cat("from/", rank)) == std::string(1000, char('a' + rank)));
  for (auto& t : threads) t.join();
  CHECK(got == 3);
  // Binary values survive.
  std::string binary("\0\x01\xff\n", 4);
  server.set("bin", binary);
  CHECK(server.get("bin") == binary);
}

TEST_CASE("store: a get times out with an error naming the rank and key", "[comm]") {
  Store server(server_options());
  Store client(client_options(server, 5));
  auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(client.get("never/set", Millis(200)), Catch::Contains("rank 5") &&
                                                              Catch::Contains("never/set") &&
                                                              Catch::Contains("timed out"));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(3));
  client.set("still", "works");  // the connection survives a timed-out get
  CHECK(client.get("still") == "works");
  CHECK_THROWS_WITH(client.add("still", 1), Catch::Contains("counter"));
  // A counter past 64 bits is an error, not undefined behaviour (found by fuzz/fuzz_store.cpp).
  CHECK(client.add("big", std::numeric_limits<int64_t>::max()) ==
        std::numeric_limits<int64_t>::max());
  CHECK_THROWS_WITH(client.add("big", 1), Catch::Contains("overflows 64 bits"));
  CHECK(client.add("small", std::numeric_limits<int64_t>::min()) ==
        std::numeric_limits<int64_t>::min());
  CHECK_THROWS_WITH(client.add("small", -1), Catch::Contains("overflows 64 bits"));
  CHECK(client.add("big", -1) == std::numeric_limits<int64_t>::max() - 1);  // it still counts
}

TEST_CASE("store: a wrong token is refused while the job continues", "[comm]") {
  Store server(server_options());
  Store good(client_options(server, 1));
  good.set("k", "v");
  CHECK_THROWS_WITH(Store(client_options(server, 2, "guess")),
                    Catch::Contains("wrong job token") && Catch::Contains("rank 2"));
  CHECK(good.get("k") == "v");
  Store late(client_options(server, 3));
  CHECK(late.get("k") == "v");
}

TEST_CASE("store: garbage, oversized frames and silent clients are dropped", "[comm]") {
  Store server(server_options());
  Store good(client_options(server, 1));
  SECTION("text instead of frames") {
    int fd = raw_connect(server.port());
    send_raw(fd, "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    CHECK(closed_by_server(fd, 2000));
    ::close(fd);
  }
  SECTION("an oversized frame header") {
    int fd = raw_connect(server.port());
    send_raw(fd, hello("job-token"));
    std::string header;
    store_wire::put_u32(header, 0xfffffff0u);
    send_raw(fd, header);
    CHECK(closed_by_server(fd, 2000));
    ::close(fd);
  }
  SECTION("a request before HELLO") {
    int fd = raw_connect(server.port());
    std::string body;
    store_wire::put_u8(body, store_wire::kSet);
    store_wire::put_str(body, "k");
    store_wire::put_str(body, "evil");
    send_raw(fd, store_wire::frame(body));
    CHECK(closed_by_server(fd, 2000));
    ::close(fd);
  }
  SECTION("a malformed request after HELLO") {
    int fd = raw_connect(server.port());
    send_raw(fd, hello("job-token"));
    std::string body;
    store_wire::put_u8(body, store_wire::kSet);
    store_wire::put_u32(body, 1000);  // a key length past the end of the frame
    send_raw(fd, store_wire::frame(body));
    CHECK(closed_by_server(fd, 2000));
    ::close(fd);
  }
  SECTION("an unknown op") {
    int fd = raw_connect(server.port());
    send_raw(fd, hello("job-token"));
    std::string body;
    store_wire::put_u8(body, 77);
    send_raw(fd, store_wire::frame(body));
    CHECK(closed_by_server(fd, 2000));
    ::close(fd);
  }
  SECTION("a client that never says hello") {
    int fd = raw_connect(server.port());
    CHECK(closed_by_server(fd, 3000));  // hello_timeout is 300 ms
    ::close(fd);
  }
  good.set("after", "garbage");
  CHECK(good.get("after") == "garbage");
  CHECK(server.get("after") == "garbage");
}

TEST_CASE("store: clients retry until the server is up, then give up with an error", "[comm]") {
  int port;
  {
    Store probe(server_options());
    port = probe.port();
  }
  StoreOptions o = server_options();
  o.serve = false;
  o.port = port;
  o.rank = 4;
  o.connect_timeout = Millis(5000);
  std::thread late_server([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    StoreOptions so = server_options();
    so.port = port;
    Store server(so);
    server.get("client/done");  // serve until the client is through
  });
  std::string error;
  try {
    Store client(o);
    client.barrier("up", 1);
    client.set("client/done", "1");
  } catch (const Error& e) {
    error = e.what();
  }
  late_server.join();
  REQUIRE(error == "");
  o.connect_timeout = Millis(300);
  CHECK_THROWS_WITH(Store(o), Catch::Contains("rank 4") && Catch::Contains("cannot connect"));
}
