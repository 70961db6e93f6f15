// The training device (trainer/device.h): resolving `device:` against what
// the build and the machine offer, with errors naming the recipe file and
// key; rebinding a module's storages in place (identity, views and tied
// tensors kept), checked on the CPU; `trainer train --dry-run` refusing an
// absent GPU; and, with a GPU, a short training run on device: cuda whose
// loss falls and whose checkpoint round-trips ([cuda]).
#include "tests/testing.h"

#include <filesystem>
#include <mutex>
#include <thread>

#include "comm/communicator.h"
#include "core/ops.h"
#include "layers/linear.h"
#include "tests/process.h"
#include "trainer/device.h"
#include "trainer/recipe.h"
#include "trainer/session.h"
#if TRAINER_HAVE_CUDA
#include "tests/cuda_testing.h"
#endif

using namespace trainer;
using namespace trainer::testing;
namespace fs = std::filesystem;

namespace {

Recipe device_recipe(const std::string& device) {
  return parse_recipe("model:\n  name: small_cnn\ndevice: " + device + "\n", "dev.yaml");
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Two parameters, one of them also held as a transposed view.
struct Tied : Module {
  Tied() {
    a = register_parameter("a", from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}));
    b = register_parameter("b", from_vector<float>({7, 8}));
    at = a.t();
  }
  Tensor forward(const Tensor& x) override { return x; }
  Tensor a, b, at;
};

}  // namespace

TEST_CASE("device: cpu and cuda resolve by local rank, with errors naming the recipe key",
          "[device]") {
  const Recipe cpu = device_recipe("cpu"), cuda = device_recipe("cuda");
  CHECK(resolve_device(cpu, 3, {false, 0}) == Device{});
  CHECK(resolve_device(cuda, 1, {true, 2}) == (Device{kCUDA, 1}));

  std::string no_build = error_of([&] { resolve_device(cuda, 0, {false, 0}); });
  INFO(no_build);
  CHECK(contains(no_build, "dev.yaml: device: cuda"));
  CHECK(contains(no_build, "without the CUDA backend"));
  CHECK(contains(no_build, "use device: cpu"));

  std::string no_gpu = error_of([&] { resolve_device(cuda, 0, {true, 0}); });
  INFO(no_gpu);
  CHECK(contains(no_gpu, "dev.yaml: device: cuda"));
  CHECK(contains(no_gpu, "no CUDA device is visible"));
  CHECK(contains(no_gpu, "use device: cpu"));

  std::string too_few = error_of([&] { resolve_device(cuda, 2, {true, 2}); });
  INFO(too_few);
  CHECK(contains(too_few, "local rank 2"));
  CHECK(contains(too_few, "2 CUDA device(s) visible"));

  // A bad name never reaches here: the recipe schema refuses it.
  CHECK(contains(error_of([] { device_recipe("tpu"); }), "device"));
}

TEST_CASE("device: a session asking for an absent GPU fails first, naming the file", "[device]") {
  if (device_availability().cuda_devices > 0) return;  // a GPU is visible: nothing to refuse
  std::string e = error_of([] { Session s(device_recipe("cuda")); });
  INFO(e);
  CHECK(contains(e, "dev.yaml: device: cuda"));
  CHECK(contains(e, "use device: cpu"));
}

TEST_CASE("device: rebinding storages keeps identity, views and values", "[device]") {
  auto m = std::make_shared<Tied>();
  m->a.requires_grad_();
  const Tensor handle = m->a;  // another handle on the same tensor
  const Storage* old_storage = m->a.storage().get();
  int copies = 0;
  TensorList tensors;
  for (const NamedTensor& t : m->state()) tensors.push_back(t.tensor);
  tensors.push_back(m->at);
  rebind_storages(tensors, [&](const Tensor& bytes) {
    ++copies;
    REQUIRE(bytes.dtype() == DType::u8);
    return bytes.clone();
  });
  CHECK(copies == 2);  // a and its view share one storage
  CHECK(m->a.storage().get() != old_storage);
  CHECK(handle.storage() == m->a.storage());
  CHECK(m->at.storage() == m->a.storage());
  CHECK(m->a.requires_grad());
  CHECK(m->a.to_vector<float>() == std::vector<float>{1, 2, 3, 4, 5, 6});
  CHECK(m->at.to_vector<float>() == std::vector<float>{1, 4, 2, 5, 3, 6});
  CHECK(m->b.to_vector<float>() == std::vector<float>{7, 8});
  // Writes through one handle show through the others.
  m->at.fill_(0.5);
  CHECK(m->a.to_vector<float>() == std::vector<float>(6, 0.5f));

  CHECK(module_device(*m) == Device{});
  move_module(*m, Device{});  // already there: nothing moves
  CHECK(m->at.storage() == m->a.storage());
  Tensor x = ones({2});
  CHECK(to_device(x, Device{}).impl() == x.impl());
}

