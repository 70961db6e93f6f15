// The CUDA core: launch geometry, the caching allocator, streams and
// events, host <-> device transfers, and the elementwise and random kernels,
// each against the CPU result on the same inputs (moved with to(Device)).
// [cuda] cases exit 77 (skipped) without a GPU; the [cuda-host] cases test
// the host side of the backend and run everywhere.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "core/cuda/cuda_allocator.h"
#include "core/cuda/cuda_backend.h"
#include "core/cuda/device.h"
#include "core/cuda/stream.h"
#include "tests/cuda_testing.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;
using Catch::Matchers::Contains;

namespace {

// Byte address of the element with row-major index i of t: the oracle of
// element_offsets().
const char* address_of(const Tensor& t, int64_t i) {
  int64_t off = 0;
  for (int d = t.dim() - 1; d >= 0; --d) {
    off += (i % t.size(d)) * t.stride(d);
    i /= t.size(d);
  }
  return static_cast<const char*>(t.data_ptr()) + off * int64_t(dtype_size(t.dtype()));
}

// Walks every launch of (out, x) the way the kernels do and checks each
// element's address; returns the number of launches.
int check_launches(const Tensor& out, const Tensor& x, bool expect_contiguous) {
  int launches = 0, mismatches = 0;
  int64_t covered = 0;
  cuda::for_each_launch<2>(out.shape(), {&out, &x}, [&](const cuda::Launch<2>& g) {
    ++launches;
    REQUIRE(g.first_index == covered);
    REQUIRE(g.ndim >= 1);
    REQUIRE(g.ndim <= cuda::kMaxDims);
    REQUIRE(g.contiguous == expect_contiguous);
    for (int64_t i = 0; i < g.numel; ++i) {
      int64_t off[2];
      cuda::element_offsets(g, i, off);
      const int64_t idx = g.first_index + i;
      mismatches += g.data[0] + off[0] * int64_t(dtype_size(out.dtype())) != address_of(out, idx);
      mismatches += g.data[1] + off[1] * int64_t(dtype_size(x.dtype())) != address_of(x, idx);
    }
    covered += g.numel;
  });
  REQUIRE(mismatches == 0);
  REQUIRE(covered == out.numel());
  return launches;
}

}  // namespace

// ---- host side (no GPU needed) ----

TEST_CASE("cuda launch geometry: offsets match the strided layout", "[cuda-host]") {
  Tensor base = arange(3 * 5 * 7, DType::f32).reshape({3, 5, 7});
  // Contiguous operands of different dtypes merge into one unit-stride dim.
  REQUIRE(check_launches(empty({3, 5, 7}, DType::f64), base, true) == 1);
  // Transposed, sliced with a step, broadcast (stride 0), scalar.
  REQUIRE(check_launches(empty({7, 5}), base.select(0, 1).t(), false) == 1);
  REQUIRE(check_launches(empty({3, 5, 3}), base.slice(2, 1, 7, 2), false) == 1);
  REQUIRE(check_launches(empty({3, 4, 7}, DType::u8), base.slice(1, 0, 1).expand({3, 4, 7}),
                         false) == 1);
  REQUIRE(check_launches(empty({}), scalar_tensor(2.0), true) == 1);
  REQUIRE(check_launches(empty({0, 4}), empty({0, 4}), true) == 0);
  // Ten dims that cannot merge: the two outer ones are looped on the host.
  Shape shape = {3, 2, 2, 2, 2, 2, 2, 2, 2, 2};
  Tensor ten = arange(shape_numel(shape), DType::f32).reshape({2, 2, 2, 2, 2, 2, 2, 2, 2, 3});
  Tensor reversed = ten.permute({9, 8, 7, 6, 5, 4, 3, 2, 1, 0});
  REQUIRE(reversed.shape() == shape);
  REQUIRE(check_launches(empty(shape), reversed, false) == 3 * 2);
}

