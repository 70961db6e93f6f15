// Work: the handle of a non-blocking communication, a collective or a
// point-to-point message. A collective runs on its communicator's progress
// thread (one per communicator, started on first use, operations in issue
// order), which completes its State; a point-to-point message is a posted
// transport request that the thread calling test() or wait() progresses (an
// Operation). Either way wait() blocks until it finished and rethrows its
// Error; the buffers must stay untouched until then.
//
//   Work w = allreduce_async(*world, grad, {});
//   Work r = pp->recv(activation, prev, {.micro_batch = 3});
//   ... compute ...
//   w.wait();
//   r.wait();
#pragma once

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>

namespace trainer::comm {

class Work {
 public:
  Work() = default;  // a finished no-op
  // True once finished; rethrows the operation's error.
  bool test() const;
  // Blocks until finished; rethrows the operation's error. Every operation
  // times out (its options' timeout, or the communicator's), so this returns.
  void wait() const;

  // Completed by another thread (the progress thread): done and error set
  // under the mutex, then done_cv notified.
  struct State {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
    std::exception_ptr error;
  };
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}

  // Completed by the thread that tests or waits (point-to-point messages,
  // comm/p2p.cpp). Both calls may come from several threads.
  class Operation {
   public:
    virtual ~Operation() = default;
    virtual bool test() = 0;
    virtual void wait() = 0;
  };
  explicit Work(std::shared_ptr<Operation> operation) : operation_(std::move(operation)) {}

 private:
  std::shared_ptr<State> state_;
  std::shared_ptr<Operation> operation_;
};

}  // namespace trainer::comm