TEST_CASE("device: train --dry-run refuses device: cuda without a GPU", "[device]") {
  if (device_availability().cuda_devices > 0) return;
  fs::path out = temp_path("device_dry");
  ProcessResult r =
      run_trainer({"train", std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_cnn.yaml",
                   "output_dir=" + out.string(), "device=cuda", "--dry-run"});
  INFO(r.output);
  CHECK(r.code == 1);
  CHECK(contains(r.output, "fmnist_cnn.yaml: device: cuda"));
  CHECK(contains(r.output, "use device: cpu"));
}

namespace {

// The host copier, doubling what it stages so the test sees the values went
// through the host and back, and recording the order of the calls.
struct DoublingCopier : parallel::BucketCopier {
  std::shared_ptr<parallel::BucketCopier> host = parallel::host_bucket_copier();
  std::mutex mutex;
  std::vector<std::string> calls;
  std::thread::id ready_thread;
  void log(const std::string& c) {
    std::lock_guard<std::mutex> lock(mutex);
    calls.push_back(c);
  }
  std::shared_ptr<void> ready(const Tensor& flat) override {
    ready_thread = std::this_thread::get_id();
    log(cat("ready ", flat.numel()));
    return std::make_shared<int>(int(flat.numel()));
  }
  void to_host(const Tensor& flat, const std::shared_ptr<void>& ready, void* h) override {
    CHECK(*static_cast<int*>(ready.get()) == int(flat.numel()));
    Tensor twice = flat * 2.0;
    host->to_host(twice, nullptr, h);
    log(cat("to_host ", flat.numel()));
  }
  void from_host(const void* h, const Tensor& flat) override {
    host->from_host(h, flat);
    log(cat("from_host ", flat.numel()));
  }
  std::shared_ptr<void> host_buffer(size_t bytes) override { return host->host_buffer(bytes); }
};

struct TwoLinear : Module {
  explicit TwoLinear(Generator& gen) {
    a = register_module("a", std::make_shared<Linear>(5, 7, gen));
    b = register_module("b", std::make_shared<Linear>(7, 3, gen));
  }
  Tensor forward(const Tensor& x) override { return (*b)(relu((*a)(x))); }
  std::shared_ptr<Linear> a, b;
};

}  // namespace

TEST_CASE("device staging: buckets go to the host, through the allreduce and back, in order",
          "[device][parallel]") {
  Generator gen(5);
  Tensor x = rand_tensor({4, 5}, gen);
  auto reference = std::make_shared<TwoLinear>(gen);
  Generator gen2(5);
  rand_tensor({4, 5}, gen2);
  auto model = std::make_shared<TwoLinear>(gen2);
  sum(reference->forward(x)).backward();

  auto copier = std::make_shared<DoublingCopier>();
  auto world = comm::init_world(comm::Bootstrap{});
  parallel::DataParallelOptions o;
  o.bucket_bytes = 64;  // several buckets in flight
  o.first_bucket_bytes = 16;
  o.reduce = parallel::staged_reduce(copier);
  {
    parallel::DataParallel dp(model, world, o);
    sum(dp.forward(x)).backward();
    dp.finish();
    REQUIRE(dp.buckets().size() >= 2);
    TensorList expected = reference->parameters(), actual = model->parameters();
    for (size_t k = 0; k < actual.size(); ++k)
      require_close(actual[k].grad(), expected[k].grad() * 2.0, 1e-6, 1e-6, cat("grad ", k));
    CHECK(copier->ready_thread == std::this_thread::get_id());
    // Per bucket: ready, then to_host, then from_host; buckets in issue order.
    std::vector<std::string> readies, to_hosts, from_hosts;
    for (const std::string& c : copier->calls) {
      if (c.rfind("ready", 0) == 0) readies.push_back(c.substr(6));
      if (c.rfind("to_host", 0) == 0) to_hosts.push_back(c.substr(8));
      if (c.rfind("from_host", 0) == 0) from_hosts.push_back(c.substr(10));
    }
    CHECK(readies.size() == dp.buckets().size());
    CHECK(to_hosts == readies);
    CHECK(from_hosts == readies);
  }
}

