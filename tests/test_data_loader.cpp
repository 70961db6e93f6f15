// The threaded loader: batches in sampler order with the right pixels,
// the same bits for any number of workers and prefetch depth, resume from a
// position, buffer reuse, kept batches left intact, bad samples, and
// shutdown at any point without a hang, and hung reads that give way to a
// stop.
#include "tests/testing.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "data/loader.h"

using namespace trainer;
using namespace trainer::data;

namespace {

// Pixel (y, x, c) of sample i is a fixed function of all four.
uint8_t pixel(int64_t index, int y, int x, int c) {
  return uint8_t(index * 31 + y * 7 + x * 3 + c * 11);
}

class SyntheticDataset final : public Dataset {
 public:
  SyntheticDataset(int64_t n, int channels, int side, std::set<int64_t> bad = {}, int sleep_us = 0)
      : n_(n), channels_(channels), side_(side), bad_(std::move(bad)), sleep_us_(sleep_us) {}
  int64_t size() const override { return n_; }
  int64_t label(int64_t index) const override { return index % 10; }
  int64_t num_classes() const override { return 10; }
  int channels() const override { return channels_; }
  DecodedImage load(int64_t index, const DecodeHint&) const override {
    loads_++;
    if (sleep_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    if (bad_.count(index)) throw BadSampleError(cat(describe(index), ": corrupt"));
    cv::Mat m(side_, side_, CV_8UC(channels_));
    for (int y = 0; y < side_; ++y)
      for (int x = 0; x < side_; ++x)
        for (int c = 0; c < channels_; ++c)
          m.ptr<uint8_t>(y)[x * channels_ + c] = pixel(index, y, x, c);
    return DecodedImage{m, side_, side_};
  }
  std::string describe(int64_t index) const override { return cat("synthetic[", index, "]"); }
  mutable std::atomic<int64_t> loads_{0};

 private:
  int64_t n_;
  int channels_, side_;
  std::set<int64_t> bad_;
  int sleep_us_;
};

TransformOptions plain(int size, int channels) {
  TransformOptions o{.mode = TransformMode::plain, .size = size};
  o.mean.assign(size_t(channels), 0.0f);
  o.std.assign(size_t(channels), 1.0f);
  return o;
}

LoaderOptions quiet(int64_t batch, int workers, int prefetch) {
  LoaderOptions o{.batch_size = batch, .num_workers = workers, .prefetch_batches = prefetch};
  o.log = [](const std::string&) {};
  return o;
}

// Every batch of an epoch, copied out.
struct Epoch {
  std::vector<std::vector<float>> images;
  std::vector<std::vector<int64_t>> labels, indices;
};

Epoch read_epoch(Loader& loader, int64_t epoch, int64_t position = 0) {
  Epoch out;
  loader.start_epoch(epoch, position);
  Batch b;
  while (loader.next(b)) {
    out.images.push_back(b.images.to_vector<float>());
    out.labels.push_back(b.labels.to_vector<int64_t>());
    out.indices.push_back(b.indices);
  }
  return out;
}

}  // namespace

TEST_CASE("loader: batches follow the sampler with the dataset's pixels and labels",
          "[data][loader]") {
  SyntheticDataset ds(23, 3, 5);
  DistributedSampler sampler(SamplerOptions{23, 1, 2, /*seed=*/4});
  Loader loader(ds, ImageTransform(plain(5, 3), 3), sampler, quiet(5, 3, 2));
  REQUIRE(loader.batches_per_epoch() == 3);  // 12 samples per rank
  Epoch e = read_epoch(loader, 2);
  std::vector<int64_t> expected = sampler.indices(2), got;
  REQUIRE(e.indices.size() == 3);
  for (size_t b = 0; b < e.indices.size(); ++b) {
    REQUIRE(e.images[b].size() == e.indices[b].size() * 75);
    for (size_t r = 0; r < e.indices[b].size(); ++r) {
      int64_t index = e.indices[b][r];
      got.push_back(index);
      REQUIRE(e.labels[b][r] == index % 10);
      for (int y = 0; y < 5; ++y)
        for (int x = 0; x < 5; ++x)
          for (int c = 0; c < 3; ++c)  // the loader writes RGB: channel c reads BGR channel 2 - c
            REQUIRE(e.images[b][r * 75 + size_t((y * 5 + x) * 3 + c)] ==
                    float(pixel(index, y, x, 2 - c)) / 255.0f);
    }
  }
  REQUIRE(got == expected);
  EpochStats s = loader.stats();
  REQUIRE(s.epoch == 2);
  REQUIRE(s.images == 12);
  REQUIRE(s.batches == 3);
  REQUIRE(s.images_per_second() > 0);
}

TEST_CASE("loader: the same bits for any worker count and prefetch depth", "[data][loader]") {
  SyntheticDataset ds(50, 3, 24);
  TransformOptions t{.mode = TransformMode::train, .size = 16, .seed = 99};
  DistributedSampler sampler(SamplerOptions{50, 0, 1, 3});
  Epoch reference;
  {
    Loader one(ds, ImageTransform(t, 3), sampler, quiet(8, 1, 1));
    reference = read_epoch(one, 1);
    Epoch other_epoch = read_epoch(one, 2);
    REQUIRE(other_epoch.indices != reference.indices);
  }
  for (auto [workers, prefetch] : {std::pair{2, 1}, std::pair{3, 4}, std::pair{4, 2}}) {
    Loader many(ds, ImageTransform(t, 3), sampler, quiet(8, workers, prefetch));
    Epoch e = read_epoch(many, 1);
    REQUIRE(e.indices == reference.indices);
    REQUIRE(e.images == reference.images);
  }
}

TEST_CASE("loader: resume from a position continues the epoch bit for bit", "[data][loader]") {
  SyntheticDataset ds(40, 3, 20);
  TransformOptions t{.mode = TransformMode::train, .size = 12, .seed = 5};
  DistributedSampler sampler(SamplerOptions{40, 2, 3, 8});  // 14 samples per rank
  Loader loader(ds, ImageTransform(t, 3), sampler, quiet(4, 2, 2));
  Epoch full = read_epoch(loader, 3);
  REQUIRE(full.indices.size() == 4);
  loader.start_epoch(3);
  Batch b;
  REQUIRE(loader.next(b));
  REQUIRE(loader.next(b));
  REQUIRE(b.position == 8);
  Epoch resumed = read_epoch(loader, 3, b.position);
  REQUIRE(resumed.indices ==
          std::vector<std::vector<int64_t>>(full.indices.begin() + 2, full.indices.end()));
  REQUIRE(resumed.images ==
          std::vector<std::vector<float>>(full.images.begin() + 2, full.images.end()));
}

TEST_CASE("loader: buffers are reused, kept batches stay intact", "[data][loader]") {
  SyntheticDataset ds(64, 1, 6);
  DistributedSampler sampler(SamplerOptions{64, 0, 1, 1});
  Loader loader(ds, ImageTransform(plain(6, 1), 1), sampler, quiet(4, 2, 3));
  std::set<const void*> buffers;
  Batch kept;
  std::vector<float> kept_values;
  for (int epoch = 0; epoch < 3; ++epoch) {
    loader.start_epoch(epoch);
    Batch b;
    while (loader.next(b)) {
      buffers.insert(b.images.data_ptr());
      if (epoch == 0 && b.number == 0) {
        kept = b;
        kept_values = kept.images.to_vector<float>();
      }
    }
  }
  // Three in flight plus the one being read, plus the kept one.
  REQUIRE(buffers.size() <= 5);
  REQUIRE(kept.images.to_vector<float>() == kept_values);
}

TEST_CASE("loader: bad samples are skipped and counted, or thrown in order", "[data][loader]") {
  SyntheticDataset ds(12, 1, 4, /*bad=*/{5, 6});
  DistributedSampler sampler(SamplerOptions{12, 0, 1, 0, /*shuffle=*/false});
  std::vector<std::string> log;
  std::mutex mu;
  LoaderOptions o = quiet(4, 3, 2);
  o.log = [&](const std::string& m) {
    std::lock_guard<std::mutex> lock(mu);
    log.push_back(m);
  };
  {
    Loader loader(ds, ImageTransform(plain(4, 1), 1), sampler, o);
    Epoch e = read_epoch(loader, 0);
    REQUIRE(e.indices == std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {4, 7}, {8, 9, 10, 11}});
    REQUIRE(e.labels[1] == std::vector<int64_t>{4, 7});
    REQUIRE(e.images[1][0] == float(pixel(4, 0, 0, 0)) / 255.0f);
    REQUIRE(e.images[1][16] == float(pixel(7, 0, 0, 0)) / 255.0f);
    REQUIRE(loader.stats().skipped == 2);
  }
  REQUIRE(log.size() == 3);
  std::sort(log.begin(), log.begin() + 2);
  REQUIRE_THAT(log[0], Catch::Contains("synthetic[5]"));
  REQUIRE_THAT(log[1], Catch::Contains("synthetic[6]"));

