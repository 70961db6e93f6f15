// The threaded loader; see loader.h for the scheme.
#include "data/loader.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <opencv2/core.hpp>
#include <thread>
#include <tuple>

namespace trainer::data {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

class Loader::Core {
 public:
  Core(const Dataset& dataset, ImageTransform transform, DistributedSampler sampler,
       LoaderOptions options)
      : dataset_(dataset),
        transform_(std::move(transform)),
        sampler_(std::move(sampler)),
        options_(std::move(options)) {}

  void start_workers(const std::shared_ptr<Core>& self);
  void shutdown();
  void start_epoch(int64_t epoch, int64_t position);
  bool next(Batch& batch);
  int64_t batches_per_epoch() const;
  int64_t samples_per_epoch() const { return sampler_.num_samples(); }
  EpochStats stats() const;
  int64_t skipped_total() const;
  void set_bad_sample_warnings(bool on);

 private:
  // The batch buffers of a batch being filled, and the fate of each row.
  struct Slot {
    int64_t batch = -1;  // the batch it holds, -1 when free
    int64_t rows = 0;
    Tensor images, labels;  // full-size pool buffers
    std::vector<int64_t> indices;
    std::vector<char> ok;
    int64_t remaining = 0;  // samples not yet done
    std::exception_ptr error;
    int64_t error_row = -1;
  };

  void worker_loop(int worker);
  bool has_claimable_work() const;
  void open_slot(Slot& slot, int64_t batch);
  void release_slot(Slot& slot);
  void recycle_lent_buffers();
  // Waits on ready_cv_ until done(), polling options_.interrupted.
  template <typename Done>
  void wait_ready(std::unique_lock<std::mutex>& lock, Done done, const std::string& waiting_for);
  // The end-of-epoch report, once per epoch ("" otherwise); logged by the
  // caller after unlocking, so a log callback may call back into the loader.
  std::string finish_epoch();
  void log(const std::string& message) const;

  const Dataset& dataset_;
  const ImageTransform transform_;
  const DistributedSampler sampler_;
  const LoaderOptions options_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;   // workers: work became claimable, or stop
  std::condition_variable ready_cv_;  // consumer: a sample finished, or a worker exited
  bool stop_ = false;
  bool warn_bad_samples_ = true;
  int busy_ = 0;                  // workers decoding a sample
  int running_ = 0;               // workers not yet exited
  std::vector<int64_t> reading_;  // per worker: the dataset index it decodes, or -1

  int64_t epoch_ = -1;
  int64_t start_position_ = 0;
  std::vector<int64_t> order_;  // this epoch's dataset indices from start_position_
  int64_t num_batches_ = 0;
  int64_t claim_end_ = 0;     // positions in order_ that belong to a batch
  int64_t next_claim_ = 0;    // the next position a worker takes
  int64_t next_deliver_ = 0;  // the batch the consumer gets next
  std::vector<Slot> slots_;   // batch b fills slots_[b % prefetch_batches]
  std::vector<std::pair<Tensor, Tensor>> free_buffers_;  // (images, labels)
  std::vector<std::pair<Tensor, Tensor>> lent_buffers_;  // handed out in a batch

