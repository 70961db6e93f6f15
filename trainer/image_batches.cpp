// The classifiers' batch source: Fashion-MNIST or an ImageFolder through
// the threaded data::Loader, each dp rank its share of the shuffled epoch
// (data::DistributedSampler), evaluated for loss, top-1 and top-5.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "core/ops.h"
#include "data/idx.h"
#include "data/image_folder.h"
#include "data/loader.h"
#include "trainer/batch_source.h"
#include "trainer/device.h"
#include "trainer/metrics.h"
#include "trainer/stop_signals.h"

namespace trainer {

namespace {

data::TransformOptions transform_options(const Recipe& r, bool train, int channels) {
  data::TransformOptions t;
  t.size = int(r.data.image_size);
  t.seed = uint64_t(r.seed);
  if (r.data.name == "fashion_mnist") {
    t.mode = data::TransformMode::plain;
    t.mean = {data::kFashionMnistMean};
    t.std = {data::kFashionMnistStd};
  } else {
    t.mode = train && r.data.augment ? data::TransformMode::train : data::TransformMode::eval;
    t.resize =
        r.data.resize > 0 ? int(r.data.resize) : int(std::lround(r.data.image_size * 8.0 / 7.0));
    if (channels == 1) t.mean = {0.5f}, t.std = {0.5f};
  }
  return t;
}

// How long after a stop signal the loader goes on waiting for a read: a
// merely slow batch still arrives and the step ends with a checkpoint.
constexpr double kLoaderStopGraceSeconds = 2.0;

// TRAINER_FAULT_LOAD_DELAY_MS=N (fault injection for tests): every sample
// read takes N ms longer, as from a stalled network filesystem.
class DelayedLoads final : public data::Dataset {
 public:
  DelayedLoads(std::unique_ptr<data::Dataset> base, int64_t ms) : base_(std::move(base)), ms_(ms) {}
  int64_t size() const override { return base_->size(); }
  int64_t label(int64_t index) const override { return base_->label(index); }
  int64_t num_classes() const override { return base_->num_classes(); }
  int channels() const override { return base_->channels(); }
  data::DecodedImage load(int64_t index, const data::DecodeHint& hint) const override {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms_));
    return base_->load(index, hint);
  }
  std::string describe(int64_t index) const override { return base_->describe(index); }

 private:
  std::unique_ptr<data::Dataset> base_;
  int64_t ms_;
};

std::unique_ptr<data::Dataset> with_fault_injection(std::unique_ptr<data::Dataset> set) {
  const char* delay = std::getenv("TRAINER_FAULT_LOAD_DELAY_MS");
  if (!delay || !*delay) return set;
  return std::make_unique<DelayedLoads>(std::move(set), std::atoll(delay));
}

// ---- stand-ins for dry runs and plans without the data (DataAccess) ----

std::string fashion_mnist_dir(const Recipe& r) {
  return r.data.root.empty() ? data::kFashionMnistDir : r.data.root;
}

std::string missing_data_path(const Recipe& r) {
  return r.data.name == "fashion_mnist" ? fashion_mnist_dir(r) : r.data.root + "/train";
}

bool data_on_disk(const Recipe& r) {
  std::error_code ec;
  if (r.data.name == "fashion_mnist")
    return std::filesystem::exists(fashion_mnist_dir(r) + "/train-images-idx3-ubyte.gz", ec);
  if (r.data.name == "image_folder")
    return !r.data.root.empty() && std::filesystem::is_directory(r.data.root + "/train", ec);
  return true;  // an unknown name: the real constructor names the error
}

struct AssumedSize {
  int64_t train, val;
  const char* what;
};

AssumedSize assumed_size(const Recipe& r) {
  const int64_t classes = r.model.num_classes;
  if (r.data.name == "fashion_mnist") return {60000, 10000, "Fashion-MNIST's"};
  if (classes == 1000) return {1281167, 50000, "ImageNet-1k's"};
  return {1300 * classes, 50 * classes, "ImageNet's 1300 and 50 per class"};
}

