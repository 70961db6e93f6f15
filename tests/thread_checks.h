// A rank program's checks (tests/*_checks.h) on ranks as threads of this
// process (tests/thread_world.h), one OpenMP thread each, with each rank's
// record of tests/worker_checks.h returned for the test to assert on.
//
//   const auto reports = run_checks_on_threads(3, [&](const auto& world) {
//     return run_pipeline_checks(world, {"equiv", "1f1b"});
//   });
//   for (const RankReport& r : reports) CHECK(r.code == 0);
#pragma once

#include <omp.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tests/thread_world.h"
#include "tests/worker_checks.h"

namespace trainer::testing {

// What one rank's checks returned and recorded.
struct RankReport {
  int code = -1;  // the check's return: 0 when every check passed
  int checks = 0, failures = 0;
  std::vector<std::string> compared;  // report_compared's parts
  bool has_compared(const std::string& part) const {
    for (const std::string& c : compared)
      if (c == part) return true;
    return false;
  }
};

inline std::vector<RankReport> run_checks_on_threads(
    int ranks, const std::function<int(const std::shared_ptr<comm::Communicator>&)>& check,
    comm::Millis timeout = comm::Millis(60000)) {
  return run_thread_ranks<RankReport>(
      ranks,
      [&](comm::Communicator& world) {
        omp_set_num_threads(1);  // as `trainer launch` gives each rank of a test
        g_rank = world.rank();
        g_checks = g_failures = 0;
        g_compared.clear();
        RankReport r;
        // A non-owning handle: the harness owns the thread's world.
        r.code = check(std::shared_ptr<comm::Communicator>(&world, [](comm::Communicator*) {}));
        r.checks = g_checks;
        r.failures = g_failures;
        r.compared = g_compared;
        return r;
      },
      {.timeout = timeout});
}

}  // namespace trainer::testing
