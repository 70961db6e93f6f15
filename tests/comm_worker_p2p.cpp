// The point-to-point scenarios of the comm test worker (tests/comm_worker.cpp
// runs them): Communicator::send / recv between processes, checked against
// closed-form contents.
//
//   comm_worker p2p [no-shm]    ring exchanges in both directions with receives posted
//                               out of order, zero-size to tens of MB, equal tags in send
//                               order, a split communicator, collectives in flight,
//                               size mismatches, a timeout and invalid arguments; exit 0
//   comm_worker p2p-kill VICTIM the victim SIGKILLs itself after one exchange; every other
//                               rank's receive from it (and large send to it) must fail
//                               naming it; exit 3
#include <signal.h>

#include <chrono>
#include <functional>
#include <thread>

#include "comm/collectives.h"
#include "tests/comm_worker.h"

namespace trainer::comm_test {

using namespace comm;

namespace {

constexpr P2PDirection kForward = P2PDirection::activation, kBackward = P2PDirection::gradient;

// Element i of the message src sends with tag: unique per (source, tag) and
// exact in f32 and bf16 for i % 8 (the large messages use i % 1021, f32 only).
double message_value(int src, const P2PTag& tag, size_t i, size_t period) {
  return double(src * 4096 + tag.micro_batch * 64 + int(tag.direction) * 32 + tag.stream * 8) +
         double(i % period);
}

Tensor message(int src, const P2PTag& tag, int64_t count, DType dtype, size_t period = 8) {
  std::vector<float> v(static_cast<size_t>(count));
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(message_value(src, tag, i, period));
  return from_vector(v).to(dtype);
}

void expect_message(const std::string& what, const Tensor& got, int src, const P2PTag& tag,
                    size_t period = 8) {
  expect(
      cat(what, ": ", p2p_tag_str(tag), " from rank ", src), got.to(DType::f32).to_vector<float>(),
      [&](size_t i) { return message_value(src, tag, i, period); }, got.dtype());
}

// Every rank exchanges with both neighbours of the ring: activations to
// the next rank, gradients to the previous one, micro-batches 0..mbs-1 and
// streams 0..1; the receives are posted first, in reverse micro-batch order,
// so each must match its own tag whatever arrives first.
void check_ring(Communicator& comm, int64_t count, DType dtype, int mbs, size_t period = 8) {
  const int n = comm.size(), me = comm.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  struct Pending {
    Tensor buffer;
    int src;
    P2PTag tag;
    Work work;
  };
  std::vector<Pending> receives, sends;
  for (int mb = mbs - 1; mb >= 0; --mb)
    for (int stream = 1; stream >= 0; --stream) {
      for (auto [direction, src] : {std::pair{kForward, prev}, std::pair{kBackward, next}}) {
        P2PTag tag{.micro_batch = mb, .direction = direction, .stream = stream};
        Tensor buffer = full({count}, -1.0, dtype);
        receives.push_back({buffer, src, tag, comm.recv(buffer, src, tag)});
      }
    }
  for (int mb = 0; mb < mbs; ++mb)
    for (int stream = 0; stream < 2; ++stream)
      for (auto [direction, dst] : {std::pair{kForward, next}, std::pair{kBackward, prev}}) {
        P2PTag tag{.micro_batch = mb, .direction = direction, .stream = stream};
        Tensor t = message(me, tag, count, dtype, period);
        sends.push_back({t, dst, tag, comm.send(t, dst, tag)});
      }
  for (Pending& s : sends) s.work.wait();
  for (Pending& r : receives) {
    r.work.wait();
    expect_message(cat("ring of ", n, ", ", count, " x ", dtype), r.buffer, r.src, r.tag, period);
  }
}

// Three messages with one tag from the previous rank arrive in send order;
// the receiver polls test() instead of waiting.
void check_same_tag_order(Communicator& comm) {
  const int n = comm.size(), me = comm.rank();
  const P2PTag tag{.micro_batch = 5};
  std::vector<Tensor> got;
  std::vector<Work> works;
  for (int k = 0; k < 3; ++k) {
    got.push_back(zeros({257}));
    works.push_back(comm.recv(got.back(), (me + n - 1) % n, tag));
  }
  std::vector<Work> sends;
  for (int k = 0; k < 3; ++k)
    sends.push_back(comm.send(full({257}, double(me * 10 + k)), (me + 1) % n, tag));
  for (Work& w : works)
    while (!w.test()) std::this_thread::yield();
  for (Work& w : sends) w.wait();
  const int src = (me + n - 1) % n;
  for (int k = 0; k < 3; ++k)
    expect(
        cat("message ", k, " of three with one tag"), got[size_t(k)].to_vector<float>(),
        [&](size_t) { return double(src * 10 + k); }, DType::f32);
}

// An allreduce in flight on the progress thread while messages pass.
void check_with_collectives(Communicator& comm) {
  std::vector<float> data = make_input<float>(comm.rank(), 100000);
  Work reduce = allreduce_async(comm, data.data(), data.size(), DType::f32,
                                {.algorithm = AllreduceAlgorithm::ring, .segment_bytes = 4096});
  check_ring(comm, 5000, DType::f32, 2);
  reduce.wait();
  expect(
      "allreduce during point-to-point", data,
      [&](size_t i) { return expected_reduction(ReduceOp::sum, comm.size(), i); }, DType::f32);
}

// Ranks 0 and 1 disagree on the size: the receiver's wait names the sender and its rank.
void check_mismatch(Communicator& comm) {
  const int me = comm.rank();
  if (me > 1) return;
  const int other = 1 - me;
  const P2PTag longer{.micro_batch = 900}, shorter{.micro_batch = 901};
  const std::string sender = cat("from rank ", other, " (world rank ", comm.world_rank(other), ")");
  if (me == 0) {
    comm.send(message(0, longer, 100, DType::f32), 1, longer).wait();
    Tensor buffer = zeros({20});
    expect_error("a receive of 80 bytes getting 40", {sender, "received 40 bytes", "[20]"},
                 [&] { comm.recv(buffer, 1, shorter).wait(); });
  } else {
    Tensor buffer = zeros({50});
    expect_error("a receive of 200 bytes getting 400", {sender, "sent more than 200 bytes", "[50]"},
                 [&] { comm.recv(buffer, 0, longer).wait(); });
    comm.send(message(1, shorter, 10, DType::f32), 0, shorter).wait();
  }
  // Large (UCX's rendezvous): the receiver fails the same way, and the
  // sender's wait returns (done or an Error) instead of hanging.
  const P2PTag large{.micro_batch = 902};
  if (me == 0) {
    Tensor big = zeros({int64_t(1) << 20});
    auto start = std::chrono::steady_clock::now();
    try {
      comm.send(big, 1, large, {.timeout = Millis(5000)}).wait();
    } catch (const Error& e) {
      std::printf("rank 0: large mismatched send: %s\n", e.what());
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++g_checks;
    if (seconds > 4) {
      std::printf("rank 0: the mismatched large send took %.2f s\n", seconds);
      ++g_failures;
    }
  } else {
    Tensor half = zeros({int64_t(1) << 19});
    expect_error("a receive of 2 MB getting 4 MB", {sender, "sent more than 2097152 bytes"},
                 [&] { comm.recv(half, 0, large).wait(); });
  }
}

// Nothing is ever sent with this tag: the wait times out naming the peer and the tag.
void check_timeout(Communicator& comm) {
  const int peer = (comm.rank() + 1) % comm.size();
  const P2PTag tag{.micro_batch = 999, .direction = kBackward, .stream = 5};
  Tensor buffer = zeros({3});
  auto start = std::chrono::steady_clock::now();
  expect_error("a receive nobody sends",
               {"timed out after 300 ms", "receive of gradient micro-batch 999 stream 5",
                cat("from rank ", peer, " (world rank ", comm.world_rank(peer), ")")},
               [&] { comm.recv(buffer, peer, tag, {.timeout = Millis(300)}).wait(); });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ++g_checks;
  if (seconds > 3) {
    std::printf("rank %d: the 300 ms timeout took %.2f s\n", g_rank, seconds);
    ++g_failures;
  }
}

// Bad arguments are Errors before anything is posted.
void check_invalid(Communicator& comm) {
  const int n = comm.size(), me = comm.rank(), peer = (me + 1) % n;
  Tensor t = zeros({2, 3});
  expect_error("send to rank n", {"the peer must be another rank", cat("rank ", n)},
               [&] { comm.send(t, n, {}); });
  expect_error("receive from itself", "the peer must be another rank",
               [&] { comm.recv(t, me, {}); });
  expect_error("send to rank -1", "the peer must be another rank", [&] { comm.send(t, -1, {}); });
  if (n == 1) return;
  expect_error("micro_batch 2^20", "micro_batch must be in [0, 1048576), got 1048576",
               [&] { comm.send(t, peer, {.micro_batch = 1 << 20}); });
  expect_error("stream -1", "stream must be in [0, 1024), got -1",
               [&] { comm.recv(t, peer, {.stream = -1}); });
  expect_error("direction 2", "neither activation nor gradient",
               [&] { comm.send(t, peer, {.direction = P2PDirection(2)}); });
  expect_error("a transposed tensor", "not contiguous",
               [&] { comm.send(t.transpose(0, 1), peer, {}); });
  expect_error("an undefined tensor", "undefined", [&] { comm.recv(Tensor(), peer, {}); });
}

}  // namespace

int run_p2p(Communicator& world) {
  check_invalid(world);
  if (world.size() > 1) {
    for (DType dtype : {DType::f32, DType::bf16, DType::i64})
      for (int64_t count : {0, 1, 33, 4099}) check_ring(world, count, dtype, 4);
    // Tens of MB: UCX's rendezvous path (cross-memory attach between local ranks).
    check_ring(world, (int64_t(24) << 20) / 4, DType::f32, 1, 1021);
    check_same_tag_order(world);
    check_with_collectives(world);
    // A reversed communicator: ranks and world ranks differ.
    auto reversed = world.split(0, -world.rank());
    check_ring(*reversed, 777, DType::f32, 3);
    check_timeout(*reversed);
    check_mismatch(world);
  }
  barrier(world);
  return testing::report_checks();
}

int run_p2p_victim(Communicator& world, int victim) {
  check_ring(world, 1000, DType::f32, 1);
  barrier(world);
  if (world.rank() == victim) ::raise(SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const std::string named = cat("rank ", victim, " (world rank ", victim, ")");
  Tensor from_victim = zeros({1000});
  Work r = world.recv(from_victim, victim, {.micro_batch = 1});
  const std::string error =
      expect_error("a receive from the killed rank", {named, "the peer failed"}, [&] { r.wait(); });
  std::printf("rank %d: after %.2f s: %s\n", g_rank, seconds(), error.c_str());
  // Large: the send completes only once the victim has read it.
  Tensor to_victim = zeros({int64_t(4) << 20});
  expect_error("a large send to the killed rank", {named, "the peer failed"},
               [&] { world.send(to_victim, victim, {.micro_batch = 1}).wait(); });
  std::printf("rank %d: caught after %.2f s, %d checks, %d failed\n", g_rank, seconds(), g_checks,
              g_failures);
  return g_failures ? 1 : 3;
}

}  // namespace trainer::comm_test