  o.bad_files = BadFilePolicy::error;
  Loader strict(ds, ImageTransform(plain(4, 1), 1), sampler, o);
  strict.start_epoch(0);
  Batch b;
  REQUIRE(strict.next(b));
  REQUIRE_THROWS_WITH(strict.next(b), Catch::Contains("synthetic[5]"));
  REQUIRE(strict.next(b));
  REQUIRE(b.indices == std::vector<int64_t>{8, 9, 10, 11});
}

TEST_CASE("loader: a batch of bad files only is an error, or comes empty under empty_batches",
          "[data][loader]") {
  SyntheticDataset ds(6, 1, 4, /*bad=*/{2, 3});
  DistributedSampler sampler(SamplerOptions{6, 0, 1, 0, /*shuffle=*/false});
  std::atomic<int> warnings{0};
  LoaderOptions o = quiet(2, 2, 2);
  o.log = [&](const std::string&) { ++warnings; };
  o.report_epochs = false;
  {
    Loader training(ds, ImageTransform(plain(4, 1), 1), sampler, o);
    training.start_epoch(0);
    Batch b;
    REQUIRE(training.next(b));
    REQUIRE_THROWS_WITH(training.next(b), Catch::Contains("all 2 samples of batch 1") &&
                                              Catch::Contains("synthetic[2]"));
  }
  o.empty_batches = true;
  Loader evaluation(ds, ImageTransform(plain(4, 1), 1), sampler, o);
  for (bool warn : {true, false}) {
    INFO("warnings " << warn);
    warnings = 0;
    evaluation.set_bad_sample_warnings(warn);
    Epoch e = read_epoch(evaluation, 0);
    REQUIRE(e.indices == std::vector<std::vector<int64_t>>{{0, 1}, {}, {4, 5}});
    REQUIRE(e.labels[2] == std::vector<int64_t>{4, 5});
    REQUIRE(e.images[2][0] == float(pixel(4, 0, 0, 0)) / 255.0f);
    REQUIRE(evaluation.stats().skipped == 2);
    REQUIRE(evaluation.stats().images == 4);
    REQUIRE(warnings == (warn ? 2 : 0));
  }
}

