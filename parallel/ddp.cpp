#include "parallel/ddp.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "core/autograd.h"
#include "core/check.h"

namespace trainer::parallel {

// The step state the gradient hooks share with the wrapper. The hooks hold a
// weak_ptr, so a hook firing after the wrapper is gone does nothing.
struct DataParallel::Impl {
  std::shared_ptr<comm::Communicator> comm;
  DataParallelOptions options;
  BucketReduceFn reduce;
  std::vector<Bucket> buckets;

  // ---- per sync step (transient buckets: per backward) ----
  std::vector<std::vector<char>> arrived;  // [bucket][param]: gradient arrived
  std::vector<int> pending;                // gradients still to arrive per bucket
  int next_to_start = 0;                   // buckets start in index order
  // ---- per sync step ----
  std::vector<comm::Work> works;
  // The timeline's end-of-span tasks, queued after each reduction, and the
  // release of transient buckets: finish() waits for them too, so no span
  // is recorded after it returns.
  std::vector<comm::Work> markers;
  int started_in_backward = 0;
  int last_started_in_backward = 0;
  bool sync = true;

  void reset_backward() {
    for (size_t b = 0; b < buckets.size(); ++b) {
      std::fill(arrived[b].begin(), arrived[b].end(), 0);
      pending[b] = int(buckets[b].params.size());
    }
    next_to_start = 0;
  }
  void reset_step() {
    reset_backward();
    works.clear();
    markers.clear();
    started_in_backward = 0;
  }
  bool synchronises() const { return sync || options.transient_buckets; }

  // A transient bucket's flat buffer, padded: the gradients copied in (zeros
  // where none arrived; converted where the buffer's dtype differs, as a
  // bf16 reduction's) and dropped from their parameters.
  void pack_transient(Bucket& bucket) {
    int64_t numel = 0;
    for (const NamedTensor& p : bucket.params) numel += p.tensor.numel();
    const int64_t multiple = std::max<int64_t>(options.bucket_numel_multiple, 1);
    const int64_t padded = (numel + multiple - 1) / multiple * multiple;
    const Tensor& first = bucket.params.front().tensor;
    bucket.flat = options.transient_buffer ? options.transient_buffer(padded, first.dtype())
                                           : empty({padded}, first.dtype(), first.device());
    const size_t item = dtype_size(bucket.flat.dtype());
    char* base = static_cast<char*>(bucket.flat.data_ptr());
    for (size_t i = 0; i < bucket.params.size(); ++i) {
      const Tensor& param = bucket.params[i].tensor;
      char* dst = base + size_t(bucket.offsets[i]) * item;
      Tensor g = param.grad();
      if (g.defined() && g.is_contiguous() && g.device().is_cpu() &&
          g.dtype() == bucket.flat.dtype())
        std::memcpy(dst, g.data_ptr(), g.nbytes());
      else if (g.defined())
        make_view(bucket.flat, param.shape(), contiguous_strides(param.shape()), bucket.offsets[i])
            .copy_(g);
      else
        std::memset(dst, 0, size_t(param.numel()) * item);
      param.set_grad(Tensor());
    }
    std::memset(base + size_t(numel) * item, 0, size_t(padded - numel) * item);
  }

  // Makes params[i]'s gradient the bucket view, copying a gradient that
  // lies elsewhere (accumulated before wrapping, or set by hand). Backward
  // puts gradients there itself (the views are the grad destinations).
  void adopt_grad(Bucket& bucket, size_t i, bool zero_if_missing) {
    const Tensor& param = bucket.params[i].tensor;
    Tensor view = bucket.grads[i];  // a handle: the in-place fill writes the bucket
    Tensor g = param.grad();
    if (g.defined() && g.data_ptr() == view.data_ptr()) return;
    if (g.defined())
      view.copy_(g);
    else if (zero_if_missing)
      view.zero_();
    else
      return;
    param.set_grad(view);
  }

