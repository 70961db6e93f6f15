#include "parallel/tensor_parallel.h"

#include "comm/collectives.h"
#include "comm/shm_region.h"
#include "core/autograd.h"
#include "core/ops.h"

namespace trainer::parallel {

CommGroup::CommGroup(std::shared_ptr<comm::Communicator> comm, bool sequence_parallel)
    : comm_(std::move(comm)), sequence_parallel_(sequence_parallel) {
  CHECK(comm_) << "a tensor-parallel group needs a communicator";
}

namespace {

// Buffers below this go through the channel's staging areas: its small
// allreduce is one copy in and out, as cheap as the in-place one.
constexpr size_t kInPlaceMinBytes = 64 << 10;

// The first region: enough for GPT-small activations (8 x 256 x 768 f32).
constexpr size_t kFirstRegionBytes = 8 << 20;

// A CPU tensor of shape and dtype over the bytes at data (not owned).
Tensor over(char* data, const Shape& shape, DType dtype) {
  return from_external(data, shape, dtype, Device{}, nullptr);
}

}  // namespace

char* CommGroup::scratch(size_t bytes) {
  if (no_region_ || bytes < kInPlaceMinBytes) return nullptr;
  if (region_ && region_->bytes() >= bytes) return region_->local();
  // Every rank asks for the same bytes here, so they create the region together.
  size_t want = region_ ? 2 * region_->bytes() : kFirstRegionBytes;
  while (want < bytes) want *= 2;
  region_.reset();
  region_ = comm_->share_memory(want);
  no_region_ = region_ == nullptr;
  return region_ ? region_->local() : nullptr;
}

// Device tensors (CUDA) go through host memory, as DataParallel stages its
// buckets: the collectives run on the host copies.

void CommGroup::allreduce(const Tensor& t, bool max) {
  CHECK(t.is_contiguous()) << "tensor-parallel allreduce of a non-contiguous tensor";
  if (!t.device().is_cpu()) {
    const Tensor host = t.to(Device{});
    allreduce(host, max);
    Tensor(t).copy_(host);  // the same storage: t's handle is const, its values are not
    return;
  }
  traffic_.allreduce_bytes += int64_t(t.nbytes());
  ++traffic_.calls;
  comm::allreduce(*comm_, t, {.op = max ? comm::ReduceOp::max : comm::ReduceOp::sum});
}

Tensor CommGroup::sum(const Tensor& x) {
  if (!x.device().is_cpu()) return sum(x.to(Device{})).to(x.device());
  char* s = scratch(size_t(x.nbytes()));
  if (!s) return TensorParallelGroup::sum(x);
  traffic_.allreduce_bytes += int64_t(x.nbytes());
  ++traffic_.calls;
  // x copied into the region (where a plain sum clones it), reduced there
  // in place, and copied out: no staging copies through the channel.
  Tensor in_region = over(s, x.shape(), x.dtype());
  in_region.copy_(x);
  comm::allreduce(*comm_, s, size_t(x.numel()), x.dtype(), {.op = comm::ReduceOp::sum});
  return in_region.clone();
}

Tensor CommGroup::allgather(const Tensor& t) {
  if (!t.device().is_cpu()) return allgather(t.to(Device{})).to(t.device());
  traffic_.allgather_bytes += int64_t(t.nbytes()) * size() / 2;
  ++traffic_.calls;
  const size_t bytes = size_t(t.nbytes());
  char* s = scratch(bytes * size_t(size()));
  if (!s) return comm::allgather(*comm_, t.contiguous());
  // The output in the region: each rank writes its block into every rank's.
  const Tensor in = t.contiguous();
  Shape shape = t.shape();
  shape[0] *= size();
  comm::allgather(*comm_, in.data_ptr(), s, bytes, {.shared_region = true});
  return over(s, shape, t.dtype()).clone();
}

Tensor CommGroup::reduce_scatter(const Tensor& t) {
  if (!t.device().is_cpu()) return reduce_scatter(t.to(Device{})).to(t.device());
  traffic_.reduce_scatter_bytes += int64_t(t.nbytes()) / 2;
  ++traffic_.calls;
  char* s = scratch(size_t(t.nbytes()));
  if (!s) return comm::reduce_scatter(*comm_, t.contiguous());
  // The input in the region: each rank folds its block from every rank's.
  CHECK(t.size(0) % size() == 0) << "reduce-scatter of " << t.shape_str() << " over " << size()
                                 << " ranks";
  over(s, t.shape(), t.dtype()).copy_(t);
  Shape shape = t.shape();
  shape[0] /= size();
  Tensor out = empty(shape, t.dtype());
  comm::reduce_scatter(*comm_, s, out.data_ptr(), size_t(out.numel()), t.dtype(),
                       {.shared_region = true});
  return out;
}

std::shared_ptr<CommGroup> make_comm_group(std::shared_ptr<comm::Communicator> comm,
                                           bool sequence_parallel) {
  return std::make_shared<CommGroup>(std::move(comm), sequence_parallel);
}

namespace {

class ShapeOnlyGroup final : public TensorParallelGroup {
 public:
  ShapeOnlyGroup(int rank, int size, bool sp) : rank_(rank), size_(size), sp_(sp) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool sequence_parallel() const override { return sp_; }
  void allreduce(const Tensor&, bool) override {}
  Tensor allgather(const Tensor& t) override {
    return concat(TensorList(size_t(size_), t.contiguous()), 0);
  }
  Tensor reduce_scatter(const Tensor& t) override {
    return t.narrow(0, 0, t.size(0) / size_).contiguous();
  }

