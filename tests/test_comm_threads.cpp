// The in-process harness (tests/thread_world.h): ranks as threads of one
// process run the collectives with the answers the multi-process tests
// check, at world sizes 1 to 8 and counts not divisible by the world.
#include <cmath>

#include "comm/collectives.h"
#include "core/ops.h"
#include "tests/testing.h"
#include "tests/thread_world.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// Rank r holds r + 1 + i / count at index i; the sum over n ranks is
// n(n+1)/2 + n i / count.
Tensor ramp(int rank, int64_t count) {
  std::vector<float> values(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) values[size_t(i)] = float(rank + 1) + float(i) / float(count);
  return from_vector(values, {count});
}

}  // namespace

TEST_CASE("thread world: allreduce, reduce-scatter and all-gather over threads", "[comm]") {
  for (int n : {1, 2, 3, 4, 8}) {
    for (int64_t count : {int64_t(1), int64_t(13), int64_t(4099)}) {
      const std::vector<double> worst = run_thread_ranks<double>(n, [&](comm::Communicator& world) {
        Tensor t = ramp(world.rank(), count);
        comm::allreduce(world, t, {.algorithm = comm::AllreduceAlgorithm::ring});
        double error = 0;
        const float* p = t.data<float>();
        for (int64_t i = 0; i < count; ++i)
          error = std::max(error, std::abs(double(p[i]) - (n * (n + 1) / 2.0 +
                                                           double(n) * double(i) / double(count))));
        return error;
      });
      for (double e : worst) CHECK(e < 1e-3);
    }
  }
  const std::vector<double> gathered = run_thread_ranks<double>(4, [](comm::Communicator& world) {
    Tensor mine = full({3}, float(world.rank()));
    Tensor all = comm::allgather(world, mine);
    double sum = 0;
    for (int64_t i = 0; i < all.numel(); ++i) sum += all.data<float>()[i] * double(i / 3 + 1);
    return sum;  // sum over r of 3 r (r + 1) = 3 (0 + 2 + 6 + 12)
  });
  for (double s : gathered) CHECK(s == 60);
}

TEST_CASE("thread world: a rank that throws is reported, the others time out naming it", "[comm]") {
  CHECK_THROWS_WITH(run_thread_ranks<int>(2,
                                          [](comm::Communicator& world) {
                                            if (world.rank() == 1) throw Error("rank 1 gave up");
                                            Tensor t = full({4}, 1.0f);
                                            comm::allreduce(world, t);
                                            return 0;
                                          },
                                          {.timeout = comm::Millis(2000)}),
                    Catch::Contains("rank"));
}
