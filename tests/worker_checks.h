// The rank programs' record of their checks (tests/*_worker.cpp): every
// rank counts its checks and failures, prints each failure with its rank,
// and ends with "rank R: N checks, F failed", the line
// testing::require_ranks_passed (tests/testing.h) reads.
//
//   g_rank = world->rank();
//   expect(grad.equal(expected), "stage 1 gradient of fc.weight");
//   return report_checks();   // exit code: 0 without failures
#pragma once

#include <cstdio>
#include <string>

namespace trainer::testing {

inline int g_rank = 0;
inline int g_checks = 0;
inline int g_failures = 0;

// Counts a check; prints "rank R: what: failed" when ok is false.
inline void expect(bool ok, const std::string& what) {
  ++g_checks;
  if (ok) return;
  std::printf("rank %d: %s: failed\n", g_rank, what.c_str());
  ++g_failures;
}

// Prints the rank's summary line; the exit code (1 when any check failed).
inline int report_checks() {
  std::printf("rank %d: %d checks, %d failed\n", g_rank, g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}

}  // namespace trainer::testing