  void start(int b) {
    Bucket& bucket = buckets[size_t(b)];
    if (options.transient_buckets) pack_transient(bucket);
    Timeline* timeline = options.timeline;
    auto begin_us = std::make_shared<int64_t>(0);
    if (timeline) comm->enqueue([begin_us] { *begin_us = trace_now_us(); });
    works.push_back(reduce(*comm, bucket));
    if (timeline) {
      markers.push_back(comm->enqueue([timeline, begin_us, b, bytes = bucket.flat.nbytes()] {
        timeline->add(cat("allreduce bucket ", b, " (", (bytes + 1023) / 1024, " KiB)"),
                      Track::comm, *begin_us, trace_now_us());
      }));
    }
    if (options.transient_buckets) {
      // Freed on the progress thread once the reduction has read it (the
      // reduction may run on another communicator's thread: hybrid sharding).
      markers.push_back(comm->enqueue(
          [flat = std::exchange(bucket.flat, Tensor()), reduced = works.back()]() mutable {
            try {
              reduced.wait();
            } catch (...) {  // finish() reports it, from the reduction's Work
            }
            flat = Tensor();
          }));
      if (options.on_bucket_started) options.on_bucket_started(b);
    }
  }

  // Starts the ready buckets that are next in order.
  void start_ready() {
    while (next_to_start < int(buckets.size()) && pending[size_t(next_to_start)] == 0) {
      start(next_to_start++);
      ++started_in_backward;
    }
  }