  EpochStats stats_;
  bool epoch_reported_ = false;
  int64_t skipped_total_ = 0;
  std::chrono::steady_clock::time_point epoch_start_;
  std::vector<std::thread> workers_;  // touched by the owner's thread only
};

Loader::Loader(const Dataset& dataset, ImageTransform transform, DistributedSampler sampler,
               LoaderOptions options) {
  if (options.batch_size < 1) throw Error(cat("loader: batch size ", options.batch_size, " < 1"));
  if (options.num_workers < 1) throw Error(cat("loader: ", options.num_workers, " workers < 1"));
  if (options.prefetch_batches < 1)
    throw Error(cat("loader: prefetch depth ", options.prefetch_batches, " < 1"));
  if (sampler.options().dataset_size != dataset.size())
    throw Error(cat("loader: the sampler covers ", sampler.options().dataset_size,
                    " samples, the dataset has ", dataset.size()));
  if (transform.channels() != dataset.channels())
    throw Error(cat("loader: the transform expects ", transform.channels(),
                    " channels, the dataset's images have ", dataset.channels()));
  // The workers are the pipeline's parallelism: OpenCV's own pool would
  // only oversubscribe the cores the model trains on.
  cv::setNumThreads(0);
  core_ =
      std::make_shared<Core>(dataset, std::move(transform), std::move(sampler), std::move(options));
  core_->start_workers(core_);
}

Loader::~Loader() { core_->shutdown(); }

void Loader::start_epoch(int64_t epoch, int64_t position) { core_->start_epoch(epoch, position); }
bool Loader::next(Batch& batch) { return core_->next(batch); }
int64_t Loader::batches_per_epoch() const { return core_->batches_per_epoch(); }
int64_t Loader::samples_per_epoch() const { return core_->samples_per_epoch(); }
EpochStats Loader::stats() const { return core_->stats(); }
int64_t Loader::skipped_total() const { return core_->skipped_total(); }
void Loader::set_bad_sample_warnings(bool on) { core_->set_bad_sample_warnings(on); }

void Loader::Core::start_workers(const std::shared_ptr<Core>& self) {
  slots_.resize(size_t(options_.prefetch_batches));
  reading_.assign(size_t(options_.num_workers), -1);
  running_ = options_.num_workers;
  for (int w = 0; w < options_.num_workers; ++w)
    workers_.emplace_back([self, w] { self->worker_loop(w); });
}

void Loader::Core::shutdown() {
  std::unique_lock<std::mutex> lock(mu_);
  stop_ = true;
  work_cv_.notify_all();
  const bool all_out =
      ready_cv_.wait_for(lock, std::chrono::duration<double>(options_.shutdown_seconds),
                         [&] { return running_ == 0; });
  std::string stuck;
  for (int64_t index : reading_)
    if (index >= 0) stuck += cat(stuck.empty() ? "" : ", ", dataset_.describe(index));
  lock.unlock();
  if (!all_out)
    log(cat("warning: data loader: leaving ", stuck.empty() ? "workers" : stuck,
            " behind, still being read after ", options_.shutdown_seconds, " s"));
  for (std::thread& t : workers_) all_out ? t.join() : t.detach();
}

int64_t Loader::Core::batches_per_epoch() const {
  int64_t n = sampler_.num_samples(), b = options_.batch_size;
  return options_.drop_last ? n / b : (n + b - 1) / b;
}

void Loader::Core::start_epoch(int64_t epoch, int64_t position) {
  std::vector<int64_t> order = sampler_.indices(epoch, position);
  std::unique_lock<std::mutex> lock(mu_);
  // Hand out nothing more of the old epoch and let its samples in flight land.
  claim_end_ = next_claim_;
  wait_ready(
      lock, [&] { return busy_ == 0; }, "the samples of the previous epoch in flight");
  for (Slot& slot : slots_) release_slot(slot);
  const int64_t n = int64_t(order.size()), b = options_.batch_size;
  order_ = std::move(order);
  epoch_ = epoch;
  start_position_ = position;
  num_batches_ = options_.drop_last ? n / b : (n + b - 1) / b;
  claim_end_ = std::min(n, num_batches_ * b);
  next_claim_ = 0;
  next_deliver_ = 0;
  stats_ = EpochStats{};
  stats_.epoch = epoch;
  epoch_reported_ = false;
  epoch_start_ = std::chrono::steady_clock::now();
  lock.unlock();
  work_cv_.notify_all();
}

bool Loader::Core::has_claimable_work() const {
  return next_claim_ < claim_end_ &&
         next_claim_ / options_.batch_size < next_deliver_ + options_.prefetch_batches;
}

void Loader::Core::open_slot(Slot& slot, int64_t batch) {
  CHECK_EQ(slot.batch, -1) << "loader: slot of batch " << batch << " still busy";
  if (free_buffers_.empty()) {
    const int s = transform_.size();
    free_buffers_.emplace_back(
        empty({options_.batch_size, s, s, transform_.channels()}, DType::f32),
        empty({options_.batch_size}, DType::i64));
  }
  std::tie(slot.images, slot.labels) = std::move(free_buffers_.back());
  free_buffers_.pop_back();
  slot.batch = batch;
  slot.rows = std::min(options_.batch_size, claim_end_ - batch * options_.batch_size);
  slot.indices.assign(size_t(slot.rows), -1);
  slot.ok.assign(size_t(slot.rows), 0);
  slot.remaining = slot.rows;
  slot.error = nullptr;
  slot.error_row = -1;
}

void Loader::Core::release_slot(Slot& slot) {
  if (slot.images.defined()) free_buffers_.emplace_back(slot.images, slot.labels);
  slot.images = Tensor();
  slot.labels = Tensor();
  slot.batch = -1;
}

void Loader::Core::worker_loop(int worker) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || has_claimable_work(); });
    if (stop_) break;
    const int64_t position = next_claim_++;
    const int64_t batch = position / options_.batch_size;
    const int64_t row = position - batch * options_.batch_size;
    Slot& slot = slots_[size_t(batch % options_.prefetch_batches)];
    if (slot.batch != batch) open_slot(slot, batch);
    const int64_t index = order_[size_t(position)];
    const int64_t epoch = epoch_;
    float* out = slot.images.data<float>() + row * transform_.sample_numel();
    ++busy_;
    reading_[size_t(worker)] = index;
    lock.unlock();

    // The dataset is not touched once the read returns: a worker left
    // behind by shutdown() may outlive it.
    const int64_t label = dataset_.label(index);
    bool ok = false;
    std::exception_ptr error;
    std::string warning;
    try {
      const PhiloxKey key = augment_key(transform_.options().seed, epoch, index);
      DecodedImage image = dataset_.load(index, transform_.decode_hint(key));
      transform_.apply(image, key, out);
      ok = true;
    } catch (const BadSampleError& e) {
      if (options_.bad_files == BadFilePolicy::error) {
        error = std::make_exception_ptr(BadSampleError(
            cat(e.what(), "; fix or remove the file, or set the bad-file policy to skip")));
      } else {
        warning = cat("warning: skipping bad sample ", index, " (", e.what(), ")");
      }
    } catch (...) {
      error = std::current_exception();
    }

    lock.lock();
    if (!warning.empty() && !stop_ && warn_bad_samples_) {
      lock.unlock();
      log(warning);
      lock.lock();
    }
    --busy_;
    reading_[size_t(worker)] = -1;
    slot.indices[size_t(row)] = index;
    slot.labels.data<int64_t>()[row] = label;
    slot.ok[size_t(row)] = ok;
    if (error && (!slot.error || row < slot.error_row)) {
      slot.error = error;
      slot.error_row = row;
    }
    --slot.remaining;
    if (slot.remaining == 0 || busy_ == 0) ready_cv_.notify_all();
  }
  --running_;
  ready_cv_.notify_all();
}

