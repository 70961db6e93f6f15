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
// its own. A second checkpoint waits for the one in flight (never two),
// and so do the end of training and a stop signal. A SIGKILL at any moment
// leaves `latest` at the last committed checkpoint. When the staged copy
// would exceed the cap, or without async_checkpoint, the step writes
// synchronously.
//
//   CheckpointWriter writer(dir, {.async = true, .max_staging_bytes = 1 << 30}, main_rank);
//   writer.start(tmp, step, is_best, session.checkpoint_part(state), run);  // at a checkpoint
//   writer.wait_staged();                                    // before each optimizer step
//   if (auto done = writer.poll(run)) log("checkpoint: " + *done);         // every step
//   writer.finish(run);                                                     // at the end
#pragma once

#include <atomic>
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

class CheckpointWriter {
 public:
  CheckpointWriter(CheckpointDir& dir, CheckpointWriterOptions options, bool main_rank);
  // Waits for a write in flight (not committed: an error is on its way).
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Writes `part` into tmp (every rank calls it, after the main rank made
  // tmp): staged and written in the background, or written now and
  // committed. Returns the committed directory when it wrote synchronously.
  std::optional<std::string> start(const std::string& tmp, int64_t step, bool best,
                                   CheckpointPart part, const DistributedRun& run);
  // Commits the write in flight once every rank has finished it
  // (collective while one is in flight; nothing otherwise). The committed
  // directory, or nothing.
  std::optional<std::string> poll(const DistributedRun& run);
  // Waits for the write in flight and commits it (collective).
  std::optional<std::string> finish(const DistributedRun& run);
  bool pending() const { return thread_.joinable() || committer_.joinable(); }
  // Waits until the background copy of the part started last is done:
  // before anything changes the parameters or the optimizer state (the
  // next optimizer step), which the background thread copies while the
  // next forward and backward passes run.
  void wait_staged();
  // How long wait_staged() held training for the checkpoint started last.
  double staging_wait_seconds() const { return staging_wait_; }
  // The bytes of this rank's part in the last start() (staged, or written).
  // What committing the last background write held the step that waited
  // for it (the main rank's: 0 when it was committed in the background
  // between two steps, the commit's time when finish() or the next
  // checkpoint had to wait for it or make it).
  double commit_seconds() const { return commit_; }
  int64_t staged_bytes() const { return staged_bytes_; }
  // Why the last start() wrote synchronously although async was asked ("" if it did not).
  const std::string& fallback() const { return fallback_; }

 private:
  std::optional<std::string> commit(const DistributedRun& run);
  void join();
  std::optional<std::string> join_commit();

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
  // The main rank's commit of a finished write, in the background.
  std::thread committer_;
  std::atomic<bool> committed_{false};
  std::optional<std::string> committed_dir_;
  int64_t step_ = 0;
  bool best_ = false;
  double commit_ = 0, staging_wait_ = 0;
  int64_t staged_bytes_ = 0;
  std::string fallback_;
  // The staged copy, reused by the next checkpoint (free once the write
  // that used it is joined).
  std::vector<Tensor> staging_;
};

}  // namespace trainer
