// The traffic counters' scenario of the comm test worker (tests/comm_worker.cpp
// runs it): each collective, in its blocking, _async and tensor forms, and a
// point-to-point message, with the counters (comm/traffic.h) read before and
// after; the deltas must be the bus bytes exactly, in the operation's own
// field and nowhere else.
//
//   comm_worker traffic [no-shm]   exit 0; no-shm: the ring's transport bytes
//                                  are checked too (all of them to this host)
#include <functional>

#include "comm/collectives.h"
#include "comm/traffic.h"
#include "tests/comm_worker.h"

namespace trainer::comm_test {

using namespace comm;

namespace {

// The counters' deltas of one operation on this rank: `field` must have
// grown by exactly `expected`, the other collective fields and p2p not at
// all. transport: the bytes the transport must have been handed (checked
// when not negative), all of them to ranks on this host.
void expect_traffic(const std::string& what, uint64_t Traffic::*field, uint64_t expected,
                    const std::function<void()>& run, int64_t transport = -1) {
  const Traffic before = traffic();
  run();
  const Traffic d = traffic() - before;
  for (uint64_t Traffic::*f : {&Traffic::allreduce, &Traffic::reduce_scatter, &Traffic::allgather,
                               &Traffic::broadcast, &Traffic::p2p, &Traffic::all_to_all}) {
    const uint64_t want = f == field ? expected : 0;
    testing::expect(d.*f == want, cat(what, ": counted ", d.*f, " bytes in ",
                                      f == field ? "its" : "another", " field, expected ", want));
  }
  testing::expect(d.total() == expected, cat(what, ": total ", d.total(), ", expected ", expected));
  if (transport >= 0)
    testing::expect(d.transport == uint64_t(transport),
                    cat(what, ": transport ", d.transport, " bytes, expected ", transport));
  testing::expect(d.network == 0, cat(what, ": ", d.network, " bytes to other hosts"));
}

}  // namespace

int run_traffic(Communicator& world, bool shared_memory) {
  const int n = world.size();
  const uint64_t un = uint64_t(n);
  // Per rank: count elements f32; a multiple of n, so the ring's blocks are equal.
  const size_t count = 3000 * size_t(n);
  const uint64_t block = count * 4;                            // one rank's block, bytes
  const uint64_t scatter_bytes = (un - 1) * block;             // (n - 1) / n of n blocks
  const uint64_t allreduce_bytes = 2 * (un - 1) * block / un;  // 2 (n - 1) / n of one block
  // Without the shared-memory channel every ring byte goes through the
  // transport; with it the allreduce does not, the ring collectives still do.
  const int64_t ring_scatter = int64_t(scatter_bytes);
  const int64_t ring_allreduce = shared_memory ? -1 : int64_t(allreduce_bytes);

  std::vector<float> flat = make_input<float>(world.rank(), count * size_t(n)), out(count);
  expect_traffic(
      "reduce_scatter", &Traffic::reduce_scatter, scatter_bytes,
      [&] { reduce_scatter(world, flat.data(), out.data(), count, DType::f32); }, ring_scatter);
  expect_traffic(
      "reduce_scatter_async", &Traffic::reduce_scatter, scatter_bytes,
      [&] { reduce_scatter_async(world, flat.data(), out.data(), count, DType::f32).wait(); },
      ring_scatter);
  expect_traffic("reduce_scatter of a tensor", &Traffic::reduce_scatter, scatter_bytes,
                 [&] { reduce_scatter(world, from_vector(flat)); });

  std::vector<float> gathered(count * size_t(n));
  expect_traffic(
      "allgather", &Traffic::allgather, scatter_bytes,
      [&] { allgather(world, out.data(), gathered.data(), block); }, ring_scatter);
  expect_traffic("allgather_async", &Traffic::allgather, scatter_bytes,
                 [&] { allgather_async(world, out.data(), gathered.data(), block).wait(); });
  expect_traffic("allgather of a tensor", &Traffic::allgather, scatter_bytes,
                 [&] { allgather(world, from_vector(out)); });

  std::vector<float> data = make_input<float>(world.rank(), count);
  expect_traffic(
      "allreduce ring", &Traffic::allreduce, allreduce_bytes,
      [&] {
        allreduce(world, data.data(), count, DType::f32, {.algorithm = AllreduceAlgorithm::ring});
      },
      ring_allreduce);
  for (AllreduceAlgorithm a :
       {AllreduceAlgorithm::automatic, AllreduceAlgorithm::recursive_doubling,
        AllreduceAlgorithm::tree, AllreduceAlgorithm::butterfly})
    expect_traffic(cat("allreduce ", algorithm_name(a)), &Traffic::allreduce, allreduce_bytes,
                   [&] { allreduce(world, data.data(), count, DType::f32, {.algorithm = a}); });
  expect_traffic("allreduce_async", &Traffic::allreduce, allreduce_bytes,
                 [&] { allreduce_async(world, data.data(), count, DType::f32).wait(); });
  // Rounded down: 2 (n - 1) / n of 4 x 7 bytes of bf16.
  expect_traffic("allreduce of an odd tensor", &Traffic::allreduce, 2 * (un - 1) * 14 / un,
                 [&] { allreduce(world, full({7}, 1.0, DType::bf16)); });

  for (int root : {0, n - 1})
    expect_traffic(cat("broadcast from ", root), &Traffic::broadcast, n > 1 ? block : 0,
                   [&] { broadcast(world, data.data(), block, root); });
  expect_traffic("broadcast_async", &Traffic::broadcast, n > 1 ? block : 0,
                 [&] { broadcast_async(world, data.data(), block, 0).wait(); });
  expect_traffic("barrier", &Traffic::allreduce, 0, [&] { barrier(world); });

  // all_to_all: the n - 1 blocks for the others; the pairwise way hands all
  // of them to the transport, the shared-memory channel none.
  std::vector<float> exchanged(count * size_t(n));
  expect_traffic(
      "all_to_all", &Traffic::all_to_all, scatter_bytes,
      [&] { all_to_all(world, flat.data(), exchanged.data(), block); },
      shared_memory && n > 1 ? 0 : int64_t(scatter_bytes));
  expect_traffic("all_to_all_async", &Traffic::all_to_all, scatter_bytes,
                 [&] { all_to_all_async(world, flat.data(), exchanged.data(), block).wait(); });
  expect_traffic("all_to_all of a tensor", &Traffic::all_to_all, scatter_bytes,
                 [&] { all_to_all(world, from_vector(flat)); });

  if (n > 1) {
    // Rank 0 sends to rank 1: the sender counts the message, the receiver nothing.
    Tensor message = full({1000}, 2.0);
    const bool sends = world.rank() == 0, receives = world.rank() == 1;
    expect_traffic(
        "p2p", &Traffic::p2p, sends ? 4000 : 0,
        [&] {
          if (sends) world.send(message, 1, {.micro_batch = 3}).wait();
          if (receives) world.recv(message, 0, {.micro_batch = 3}).wait();
        },
        sends ? 4000 : 0);
  }
  barrier(world);
  return testing::report_checks();
}

}  // namespace trainer::comm_test