  void on_grad_ready(int b, size_t i) {
    Bucket& bucket = buckets[size_t(b)];
    if (!options.transient_buckets) adopt_grad(bucket, i, /*zero_if_missing=*/false);
    if (!synchronises()) return;
    CHECK(!arrived[size_t(b)][i])
        << "the gradient of " << bucket.params[i].name
        << " arrived twice in one synchronised step: call finish() after each backward, or "
           "use no_sync() for the micro-steps of gradient accumulation";
    arrived[size_t(b)][i] = 1;
    --pending[size_t(b)];
    if (options.overlap) start_ready();
  }
};

namespace {

// The flat buffer of each bucket: slices of one shared region when the
// options and the communicator allow, else zeros on the parameters' device
// (backward writes the gradients there; a GPU's buckets are staged through
// host memory by the reduce hook).
std::vector<Tensor> allocate_flats(comm::Communicator& comm, const DataParallelOptions& options,
                                   const std::vector<std::vector<NamedTensor>>& groups) {
  std::vector<std::pair<int64_t, DType>> sizes;
  bool all_cpu = true;
  const int64_t multiple =
      options.reduce_in_place ? std::max<int64_t>(options.bucket_numel_multiple, 1) : 1;
  for (const auto& group : groups) {
    int64_t numel = 0;
    for (const NamedTensor& p : group) numel += p.tensor.numel();
    sizes.emplace_back((numel + multiple - 1) / multiple * multiple, group.front().tensor.dtype());
    all_cpu = all_cpu && group.front().tensor.device().is_cpu();
  }
  if (options.shared_buckets && (!options.reduce || options.reduce_in_place) && all_cpu)
    if (std::vector<Tensor> flats = shared_flat_buffers(comm, sizes); !flats.empty()) return flats;
  std::vector<Tensor> flats;
  for (size_t b = 0; b < groups.size(); ++b)
    flats.push_back(zeros({sizes[b].first}, sizes[b].second, groups[b].front().tensor.device()));
  return flats;
}

// One group per unit, the last unit first, each in reverse registration
// order, and after it one per own_bucket parameter of the unit; every
// parameter in exactly one unit.
std::vector<std::vector<NamedTensor>> unit_groups(const std::vector<NamedTensor>& params,
                                                  const DataParallelOptions& options) {
  std::map<const TensorImpl*, size_t> unit_of;
  for (size_t u = 0; u < options.units.size(); ++u)
    for (const Tensor& t : options.units[u])
      CHECK(unit_of.emplace(t.impl(), u).second) << "DataParallel: a parameter in two units";
  // Per unit, the last first: its parameters, then each of its own_bucket ones alone.
  std::vector<std::vector<std::vector<NamedTensor>>> per_unit(options.units.size());
  for (auto& unit : per_unit) unit.resize(1);
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    auto u = unit_of.find(it->tensor.impl());
    CHECK(u != unit_of.end()) << "DataParallel: parameter " << it->name << " is in no unit";
    auto& unit = per_unit[options.units.size() - 1 - u->second];
    const bool alone = std::any_of(options.own_bucket.begin(), options.own_bucket.end(),
                                   [&](const Tensor& q) { return q.impl() == it->tensor.impl(); });
    if (alone)
      unit.push_back({*it});
    else
      unit.front().push_back(*it);
  }
  std::vector<std::vector<NamedTensor>> groups;
  for (auto& unit : per_unit)
    for (auto& g : unit)
      if (!g.empty()) groups.push_back(std::move(g));
  return groups;
}

bool excluded(const DataParallelOptions& options, const Tensor& t) {
  return std::any_of(options.exclude.begin(), options.exclude.end(),
                     [&](const Tensor& q) { return q.impl() == t.impl(); });
}

// Reverse registration order, a bucket closing once it holds its cap (the
// first one smaller), before a parameter of another dtype, or where the
// last bucket (the leading parameters up to last_bucket_bytes) begins.
std::vector<Bucket> make_buckets(const Module& module, comm::Communicator& comm,
                                 const DataParallelOptions& options) {
  std::vector<NamedTensor> params;
  for (const NamedTensor& p : module.named_parameters()) {
    if (!p.tensor.requires_grad() || excluded(options, p.tensor)) continue;
    CHECK(p.tensor.is_contiguous())
        << "DataParallel reduces contiguous parameters; " << p.name << " is " << p.tensor.str();
    // Device buckets need a reduce hook that moves them (parallel/device_staging.h,
    // parallel/zero.h): the default one hands their pointers to the host collectives.
    CHECK(p.tensor.device().is_cpu() || options.reduce)
        << "DataParallel: " << p.name << " is on " << p.tensor.device()
        << "; gradients off the CPU need DataParallelOptions::reduce (staged_reduce)";
    params.push_back(p);
  }
  // params[0, tail) form the last bucket, if that leaves some for the others.
  size_t tail = 0, tail_bytes = 0;
  while (tail < params.size() &&
         (tail == 0 || tail_bytes + params[tail].tensor.nbytes() <= options.last_bucket_bytes))
    tail_bytes += params[tail++].tensor.nbytes();
  if (options.last_bucket_bytes == 0 || tail == params.size()) tail = 0;
  auto alone = [&](const Tensor& p) {
    return std::any_of(options.own_bucket.begin(), options.own_bucket.end(),
                       [&](const Tensor& q) { return q.impl() == p.impl(); });
  };
  std::vector<std::vector<NamedTensor>> groups = options.units.empty()
                                                     ? std::vector<std::vector<NamedTensor>>()
                                                     : unit_groups(params, options);
  size_t bytes = 0;
  for (auto it = params.rbegin(); options.units.empty() && it != params.rend(); ++it) {
    const size_t cap = groups.size() <= 1 ? options.first_bucket_bytes : options.bucket_bytes;
    const bool new_dtype =
        !groups.empty() && groups.back().back().tensor.dtype() != it->tensor.dtype();
    const bool tail_starts = size_t(params.rend() - it) == tail;
    const bool after_alone = !groups.empty() && alone(groups.back().back().tensor);
    if (groups.empty() || bytes >= cap || new_dtype || tail_starts || after_alone ||
        alone(it->tensor)) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(*it);
    bytes += it->tensor.nbytes();
  }
  std::vector<Tensor> flats = options.transient_buckets ? std::vector<Tensor>(groups.size())
                                                        : allocate_flats(comm, options, groups);
  std::vector<Bucket> buckets;
  for (auto& group : groups) {
    Bucket bucket;
    bucket.index = int(buckets.size());
    int64_t numel = 0;
    for (const NamedTensor& p : group) {
      bucket.offsets.push_back(numel);
      numel += p.tensor.numel();
    }
    bucket.flat = flats[size_t(bucket.index)];
    for (size_t i = 0; bucket.flat.defined() && i < group.size(); ++i) {
      const Shape& shape = group[i].tensor.shape();
      bucket.grads.push_back(
          make_view(bucket.flat, shape, contiguous_strides(shape), bucket.offsets[i]));
    }
    bucket.params = std::move(group);
    buckets.push_back(std::move(bucket));
  }
  return buckets;
}

// Copies root's tensors to every rank in one message, after checking that
// the ranks agree on the layout (a different model would scramble it).
// Device tensors travel through host copies.
void broadcast_tensors(comm::Communicator& comm, const std::vector<NamedTensor>& tensors,
                       int root) {
  uint64_t layout[2] = {tensors.size(), 0};
  for (const NamedTensor& t : tensors) {
    CHECK(t.tensor.is_contiguous())
        << "DataParallel broadcasts contiguous state; " << t.name << " is " << t.tensor.str();
    layout[1] += t.tensor.nbytes();
  }
  uint64_t root_layout[2] = {layout[0], layout[1]};
  comm::broadcast(comm, root_layout, sizeof(root_layout), root);
  if (root_layout[0] != layout[0] || root_layout[1] != layout[1]) {
    throw Error(cat("data parallel: rank ", comm.rank(), "'s model has ", layout[0], " tensors of ",
                    layout[1], " bytes, rank ", root, "'s has ", root_layout[0], " of ",
                    root_layout[1], "; every rank must build the same model"));
  }
  std::vector<char> packed(layout[1]);
  size_t offset = 0;
  for (const NamedTensor& t : tensors) {
    const Tensor host = t.tensor.device().is_cpu() ? t.tensor : t.tensor.to(Device{});
    std::memcpy(packed.data() + offset, host.data_ptr(), host.nbytes());
    offset += host.nbytes();
  }
  comm::broadcast(comm, packed.data(), packed.size(), root);
  offset = 0;
  for (const NamedTensor& t : tensors) {
    if (t.tensor.device().is_cpu()) {
      std::memcpy(t.tensor.data_ptr(), packed.data() + offset, t.tensor.nbytes());
    } else {
      Tensor host = empty(t.tensor.shape(), t.tensor.dtype());
      std::memcpy(host.data_ptr(), packed.data() + offset, host.nbytes());
      Tensor dst = t.tensor;  // a handle on the module's tensor
      dst.copy_(host);
    }
    offset += t.tensor.nbytes();
  }
}

}  // namespace

