// The data-parallel equivalence checks, run by tests/dp_worker.cpp as the
// ranks of a launched job and by tests/test_parallel_ddp.cpp as threads of
// one process (tests/thread_world.h): see tests/dp_checks.h.
#include "tests/dp_checks.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "comm/collectives.h"
#include "core/ops.h"
#include "models/small.h"
#include "optim/optimizer.h"
#include "parallel/ddp.h"
#include "parallel/device_staging.h"
#include "parallel/trace.h"
#include "tests/worker_checks.h"

namespace trainer::testing {

using namespace trainer::parallel;

std::shared_ptr<MLP> make_mlp(uint64_t seed) {
  return std::make_shared<MLP>(
      MLPOptions{.in_features = kIn, .hidden = {33, 17}, .num_classes = kClasses, .seed = seed});
}

// The global batch of a step: inputs [n, kIn] and labels [n].
std::pair<Tensor, Tensor> global_batch(int64_t step, int64_t n) {
  Generator gen(1234, uint64_t(step));
  Tensor x = normal({n, kIn}, 0.0, 1.0, gen);
  std::vector<int64_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) labels[size_t(i)] = (i * 7 + step * 3) % kClasses;
  return {x, from_vector(labels)};
}

namespace {

// First element where a and b differ by more than a float tolerance, reported.
void expect_close(const std::string& what, const Tensor& actual, const Tensor& expected) {
  std::vector<float> a = actual.to_vector<float>(), e = expected.to_vector<float>();
  ++g_checks;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(std::fabs(a[i] - e[i]) <= 2e-5 * (1.0 + std::fabs(e[i])))) {
      std::printf("rank %d: %s: mismatch at index %zu: expected %.8g, actual %.8g\n", g_rank,
                  what.c_str(), i, double(e[i]), double(a[i]));
      ++g_failures;
      return;
    }
  }
}

struct ReducerCalls {
  std::atomic<int> reduce{0}, scale{0}, scratch{0};
};

std::shared_ptr<const comm::Reducer> counting_reducer(std::shared_ptr<ReducerCalls> calls) {
  auto r = std::make_shared<comm::Reducer>();
  r->reduce = [calls](void* dst, const void* src, size_t count, DType dtype, comm::ReduceOp op) {
    ++calls->reduce;
    comm::reduce_into(dst, src, count, dtype, op);
  };
  r->scale = [calls](void* data, size_t count, DType dtype, double factor) {
    ++calls->scale;
    comm::scale(data, count, dtype, factor);
  };
  r->scratch = [calls](size_t bytes) {
    ++calls->scratch;
    return std::shared_ptr<void>(::operator new(bytes), [](void* p) { ::operator delete(p); });
  };
  return r;
}

}  // namespace

