// CheckpointWriter (trainer/checkpoint_writer.h).
#include "trainer/checkpoint_writer.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <utility>

#include "core/check.h"
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
  buffers.resize(first + tensors.size());
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

std::optional<std::string> CheckpointWriter::start(const std::string& tmp, int64_t step, bool best,
                                                   CheckpointPart part, const DistributedRun& run) {
  CHECK(!thread_.joinable() && !committer_.joinable())
      << "a checkpoint started while another is being written";
  step_ = step;
  best_ = best;
  commit_ = 0;
  staging_wait_ = 0;
  fallback_.clear();
  const int rank = run.dist().rank();
  // Staging copies every tensor whole: the part's bytes are the staged bytes.
  staged_bytes_ = part_bytes(part);
  // The ranks agree on writing in the background: the cap is per rank.
  bool async = options_.async;
  if (async && options_.max_staging_bytes > 0) {
    const bool over = staged_bytes_ > options_.max_staging_bytes;
    if (run.any_rank(over)) {
      async = false;
      fallback_ = cat("a rank's state is over training.async_checkpoint_mb (",
                      options_.max_staging_bytes >> 20, " MiB; this rank's: ", staged_bytes_ >> 20,
                      " MiB): written synchronously");
    }
  }
  if (!async) {
    write_checkpoint_part(tmp, rank, part);
    run.barrier();
    return commit(run);
  }
  copy_into(staging_order(part).now, staging_, 0);
  done_ = false;
  staged_ = false;
  error_ = nullptr;
  thread_ = std::thread([this, tmp, rank, part = std::move(part)]() mutable {
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
  return std::nullopt;
}

void CheckpointWriter::wait_staged() {
  if (!thread_.joinable() || staged_.load()) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(staged_mutex_);
  staged_changed_.wait(lock, [this] { return staged_.load(); });
  staging_wait_ += seconds_since(t0);
}

void CheckpointWriter::join() {
  thread_.join();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

std::optional<std::string> CheckpointWriter::poll(const DistributedRun& run) {
  // The main rank's commit, in the background since the last poll.
  if (committer_.joinable()) return committed_.load() ? join_commit() : std::nullopt;
  if (!thread_.joinable()) return std::nullopt;
  // Every rank holds a write in flight here (they started it at the same step).
  if (run.any_rank(!done_.load())) return std::nullopt;
  join();
  if (!main_) return std::nullopt;
  // Committing (the index, fsyncs, the rename, `latest`, pruning) is the
  // main rank's alone and needs no other: it goes on in the background too.
  committed_ = false;
  commit_ = 0;
  committer_ = std::thread([this] {
    try {
      committed_dir_ = dir_.commit(step_, best_);
    } catch (...) {
      error_ = std::current_exception();
    }
    committed_ = true;
  });
  return std::nullopt;
}

std::optional<std::string> CheckpointWriter::join_commit() {
  committer_.join();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return std::exchange(committed_dir_, std::nullopt);
}

std::optional<std::string> CheckpointWriter::finish(const DistributedRun& run) {
  if (committer_.joinable()) {
    const auto t0 = std::chrono::steady_clock::now();
    std::optional<std::string> dir = join_commit();
    commit_ = seconds_since(t0);
    return dir;
  }
  if (!thread_.joinable()) return std::nullopt;
  join();
  run.barrier();
  return commit(run);
}

std::optional<std::string> CheckpointWriter::commit(const DistributedRun&) {
  if (!main_) return std::nullopt;
  const auto t0 = std::chrono::steady_clock::now();
  std::string committed = dir_.commit(step_, best_);
  commit_ = seconds_since(t0);
  return committed;
}

}  // namespace trainer