TEST_CASE("loader: early shutdown and abandoned epochs never hang", "[data][loader]") {
  SyntheticDataset ds(200, 3, 16, {}, /*sleep_us=*/500);
  DistributedSampler sampler(SamplerOptions{200, 0, 1, 2});
  TransformOptions t{.mode = TransformMode::train, .size = 8};
  {
    Loader idle(ds, ImageTransform(t, 3), sampler, quiet(8, 3, 2));  // never started
  }
  {
    Loader loader(ds, ImageTransform(t, 3), sampler, quiet(8, 3, 2));
    loader.start_epoch(0);
    Batch b;
    REQUIRE(loader.next(b));
  }  // workers are mid-sample here
  // At most the prefetch window plus one sample per worker was decoded.
  REQUIRE(ds.loads_.load() <= 8 * 3 + 3);
  {
    Loader loader(ds, ImageTransform(t, 3), sampler, quiet(8, 2, 3));
    loader.start_epoch(0);
    Batch b;
    REQUIRE(loader.next(b));
    Epoch e = read_epoch(loader, 1);  // abandons epoch 0 mid-way
    REQUIRE(e.indices.size() == 25);
    loader.start_epoch(2);
  }
}

namespace {

// Reads that hang until the test opens the gate, as on a dead network
// filesystem; samples below `fast` load at once.
class GatedDataset final : public Dataset {
 public:
  GatedDataset(int64_t n, int64_t fast) : n_(n), fast_(fast) {}
  int64_t size() const override { return n_; }
  int64_t label(int64_t index) const override { return index % 10; }
  int64_t num_classes() const override { return 10; }
  int channels() const override { return 1; }
  DecodedImage load(int64_t index, const DecodeHint&) const override {
    if (index >= fast_) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return open_; });
    }
    cv::Mat m(4, 4, CV_8UC1, cv::Scalar(uint8_t(index)));
    returned_++;
    return DecodedImage{m, 4, 4};
  }
  std::string describe(int64_t index) const override { return cat("gated[", index, "]"); }
  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  mutable std::atomic<int64_t> returned_{0};

 private:
  int64_t n_, fast_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool open_ = false;
};

}  // namespace