std::vector<Tensor> shared_flat_buffers(comm::Communicator& comm,
                                        const std::vector<std::pair<int64_t, DType>>& sizes,
                                        size_t align) {
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const auto& [numel, dtype] : sizes) {
    offsets.push_back(total);
    total += (size_t(numel) * dtype_size(dtype) + align - 1) / align * align;
  }
  std::shared_ptr<comm::ShmRegion> region =
      comm.size() > 1 && total > 0 ? comm.share_memory(total) : nullptr;  // zero-filled
  std::vector<Tensor> flats;
  for (size_t b = 0; region && b < sizes.size(); ++b)
    flats.push_back(from_external(region->local() + offsets[b], {sizes[b].first}, sizes[b].second,
                                  Device{}, region));
  return flats;
}

DataParallel::DataParallel(std::shared_ptr<Module> module, std::shared_ptr<comm::Communicator> comm,
                           DataParallelOptions options)
    : module_(std::move(module)), comm_(std::move(comm)), options_(std::move(options)) {
  CHECK(module_ && comm_) << "DataParallel needs a module and a communicator";
  CHECK(options_.bucket_bytes > 0 && options_.first_bucket_bytes > 0)
      << "bucket sizes must be positive";
  if (options_.broadcast_at_start) broadcast_state(0);
  if (options_.low_priority_progress) {
    // Runs on the progress thread, so it sets that thread's priority. Failing
    // to (a restricted container) only costs speed.
    comm_->enqueue([] { ::setpriority(PRIO_PROCESS, ::gettid(), 19); }).wait();
  }

  impl_ = std::make_shared<Impl>();
  impl_->comm = comm_;
  impl_->options = options_;
  impl_->reduce = options_.reduce;
  if (!impl_->reduce) {
    comm::AllreduceOptions allreduce = options_.allreduce;
    allreduce.op = comm::ReduceOp::avg;
    impl_->reduce = [allreduce](comm::Communicator& c, const Bucket& bucket) {
      return comm::allreduce_async(c, bucket.flat, allreduce);
    };
  }
  impl_->buckets = make_buckets(*module_, *comm_, options_);
  const size_t n = impl_->buckets.size();
  impl_->arrived.resize(n);
  impl_->pending.resize(n);
  impl_->works.resize(n);
  impl_->markers.resize(n);
  for (size_t b = 0; b < n; ++b) {
    Bucket& bucket = impl_->buckets[b];
    impl_->arrived[b].resize(bucket.params.size());
    for (size_t i = 0; i < bucket.params.size(); ++i) {
      // Gradients accumulated before wrapping carry over into the buckets.
      if (!options_.transient_buckets) {
        impl_->adopt_grad(bucket, i, /*zero_if_missing=*/false);
        bucket.params[i].tensor.set_grad_destination(bucket.grads[i]);
      }
      std::weak_ptr<Impl> weak = impl_;
      bucket.params[i].tensor.register_hook([weak, b, i](const Tensor&) {
        if (std::shared_ptr<Impl> impl = weak.lock()) impl->on_grad_ready(int(b), i);
      });
    }
  }
  impl_->reset_step();
}

