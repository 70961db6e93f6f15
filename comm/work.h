// Work: the handle of a non-blocking collective. The collective runs on its
// communicator's progress thread (one per communicator, started on first
// use, operations in issue order); wait() blocks until it finished and
// rethrows its Error. The buffers must stay untouched until then.
//
//   Work w = allreduce_async(*world, grad, {});
//   ... compute ...
//   w.wait();
#pragma once

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>

namespace trainer::comm {

class Work {
 public:
  Work() = default;  // a finished no-op
  // True once finished; rethrows the collective's error.
  bool test() const;
  // Blocks until finished; rethrows the collective's error. The collective
  // itself times out (its options' timeout), so this returns.
  void wait() const;

  struct State {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
    std::exception_ptr error;
  };
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

}  // namespace trainer::comm