TEST_CASE("cuda devices: a missing GPU is an Error, not a crash", "[cuda-host]") {
  int n = cuda::device_count();
  REQUIRE_THROWS_WITH(cuda::set_device(n), Contains("cuda:" + std::to_string(n)));
  if (n == 0) REQUIRE_THROWS_AS(empty({4}, DType::f32, Device{kCUDA}), Error);
}

// ---- memory ----

TEST_CASE("cuda fill and copy: every dtype and conversion, strided", "[cuda]") {
  require_gpu_or_skip();
  for (DType t : kAll) {
    INFO(dtype_name(t));
    for (double v : {0.0, -0.0, 1.0, 3.75, 200.0}) {
      Tensor expected = full({5, 3}, v, t);
      Tensor actual = full({5, 3}, v, t, gpu());
      REQUIRE(actual.to_vector<double>() == expected.to_vector<double>());
    }
    Tensor view = zeros({4, 6}, t, gpu()).slice(1, 1, 6, 2);
    view.fill_(7.0);
    REQUIRE(view.to_vector<double>() == full({4, 3}, 7.0, t).to_vector<double>());
  }
  // Values every dtype holds exactly or converts the same way on both sides.
  Tensor values = from_vector<double>({0, 1, 2.5, 3.75, 100, 0.1, 7, 200, 13, 64, 0.5, 9}, {3, 4});
  for (DType src : kAll) {
    for (DType dst : kAll) {
      INFO(dtype_name(src) << " -> " << dtype_name(dst));
      Tensor x = values.to(src);
      Tensor expected = x.t().to(dst).contiguous();
      Tensor on_gpu = x.to(gpu());
      REQUIRE(on_gpu.to(dst).to_vector<double>() == x.to(dst).to_vector<double>());
      REQUIRE(on_gpu.t().to(dst).contiguous().to_vector<double>() == expected.to_vector<double>());
    }
  }
  Generator gen(3);
  Tensor x = rand_tensor({6, 1, 5}, gen);
  Tensor wide = zeros({6, 4, 5}, DType::f32, gpu());
  wide.copy_(x.to(gpu()));  // broadcast on the device
  REQUIRE(wide.to_vector<float>() == x.expand({6, 4, 5}).contiguous().to_vector<float>());
}

TEST_CASE("cuda transfers: chunked staging, pinned memory, strided both ways", "[cuda]") {
  require_gpu_or_skip();
  const cuda::TransferOptions saved = cuda::transfer_options();
  // 1000 bytes: many chunks, and chunk edges that split f64 elements.
  cuda::set_transfer_options({.staging_bytes = 1000});
  Generator gen(5);
  Tensor x = rand_f64({37, 129}, gen);
  Tensor d = x.to(gpu());
  REQUIRE(d.to(kHost).to_vector<double>() == x.to_vector<double>());
  REQUIRE(x.t().to(gpu()).to(kHost).to_vector<double>() == x.t().contiguous().to_vector<double>());
  // Into a non-contiguous device view, then into a non-contiguous host view.
  Tensor dev_view = zeros({129, 74}, DType::f64, gpu()).slice(1, 0, 74, 2);
  dev_view.copy_(x.t());
  Tensor host_view = zeros({129, 111}, DType::f64).slice(1, 1, 111, 3);
  host_view.copy_(dev_view);
  REQUIRE(host_view.contiguous().to_vector<double>() == x.t().contiguous().to_vector<double>());
  cuda::set_transfer_options(saved);

  // Page-locked host memory goes without staging.
  const int64_t kPage = 4096, n = 3 * kPage;
  Tensor host = zeros({n + kPage}, DType::u8);
  auto addr = reinterpret_cast<uintptr_t>(host.data_ptr());
  int64_t skip = int64_t((kPage - addr % kPage) % kPage);
  Tensor pinned = make_view(host, {n}, {1}, skip);
  REQUIRE(cudaHostRegister(pinned.data_ptr(), size_t(n), cudaHostRegisterDefault) == cudaSuccess);
  Tensor src = uniform({n}, 0, 250, gen, DType::u8);
  pinned.copy_(src.to(gpu()));
  REQUIRE(pinned.to_vector<int32_t>() == src.to_vector<int32_t>());
  Tensor back = pinned.to(gpu());
  REQUIRE(back.to_vector<int32_t>() == src.to_vector<int32_t>());
  REQUIRE(cudaHostUnregister(pinned.data_ptr()) == cudaSuccess);

  if (cuda::device_count() >= 2) {  // GPU to GPU
    Tensor on1;
    {
      cuda::DeviceGuard g(1);
      on1 = d.to(Device{kCUDA, 1});
    }
    REQUIRE(on1.to(kHost).to_vector<double>() == x.to_vector<double>());
  }
}

