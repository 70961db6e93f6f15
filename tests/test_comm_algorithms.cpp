// The allreduce algorithms by name: their names, the alpha-beta model and
// the choice automatic makes from it (in this process), and every algorithm
// on 2 to 8 ranks (tests/comm_worker_algorithms.cpp under `trainer launch`):
// 2, 3, 4 and 8 ranks on f32 and bf16 by default, 5 to 8 with every dtype
// in the [slow] case.
#include <string>
#include <vector>

#include "comm/alpha_beta.h"
#include "comm/collectives.h"
#include "tests/process.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::comm;

TEST_CASE("comm: allreduce algorithms parse from their names and back", "[comm]") {
  for (const char* key : {"auto", "ring", "recursive_doubling", "tree", "butterfly", "all_to_all",
                          "master_worker", "round_robin", "shm"}) {
    INFO(key);
    const std::optional<AllreduceAlgorithm> algorithm = parse_allreduce_algorithm(key);
    REQUIRE(algorithm.has_value());
    CHECK(algorithm_key(*algorithm) == key);
  }
  CHECK(parse_allreduce_algorithm("recursive-doubling") == AllreduceAlgorithm::recursive_doubling);
  CHECK(parse_allreduce_algorithm("all-to-all") == AllreduceAlgorithm::all_to_all);
  CHECK(parse_allreduce_algorithm("automatic") == AllreduceAlgorithm::automatic);
  CHECK_FALSE(parse_allreduce_algorithm("hypercube").has_value());
  CHECK(algorithm_name(AllreduceAlgorithm::master_worker) == "master-worker");
}

TEST_CASE("comm: the alpha-beta model ranks the algorithms as the textbook does", "[comm]") {
  // 20 us per message, 1 GB/s links, reductions at 5 GB/s.
  const LinkModel model{.alpha = 20e-6, .beta = 1e-9, .gamma = 0.2e-9};
  const size_t segment = size_t(1) << 20, large = size_t(64) << 20;
  auto predict = [&](AllreduceAlgorithm a, int n, size_t bytes) {
    return predict_allreduce(a, n, bytes, segment, model);
  };
  // Small messages: latency rules, log2(n) rounds of recursive doubling win.
  CHECK(choose_allreduce(8, 8, segment, model) == AllreduceAlgorithm::recursive_doubling);
  CHECK(predict(AllreduceAlgorithm::recursive_doubling, 8, 8) ==
        Approx(3 * (20e-6 + 8e-9 + 8 * 0.2e-9)));
  // Large ones: bandwidth rules. The butterfly moves what the ring does in
  // fewer messages on a power of two; elsewhere its fold costs a whole buffer.
  CHECK(choose_allreduce(8, large, segment, model) == AllreduceAlgorithm::butterfly);
  CHECK(choose_allreduce(6, large, segment, model) == AllreduceAlgorithm::ring);
  CHECK(predict(AllreduceAlgorithm::ring, 8, large) ==
        Approx(14 * 20e-6 + 1.75 * large * 1e-9 + 0.875 * large * 0.2e-9));
  // The master's link carries 2(n-1) buffers, all-to-all's every link n-1:
  // both several times the ring's 2(n-1)/n.
  for (int n : {3, 5, 8}) {
    INFO(n << " ranks");
    const double ring = predict(AllreduceAlgorithm::ring, n, large);
    CHECK(predict(AllreduceAlgorithm::master_worker, n, large) > n * 0.9 * ring);
    CHECK(predict(AllreduceAlgorithm::all_to_all, n, large) > n * 0.45 * ring);
    CHECK(predict(AllreduceAlgorithm::round_robin, n, large) > ring);
    CHECK(predict(AllreduceAlgorithm::tree, n, large) > ring);
  }
  CHECK(predict(AllreduceAlgorithm::shm, 8, large) < 0);
  // Two ranks: one exchange either way, so the simplest is kept.
  CHECK(choose_allreduce(2, 8, segment, model) == AllreduceAlgorithm::recursive_doubling);
}

