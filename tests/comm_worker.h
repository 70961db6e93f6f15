// What the scenarios of the comm test worker share (tests/comm_worker.cpp,
// tests/comm_worker_p2p.cpp): closed-form inputs, checks that count and print
// the first mismatch with rank, index, expected and actual, and expected errors.
#pragma once

#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "comm/reduce.h"
#include "tests/worker_checks.h"

namespace trainer::comm_test {

using comm::ReduceOp;

using testing::g_checks;
using testing::g_failures;
using testing::g_rank;

// Rank r's element i: (r + 1) + i % 7, exact in every dtype for the sizes used.
inline double input_value(int rank, size_t i) { return double(rank + 1) + double(i % 7); }

inline double expected_reduction(ReduceOp op, int n, size_t i) {
  switch (op) {
    case ReduceOp::sum:
      return n * (n + 1) / 2.0 + n * double(i % 7);
    case ReduceOp::avg:
      return (n * (n + 1) / 2.0 + n * double(i % 7)) / n;
    case ReduceOp::max:
      return double(n) + double(i % 7);
  }
  return 0;
}

inline double tolerance(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return 1e-2;
    case DType::f16:
      return 1e-3;
    default:
      return 1e-6;
  }
}

template <class T>
std::vector<T> make_input(int rank, size_t count) {
  std::vector<T> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = store_as<T>(float(input_value(rank, i)));
  return v;
}

// Compares and reports the first mismatch of one check.
template <class T, class Expected>
void expect(const std::string& what, const std::vector<T>& actual, Expected&& expected,
            DType dtype) {
  ++g_checks;
  for (size_t i = 0; i < actual.size(); ++i) {
    double a = double(load(actual[i])), e = expected(i);
    if (std::fabs(a - e) > tolerance(dtype) * std::fabs(e)) {
      std::printf("rank %d: %s: mismatch at index %zu: expected %g, actual %g\n", g_rank,
                  what.c_str(), i, e, a);
      ++g_failures;
      return;
    }
  }
}

// run() must throw an Error whose message contains every needle on this
// rank; returns the message.
template <class Fn>
std::string expect_error(const std::string& what, std::initializer_list<std::string> needles,
                         Fn&& run) {
  ++g_checks;
  try {
    run();
    std::printf("rank %d: %s: no error\n", g_rank, what.c_str());
    ++g_failures;
    return "";
  } catch (const Error& e) {
    for (const std::string& needle : needles)
      if (std::string(e.what()).find(needle) == std::string::npos) {
        std::printf("rank %d: %s: unexpected error (no '%s'): %s\n", g_rank, what.c_str(),
                    needle.c_str(), e.what());
        ++g_failures;
        break;
      }
    return e.what();
  }
}
template <class Fn>
std::string expect_error(const std::string& what, const std::string& needle, Fn&& run) {
  return expect_error(what, {needle}, std::forward<Fn>(run));
}

// The point-to-point scenarios (tests/comm_worker_p2p.cpp); exit codes as
// the collectives' scenarios.
int run_p2p(comm::Communicator& world);
int run_p2p_victim(comm::Communicator& world, int victim);

// Every allreduce algorithm by name (tests/comm_worker_algorithms.cpp); full:
// every dtype and op, else f32 with every op and bf16 sum.
int run_algorithms(comm::Communicator& world, bool full);

// The traffic counters' deltas per collective (tests/comm_worker_traffic.cpp);
// shared_memory: as CommOptions::shared_memory.
int run_traffic(comm::Communicator& world, bool shared_memory);

}  // namespace trainer::comm_test