TEST_CASE("cuda allocator: statistics, reuse and empty_cache", "[cuda]") {
  require_gpu_or_skip();
  Allocator& a = allocator(gpu());
  a.empty_cache();
  a.reset_peak();
  const AllocatorStats s0 = a.stats();
  REQUIRE(s0.cached_bytes == 0);
  void* first = nullptr;
  {
    Tensor t = empty({1000, 1000}, DType::f32, gpu());
    first = t.data_ptr();
    REQUIRE(a.stats().current_bytes >= s0.current_bytes + 4000000);
  }
  const AllocatorStats s1 = a.stats();
  REQUIRE(s1.current_bytes == s0.current_bytes);
  REQUIRE(s1.peak_bytes >= s0.current_bytes + 4000000);
  REQUIRE(s1.cached_bytes >= 4000000);
  {
    Tensor again = empty({999, 1001}, DType::f32, gpu());  // same size class
    REQUIRE(again.data_ptr() == first);
    REQUIRE(a.stats().cache_hits == s1.cache_hits + 1);
    const int64_t block_bytes = s1.peak_bytes - s0.current_bytes;  // its size class
    REQUIRE(a.stats().cached_bytes == s1.cached_bytes - block_bytes);
  }
  if (cuda::device_count() == 1) {
    AllocatorStats d0 = cuda::memory_stats(0), all = a.stats();
    REQUIRE(d0.current_bytes == all.current_bytes);
    REQUIRE(d0.cached_bytes == all.cached_bytes);
  }
  a.empty_cache();
  REQUIRE(a.stats().cached_bytes == 0);
}

