// The threaded loader; see loader.h for the scheme.
#include "data/loader.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <opencv2/core.hpp>
#include <tuple>

namespace trainer::data {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

Loader::Loader(const Dataset& dataset, ImageTransform transform, DistributedSampler sampler,
               LoaderOptions options)
    : dataset_(dataset),
      transform_(std::move(transform)),
      sampler_(std::move(sampler)),
      options_(std::move(options)) {
  if (options_.batch_size < 1) throw Error(cat("loader: batch size ", options_.batch_size, " < 1"));
  if (options_.num_workers < 1) throw Error(cat("loader: ", options_.num_workers, " workers < 1"));
  if (options_.prefetch_batches < 1)
    throw Error(cat("loader: prefetch depth ", options_.prefetch_batches, " < 1"));
  if (sampler_.options().dataset_size != dataset_.size())
    throw Error(cat("loader: the sampler covers ", sampler_.options().dataset_size,
                    " samples, the dataset has ", dataset_.size()));
  if (transform_.channels() != dataset_.channels())
    throw Error(cat("loader: the transform expects ", transform_.channels(),
                    " channels, the dataset's images have ", dataset_.channels()));
  // The workers are the pipeline's parallelism: OpenCV's own pool would
  // only oversubscribe the cores the model trains on.
  cv::setNumThreads(0);
  slots_.resize(size_t(options_.prefetch_batches));
  for (int w = 0; w < options_.num_workers; ++w) workers_.emplace_back([this] { worker_loop(); });
}

Loader::~Loader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

int64_t Loader::batches_per_epoch() const {
  int64_t n = sampler_.num_samples(), b = options_.batch_size;
  return options_.drop_last ? n / b : (n + b - 1) / b;
}

void Loader::start_epoch(int64_t epoch, int64_t position) {
  std::vector<int64_t> order = sampler_.indices(epoch, position);
  std::unique_lock<std::mutex> lock(mu_);
  // Hand out nothing more of the old epoch and let its samples in flight land.
  claim_end_ = next_claim_;
  ready_cv_.wait(lock, [&] { return busy_ == 0; });
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

bool Loader::has_claimable_work() const {
  return next_claim_ < claim_end_ &&
         next_claim_ / options_.batch_size < next_deliver_ + options_.prefetch_batches;
}

void Loader::open_slot(Slot& slot, int64_t batch) {
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

void Loader::release_slot(Slot& slot) {
  if (slot.images.defined()) free_buffers_.emplace_back(slot.images, slot.labels);
  slot.images = Tensor();
  slot.labels = Tensor();
  slot.batch = -1;
}

void Loader::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || has_claimable_work(); });
    if (stop_) return;
    const int64_t position = next_claim_++;
    const int64_t batch = position / options_.batch_size;
    const int64_t row = position - batch * options_.batch_size;
    Slot& slot = slots_[size_t(batch % options_.prefetch_batches)];
    if (slot.batch != batch) open_slot(slot, batch);
    const int64_t index = order_[size_t(position)];
    const int64_t epoch = epoch_;
    float* out = slot.images.data<float>() + row * transform_.sample_numel();
    ++busy_;
    lock.unlock();

    bool ok = false;
    std::exception_ptr error;
    std::string warning;
    try {
      DecodedImage image = dataset_.load(index, transform_.min_decode_side());
      transform_.apply(image, augment_key(transform_.options().seed, epoch, index), out);
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
    const int64_t label = dataset_.label(index);
    if (!warning.empty()) log(warning);

    lock.lock();
    --busy_;
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
}

void Loader::recycle_lent_buffers() {
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

bool Loader::next(Batch& batch) {
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
  ready_cv_.wait(lock, [&] { return slot.batch == number && slot.remaining == 0; });
  stats_.wait_seconds += seconds_since(wait_start);

  ++next_deliver_;
  if (slot.error) {
    std::exception_ptr error = slot.error;
    release_slot(slot);
    lock.unlock();
    work_cv_.notify_all();
    std::rethrow_exception(error);
  }
  if (slot.rows > 0 && std::count(slot.ok.begin(), slot.ok.end(), char(1)) == 0) {
    // Nothing to deliver: an empty batch would reach the model (batch norm
    // over zero samples), so a batch of bad files only is an error.
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

std::string Loader::finish_epoch() {
  if (epoch_reported_ || !options_.report_epochs) return "";
  epoch_reported_ = true;
  return cat("data: epoch ", stats_.epoch, ": ", stats_.images, " images in ", stats_.batches,
             " batches, ", int64_t(stats_.images_per_second()), " images/s with ",
             options_.num_workers, " workers (consumer waited ", stats_.wait_seconds, " s), ",
             stats_.skipped, " bad samples skipped");
}

EpochStats Loader::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

int64_t Loader::skipped_total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return skipped_total_;
}

void Loader::log(const std::string& message) const {
  if (options_.log) {
    options_.log(message);
  } else {
    std::fprintf(stderr, "%s\n", message.c_str());
  }
}

}  // namespace trainer::data
