// Ranks as threads of one process: each thread joins its own world
// communicator (its own store client, UCX worker, progress thread and
// shared-memory channel), as a process of `trainer launch` would, so the
// equivalence tests of collectives and parallel layers run as unit tests in
// milliseconds, without starting processes.
//
//   std::vector<double> sums = run_thread_ranks<double>(4, [](comm::Communicator& world) {
//     Tensor t = full({8}, world.rank() + 1.0);
//     comm::allreduce(world, t);
//     return t.item<double>(0);
//   });
//   for (double s : sums) CHECK(s == 10);
//
// Catch's assertions are not thread-safe: the function returns what each
// rank computed and the test checks the results on its own thread. A rank
// that throws has its error rethrown here (the first rank's first), after
// every thread has ended; a rank that waits on a thrown one times out after
// `timeout` (its error names the peer), so a broken test never hangs.
#pragma once

#include <unistd.h>

#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "comm/bootstrap.h"
#include "comm/communicator.h"
#include "core/check.h"
#include "tests/process.h"

namespace trainer::testing {

struct ThreadWorldOptions {
  comm::Millis timeout{20000};  // each wait of a collective or message
  bool shared_memory = true;    // the communicators' shared-memory channel
};

template <class Result>
std::vector<Result> run_thread_ranks(int world_size,
                                     const std::function<Result(comm::Communicator&)>& body,
                                     const ThreadWorldOptions& options = {}) {
  const int port = free_port();
  static int job = 0;
  const std::string token = cat("thread-world-", ::getpid(), "-", ++job);
  std::vector<Result> results(static_cast<size_t>(world_size), Result{});
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank)
    threads.emplace_back([&, rank] {
      try {
        comm::Bootstrap boot;
        boot.launcher = comm::Launcher::torchrun;
        boot.rank = rank;
        boot.world_size = world_size;
        boot.local_rank = rank;
        boot.local_world_size = world_size;
        boot.master_port = port;
        boot.job_token = token;
        auto world = comm::init_world(boot, {.timeout = options.timeout,
                                             .connect_timeout = options.timeout,
                                             .shared_memory = options.shared_memory});
        results[size_t(rank)] = body(*world);
      } catch (...) {
        errors[size_t(rank)] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  return results;
}

}  // namespace trainer::testing