int run_equiv(const std::shared_ptr<comm::Communicator>& world, bool overlap, int64_t accum,
              size_t bucket_bytes, const std::string& path) {
  const int n = world->size(), rank = world->rank();
  auto model = make_mlp(uint64_t(rank) + 1);
  auto reference = make_mlp(1);  // rank 0's initialisation
  Timeline timeline(rank);
  DataParallelOptions options{.bucket_bytes = bucket_bytes,
                              .first_bucket_bytes = bucket_bytes,
                              .last_bucket_bytes = bucket_bytes,
                              .overlap = overlap,
                              .timeline = &timeline};
  if (path != "default") {
    options.shared_buckets = path == "in-place";
    options.allreduce.staged_bytes = 0;
  }
  DataParallel dp(model, world, options);
  // Shared buckets are memory of a region (external storage with an owner).
  for (const Bucket& b : dp.buckets()) {
    const bool shared = b.flat.impl()->storage->owner != nullptr;
    expect(shared == (n > 1 && path != "pipelined"),
           cat("bucket ", b.index, (shared ? " is" : " is not"), " in a shared region (", n,
               " ranks, path ", path, ")"));
  }
  for (const NamedTensor& p : model->named_parameters()) {
    Tensor ref = p.tensor;
    for (const NamedTensor& q : reference->named_parameters())
      if (q.name == p.name) ref = q.tensor;
    expect_close(cat("broadcast at start: ", p.name), p.tensor, ref);
  }

  // Buckets: reverse registration order, every parameter once, views into flat.
  std::vector<NamedTensor> params = model->named_parameters();
  size_t next = params.size();
  int64_t bucket_sum = 0;
  for (const Bucket& b : dp.buckets()) {
    for (size_t i = 0; i < b.params.size(); ++i) {
      --next;
      expect(b.params[i].name == params[next].name,
             cat("bucket ", b.index, " holds ", b.params[i].name, " where ", params[next].name,
                 " was expected"));
      expect(b.grads[i].data_ptr() == static_cast<char*>(b.flat.data_ptr()) + 4 * b.offsets[i],
             cat("bucket ", b.index, ": the gradient of ", b.params[i].name, " is not a view"));
      // Backward writes there itself (conv2d and linear in place, others by a copy).
      expect(
          b.params[i].tensor.grad_destination().data_ptr() == b.grads[i].data_ptr(),
          cat("bucket ", b.index, ": ", b.params[i].name, "'s grad destination is not its view"));
    }
    bucket_sum += b.numel();
  }
  expect(next == 0 && bucket_sum == model->num_parameters(),
         "the buckets do not cover every parameter exactly once");
  // The last bucket holds just the leading parameters up to last_bucket_bytes
  // (at least one), unless they are all of them.
  size_t lead = 0, lead_bytes = 0;
  while (lead < params.size() &&
         (lead == 0 || lead_bytes + params[lead].tensor.nbytes() <= bucket_bytes))
    lead_bytes += params[lead++].tensor.nbytes();
  if (lead < params.size())
    expect(dp.buckets().back().params.size() == lead,
           cat("the last bucket holds ", dp.buckets().back().params.size(), " parameters, not the ",
               lead, " leading ones within ", bucket_bytes, " bytes"));
  else
    expect(dp.buckets().size() == 1, "a model within one bucket is not split");

  const optim::SGDOptions sgd{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3};
  optim::SGD opt({{model->named_parameters()}}, sgd);
  optim::SGD ref_opt({{reference->named_parameters()}}, sgd);
  const int64_t steps = 4;
  for (int64_t step = 0; step < steps; ++step) {
    auto [x, y] = global_batch(step, n * kBatch * accum);
    for (int64_t m = 0; m < accum; ++m) {
      const int64_t first = (m * n + rank) * kBatch;
      Tensor xr = x.slice(0, first, first + kBatch).contiguous();
      Tensor yr = y.slice(0, first, first + kBatch).contiguous();
      DataParallel::NoSync no_sync = dp.no_sync(m + 1 < accum);
      (cross_entropy(dp(xr), yr) * (1.0 / double(accum))).backward();
    }
    dp.finish();
    for (const Bucket& b : dp.buckets())
      for (size_t i = 0; i < b.params.size(); ++i)
        expect(b.params[i].tensor.grad().data_ptr() == b.grads[i].data_ptr(),
               cat("step ", step, ": the gradient of ", b.params[i].name, " is not in its bucket"));
    if (overlap && dp.buckets().size() > 1)
      expect(dp.buckets_started_in_backward() == int(dp.buckets().size()),
             cat("step ", step, ": ", dp.buckets_started_in_backward(), " of ", dp.buckets().size(),
                 " buckets started during backward"));
    if (!overlap)
      expect(dp.buckets_started_in_backward() == 0, "overlap off but buckets started in backward");
    opt.step();
    // Both ways of clearing gradients: the bucket-preserving one and set_to_none.
    if (step % 2 == 0)
      dp.zero_grad();
    else
      opt.zero_grad();

    cross_entropy((*reference)(x), y).backward();
    ref_opt.step();
    ref_opt.zero_grad();
    for (size_t i = 0; i < params.size(); ++i)
      expect_close(cat("step ", step, ": ", params[i].name), params[i].tensor,
                   reference->named_parameters()[i].tensor);
  }
  int64_t comm_spans = 0;
  for (const TraceSpan& s : timeline.spans()) comm_spans += s.track == Track::comm;
  expect(comm_spans == steps * int64_t(dp.buckets().size()),
         cat(comm_spans, " allreduce spans for ", steps, " steps of ", dp.buckets().size(),
             " buckets (only the final micro-step may communicate)"));
  std::printf("rank %d: %d buckets, %d checks, %d failed\n", rank, int(dp.buckets().size()),
              g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}

int run_reducer(const std::shared_ptr<comm::Communicator>& world) {
  const int n = world->size(), rank = world->rank();
  for (DType dtype : {DType::f32, DType::f64, DType::bf16})
    for (comm::ReduceOp op : {comm::ReduceOp::sum, comm::ReduceOp::avg, comm::ReduceOp::max})
      for (int64_t count : {1, 7, 1000, 70000}) {
        std::string what = cat("reducer ", dtype, " ", comm::reduce_op_name(op), " x ", count);
        Generator gen(77, uint64_t(rank));
        Tensor x = normal({count}, 0.0, 1.0, gen).to(dtype);
        Tensor plain = x.clone(), hooked = x.clone();
        comm::allreduce(
            *world, plain.data_ptr(), size_t(count), dtype,
            {.op = op, .algorithm = comm::AllreduceAlgorithm::ring, .segment_bytes = 4096});
        auto calls = std::make_shared<ReducerCalls>();
        // `automatic` would pick shared memory; the reducer forces the ring.
        comm::allreduce(*world, hooked.data_ptr(), size_t(count), dtype,
                        {.op = op, .segment_bytes = 4096, .reducer = counting_reducer(calls)});
        ++g_checks;
        if (std::memcmp(plain.data_ptr(), hooked.data_ptr(), plain.nbytes()) != 0) {
          std::printf("rank %d: %s: mismatch with the plain ring\n", rank, what.c_str());
          ++g_failures;
        }
        if (n > 1) {
          // Every rank reduces n - 1 received chunks (empty ones are skipped).
          expect(count < n || calls->reduce >= n - 1,
                 cat(what, ": the reducer reduced ", int(calls->reduce), " segments"));
          expect(calls->scratch == 1, cat(what, ": ", int(calls->scratch), " scratch buffers"));
          expect(calls->scale == (op == comm::ReduceOp::avg ? 1 : 0),
                 cat(what, ": ", int(calls->scale), " scalings"));
        }
      }
  // DataParallel through direct_reduce against its default reduction.
  auto calls = std::make_shared<ReducerCalls>();
  int readies = 0;
  auto plain_model = make_mlp(1), direct_model = make_mlp(1);
  DataParallelOptions options;
  options.bucket_bytes = 1024;
  options.first_bucket_bytes = 256;
  DataParallel plain(plain_model, world, options);
  options.reduce = direct_reduce(counting_reducer(calls), [&](const Tensor&) { ++readies; });
  DataParallel direct(direct_model, world, options);
  for (int64_t step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step * n + rank, kBatch);
    cross_entropy(plain(x), y).backward();
    cross_entropy(direct(x), y).backward();
    plain.finish();
    direct.finish();
    std::vector<NamedTensor> a = direct_model->named_parameters(),
                             e = plain_model->named_parameters();
    for (size_t i = 0; i < a.size(); ++i)
      expect_close(cat("direct_reduce step ", step, ": gradient of ", a[i].name),
                   a[i].tensor.grad(), e[i].tensor.grad());
    plain.zero_grad();
    direct.zero_grad();
  }
  expect(readies == 3 * int(direct.buckets().size()),
         cat(readies, " ready calls for 3 steps of ", direct.buckets().size(), " buckets"));
  expect(n == 1 || calls->reduce > 0, "direct_reduce used the reducer");
  return testing::report_checks();
}

}  // namespace trainer::testing