TEST_CASE("comm: TRAINER_LINK_MODEL gives the cost model in microseconds and GB/s", "[comm]") {
  const LinkModel m = parse_link_model("2,1.5,12");
  CHECK(m.alpha == Approx(2e-6));
  CHECK(m.beta == Approx(1e-9 / 1.5));
  CHECK(m.gamma == Approx(1e-9 / 12));
  CHECK(m.str() == "alpha 2.0 us, beta 1.50 GB/s, gamma 12.00 GB/s");
  for (const char* bad : {"", "2,1.5", "2,1.5,12,4", "2,0,12", "2,-1,12", "2,x,12", "2,1.5,inf"}) {
    INFO(bad);
    CHECK_THAT(testing::error_of([&] { parse_link_model(bad); }),
               Catch::StartsWith(cat("TRAINER_LINK_MODEL=", bad,
                                     ": expected three positive numbers ALPHA_US,BETA_GBPS,")));
  }
}

TEST_CASE("comm: the traffic of each allreduce algorithm", "[comm]") {
  const size_t bytes = 1024, segment = size_t(1) << 20;
  auto traffic = [&](AllreduceAlgorithm a, int n) {
    return allreduce_traffic(a, n, bytes, segment);
  };
  CHECK(traffic(AllreduceAlgorithm::all_to_all, 8).messages == 56);
  CHECK(traffic(AllreduceAlgorithm::all_to_all, 8).busiest_rank_bytes == 7 * bytes);
  CHECK(traffic(AllreduceAlgorithm::master_worker, 8).messages == 14);
  CHECK(traffic(AllreduceAlgorithm::master_worker, 8).busiest_rank_bytes == 7 * bytes);
  CHECK(traffic(AllreduceAlgorithm::ring, 8).messages == 112);
  CHECK(traffic(AllreduceAlgorithm::ring, 8).busiest_rank_bytes == 1.75 * bytes);
  CHECK(traffic(AllreduceAlgorithm::recursive_doubling, 8).messages == 24);
  CHECK(traffic(AllreduceAlgorithm::butterfly, 8).messages == 48);
  CHECK(traffic(AllreduceAlgorithm::butterfly, 6).messages == 2 * 4 * 2 + 4);
  CHECK(traffic(AllreduceAlgorithm::tree, 8).messages == 14);
  CHECK(traffic(AllreduceAlgorithm::tree, 8).busiest_rank_bytes == 3 * bytes);
  CHECK(traffic(AllreduceAlgorithm::round_robin, 4).messages == 24);
  // Over all ranks every algorithm but two sends 2(n-1) buffers.
  for (AllreduceAlgorithm a : modelled_algorithms()) {
    INFO(algorithm_name(a));
    const double total = traffic(a, 8).total_bytes / double(bytes);
    if (a == AllreduceAlgorithm::all_to_all)
      CHECK(total == 56);
    else if (a == AllreduceAlgorithm::recursive_doubling)
      CHECK(total == 24);
    else
      CHECK(total == 14);
  }
}

namespace {

void check_algorithms(int nproc, bool full) {
  INFO("world size " << nproc);
  std::vector<std::string> argv{
      TRAINER_BINARY,     "launch", "--nproc-per-node", std::to_string(nproc), "--program",
      COMM_WORKER_BINARY, "--",     "algorithms"};
  if (full) argv.push_back("full");
  argv.push_back("no-shm");
  const testing::ProcessResult o = testing::run_process(argv, {.timeout_s = 300});
  INFO(o.output);
  REQUIRE(o.code == 0);
  // Every rank's summary line reports its checks and no failure.
  for (int r = 0; r < nproc; ++r) {
    std::string summary;
    for (size_t at = o.output.find(cat("rank ", r, ": ")); at != std::string::npos;
         at = o.output.find(cat("rank ", r, ": "), at + 1)) {
      const std::string line = o.output.substr(at, o.output.find('\n', at) - at);
      if (line.find(" checks, ") != std::string::npos) summary = line;
    }
    INFO("rank " << r << " summary: " << summary);
    CHECK(summary.find(" checks, 0 failed") != std::string::npos);
  }
}

}  // namespace

TEST_CASE("comm: every allreduce algorithm on 2, 3, 4 and 8 ranks", "[comm][mp]") {
  for (int n : {2, 3, 4, 8}) check_algorithms(n, false);
}

TEST_CASE("comm: every allreduce algorithm, dtype and op on 5 to 8 ranks", "[comm][mp][slow]") {
  for (int n : {5, 6, 7, 8}) check_algorithms(n, true);
}