#if TRAINER_HAVE_CUDA
TEST_CASE("device: the small CNN trains on cuda and its checkpoint round-trips", "[cuda]") {
  require_gpu_or_skip();
  fs::path out = temp_path("device_cuda");
  fs::remove_all(out);
  Recipe r = load_recipe(
      std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_cnn.yaml",
      {"device=cuda", "training.steps=30", "training.global_batch=64", "schedule.name=constant",
       "schedule.warmup_epochs=0", "data.workers=1", "output_dir=" + out.string()});
  Session s(r);
  REQUIRE(module_device(s.model()) == gpu());
  s.start_epoch(0, 0);
  double first = 0, last = 0;
  TrainState state;
  for (int step = 0; step < 30; ++step) {
    StepBatch batch;
    REQUIRE(s.next_batch(batch));
    REQUIRE(batch.inputs.device() == gpu());
    Tensor loss = s.loss(batch);
    loss.backward();
    s.optimizer().set_lr(s.schedule().lr(step));
    s.optimizer().step();
    s.optimizer().zero_grad();
    double v = loss.item<double>();
    if (step < 5) first += v / 5;
    if (step >= 25) last += v / 5;
    state.step = step + 1;
    state.position = batch.position;
  }
  INFO("mean loss of the first 5 steps " << first << ", of the last 5 " << last);
  CHECK(last < 0.8 * first);

  fs::create_directories(out / "ckpt");
  s.save((out / "ckpt").string(), state);
  Session t(r);
  TrainState loaded = t.load((out / "ckpt").string());
  CHECK(loaded.step == 30);
  REQUIRE(module_device(t.model()) == gpu());
  std::vector<NamedTensor> a = s.model().state(), b = t.model().state();
  REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    REQUIRE(b[k].tensor.device() == gpu());
    require_close(b[k].tensor.to(kHost), a[k].tensor.to(kHost), 0, 0, a[k].name);
  }
  std::vector<NamedTensor> sa = s.optimizer().state(), sb = t.optimizer().state();
  REQUIRE(sa.size() == sb.size());
  for (size_t k = 0; k < sa.size(); ++k)
    require_close(sb[k].tensor.to(kHost), sa[k].tensor.to(kHost), 0, 0, sa[k].name);
  EvalMetrics m = t.evaluate();
  CHECK(m.samples == 10000);
  CHECK(m.top1 > 50);
}
#endif

#if TRAINER_HAVE_CUDA
TEST_CASE("device staging: the CUDA copier stages after the compute stream's work", "[cuda]") {
  require_gpu_or_skip();
  Tensor flat = arange(1001, DType::f32, gpu()) * 2.0;  // queued on the compute stream
  auto copier = parallel::cuda_bucket_copier(gpu());
  std::shared_ptr<void> host = copier->host_buffer(flat.nbytes());
  copier->to_host(flat, copier->ready(flat), host.get());
  float* h = static_cast<float*>(host.get());
  CHECK(h[1000] == 2000.0f);
  h[0] = -1;
  copier->from_host(host.get(), flat);
  CHECK(flat.to_vector<float>()[0] == -1.0f);

  // Through the staged reduction (one rank: the average is the identity).
  auto world = comm::init_world(comm::Bootstrap{});
  parallel::BucketReduceFn reduce = parallel::staged_reduce(copier);
  parallel::Bucket bucket;
  bucket.flat = flat * 3.0;
  reduce(*world, bucket).wait();
  require_close(bucket.flat.to(kHost), flat.to(kHost) * 3.0, 0, 0, "staged bucket");
}
#endif
