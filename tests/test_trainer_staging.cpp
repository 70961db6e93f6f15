// GPU data parallelism checked from the CPU: SyncBatchNorm's tensor-op path
// (what a GPU runs, its statistics staged through host copies) against the
// fused CPU loops, and which recipes trainer/device.h accepts on GPUs with
// several ranks (parallel.zero1, parallel.sync_bn, parallel.gpu_direct); the
// cuDNN RNN's one-backward-per-record guard (core/cuda/consumed_records.h).
// The multi-rank runs of the staged paths are in test_parallel_zero.cpp
// (zero_worker zero_staged / zero_ddp_staged / syncbn_ops) and
// test_parallel_ddp.cpp (dp_worker reducer).
#include "tests/testing.h"

#include "comm/communicator.h"
#include "core/cuda/consumed_records.h"
#include "core/ops.h"
#include "parallel/device_staging.h"
#include "parallel/sync_batchnorm.h"
#include "trainer/device.h"
#include "trainer/recipe.h"
#if TRAINER_HAVE_CUDA
#include "tests/cuda_testing.h"
#endif

using namespace trainer;
using namespace trainer::testing;

namespace {

Recipe parallel_recipe(const std::string& parallel) {
  return parse_recipe("model:\n  name: small_cnn\ndevice: cuda\nparallel:\n" + parallel,
                      "gpu.yaml");
}

}  // namespace

TEST_CASE("staging: sync_batch_norm_ops matches the CPU sync_batch_norm, values and gradients",
          "[device][parallel][syncbn]") {
  auto world = comm::init_world(comm::Bootstrap{});
  for (DType dtype : {DType::f32, DType::f64})
    for (bool relu : {false, true}) {
      INFO(dtype << (relu ? " with relu" : ""));
      Generator gen(21, 2);
      Tensor x = to_channels_last(uniform({3, 4, 5, 6}, -2, 3, gen).to(dtype));
      Tensor probe = uniform({3, 4, 5, 6}, -1, 1, gen).to(dtype);
      Tensor gamma = uniform({4}, 0.5, 1.5, gen).to(dtype);
      Tensor beta = uniform({4}, -0.5, 0.5, gen).to(dtype);
      TensorList grads[2];
      BatchStatsResult results[2];
      for (int path = 0; path < 2; ++path) {
        Tensor xi = x.clone().detach().requires_grad_();
        Tensor gi = gamma.clone().requires_grad_(), bi = beta.clone().requires_grad_();
        results[path] = path == 0 ? parallel::sync_batch_norm(*world, xi, gi, bi, 1e-5, relu)
                                  : parallel::sync_batch_norm_ops(*world, xi, gi, bi, 1e-5, relu);
        sum(results[path].result.out * probe).backward();
        grads[path] = {xi.grad(), gi.grad(), bi.grad()};
      }
      const double tol = dtype == DType::f64 ? 1e-12 : 1e-5;
      CHECK(results[1].count == 3 * 5 * 6);
      require_close(results[1].result.out, results[0].result.out, tol, tol, "output");
      require_close(results[1].result.mean, results[0].result.mean, tol, tol, "mean");
      require_close(results[1].result.var, results[0].result.var, tol, tol, "variance");
      const char* names[3] = {"input gradient", "gamma gradient", "beta gradient"};
      for (int k = 0; k < 3; ++k) require_close(grads[1][k], grads[0][k], tol, tol, names[k]);
    }
}

TEST_CASE("staging: sync_batch_norm_ops takes bf16 input with f32 gamma and beta (autocast)",
          "[device][parallel][syncbn]") {
  auto world = comm::init_world(comm::Bootstrap{});
  Generator gen(22, 2);
  Tensor x = to_channels_last(uniform({2, 3, 4, 5}, -2, 3, gen)).to(DType::bf16);
  Tensor gamma = uniform({3}, 0.5, 1.5, gen), beta = uniform({3}, -0.5, 0.5, gen);
  Tensor g16 = gamma.clone().requires_grad_(), g32 = gamma.clone().requires_grad_();
  Tensor x16 = x.clone().detach().requires_grad_();
  Tensor x32 = x.to(DType::f32).detach().requires_grad_();
  BatchStatsResult a = parallel::sync_batch_norm_ops(*world, x16, g16, beta, 1e-5);
  BatchStatsResult b = parallel::sync_batch_norm_ops(*world, x32, g32, beta, 1e-5);
  CHECK(a.result.out.dtype() == DType::bf16);
  require_close(a.result.out.to(DType::f32), b.result.out, 1e-2, 1e-2, "bf16 output");
  sum(a.result.out).backward();
  sum(b.result.out).backward();
  CHECK(g16.grad().dtype() == DType::f32);
  CHECK(x16.grad().dtype() == DType::bf16);
  require_close(g16.grad(), g32.grad(), 2e-2, 2e-2, "gamma gradient");
}

