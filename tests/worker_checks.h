// The rank programs' record of their checks (tests/*_worker.cpp): every
// rank counts its checks and failures, prints each failure with its rank,
// and ends with "rank R: N checks, F failed", the line
// testing::require_ranks_passed (tests/testing.h) reads. The record is per
// thread, so ranks run as threads of one process (tests/thread_world.h)
// keep their own.
//
//   g_rank = world->rank();
//   expect(grad.equal(expected), "stage 1 gradient of fc.weight");
//   return report_checks();   // exit code: 0 without failures
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace trainer::testing {

inline thread_local int g_rank = 0;
inline thread_local int g_checks = 0;
inline thread_local int g_failures = 0;
// The parts a rank compared ("block, n = 2"), as report_compared printed them.
inline thread_local std::vector<std::string> g_compared;

// Counts a check; prints "rank R: what: failed" when ok is false.
inline void expect(bool ok, const std::string& what) {
  ++g_checks;
  if (ok) return;
  std::printf("rank %d: %s: failed\n", g_rank, what.c_str());
  ++g_failures;
}

// Prints "rank R: <part>: compared" and records part (a rank run as a
// thread is checked by what it recorded, a process by what it printed).
inline void report_compared(const std::string& part) {
  std::printf("rank %d: %s: compared\n", g_rank, part.c_str());
  g_compared.push_back(part);
}

// Prints the rank's summary line; the exit code (1 when any check failed).
inline int report_checks() {
  std::printf("rank %d: %d checks, %d failed\n", g_rank, g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}

}  // namespace trainer::testing
