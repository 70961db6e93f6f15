// CheckpointWriter (trainer/checkpoint_writer.h).
#include "trainer/checkpoint_writer.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <utility>

#include "core/check.h"
#include "core/cpu/threads.h"
#include "trainer/distributed.h"

namespace trainer {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The bytes of the part's tensors.
int64_t part_bytes(const CheckpointPart& part) {
  int64_t bytes = 0;
  for (const TensorPiece& p : part.model) bytes += int64_t(p.values.nbytes());
  for (const TensorPiece& p : part.optimizer) bytes += int64_t(p.values.nbytes());
  if (part.stream_state)
    for (const NamedTensor& t : *part.stream_state) bytes += int64_t(t.tensor.nbytes());
  return bytes;
}

// The part's tensors in staging order: `now`, what the next forward pass
// changes (the model's buffers, the carried stream state), copied before
// training goes on; `later`, what only the next optimizer step changes
// (parameters, optimizer state), copied in the background meanwhile.
struct StagingOrder {
  std::vector<Tensor*> now, later;
};
StagingOrder staging_order(CheckpointPart& part) {
  StagingOrder order;
  for (TensorPiece& p : part.model)
    (part.changes_in_forward.count(p.name) ? order.now : order.later).push_back(&p.values);
  if (part.stream_state)
    for (NamedTensor& t : *part.stream_state) order.now.push_back(&t.tensor);
  for (TensorPiece& p : part.optimizer) order.later.push_back(&p.values);
  return order;
}

// Copies each tensor into host memory training does not touch, buffers[first
// + k] for the k-th: the buffers of the previous checkpoint where they fit
// (a part's tensors come in the same order each time), so a run allocates
// its staging memory once. The tensor then refers to its copy.
void copy_into(const std::vector<Tensor*>& tensors, std::vector<Tensor>& buffers, size_t first) {
  // Grow only: the `now` copy comes first and must not drop the `later` buffers.
  if (buffers.size() < first + tensors.size()) buffers.resize(first + tensors.size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    Tensor& t = *tensors[k];
    Tensor& buffer = buffers[first + k];
    const bool fits =
        buffer.defined() && buffer.shape() == t.shape() && buffer.dtype() == t.dtype();
    if (!fits) buffer = empty(t.shape(), t.dtype());
    buffer.copy_(t);
    t = buffer;
  }
}

// TRAINER_FAULT_CHECKPOINT_DELAY_MS: a pause in the middle of each
// background write, for tests that kill a rank while one is in flight.
int64_t write_delay_ms() {
  const char* v = std::getenv("TRAINER_FAULT_CHECKPOINT_DELAY_MS");
  return v ? std::max<int64_t>(0, std::atoll(v)) : 0;
}

}  // namespace

CheckpointWriter::CheckpointWriter(CheckpointDir& dir, CheckpointWriterOptions options,
                                   bool main_rank)
    : dir_(dir), options_(options), main_(main_rank) {}

CheckpointWriter::~CheckpointWriter() {
  if (thread_.joinable()) thread_.join();
  if (committer_.joinable()) committer_.join();
}

std::vector<CommittedCheckpoint> CheckpointWriter::settle(const DistributedRun& run, int64_t step) {
  // A write in flight: the step waits for it, and for its commit as well
  // (a few ms more, and `latest` is where the write ended).
  if (thread_.joinable()) return finish(run);
  std::vector<CommittedCheckpoint> done;
  // A commit goes on, unless it renames the directory this checkpoint makes again.
  if (committer_.joinable() && (committed_.load() || committing_.step == step))
    done.push_back(join_commit());
  return done;
}