template <typename Done>
void Loader::Core::wait_ready(std::unique_lock<std::mutex>& lock, Done done,
                              const std::string& waiting_for) {
  if (!options_.interrupted) {
    ready_cv_.wait(lock, done);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  while (!ready_cv_.wait_for(lock, std::chrono::milliseconds(50), done)) {
    if (!options_.interrupted()) continue;
    std::string reading;
    for (int64_t index : reading_)
      if (index >= 0) reading += cat(reading.empty() ? "" : ", ", dataset_.describe(index));
    throw LoaderStalled(cat("data loader: gave up waiting for ", waiting_for, " after ",
                            std::round(seconds_since(start) * 10) / 10, " s; still being read: ",
                            reading.empty() ? "nothing (the workers are queued)" : reading));
  }
}

void Loader::Core::recycle_lent_buffers() {
  // use_count 1: only the loader's handle is left, no batch view refers to it.
  auto unused = [](const std::pair<Tensor, Tensor>& b) {
    return b.first.storage().use_count() == 1 && b.second.storage().use_count() == 1;
  };
  for (auto it = lent_buffers_.begin(); it != lent_buffers_.end();) {
    if (unused(*it)) {
      free_buffers_.push_back(std::move(*it));
      it = lent_buffers_.erase(it);
    } else {
      ++it;
    }
  }
}

bool Loader::Core::next(Batch& batch) {
  batch = Batch{};
  std::unique_lock<std::mutex> lock(mu_);
  CHECK_GE(epoch_, 0) << "loader: next() before start_epoch()";
  recycle_lent_buffers();
  if (next_deliver_ >= num_batches_) {
    std::string report = finish_epoch();
    lock.unlock();
    if (!report.empty()) log(report);
    return false;
  }
  const int64_t number = next_deliver_;
  Slot& slot = slots_[size_t(number % options_.prefetch_batches)];
  auto wait_start = std::chrono::steady_clock::now();
  wait_ready(
      lock, [&] { return slot.batch == number && slot.remaining == 0; },
      cat("batch ", number, " of epoch ", epoch_));
  stats_.wait_seconds += seconds_since(wait_start);

  ++next_deliver_;
  if (slot.error) {
    std::exception_ptr error = slot.error;
    release_slot(slot);
    lock.unlock();
    work_cv_.notify_all();
    std::rethrow_exception(error);
  }
  if (slot.rows > 0 && std::count(slot.ok.begin(), slot.ok.end(), char(1)) == 0 &&
      !options_.empty_batches) {
    // Nothing to deliver: an empty batch would reach the model (batch norm
    // over zero samples), so a batch of bad files only is an error unless
    // the consumer takes empty batches.
    const std::string first = dataset_.describe(slot.indices[0]);
    const int64_t rows = slot.rows;
    release_slot(slot);
    lock.unlock();
    work_cv_.notify_all();
    throw BadSampleError(cat("all ", rows, " samples of batch ", number, " (the first: ", first,
                             ") are bad files, skipped: nothing is left to train on. Fix or "
                             "replace the files (the warnings above name each), or point "
                             "data.root at the right folder"));
  }
  // Close the gaps of skipped samples, keeping the order.
  const int64_t numel = transform_.sample_numel();
  float* images = slot.images.data<float>();
  int64_t* labels = slot.labels.data<int64_t>();
  int64_t kept = 0;
  for (int64_t row = 0; row < slot.rows; ++row) {
    if (!slot.ok[size_t(row)]) continue;
    if (kept != row) {
      std::memcpy(images + kept * numel, images + row * numel, size_t(numel) * sizeof(float));
      labels[kept] = labels[row];
    }
    batch.indices.push_back(slot.indices[size_t(row)]);
    ++kept;
  }
  const int s = transform_.size();
  batch.images = make_view(slot.images, {kept, s, s, transform_.channels()},
                           contiguous_strides({kept, s, s, transform_.channels()}), 0);
  batch.labels = make_view(slot.labels, {kept}, {1}, 0);
  batch.number = number;
  batch.position = start_position_ + number * options_.batch_size + slot.rows;

  stats_.batches += 1;
  stats_.images += kept;
  stats_.skipped += slot.rows - kept;
  skipped_total_ += slot.rows - kept;
  stats_.seconds = seconds_since(epoch_start_);
  lent_buffers_.emplace_back(slot.images, slot.labels);
  slot.images = Tensor();
  slot.labels = Tensor();
  slot.batch = -1;
  std::string report = next_deliver_ == num_batches_ ? finish_epoch() : "";
  lock.unlock();
  work_cv_.notify_all();
  if (!report.empty()) log(report);
  return true;
}

std::string Loader::Core::finish_epoch() {
  if (epoch_reported_ || !options_.report_epochs) return "";
  epoch_reported_ = true;
  return cat("data: epoch ", stats_.epoch, ": ", stats_.images, " images in ", stats_.batches,
             " batches, ", int64_t(stats_.images_per_second()), " images/s with ",
             options_.num_workers, " workers (consumer waited ", stats_.wait_seconds, " s), ",
             stats_.skipped, " bad samples skipped");
}

EpochStats Loader::Core::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

int64_t Loader::Core::skipped_total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return skipped_total_;
}

void Loader::Core::set_bad_sample_warnings(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  warn_bad_samples_ = on;
}

void Loader::Core::log(const std::string& message) const {
  if (options_.log) {
    options_.log(message);
  } else {
    std::fprintf(stderr, "%s\n", message.c_str());
  }
}

}  // namespace trainer::data