TEST_CASE("cuda allocator: blocks follow stream order", "[cuda]") {
  require_gpu_or_skip();
  Allocator& a = allocator(gpu());
  a.empty_cache();
  const Shape shape = {1953125};  // 7.8 MB: a size class of its own here
  // Keep `side` busy until `go` is set (also when an assertion fails, before
  // ~Stream waits for it).
  std::atomic<bool> go{false};
  cuda::Stream side;
  struct Release {
    std::atomic<bool>& flag;
    ~Release() { flag = true; }
  } release{go};
  auto wait_for_flag = [](void* flag) {
    while (!static_cast<std::atomic<bool>*>(flag)->load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  REQUIRE(cudaLaunchHostFunc(side.handle(), wait_for_flag, &go) == cudaSuccess);
  void* block = nullptr;
  {
    cuda::StreamGuard g(side);
    block = empty(shape, DType::f32, gpu()).data_ptr();  // freed on `side`
    // Same stream: reused at once, although `side` has not run yet.
    REQUIRE(empty(shape, DType::f32, gpu()).data_ptr() == block);
  }
  // Another stream must not take it while `side` may still use it...
  Tensor other = empty(shape, DType::f32, gpu());
  REQUIRE(other.data_ptr() != block);
  go = true;
  side.synchronize();
  // ... and takes it once `side` has passed the release.
  REQUIRE(empty(shape, DType::f32, gpu()).data_ptr() == block);

  // A destroyed stream's blocks are free for everyone.
  void* from_temp = nullptr;
  {
    cuda::Stream temp;
    cuda::StreamGuard g(temp);
    from_temp = empty({1234567}, DType::f32, gpu()).data_ptr();
  }
  REQUIRE(empty({1234567}, DType::f32, gpu()).data_ptr() == from_temp);
}

TEST_CASE("cuda allocator: exhausted memory is an Error naming bytes and device", "[cuda]") {
  require_gpu_or_skip();
  const int64_t huge = int64_t(1) << 50;  // 1 PiB
  REQUIRE_THROWS_WITH(empty({huge}, DType::u8, gpu()),
                      Contains(std::to_string(huge) + " bytes") &&
                          Contains("cuda:" + std::to_string(cuda::current_device())));
  // The error left nothing behind: the device still works.
  REQUIRE(full({3}, 2.0, DType::f32, gpu()).to_vector<float>() == std::vector<float>{2, 2, 2});
}

// ---- streams and events ----

TEST_CASE("cuda streams: guard, events, cross-stream order", "[cuda]") {
  require_gpu_or_skip();
  const int dev = cuda::current_device();
  REQUIRE(cuda::current_stream() == cuda::compute_stream(dev));
  cuda::Stream side;
  cuda::Event start(/*timing=*/true), stop(/*timing=*/true);
  Tensor x = full({1 << 20}, 1.5, DType::f32, gpu());
  cuda::Event x_ready;
  x_ready.record(cuda::current_stream());
  Tensor y;
  {
    cuda::StreamGuard g(side);
    REQUIRE(cuda::current_stream() == side.handle());
    cudaStream_t seen_by_other_thread = nullptr;
    std::thread([&] { seen_by_other_thread = cuda::current_stream(dev); }).join();
    REQUIRE(seen_by_other_thread == cuda::compute_stream(dev));
    x_ready.wait(side);
    start.record(side);
    y = x * 2.0;  // on `side`, after x was filled on the compute stream
    stop.record(side);
  }
  REQUIRE(cuda::current_stream() == cuda::compute_stream(dev));
  cuda::Event y_ready;
  y_ready.record(side);
  y_ready.wait(cuda::current_stream());
  Tensor z = y + 1.0;  // on the compute stream, after y
  stop.synchronize();
  REQUIRE(stop.query());
  REQUIRE(cuda::elapsed_ms(start, stop) >= 0.0f);
  REQUIRE(z.to_vector<float>() == std::vector<float>(1 << 20, 4.0f));
  side.synchronize();
  REQUIRE(side.query());
}

// ---- elementwise ----

TEST_CASE("cuda unary ops and their gradients match the CPU", "[cuda]") {
  require_gpu_or_skip();
  const UnaryOp ops[] = {UnaryOp::neg,   UnaryOp::exp,       UnaryOp::log,      UnaryOp::sqrt,
                         UnaryOp::rsqrt, UnaryOp::abs,       UnaryOp::tanh,     UnaryOp::sigmoid,
                         UnaryOp::relu,  UnaryOp::gelu_tanh, UnaryOp::gelu_erf, UnaryOp::silu};
  Generator gen(11);
  for (UnaryOp op : ops) {
    bool positive = op == UnaryOp::log || op == UnaryOp::sqrt || op == UnaryOp::rsqrt;
    for (DType t : kFloating) {
      for (bool strided : {false, true}) {
        Tensor x = rand_tensor({7, 33}, gen, positive ? 0.2 : -3.0, 3.0, t);
        Tolerance tol = tolerance(t);
        check_cuda_vs_cpu([op](const TensorList& in) { return unary(op, in[0]); }, {x}, tol.rtol,
                          tol.atol, strided, true,
                          cat(unary_op_name(op), " ", t, strided ? " strided" : ""));
      }
    }
  }
}

TEST_CASE("cuda binary ops, broadcasting and scalars match the CPU", "[cuda]") {
  require_gpu_or_skip();
  const BinaryOp ops[] = {BinaryOp::add, BinaryOp::sub,     BinaryOp::mul,    BinaryOp::div,
                          BinaryOp::pow, BinaryOp::maximum, BinaryOp::minimum};
  Generator gen(13);
  for (BinaryOp op : ops) {
    for (DType t : kFloating) {
      Tolerance tol = tolerance(t);
      std::string what = cat(binary_op_name(op), " ", t);
      auto f = [op](const TensorList& in) { return binary(op, in[0], in[1]); };
      // Positive operands keep pow and div finite.
      Tensor a = rand_tensor({9, 17}, gen, 0.5, 2.0, t), b = rand_tensor({9, 17}, gen, 0.5, 2.0, t);
      check_cuda_vs_cpu(f, {a, b}, tol.rtol, tol.atol, false, true, what);
      check_cuda_vs_cpu(f, {a, b}, tol.rtol, tol.atol, true, true, what + " strided");
      // Broadcast forward ([5, 1, 7] with [3, 7]); its backward needs reductions.
      Tensor c = rand_tensor({5, 1, 7}, gen, 0.5, 2.0, t),
             e = rand_tensor({3, 7}, gen, 0.5, 2.0, t);
      check_cuda_vs_cpu(f, {c, e}, tol.rtol, tol.atol, false, false, what + " broadcast");
      for (bool first : {false, true}) {
        check_cuda_vs_cpu(
            [op, first](const TensorList& in) { return binary_scalar(op, in[0], 1.7, first); }, {a},
            tol.rtol, tol.atol, true, true, what + (first ? " scalar first" : " scalar"));
      }
    }
  }
  // In place, as optimizers and gradient accumulation use them.
  Tensor p = rand_tensor({4, 6}, gen), q = rand_tensor({6}, gen);
  Tensor pg = p.to(gpu());
  add_(p, q, -0.5);
  add_(pg, q.to(gpu()), -0.5);
  mul_(p, 3.0);
  mul_(pg, 3.0);
  require_close(pg, p, 1e-6, 1e-6, "add_ and mul_");
}

TEST_CASE("cuda where, clamp and comparisons match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(17);
  for (DType t : kFloating) {
    Tolerance tol = tolerance(t);
    Tensor x = rand_tensor({8, 15}, gen, -2.0, 2.0, t);
    check_cuda_vs_cpu([](const TensorList& in) { return clamp(in[0], -0.5, 0.7); }, {x}, tol.rtol,
                      tol.atol, true, true, cat("clamp ", t));
    Tensor cond = bernoulli({8, 15}, 0.4, gen, DType::boolean);
    Tensor a = rand_tensor({8, 15}, gen, -1, 1, t), b = rand_tensor({8, 15}, gen, -1, 1, t);
    auto where_fn = [](const TensorList& in) { return where(in[0], in[1], in[2]); };
    check_cuda_vs_cpu(where_fn, {cond, a, b}, 0, 0, true, true, cat("where ", t));
    Tensor c1 = bernoulli({8, 1}, 0.5, gen, DType::boolean);
    check_cuda_vs_cpu(where_fn, {c1, a, rand_tensor({15}, gen, -1, 1, t)}, 0, 0, false, false,
                      cat("where broadcast ", t));
  }
  // Every dtype: where, and comparisons with ties, broadcast.
  Tensor u = from_vector<double>({0, 1, 2, 3, 1, 2, 0, 3, 2, 1, 1, 0}, {4, 3});
  Tensor v = from_vector<double>({1, 1, 0}, {3});
  Tensor mask = gt(u, v);
  for (DType t : kAll) {
    Tensor a = u.to(t), b = v.to(t);
    check_cuda_vs_cpu(
        [&](const TensorList& in) { return where(mask.to(in[0].device()), in[0], in[1]); },
        {a, b.expand({4, 3}).contiguous()}, 0, 0, true, false, cat("where ", t));
    for (auto cmp : {eq, lt, gt})
      check_cuda_vs_cpu([cmp](const TensorList& in) { return cmp(in[0], in[1]); }, {a, b}, 0, 0,
                        false, false, cat("compare ", t));
  }
  // Mixed dtypes compare in double.
  Tensor half = from_vector<float>({0.5f, 1.0f, 2.0f}).to(DType::f16);
  check_cuda_vs_cpu([](const TensorList& in) { return lt(in[0], in[1]); },
                    {half, from_vector<double>({0.5, 1.5, 1.0})}, 0, 0, false, false,
                    "compare f16 with f64");
}

TEST_CASE("cuda: a dtype a kernel does not take is an Error", "[cuda]") {
  require_gpu_or_skip();
  Tensor i = ones({4}, DType::i32, gpu());
  REQUIRE_THROWS_AS(backend(gpu()).binary(BinaryOp::add, i, i, empty({4}, DType::i32, gpu())),
                    Error);
  Tensor m = ones({2, 2}, DType::i32, gpu());
  REQUIRE_THROWS_WITH(backend(gpu()).matmul(m, m, empty({2, 2}, DType::i32, gpu())),
                      Contains("matmul"));
}

// ---- random ----

TEST_CASE("cuda random draws equal the CPU draws of the same generator", "[cuda]") {
  require_gpu_or_skip();
  for (DType t : kAll) {
    INFO(dtype_name(t));
    Generator on_cpu(42, kStreamInit), on_gpu(42, kStreamInit);
    // A positive range: negative values have no portable u8 conversion.
    Tensor u = uniform({37, 5}, 0.25, 9.5, on_cpu, t);
    REQUIRE(uniform({37, 5}, 0.25, 9.5, on_gpu, t, gpu()).to_vector<double>() ==
            u.to_vector<double>());
    Tensor m = bernoulli({129}, 0.3, on_cpu, t);
    REQUIRE(bernoulli({129}, 0.3, on_gpu, t, gpu()).to_vector<double>() == m.to_vector<double>());
    if (is_floating(t)) {
      // Box-Muller's log/sin/cos in double: device and host libm may differ
      // in the last double bit, which survives rounding to the storage type
      // only near a tie (the draws agree bit for bit in practice).
      Tensor z = normal({3, 41}, 0.5, 2.0, on_cpu, t);
      Tolerance tol = tolerance(t);
      require_close(normal({3, 41}, 0.5, 2.0, on_gpu, t, gpu()), z, tol.rtol, tol.atol, "normal");
    }
    REQUIRE(on_gpu.offset() == on_cpu.offset());
  }
  // A strided output draws in its own row-major order, also past eight dims.
  PhiloxKey key{7, kStreamDropout, 100};
  Tensor cpu_buf = zeros({6, 10}), gpu_buf = zeros({6, 10}, DType::f32, gpu());
  reference_backend().uniform(cpu_buf.t(), 0, 1, key);
  backend(gpu()).uniform(gpu_buf.t(), 0, 1, key);
  REQUIRE(gpu_buf.to_vector<float>() == cpu_buf.to_vector<float>());
  Tensor cpu_ten = zeros({2, 2, 2, 2, 2, 2, 2, 2, 2, 3});
  Tensor gpu_ten = zeros({2, 2, 2, 2, 2, 2, 2, 2, 2, 3}, DType::f32, gpu());
  std::vector<int> reverse = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0};
  reference_backend().normal(cpu_ten.permute(reverse), 0, 1, key);
  backend(gpu()).normal(gpu_ten.permute(reverse), 0, 1, key);
  require_close(gpu_ten, cpu_ten, 1e-6, 1e-7, "normal into a ten-dim view");
}
