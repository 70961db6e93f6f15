// Loader: worker threads that read, decode and transform samples into a
// bounded window of batches, handed to the consumer in order.
//
// Each epoch the sampler gives this rank's dataset indices; batch b holds
// positions [b * batch_size, (b + 1) * batch_size) of that list. Workers
// claim single samples in order, so all of them work on the oldest batches
// and a batch is ready soon after its last sample is claimed. At most
// prefetch_batches batches are decoded ahead of the consumer (filled or
// being filled); a worker waits rather than run further ahead. A sample's
// pixels depend only on (seed, epoch, dataset index) (data/transforms.h),
// so the batches are the same bits for any number of workers.
//
// Memory. A batch's images and labels live in buffers from a pool; the
// tensors handed out are views of them. A buffer goes back to the pool
// once no tensor outside the loader refers to it, so the consumer may keep
// a batch as long as it likes; in the usual loop (next() into the same
// Batch) the pool settles at prefetch_batches + 1 buffers.
//
// Bad samples (BadSampleError: corrupt, truncated or non-image files): with
// BadFilePolicy::skip the sample is left out of its batch (which comes out
// shorter), counted, and a warning naming the file is logged; with
// BadFilePolicy::error next() throws it when its batch is due.
//
// Shutdown: the destructor stops the workers and joins them; it never waits
// for more than the samples being decoded, whether or not the consumer
// read the epoch to its end.
//
//   Loader loader(dataset, ImageTransform(opts, dataset.channels()), sampler, {.batch_size = 256});
//   loader.start_epoch(epoch, /*position=*/0);
//   Batch batch;
//   while (loader.next(batch)) train_step(batch.images, batch.labels);
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/tensor.h"
#include "data/dataset.h"
#include "data/sampler.h"
#include "data/transforms.h"

namespace trainer::data {

enum class BadFilePolicy { skip, error };

struct LoaderOptions {
  int64_t batch_size = 256;
  int num_workers = 2;
  int prefetch_batches = 4;  // batches decoded ahead of the consumer
  bool drop_last = false;    // drop the epoch's last, partial batch
  BadFilePolicy bad_files = BadFilePolicy::skip;
  // Receives the bad-sample warnings and the end-of-epoch report; called
  // from worker threads. Default: a line on stderr.
  std::function<void(const std::string&)> log = nullptr;
  bool report_epochs = true;
};

struct Batch {
  Tensor images;                 // f32 [N, size, size, C], channels-last
  Tensor labels;                 // i64 [N]
  std::vector<int64_t> indices;  // dataset index of each row
  int64_t number = 0;            // batch number within the epoch, counted from its start
  int64_t position = 0;          // this rank's sample position after the batch (resume point)
};

struct EpochStats {
  int64_t epoch = -1;
  int64_t batches = 0;      // delivered so far
  int64_t images = 0;       // delivered so far
  int64_t skipped = 0;      // bad samples left out
  double seconds = 0;       // from start_epoch to the last delivery
  double wait_seconds = 0;  // the consumer's time blocked in next()
  double images_per_second() const { return seconds > 0 ? double(images) / seconds : 0.0; }
};

class Loader {
 public:
  Loader(const Dataset& dataset, ImageTransform transform, DistributedSampler sampler,
         LoaderOptions options);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // Begins an epoch at this rank's sample position (0, or a resume point:
  // Batch::position of the last batch consumed). Abandons the rest of the
  // previous epoch.
  void start_epoch(int64_t epoch, int64_t position = 0);
  // Fills batch with the next batch in order (releasing what it held); false
  // at the end of the epoch.
  bool next(Batch& batch);
  // Batches of a whole epoch from position 0.
  int64_t batches_per_epoch() const;
  EpochStats stats() const;
  int64_t skipped_total() const;

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

  void worker_loop();
  bool has_claimable_work() const;
  void open_slot(Slot& slot, int64_t batch);
  void release_slot(Slot& slot);
  void recycle_lent_buffers();
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
  std::condition_variable ready_cv_;  // consumer: a sample finished
  bool stop_ = false;
  int busy_ = 0;  // workers decoding a sample

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
  std::vector<std::thread> workers_;
};

}  // namespace trainer::data