// A dataset of a given size whose samples are never read.
class AssumedDataset final : public data::Dataset {
 public:
  AssumedDataset(int64_t size, int64_t classes, int64_t channels)
      : size_(size), classes_(classes), channels_(int(channels)) {}
  int64_t size() const override { return size_; }
  int64_t label(int64_t index) const override { return index % classes_; }
  int64_t num_classes() const override { return classes_; }
  int channels() const override { return channels_; }
  data::DecodedImage load(int64_t index, const data::DecodeHint&) const override {
    throw Error(cat("sample ", index, " read from the stand-in of a dataset not on disk"));
  }
  std::string describe(int64_t index) const override { return cat("assumed[", index, "]"); }

 private:
  int64_t size_, classes_;
  int channels_;
};

class ImageBatches final : public BatchSource {
 public:
  ImageBatches(const Recipe& recipe, const RankLayout& layout, int64_t micro_batch,
               DataAccess access);

  bool is_language_model() const override { return false; }
  const char* item_name() const override { return "samples"; }
  int64_t batches_per_epoch() const override { return train_loader_->batches_per_epoch(); }
  int64_t samples_per_epoch() const override { return train_loader_->samples_per_epoch(); }
  std::string epoch_text() const override { return cat(train_set_->size(), " training samples"); }
  std::string summary() const override { return assumed_; }

  void set_reads_batches(bool reads) override { reads_batches_ = reads; }

  void start_epoch(int64_t epoch, int64_t position) override {
    if (!reads_batches_) {
      // What the loader would hand out (drop_last): whole batches from position.
      position_ = position;
      end_ =
          position + (train_loader_->samples_per_epoch() - position) / micro_batch_ * micro_batch_;
      return;
    }
    train_loader_->start_epoch(epoch, position);
  }

  bool next(StepBatch& batch) override {
    if (!reads_batches_) {
      if (position_ >= end_) return false;
      position_ += micro_batch_;
      batch = StepBatch{Tensor(), Tensor(), position_, micro_batch_};
      return true;
    }
    data::Batch b;
    if (!train_loader_->next(b)) return false;
    const Device device = module_device(*model_);
    batch = StepBatch{to_device(b.images, device), to_device(b.labels, device), b.position,
                      b.labels.numel()};
    return true;
  }

  Tensor loss(const StepBatch& batch) override {
    return cross_entropy(forward(batch.inputs), to_device(batch.targets, module_device(*model_)));
  }

  Tensor probe_loss(int64_t n) override { return loss(probe_batch(n)); }

  TensorList model_inputs(const StepBatch& batch) override {
    return {to_device(batch.inputs, module_device(*model_)).permute({0, 3, 1, 2})};
  }
  Tensor loss_from(const StepBatch& batch, const TensorList& outputs) override {
    return cross_entropy(outputs.at(0), to_device(batch.targets, module_device(*model_)));
  }
  StepBatch probe_batch(int64_t n) override {
    const Device device = module_device(*model_);
    return StepBatch{to_device(zeros({n, image_size_, image_size_, channels_}), device),
                     to_device(zeros({n}, DType::i64), device)};
  }

  EvalSums evaluate_shard() override;

  void start_eval() override {
    if (reads_batches_) start_val_epoch();
    eval_left_ = val_loader_->batches_per_epoch();
  }
  bool next_eval(StepBatch& batch) override {
    if (!reads_batches_) {
      // As many batches as the loader gives (drop_last off: the last may be short).
      if (eval_left_ == 0) return false;
      --eval_left_;
      batch = StepBatch{};
      return true;
    }
    data::Batch b;
    if (!val_loader_->next(b)) return false;
    const Device device = module_device(*model_);
    // A batch of bad files only comes empty: all padding, no targets.
    batch = StepBatch{to_device(pad_samples(b.images, micro_batch_), device),
                      to_device(b.labels, device), b.position, b.labels.numel()};
    return true;
  }
  TensorList eval_inputs(const StepBatch& batch) override {
    if (!batch.inputs.defined()) return {Tensor()};
    return model_inputs(batch);
  }
  void add_eval_sums(const StepBatch& batch, const TensorList& outputs,
                     EvalSums& sums) const override;