 private:
  int rank_, size_;
  bool sp_;
};

}  // namespace

std::shared_ptr<TensorParallelGroup> shape_only_group(int rank, int size, bool sequence_parallel) {
  return std::make_shared<ShapeOnlyGroup>(rank, size, sequence_parallel);
}

TensorList parameters_split_as(const Module& model, ParameterSplit::Kind kind) {
  const std::map<std::string, ParameterSplit> splits = model.parameter_splits();
  TensorList out;
  for (const NamedTensor& p : model.named_parameters()) {
    auto it = splits.find(p.name);
    if (it != splits.end() && it->second.kind == kind) out.push_back(p.tensor);
  }
  return out;
}

void sum_partial_gradients(const TensorList& params, TensorParallelGroup& g) {
  for (const Tensor& p : params) {
    Tensor grad = p.grad();
    if (!grad.defined()) {
      p.set_grad(zeros_like(p));
      grad = p.grad();
    }
    // In place when the gradient is a bucket view of DataParallel's.
    Tensor sum = grad.is_contiguous() ? grad : grad.contiguous();
    g.allreduce(sum);
    if (sum.impl() != grad.impl()) {
      autograd::NoGradGuard no_grad;
      grad.copy_(sum);
    }
  }
}

namespace {

std::map<std::string, Shape> parameter_shapes(const Module& model) {
  std::map<std::string, Shape> shapes;
  for (const NamedTensor& t : model.state()) shapes.emplace(t.name, t.tensor.shape());
  return shapes;
}

}  // namespace

const ParameterSplit* split_of(const std::map<std::string, ParameterSplit>& splits,
                               const std::map<std::string, Shape>& shapes, const std::string& name,
                               const Shape& shape) {
  auto it = splits.find(name);
  if (it == splits.end()) {
    // An optimizer slot: "<parameter>.<slot>" of the parameter's shape.
    const size_t dot = name.rfind('.');
    if (dot == std::string::npos) return nullptr;
    it = splits.find(name.substr(0, dot));
    if (it == splits.end()) return nullptr;
    auto s = shapes.find(it->first);
    if (s == shapes.end() || s->second != shape) return nullptr;
  }
  return it->second.kind == ParameterSplit::Kind::sharded ? &it->second : nullptr;
}

std::vector<NamedTensor> gather_whole(const std::vector<NamedTensor>& named, const Module& model,
                                      TensorParallelGroup& g) {
  const std::map<std::string, ParameterSplit> splits = model.parameter_splits();
  const std::map<std::string, Shape> shapes = parameter_shapes(model);
  std::vector<NamedTensor> out;
  for (const NamedTensor& t : named) {
    const ParameterSplit* split = split_of(splits, shapes, t.name, t.tensor.shape());
    if (!split) {
      out.push_back(t);
      continue;
    }
    // Each rank's part as one row: [n, numel], then back to its shape.
    Tensor mine = t.tensor.to(Device{}).contiguous().reshape({1, t.tensor.numel()});
    Tensor rows = g.allgather(mine);
    TensorList parts;
    for (int r = 0; r < g.size(); ++r) parts.push_back(rows.select(0, r).reshape(t.tensor.shape()));
    out.push_back({t.name, unshard(parts, *split)});
  }
  return out;
}

void take_shards(std::map<std::string, Tensor>& tensors, const Module& model) {
  const std::map<std::string, ParameterSplit> splits = model.parameter_splits();
  const std::map<std::string, Shape> shapes = parameter_shapes(model);
  for (auto& [name, t] : tensors) {
    // Whole in the file: it has the shape of the parameter's whole tensor.
    auto it = splits.find(name);
    std::string param = name;
    if (it == splits.end()) {
      const size_t dot = name.rfind('.');
      if (dot == std::string::npos) continue;
      param = name.substr(0, dot);
      it = splits.find(param);
      if (it == splits.end()) continue;
    }
    if (it->second.kind != ParameterSplit::Kind::sharded) continue;
    auto s = shapes.find(param);
    if (s == shapes.end() || t.shape() != full_shape(s->second, it->second)) continue;
    t = shard_of(t, it->second);
  }
}

}  // namespace trainer::parallel
