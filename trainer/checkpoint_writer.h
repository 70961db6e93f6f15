// Writing checkpoints without stopping training (training.async_checkpoint):
// at a checkpoint step each rank copies into host memory what the next
// forward pass changes (CheckpointPart::changes_in_forward: the model's
// buffers, its stream state; the main rank's trainer_state.json is a copy
// already); a background thread copies the rest (parameters, optimizer
// state) while the next forward and backward passes run, the next
// optimizer step waiting for it (wait_staged), then writes the files while
// training goes on. The checkpoint is committed (renamed, `latest` moved)
// only once every rank has finished its part: the ranks agree on it at a
// step boundary (DistributedRun::any_rank, one small allreduce per step
// while a write is in flight), and the main rank commits on a thread of
// its own, in order: a checkpoint is committed after the one before it.
// A second checkpoint waits for the write in flight (never two), and
// commits it; a commit already under way when its write had ended goes on
// meanwhile. The end of training and a stop signal wait for both. A
// SIGKILL at any moment leaves `latest` at the last committed checkpoint.
// When the staged copy would exceed the cap, or without async_checkpoint,
// the step writes synchronously.
//
//   CheckpointWriter writer(dir, {.async = true, .max_staging_bytes = 1 << 30}, main_rank);
//   report(writer.settle(run, step));           // at a checkpoint: the write in flight
//   writer.start(tmp, step, is_best, session.checkpoint_part(state), run, t0);
//   writer.wait_staged();                       // before each optimizer step
//   report(writer.poll(run));                   // every step
//   report(writer.finish(run));                 // at the end
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "trainer/checkpoint.h"

namespace trainer {

class DistributedRun;

struct CheckpointWriterOptions {
  bool async = true;
  int64_t max_staging_bytes = 0;  // 0: no cap
};

// A committed checkpoint and what it cost training.
struct CommittedCheckpoint {
  std::string dir;
  bool background = false;  // written in the background, else by the step
  // What the checkpoint step waited from the moment it began on (the
  // directory, the part, then the copy or the whole write) and the next
  // optimizer step's wait for the background copy.
  double blocked_seconds = 0;
  // What waiting for its background commit held a step (the main rank's).
  double commit_seconds = 0;
  int64_t bytes = 0;  // this rank's part
};

class CheckpointWriter {
 public:
  using Clock = std::chrono::steady_clock;

  CheckpointWriter(CheckpointDir& dir, CheckpointWriterOptions options, bool main_rank);
  // Waits for a write and a commit in flight (not committed: an error is on its way).
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Before a checkpoint of `step` (collective): waits for the write in
  // flight and commits it; a commit in flight (its write was done) goes on
  // unless it is of the same step. What it committed.
  std::vector<CommittedCheckpoint> settle(const DistributedRun& run, int64_t step);
  // Writes `part` into tmp (every rank calls it, after settle() and after
  // the main rank made tmp): staged and written in the background, or
  // written now and committed (then returned, after a commit in flight).
  // `since`: when the step began to wait for this checkpoint.
  std::vector<CommittedCheckpoint> start(const std::string& tmp, int64_t step, bool best,
                                         CheckpointPart part, const DistributedRun& run,
                                         Clock::time_point since);
  // Commits the write in flight once every rank has finished it
  // (collective while one is in flight; nothing otherwise). What it committed.
  std::vector<CommittedCheckpoint> poll(const DistributedRun& run);
  // Waits for the write and the commit in flight (collective). What it committed.
  std::vector<CommittedCheckpoint> finish(const DistributedRun& run);
  // Waits until the background copy of the part started last is done:
  // before anything changes the parameters or the optimizer state (the
  // next optimizer step), which the background thread copies while the
  // next forward and backward passes run.
  void wait_staged();
  // Why the last start() wrote synchronously although async was asked ("" if it did not).
  const std::string& fallback() const { return fallback_; }

 private:
  // A checkpoint between start() and its commit.
  struct Flight {
    int64_t step = 0;
    bool best = false;
    CommittedCheckpoint report;
  };
  void join();
  // The main rank's commit of writing_ on committer_, after the one before it.
  void commit_in_background(std::vector<CommittedCheckpoint>& done);
  CommittedCheckpoint join_commit();

  CheckpointDir& dir_;
  CheckpointWriterOptions options_;
  bool main_;
  std::thread thread_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
  // Set once the background thread has copied the part (or failed to).
  std::atomic<bool> staged_{true};
  std::mutex staged_mutex_;
  std::condition_variable staged_changed_;
  Flight writing_;
  // The main rank's commit of a finished write, in the background.
  std::thread committer_;
  std::atomic<bool> committed_{false};
  std::exception_ptr commit_error_;
  Flight committing_;
  std::string fallback_;
  // The staged copy, reused by the next checkpoint (free once the write
  // that used it is joined).
  std::vector<Tensor> staging_;
};

}  // namespace trainer