 private:
  // The validation loader at the start of its one epoch. It names each bad
  // file in a warning during the first evaluation only: later ones read the
  // same files, and their metrics count them.
  void start_val_epoch() {
    val_loader_->set_bad_sample_warnings(evaluations_++ == 0);
    val_loader_->start_epoch(0);
  }

  // train_set_ and val_set_ from the recipe's data, or stand-ins of the
  // dataset's size when it is not on disk and `access` allows (assumed_ says so).
  void open_datasets(const Recipe& r, DataAccess access);

  // Logits for a batch of NHWC images [N, H, W, C] (viewed as NCHW channels-last).
  Tensor forward(const Tensor& images) {
    return (*model_)(to_device(images, module_device(*model_)).permute({0, 3, 1, 2}));
  }

  const int64_t image_size_, channels_;  // of the model's input
  std::unique_ptr<data::Dataset> train_set_, val_set_;
  std::unique_ptr<data::Dataset> val_whole_;  // under data.val_samples: what val_set_ cuts
  std::unique_ptr<data::Loader> train_loader_, val_loader_;
  std::string assumed_;  // the summary's note when the datasets are stand-ins
  const int64_t micro_batch_;
  int64_t position_ = 0, end_ = 0;  // without reading batches: this epoch's positions
  int64_t eval_left_ = 0;           // pipelined evaluation: batches still to come
  int64_t evaluations_ = 0;         // validation epochs started
};

void ImageBatches::open_datasets(const Recipe& r, DataAccess access) {
  if (access == DataAccess::assume_if_missing && !data_on_disk(r)) {
    AssumedSize a = assumed_size(r);
    train_set_ =
        std::make_unique<AssumedDataset>(a.train, r.model.num_classes, r.model.in_channels);
    val_set_ = std::make_unique<AssumedDataset>(a.val, r.model.num_classes, r.model.in_channels);
    assumed_ = cat("data: ", missing_data_path(r), " is not on disk; assumed ",
                   with_commas(a.train), " training and ", with_commas(a.val), " validation images",
                   " of ", r.model.num_classes, " classes and ", r.model.in_channels, " channels (",
                   a.what, "). Steps per epoch, the schedule's length and the class ",
                   "and channel counts are checked against the real data when training starts\n");
  } else if (r.data.name == "fashion_mnist") {
    const std::string dir = fashion_mnist_dir(r);
    auto train =
        std::make_unique<data::MnistDataset>(data::load_fashion_mnist(dir, data::Split::train));
    auto val =
        std::make_unique<data::MnistDataset>(data::load_fashion_mnist(dir, data::Split::val));
    data::check_same_image_size(*train, *val);
    train_set_ = std::move(train);
    val_set_ = std::move(val);
  } else if (r.data.name == "image_folder") {
    if (r.data.root.empty())
      throw Error(
          cat(r.source, ": data.root must name a folder with train/ and val/ for image_folder"));
    auto train = std::make_unique<data::ImageFolder>(r.data.root + "/train");
    auto val = std::make_unique<data::ImageFolder>(r.data.root + "/val");
    data::check_same_classes(*train, *val);
    train_set_ = std::move(train);
    val_set_ = std::move(val);
  } else {
    throw Error(cat(r.source, ": data.name '", r.data.name, "' has no image reader"));
  }
}