TEST_CASE("staging: allreduce_through_host round-trips a tensor", "[device][parallel]") {
  auto world = comm::init_world(comm::Bootstrap{});
  Tensor t = from_vector(std::vector<double>{1.5, -2, 3});
  Tensor before = t.clone();
  parallel::allreduce_through_host(*world, t);
  require_close(t, before, 0, 0, "one rank's sum");
}

TEST_CASE("staging: GPUs with several ranks accept parallel.zero1 and parallel.sync_bn",
          "[device][parallel]") {
  const Device gpu{kCUDA, 0};
  for (const char* p :
       {"  zero1: true\n", "  sync_bn: true\n", "  zero1: true\n  sync_bn: true\n"}) {
    INFO(p);
    Recipe r = parallel_recipe(p);
    CHECK_NOTHROW(check_device_parallel(r, gpu, 2, false));
    CHECK(!uses_gpu_direct(r, gpu, 2, true));  // gpu_direct defaults to off
  }
}

TEST_CASE("staging: parallel.gpu_direct is auto, on or off, and on says what it needs",
          "[device][parallel][recipe]") {
  const Device gpu{kCUDA, 0};
  CHECK(parallel_recipe("  dp: 2\n").parallel.gpu_direct == "off");
  CHECK(error_of([] {
          parallel_recipe("  gpu_direct: yes\n");
        }).find("'parallel.gpu_direct' = 'yes' is not one of: auto, on, off") != std::string::npos);

  Recipe on = parallel_recipe("  gpu_direct: on\n");
  CHECK(on.parallel.gpu_direct == "on");
  CHECK_NOTHROW(check_device_parallel(on, gpu, 2, true));
  CHECK(uses_gpu_direct(on, gpu, 2, true));
  CHECK(!uses_gpu_direct(on, gpu, 1, true));  // one rank: nothing to communicate
  std::string e = error_of([&] { check_device_parallel(on, gpu, 2, false); });
  CHECK(e.find("gpu.yaml: parallel.gpu_direct: on") != std::string::npos);
  CHECK(e.find("does not report CUDA memory support") != std::string::npos);
  e = error_of([&] { check_device_parallel(on, Device{}, 2, true); });
  CHECK(e.find("parallel.gpu_direct: on") != std::string::npos);
  CHECK(e.find("device: cuda") != std::string::npos);
  Recipe on_zero = parallel_recipe("  gpu_direct: on\n  zero1: true\n");
  e = error_of([&] { check_device_parallel(on_zero, gpu, 2, true); });
  CHECK(e.find("parallel.gpu_direct: on with parallel.zero1") != std::string::npos);

  Recipe automatic = parallel_recipe("  gpu_direct: auto\n");
  CHECK_NOTHROW(check_device_parallel(automatic, gpu, 2, false));
  CHECK(uses_gpu_direct(automatic, gpu, 2, true));
  CHECK(!uses_gpu_direct(automatic, gpu, 2, false));
  CHECK(!uses_gpu_direct(automatic, Device{}, 2, true));
  Recipe auto_zero = parallel_recipe("  gpu_direct: auto\n  zero1: true\n");
  CHECK_NOTHROW(check_device_parallel(auto_zero, gpu, 2, true));
  CHECK(!uses_gpu_direct(auto_zero, gpu, 2, true));  // ZeRO-1 stages
}

TEST_CASE("staging: a cuDNN RNN record serves one backward, a second is an error",
          "[device][cuda-host]") {
  cuda::ConsumedRecords consumed;
  Tensor record = zeros({16}, DType::u8);
  consumed.take(record, "lstm_layer backward");
  std::string e = error_of([&] { consumed.take(record, "lstm_layer backward"); });
  CHECK(e.find("lstm_layer backward: a second backward through the same forward") !=
        std::string::npos);
  Tensor view = make_view(record, {8}, {1}, 8);  // the same storage
  CHECK(!error_of([&] { consumed.take(view, "gru_layer backward"); }).empty());
  // Another forward's record is fine; a freed one is forgotten.
  Tensor other = zeros({16}, DType::u8);
  CHECK_NOTHROW(consumed.take(other, "gru_layer backward"));
  CHECK(consumed.size() == 2);
  record = Tensor();
  view = Tensor();
  Tensor third = zeros({16}, DType::u8);
  CHECK_NOTHROW(consumed.take(third, "gru_layer backward"));
  CHECK(consumed.size() == 2);
}

#if TRAINER_HAVE_CUDA
TEST_CASE("staging: training_device accepts cuda with 2 ranks and zero1 + sync_bn", "[cuda]") {
  require_gpu_or_skip();
  Recipe r = parallel_recipe("  zero1: true\n  sync_bn: true\n");
  CHECK(training_device(r, 2) == gpu());
}
#endif