DataParallel::~DataParallel() {
  for (Bucket& bucket : impl_->buckets)
    for (const NamedTensor& p : bucket.params) p.tensor.set_grad_destination(Tensor());
  // Outstanding reductions write into the buckets (and spans into the
  // timeline): let them finish first.
  for (const auto* list : {&impl_->works, &impl_->markers}) {
    for (const comm::Work& w : *list) {
      try {
        w.wait();
      } catch (const std::exception&) {  // the error was reported by finish() or is moot now
      }
    }
  }
}

const std::vector<Bucket>& DataParallel::buckets() const { return impl_->buckets; }

void DataParallel::broadcast_state(int root) {
  std::vector<NamedTensor> state = module_->state();
  std::erase_if(state, [&](const NamedTensor& t) { return excluded(options_, t.tensor); });
  broadcast_tensors(*comm_, state, root);
}

void DataParallel::broadcast_buffers(int root) {
  std::vector<NamedTensor> buffers = module_->named_buffers();
  if (!buffers.empty()) broadcast_tensors(*comm_, buffers, root);
}

void DataParallel::set_sync(bool sync) { impl_->sync = sync; }
bool DataParallel::sync() const { return impl_->sync; }

DataParallel::NoSync::NoSync(DataParallel* dp, bool active) : dp_(active ? dp : nullptr) {
  if (dp_) {
    previous_ = dp_->sync();
    dp_->set_sync(false);
  }
}

DataParallel::NoSync::~NoSync() {
  if (dp_) dp_->set_sync(previous_);
}

DataParallel::NoSync::NoSync(NoSync&& other) noexcept
    : dp_(std::exchange(other.dp_, nullptr)), previous_(other.previous_) {}

void DataParallel::end_backward() {
  Impl& s = *impl_;
  if (!options_.transient_buckets) return;
  // A bucket none of whose gradients arrived in this backward (all zeros)
  // still starts: every rank issues the same reductions.
  while (s.next_to_start < int(s.buckets.size())) s.start(s.next_to_start++);
  s.reset_backward();
}

void DataParallel::finish() {
  Impl& s = *impl_;
  if (!s.synchronises()) return;
  TraceScope scope(options_.timeline, "dp finish");
  // Parameters whose hook did not fire this step contribute what their view
  // holds (gradients of NoSync micro-steps, or zeros).
  for (size_t b = 0; !options_.transient_buckets && b < s.buckets.size(); ++b) {
    for (size_t i = 0; i < s.buckets[b].params.size(); ++i)
      if (!s.arrived[b][i]) s.adopt_grad(s.buckets[b], i, /*zero_if_missing=*/true);
  }
  const int in_backward = s.started_in_backward;
  // Transient buckets: only a backward that ran since the last end_backward() starts some.
  if (options_.transient_buckets) {
    bool began = false;
    for (size_t b = 0; b < s.buckets.size(); ++b)
      began = began || s.pending[b] != int(s.buckets[b].params.size());
    if (began || s.works.empty()) end_backward();
  } else {
    while (s.next_to_start < int(s.buckets.size())) s.start(s.next_to_start++);
  }
  std::exception_ptr error;
  for (const auto* list : {&s.works, &s.markers}) {
    for (const comm::Work& w : *list) {
      try {
        w.wait();
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
  }
  s.reset_step();
  s.last_started_in_backward = in_backward;
  if (error) std::rethrow_exception(error);
}

void DataParallel::zero_grad() {
  for (Bucket& bucket : impl_->buckets)
    for (const NamedTensor& p : bucket.params) p.tensor.set_grad(Tensor());
}

int DataParallel::buckets_started_in_backward() const { return impl_->last_started_in_backward; }

}  // namespace trainer::parallel
