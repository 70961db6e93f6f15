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
// BadFilePolicy::error next() throws it when its batch is due. Under skip, a
// batch of bad files only is a BadSampleError too (a training step cannot
// run on zero samples), unless LoaderOptions::empty_batches lets it through
// with zero rows (evaluation, which counts what it could read).
//
// Shutdown: the destructor stops the workers and joins them; it never waits
// for more than the samples being decoded, whether or not the consumer
// read the epoch to its end, and not even for those past
// LoaderOptions::shutdown_seconds: a worker still stuck in a read then is
// left behind (it ends when the read returns, touching only the loader's
// own state, which it keeps alive).
//
// Stalls: next() and start_epoch() poll LoaderOptions::interrupted while
// they wait, and give up with LoaderStalled (naming the files still being
// read) once it says so; a stop signal is answered even when a read hangs
// (a dead network filesystem, a disk retrying a bad sector).
//
//   Loader loader(dataset, ImageTransform(opts, dataset.channels()), sampler, {.batch_size = 256});
//   loader.start_epoch(epoch, /*position=*/0);
//   Batch batch;
//   while (loader.next(batch)) train_step(batch.images, batch.labels);
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "data/dataset.h"
#include "data/sampler.h"
#include "data/transforms.h"

namespace trainer::data {

enum class BadFilePolicy { skip, error };

// next() or start_epoch() gave up waiting because LoaderOptions::interrupted
// said so; the message names the samples still being read.
class LoaderStalled : public Error {
 public:
  explicit LoaderStalled(const std::string& message) : Error(message) {}
};

struct LoaderOptions {
  int64_t batch_size = 256;
  int num_workers = 2;
  int prefetch_batches = 4;  // batches decoded ahead of the consumer
  bool drop_last = false;    // drop the epoch's last, partial batch
  BadFilePolicy bad_files = BadFilePolicy::skip;
  // Under skip: a batch whose samples were all bad files is delivered with
  // zero rows (true) or is a BadSampleError (false).
  bool empty_batches = false;
  // Receives the bad-sample warnings and the end-of-epoch report; called
  // from worker threads. Default: a line on stderr.
  std::function<void(const std::string&)> log = nullptr;
  bool report_epochs = true;
  // Polled about every 50 ms while next() or start_epoch() waits (on the
  // consumer's thread, under the loader's lock: it must not call back into
  // the loader); once it returns true they throw LoaderStalled. Default:
  // wait as long as it takes.
  std::function<bool()> interrupted = nullptr;
  // How long the destructor waits for the workers' samples in progress.
  double shutdown_seconds = 5.0;
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
  // Batches of a whole epoch from position 0, and this rank's samples in it.
  int64_t batches_per_epoch() const;
  int64_t samples_per_epoch() const;
  EpochStats stats() const;
  int64_t skipped_total() const;
  // Whether bad samples are logged one warning each (the default) or only
  // counted: a loader reading the same files again (evaluation) need not
  // name them every time.
  void set_bad_sample_warnings(bool on);

 private:
  // Everything the workers touch, shared with them: a worker stuck in a
  // read past the shutdown grace keeps it alive after the Loader is gone.
  class Core;
  std::shared_ptr<Core> core_;
};

}  // namespace trainer::data
