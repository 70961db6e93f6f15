// The allreduce algorithms scenario of the comm test worker
// (tests/test_comm_algorithms.cpp): every algorithm by name, and automatic
// through the measured alpha-beta model (run with no-shm, so that the
// shared-memory channel does not take automatic's place), on counts 0, 1,
// below the world size, odd and spanning several segments, checked against
// the closed form and for the same bits on every rank.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "comm/alpha_beta.h"
#include "comm/collectives.h"
#include "tests/comm_worker.h"

namespace trainer::comm_test {

using namespace comm;

namespace {

// FNV-1a of the bytes: the replicas of data parallelism must stay identical.
uint64_t fingerprint(const void* data, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < bytes; ++i)
    h = (h ^ static_cast<const unsigned char*>(data)[i]) * 1099511628211ull;
  return h;
}

// Every rank's fingerprint equals rank 0's.
void expect_same_on_every_rank(Communicator& comm, const std::string& what, uint64_t mine) {
  std::vector<uint64_t> all(size_t(comm.size()));
  allgather(comm, &mine, all.data(), sizeof mine);
  bool same = true;
  for (uint64_t h : all) same = same && h == all[0];
  testing::expect(same, what + ": the ranks' results differ in their bits");
}

template <class T>
void check_algorithm(Communicator& comm, size_t count, const AllreduceOptions& o) {
  std::vector<T> data = make_input<T>(comm.rank(), count);
  allreduce(comm, data.data(), count, dtype_of<T>(), o);
  const std::string what =
      cat("allreduce ", algorithm_name(o.algorithm), " ", dtype_of<T>(), " ", reduce_op_name(o.op),
          " count ", count, " segment ", o.segment_bytes, " (", comm.size(), " ranks)");
  expect(
      what, data, [&](size_t i) { return expected_reduction(o.op, comm.size(), i); },
      dtype_of<T>());
  expect_same_on_every_rank(comm, what, fingerprint(data.data(), data.size() * sizeof(T)));
}

const AllreduceAlgorithm kNamed[] = {
    AllreduceAlgorithm::automatic,          AllreduceAlgorithm::ring,
    AllreduceAlgorithm::recursive_doubling, AllreduceAlgorithm::tree,
    AllreduceAlgorithm::butterfly,          AllreduceAlgorithm::all_to_all,
    AllreduceAlgorithm::master_worker,      AllreduceAlgorithm::round_robin};

// The algorithms that cut the buffer into segments also run with 64-byte
// ones (many segments, pipelines deeper than their windows).
bool segmented(AllreduceAlgorithm a) {
  return a == AllreduceAlgorithm::ring || a == AllreduceAlgorithm::tree ||
         a == AllreduceAlgorithm::all_to_all || a == AllreduceAlgorithm::master_worker;
}

template <class T>
void check_algorithms(Communicator& comm, const std::vector<ReduceOp>& ops) {
  const size_t n = size_t(comm.size());
  for (size_t count : {size_t(0), size_t(1), n - 1, n * 3 + 1, size_t(1000), size_t(4099)})
    for (ReduceOp op : ops)
      for (AllreduceAlgorithm a : kNamed) {
        check_algorithm<T>(comm, count, {.op = op, .algorithm = a});
        if (segmented(a))
          check_algorithm<T>(comm, count, {.op = op, .algorithm = a, .segment_bytes = 64});
      }
}

// The model: measured, positive, the same on every rank, and the choice it
// makes one of the algorithms.
void check_model(Communicator& comm) {
  const LinkModel& model = link_model(comm);
  testing::expect(comm.size() == 1 || (model.alpha > 0 && model.beta > 0 && model.gamma > 0),
                  cat("link model has positive constants: ", model.str()));
  double constants[3] = {model.alpha, model.beta, model.gamma};
  expect_same_on_every_rank(comm, "link model", fingerprint(constants, sizeof constants));
  testing::expect(&link_model(comm) == &model, "link model is cached");
  for (size_t bytes : {size_t(4), size_t(1) << 20}) {
    const AllreduceAlgorithm choice = choose_allreduce(comm.size(), bytes, 1 << 20, model);
    testing::expect(choice != AllreduceAlgorithm::automatic && choice != AllreduceAlgorithm::shm,
                    cat("automatic chooses a point-to-point algorithm for ", bytes, " bytes"));
  }
}

}  // namespace

int run_algorithms(Communicator& world, bool full) {
  check_model(world);
  const std::vector<ReduceOp> all_ops{ReduceOp::sum, ReduceOp::avg, ReduceOp::max};
  check_algorithms<float>(world, all_ops);
  check_algorithms<bf16>(world, full ? all_ops : std::vector<ReduceOp>{ReduceOp::sum});
  if (full) {
    check_algorithms<f16>(world, all_ops);
    check_algorithms<double>(world, all_ops);
  }
  // In a split group (its own tag space and members), odd ranks reversed.
  auto group = world.split(world.rank() % 2, -world.rank());
  for (AllreduceAlgorithm a : kNamed)
    check_algorithm<float>(*group, 37, {.op = ReduceOp::avg, .algorithm = a, .segment_bytes = 16});
  barrier(world);
  return testing::report_checks();
}

}  // namespace trainer::comm_test