TEST_CASE("loader: a hung read gives way to interrupted, and shutdown leaves it behind",
          "[data][loader]") {
  GatedDataset ds(64, /*fast=*/8);  // batch 0 loads, batch 1 hangs
  DistributedSampler sampler(SamplerOptions{.dataset_size = 64, .shuffle = false});
  std::atomic<bool> stop{false};
  LoaderOptions o = quiet(8, 2, 2);
  o.interrupted = [&] { return stop.load(); };
  o.shutdown_seconds = 0.3;
  auto loader = std::make_unique<Loader>(ds, ImageTransform(plain(4, 1), 1), sampler, o);
  loader->start_epoch(0);
  Batch b;
  REQUIRE(loader->next(b));
  REQUIRE(b.indices.front() == 0);
  // Batch 1 waits for ever until interrupted says so.
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    stop = true;
  });
  auto t0 = std::chrono::steady_clock::now();
  std::string message;
  try {
    loader->next(b);
  } catch (const LoaderStalled& e) {
    message = e.what();
  }
  stopper.join();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(message);
  REQUIRE(message.find("gave up waiting for batch 1 of epoch 0") != std::string::npos);
  REQUIRE(message.find("gated[8]") != std::string::npos);  // the reads in progress are named
  REQUIRE(waited < 2.0);
  // The workers are stuck in their reads: the destructor waits its grace, then leaves them.
  t0 = std::chrono::steady_clock::now();
  loader.reset();
  const double shut = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE(shut >= 0.25);
  REQUIRE(shut < 2.0);
  // The reads return after the loader is gone; the workers end on the state they kept alive.
  const int64_t before = ds.returned_.load();
  ds.open();
  for (int i = 0; i < 200 && ds.returned_.load() < before + 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(ds.returned_.load() == before + 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let them finish (ASan watches)
}

TEST_CASE("loader: slow reads are waited for while interrupted stays false", "[data][loader]") {
  SyntheticDataset ds(16, 1, 4, {}, /*sleep_us=*/100000);
  DistributedSampler sampler(SamplerOptions{.dataset_size = 16, .shuffle = false});
  LoaderOptions o = quiet(4, 2, 1);
  o.interrupted = [] { return false; };
  Loader loader(ds, ImageTransform(plain(4, 1), 1), sampler, o);
  Epoch e = read_epoch(loader, 0);
  REQUIRE(e.indices.size() == 4);
}