ImageBatches::ImageBatches(const Recipe& r, const RankLayout& layout, int64_t micro_batch,
                           DataAccess access)
    : image_size_(r.data.image_size), channels_(r.model.in_channels), micro_batch_(micro_batch) {
  if (r.data.image_size < data::kMinImageSide)
    throw Error(cat(r.source, ": data.image_size ", r.data.image_size,
                    " is too small: the model would see images of ", r.data.image_size, "x",
                    r.data.image_size, " pixels; expected at least ", data::kMinImageSide,
                    " (Fashion-MNIST's images are 28x28, the ImageNet recipes crop 224)"));
  open_datasets(r, access);
  train_set_ = with_fault_injection(std::move(train_set_));
  if (train_set_->num_classes() != r.model.num_classes)
    throw Error(cat(r.source, ": model.num_classes is ", r.model.num_classes,
                    " but the dataset has ", train_set_->num_classes(), " classes"));
  if (train_set_->channels() != r.model.in_channels)
    throw Error(cat(r.source, ": model.in_channels is ", r.model.in_channels,
                    " but the dataset's images have ", train_set_->channels(), " channels"));

  data::LoaderOptions lo;
  lo.batch_size = micro_batch;
  lo.num_workers = int(r.data.workers);
  lo.prefetch_batches = int(r.data.prefetch);
  lo.bad_files =
      r.data.bad_files == "error" ? data::BadFilePolicy::error : data::BadFilePolicy::skip;
  lo.report_epochs = false;
  lo.drop_last = true;  // every step sees the same batch size
  // A stop signal is answered within seconds even when a read hangs.
  lo.interrupted = [] { return StopSignals::waited(kLoaderStopGraceSeconds); };
  data::SamplerOptions so{.dataset_size = train_set_->size(),
                          .rank = layout.dp_rank(),
                          .world_size = layout.dp_size(),
                          .seed = uint64_t(r.seed)};
  train_loader_ = std::make_unique<data::Loader>(
      *train_set_,
      data::ImageTransform(transform_options(r, true, train_set_->channels()),
                           train_set_->channels()),
      data::DistributedSampler(so), lo);
  // Each rank evaluates its share, every image exactly once.
  // data.val_samples: the first N validation images only.
  if (r.data.val_samples > 0 && r.data.val_samples < val_set_->size()) {
    val_whole_ = std::move(val_set_);
    val_set_ = std::make_unique<data::FirstSamples>(*val_whole_, r.data.val_samples);
  }
  data::SamplerOptions vo{.dataset_size = val_set_->size(),
                          .rank = layout.dp_rank(),
                          .world_size = layout.dp_size(),
                          .shuffle = false,
                          .exact = true};
  lo.drop_last = false;
  // Evaluation counts what it can read: under bad_files: skip a batch of bad
  // files only is no reason to lose the run (training stops on one: it
  // cannot step on zero samples).
  lo.empty_batches = true;
  val_loader_ = std::make_unique<data::Loader>(
      *val_set_,
      data::ImageTransform(transform_options(r, false, val_set_->channels()), val_set_->channels()),
      data::DistributedSampler(vo), lo);
}

EvalSums ImageBatches::evaluate_shard() {
  autograd::NoGradGuard no_grad;
  model_->eval();
  EvalSums sums;
  start_val_epoch();
  data::Batch batch;
  while (val_loader_->next(batch))
    if (batch.labels.numel() > 0)
      add_eval_sums(StepBatch{Tensor(), batch.labels}, {forward(batch.images)}, sums);
  sums.skipped = val_loader_->stats().skipped;
  model_->train();
  return sums;
}

void ImageBatches::add_eval_sums(const StepBatch& batch, const TensorList& outputs,
                                 EvalSums& sums) const {
  const int64_t N = batch.targets.size(0);
  if (N == 0) return;  // every sample of the batch was a bad file
  // The real samples' logits: the rows after them are padding.
  const Tensor logits = outputs.at(0).narrow(0, 0, N);
  CrossEntropyOptions sum_loss;
  sum_loss.reduction = CrossEntropyOptions::Reduction::sum;
  sums.loss +=
      cross_entropy(logits, to_device(batch.targets, logits.device()), sum_loss).item<double>();
  std::vector<float> l = logits.to_vector<float>();
  std::vector<int64_t> y = batch.targets.to_vector<int64_t>();
  const int64_t C = logits.size(1);
  for (size_t n = 0; n < y.size(); ++n) {
    // Rank of the target: how many classes score strictly higher.
    float target = l[n * size_t(C) + size_t(y[n])];
    int64_t higher = 0;
    for (int64_t c = 0; c < C; ++c) higher += l[n * size_t(C) + size_t(c)] > target;
    sums.top1 += higher < 1;
    sums.top5 += higher < 5;
  }
  sums.samples += int64_t(y.size());
}

}  // namespace

std::unique_ptr<BatchSource> make_image_batches(const Recipe& recipe, const RankLayout& layout,
                                                int64_t micro_batch, DataAccess access) {
  return std::make_unique<ImageBatches>(recipe, layout, micro_batch, access);
}

}  // namespace trainer