std::vector<CommittedCheckpoint> CheckpointWriter::start(const std::string& tmp, int64_t step,
                                                         bool best, CheckpointPart part,
                                                         const DistributedRun& run,
                                                         Clock::time_point since) {
  CHECK(!thread_.joinable()) << "a checkpoint started while another is being written";
  writing_ = Flight{};
  writing_.step = step;
  writing_.best = best;
  fallback_.clear();
  const int rank = run.dist().rank();
  // Staging copies every tensor whole: the part's bytes are the staged bytes.
  writing_.report.bytes = part_bytes(part);
  // The ranks agree on writing in the background: the cap is per rank.
  bool async = options_.async;
  if (async && options_.max_staging_bytes > 0) {
    const bool over = writing_.report.bytes > options_.max_staging_bytes;
    if (run.any_rank(over)) {
      async = false;
      fallback_ = cat(
          "a rank's state is over training.async_checkpoint_mb (", options_.max_staging_bytes >> 20,
          " MiB; this rank's: ", writing_.report.bytes >> 20, " MiB): written synchronously");
    }
  }
  if (!async) {
    write_checkpoint_part(tmp, rank, part);
    run.barrier();
    if (!main_) return {};
    std::vector<CommittedCheckpoint> done;
    // The commit before this one first: `latest` moves in step order.
    if (committer_.joinable()) done.push_back(join_commit());
    writing_.report.dir = dir_.commit(step, best);
    writing_.report.blocked_seconds = seconds_since(since);
    done.push_back(writing_.report);
    return done;
  }
  copy_into(staging_order(part).now, staging_, 0);
  writing_.report.background = true;
  writing_.report.blocked_seconds = seconds_since(since);
  done_ = false;
  staged_ = false;
  error_ = nullptr;
  thread_ = std::thread([this, tmp, rank, part = std::move(part)]() mutable {
    use_one_kernel_thread();  // the staging copy
    try {
      const StagingOrder order = staging_order(part);
      copy_into(order.later, staging_, order.now.size());
    } catch (...) {
      error_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(staged_mutex_);
      staged_ = true;
    }
    staged_changed_.notify_all();
    if (error_) {
      done_ = true;
      return;
    }
    try {
      // The model's pieces first, then the rest; TRAINER_FAULT_CHECKPOINT_DELAY_MS
      // holds the write between the two (the crash tests' window).
      CheckpointPart model;
      model.model = part.model;
      write_checkpoint_part(tmp, rank, model);
      if (const int64_t ms = write_delay_ms(); ms > 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      CheckpointPart rest = part;
      rest.model.clear();
      write_checkpoint_part(tmp, rank, rest);
    } catch (...) {
      error_ = std::current_exception();
    }
    done_ = true;
  });
  return {};
}

void CheckpointWriter::wait_staged() {
  if (!thread_.joinable() || staged_.load()) return;
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(staged_mutex_);
  staged_changed_.wait(lock, [this] { return staged_.load(); });
  writing_.report.blocked_seconds += seconds_since(t0);
}

void CheckpointWriter::join() {
  thread_.join();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

std::vector<CommittedCheckpoint> CheckpointWriter::poll(const DistributedRun& run) {
  std::vector<CommittedCheckpoint> done;
  // The main rank's commit, in the background since an earlier call.
  if (committer_.joinable() && committed_.load()) done.push_back(join_commit());
  if (!thread_.joinable()) return done;
  // Every rank holds a write in flight here (they started it at the same step).
  if (run.any_rank(!done_.load())) return done;
  join();
  if (main_) commit_in_background(done);
  return done;
}

// Committing (the index, fsyncs, the rename, `latest`, pruning) is the main
// rank's alone and needs no other rank: it goes on while training does.
void CheckpointWriter::commit_in_background(std::vector<CommittedCheckpoint>& done) {
  if (committer_.joinable()) done.push_back(join_commit());  // in step order
  committing_ = writing_;
  committed_ = false;
  committer_ = std::thread([this] {
    try {
      committing_.report.dir = dir_.commit(committing_.step, committing_.best);
    } catch (...) {
      commit_error_ = std::current_exception();
    }
    committed_ = true;
  });
}

CommittedCheckpoint CheckpointWriter::join_commit() {
  const auto t0 = Clock::now();
  committer_.join();
  committing_.report.commit_seconds += seconds_since(t0);
  if (commit_error_) std::rethrow_exception(std::exchange(commit_error_, nullptr));
  return committing_.report;
}

std::vector<CommittedCheckpoint> CheckpointWriter::finish(const DistributedRun& run) {
  std::vector<CommittedCheckpoint> done;
  if (thread_.joinable()) {
    join();
    run.barrier();
    if (main_) commit_in_background(done);
  }
  if (committer_.joinable()) done.push_back(join_commit());
  return done;
}

}  // namespace trainer
