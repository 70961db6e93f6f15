#include "parallel/zero.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "comm/shm_region.h"
#include "comm/traffic.h"
#include "core/autograd.h"
#include "core/ops.h"

namespace trainer::parallel {

// One parameter's part of this rank's block of a segment.
struct ZeroOptimizer::Piece {
  int segment = 0;
  int param = 0;  // index in the segment
  int group = 0;
  int64_t begin = 0, end = 0;  // elements of the flattened parameter
  int64_t shard_offset = 0;    // element offset in the rank's block
  Tensor value;      // [end - begin] view of the master block: the wrapped optimizer's parameter
  Tensor grad;       // [end - begin] view of the reduced gradient block (the optimizer's)
  Tensor host_grad;  // the same elements in the host buffer `flat` (== grad unless staged)
};

// Per segment: the flat buffer [world_size * shard_numel] that the gradients
// are reduce-scattered in and the parameters all-gathered in, and this
// rank's block of the parameters [shard_numel] that the optimizer updates.
struct ZeroOptimizer::SegmentBuffers {
  Tensor flat;    // host
  Tensor master;  // on the parameters' device
  Tensor grad;    // staged: this rank's reduced block [shard_numel] on the parameters' device
  bool reduced = false;        // its gradients were reduced this step
  bool accumulated = false;    // stages 2, 3: flat holds this step's reduced gradients
  bool stepped = false;        // some parameter of it had a gradient this step
  std::vector<bool> has_grad;  // per parameter, this step
};

namespace {

char* bytes_at(const Tensor& t, int64_t element) {
  return static_cast<char*>(t.data_ptr()) + element * int64_t(dtype_size(t.dtype()));
}

size_t byte_count(DType dtype, int64_t elements) { return size_t(elements) * dtype_size(dtype); }

template <class T>
void add_into(T* acc, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}

template <class T>
double sum_of_squares(const T* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * double(x[i]);
  return s;
}

// HSDP: this rank's reduced block averaged over the replica groups as well.
void average_over_replicas(const std::shared_ptr<comm::Communicator>& replicate, void* block,
                           int64_t n, DType dtype, comm::Millis timeout) {
  if (replicate && replicate->size() > 1)
    comm::allreduce(*replicate, block, size_t(n), dtype,
                    {.op = comm::ReduceOp::avg, .timeout = timeout});
}

std::string numels_str(const std::vector<int64_t>& v, size_t from) {
  std::string out = "[";
  for (size_t i = from; i < v.size(); ++i) out += cat(i > from ? ", " : "", v[i]);
  return out + "]";
}

}  // namespace

std::pair<int64_t, int64_t> ZeroSegment::shard_range(int rank) const {
  int64_t first = std::min(numel, int64_t(rank) * shard_numel);
  return {first, std::min(numel, first + shard_numel)};
}

int64_t gather_in_place_align(DType dtype) {
  return int64_t(comm::ShmRegion::page_size() / dtype_size(dtype));
}

std::vector<ZeroSegment> zero_segments(
    const std::vector<std::vector<NamedTensor>>& params_per_segment, int world_size,
    int64_t align) {
  CHECK(world_size >= 1 && align >= 1)
      << "zero_segments: world size " << world_size << ", align " << align;
  std::vector<ZeroSegment> out;
  for (const std::vector<NamedTensor>& params : params_per_segment) {
    if (params.empty()) continue;
    ZeroSegment s;
    s.params = params;
    for (const NamedTensor& p : params) {
      s.offsets.push_back(s.numel);
      s.numel += p.tensor.numel();
    }
    s.shard_numel = (s.numel + world_size - 1) / world_size;
    s.shard_numel = (s.shard_numel + align - 1) / align * align;
    out.push_back(std::move(s));
  }
  return out;
}

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<comm::Communicator> comm,
                             std::vector<optim::ParamGroup> groups,
                             const OptimizerFactory& make_optimizer, const ZeroOptions& options)
    : comm_(std::move(comm)), groups_(std::move(groups)), options_(options) {
  CHECK(comm_) << "ZeroOptimizer needs a communicator";
  bool first = true;
  std::vector<NamedTensor> all;
  for (const optim::ParamGroup& g : groups_)
    for (const NamedTensor& p : g.params) {
      if (!p.tensor.defined()) throw Error(cat("ZeRO-1: parameter '", p.name, "' is undefined"));
      if (first) dtype_ = p.tensor.dtype();
      first = false;
      if (p.tensor.dtype() != dtype_)
        throw Error(cat("ZeRO-1: parameter '", p.name, "' is ", p.tensor.dtype(), " but '",
                        all.front().name, "' is ", dtype_, "; the sharded buffers hold one dtype"));
      if (!p.tensor.is_contiguous())
        throw Error(cat("ZeRO-1: parameter '", p.name, "' must be a contiguous tensor"));
      if (all.empty()) device_ = p.tensor.device();
      if (p.tensor.device() != device_)
        throw Error(cat("ZeRO-1: parameter '", p.name, "' is on ", p.tensor.device(), " but '",
                        all.front().name, "' is on ", device_,
                        "; the sharded buffers live on one device"));
      all.push_back(p);
    }
  if (options_.buckets) {
    std::vector<std::vector<NamedTensor>> lists;
    for (const Bucket& b : *options_.buckets) lists.push_back(b.params);
    if (options_.gather_in_place && options_.stage == 3)
      block_align_ = gather_in_place_align(dtype_);
    segments_ = zero_segments(lists, world_size(), block_align_);
    CHECK_EQ(segments_.size(), options_.buckets->size()) << "ZeRO-1: an empty bucket";
    // A parameter the module names otherwise (a tied weight's second name)
    // goes by the optimizer's name, in the pieces and the saved state.
    std::map<const TensorImpl*, std::string> name_of;
    for (const NamedTensor& p : all) name_of.emplace(p.tensor.impl(), p.name);
    for (ZeroSegment& seg : segments_)
      for (NamedTensor& p : seg.params)
        if (auto it = name_of.find(p.tensor.impl()); it != name_of.end()) p.name = it->second;
  } else {
    segments_ = zero_segments({all}, world_size());
  }
  for (const Tensor& t : options_.norm_skips) norm_skips_.insert(t.impl());
  staged_ = !device_.is_cpu() || options_.stage_through_host;
  CHECK(options_.stage >= 1 && options_.stage <= 3) << "ZeRO stage " << options_.stage;
  if (options_.stage > 1 && (staged_ || !options_.buckets))
    throw Error(cat("ZeRO-", options_.stage,
                    ": sharded gradients and parameters need DataParallel's buckets and "
                    "parameters on the CPU (these are on ",
                    device_, "); use parallel.shard=optimizer"));
  gather_dtype_ = options_.param_dtype.value_or(dtype_);
  reduce_dtype_ = options_.reduce_dtype.value_or(dtype_);
  if (gather_dtype_ != dtype_ && options_.stage != 3)
    throw Error(cat("ZeRO-", options_.stage, ": parameters gathered in ", gather_dtype_,
                    " need sharded parameters (stage 3); the others keep them whole in ", dtype_));
  if (reduce_dtype_ != dtype_ && options_.stage < 2)
    throw Error(cat("ZeRO-1: gradients reduced in ", reduce_dtype_,
                    " need sharded gradients (stage 2 or 3); ZeRO-1 reduces them in ", dtype_));
  for (DType d : {gather_dtype_, reduce_dtype_})
    if (!is_floating(d)) throw Error(cat("ZeRO-", options_.stage, ": ", d, " is not floating"));
  allocate_buffers();
  build_pieces(make_optimizer);
}

void ZeroOptimizer::allocate_buffers() {
  // Unstaged segments in one shared region when the ranks share a host (the
  // collectives then run in place); else ordinary memory and the ring.
  // Stage 1 shares the flat buffers (reduce-scattered and all-gathered in
  // place); stages 2 and 3 the blocks of parameters, which the gathers read
  // where they lie.
  // Shared, in order: the segments' buffers, the two slots of transient
  // buckets, and the gather slots (stage 3 gathering in a narrower dtype).
  std::vector<Tensor> shared;
  const bool own_buffers = !(options_.reduce_in_buckets && options_.stage == 1);
  const bool rounded = options_.stage == 3 && gather_dtype_ != dtype_;
  int64_t largest = 0, largest_shard = 0;
  for (const ZeroSegment& seg : segments_) {
    largest = std::max(largest, seg.shard_numel * world_size());
    largest_shard = std::max(largest_shard, seg.shard_numel);
  }
  const size_t n_slots = options_.stage > 1 ? 2 : 0, n_gather_slots = rounded ? 2 : 0;
  if (options_.shared_buffers && !staged_ && own_buffers) {
    std::vector<std::pair<int64_t, DType>> sizes;
    for (const ZeroSegment& seg : segments_)
      sizes.emplace_back(seg.shard_numel * (options_.stage == 1 ? world_size() : 1), dtype_);
    for (size_t k = 0; k < n_slots; ++k) sizes.emplace_back(largest, reduce_dtype_);
    for (size_t k = 0; k < n_gather_slots; ++k) sizes.emplace_back(largest_shard, gather_dtype_);
    // Gathered in place: each block on pages of its own (the region starts on one).
    shared =
        shared_flat_buffers(*comm_, sizes, in_place_wanted() ? comm::ShmRegion::page_size() : 64);
  }
  shared_ = !shared.empty();
  const size_t first_slot = segments_.size();
  for (size_t k = 0; shared_ && k < n_slots; ++k) slots_.push_back({shared[first_slot + k], {}});
  for (size_t k = 0; k < n_gather_slots; ++k)
    gather_slots_.push_back(
        {shared_ ? shared[first_slot + n_slots + k] : zeros({largest_shard}, gather_dtype_), {}});
  buffers_.resize(segments_.size());
  // Stage 1 in the buckets: their flat buffers are the segments'.
  const bool in_buckets =
      options_.reduce_in_buckets && options_.stage == 1 && !staged_ && options_.buckets != nullptr;
  if (in_buckets) {
    comm::ShmChannel* shm = comm_->size() > 1 ? comm_->shm() : nullptr;
    shared_ = shm != nullptr;
    for (size_t s = 0; s < segments_.size(); ++s) {
      const Tensor& flat = (*options_.buckets)[s].flat;
      CHECK(flat.numel() == segments_[s].shard_numel * world_size() && flat.dtype() == dtype_ &&
            flat.device().is_cpu())
          << "ZeRO-1: bucket " << s << " is " << flat.dtype() << " " << flat.shape_str()
          << ", reducing in place needs " << segments_[s].shard_numel * world_size() << " x "
          << dtype_ << " (padded to a multiple of the world size, on the CPU)";
      shared_ = shared_ && shm->find_region(flat.data_ptr(), flat.nbytes());
    }
  }
  for (size_t s = 0; s < segments_.size(); ++s) {
    const ZeroSegment& seg = segments_[s];
    const bool flat_shared = shared_ && options_.stage == 1;
    const bool master_shared = shared_ && options_.stage > 1;
    // Stages 2 and 3: this rank's block of the reduced gradients only.
    const int64_t flat = options_.stage > 1 ? seg.shard_numel : seg.shard_numel * world_size();
    buffers_[s].flat = in_buckets    ? (*options_.buckets)[s].flat
                       : flat_shared ? shared[s]
                                     : zeros({flat}, dtype_);
    buffers_[s].master = master_shared ? shared[s] : zeros({seg.shard_numel}, dtype_, device_);
    if (staged_) buffers_[s].grad = zeros({seg.shard_numel}, dtype_, device_);
    buffers_[s].has_grad.assign(seg.params.size(), false);
  }
  if (shared_ && in_place_wanted()) map_in_place();
}

bool ZeroOptimizer::in_place_wanted() const {
  return options_.gather_in_place && options_.stage == 3 && gather_dtype_ == dtype_ && !staged_ &&
         world_size() > 1;
}

void ZeroOptimizer::map_in_place() {
  // The same on every rank: a rank that cannot map them all copies, and so
  // does every other (sync_blocks is collective).
  std::vector<Tensor> views;
  for (size_t s = 0; s < segments_.size(); ++s) {
    const Tensor& master = buffers_[s].master;
    const std::shared_ptr<comm::ShmRegion> region =
        comm_->shm()->find_region(master.data_ptr(), master.nbytes());
    const char* side_by_side =
        region ? region->map_side_by_side(region->offset_of(master.data_ptr()), master.nbytes())
               : nullptr;
    if (!side_by_side) break;
    views.push_back(from_external(const_cast<char*>(side_by_side),
                                  {segments_[s].shard_numel * world_size()}, dtype_, Device{},
                                  region));
  }
  double failed = views.size() == segments_.size() ? 0 : 1;
  comm::allreduce(*comm_, &failed, 1, DType::f64, {.op = comm::ReduceOp::max});
  if (failed == 0) in_place_ = std::move(views);
}

ZeroOptimizer::~ZeroOptimizer() {
  // A reduction still in flight reads and writes the flat buffers.
  for (comm::Work& w : pending_) {
    try {
      w.wait();
    } catch (const Error&) {
    }
  }
}

void ZeroOptimizer::build_pieces(const OptimizerFactory& make_optimizer) {
  std::map<std::string, int> group_of;
  for (size_t g = 0; g < groups_.size(); ++g)
    for (const NamedTensor& p : groups_[g].params) group_of[p.name] = int(g);
  std::vector<Piece> pieces;
  for (size_t s = 0; s < segments_.size(); ++s) {
    const ZeroSegment& seg = segments_[s];
    auto [first, last] = seg.shard_range(rank());
    for (size_t i = 0; i < seg.params.size(); ++i) {
      const NamedTensor& p = seg.params[i];
      auto it = group_of.find(p.name);
      if (it == group_of.end())
        throw Error(cat("ZeRO-1: bucket parameter '", p.name,
                        "' is in no parameter group of the optimizer"));
      int64_t lo = seg.offsets[i], hi = lo + p.tensor.numel();
      if (std::max(lo, first) >= std::min(hi, last)) continue;
      Piece piece;
      piece.segment = int(s);
      piece.param = int(i);
      piece.group = it->second;
      piece.begin = std::max(lo, first) - lo;
      piece.end = std::min(hi, last) - lo;
      piece.shard_offset = lo + piece.begin - first;
      int64_t n = piece.end - piece.begin;
      piece.value = make_view(buffers_[s].master, {n}, {1}, piece.shard_offset);
      const int64_t block = options_.stage > 1 ? 0 : int64_t(rank()) * seg.shard_numel;
      piece.host_grad = make_view(buffers_[s].flat, {n}, {1}, block + piece.shard_offset);
      piece.grad =
          staged_ ? make_view(buffers_[s].grad, {n}, {1}, piece.shard_offset) : piece.host_grad;
      pieces.push_back(std::move(piece));
    }
  }
  // The wrapped optimizer's order: by group, then by position in the layout.
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const Piece& a, const Piece& b) { return a.group < b.group; });
  pieces_ = std::move(pieces);
  // ZeroOptions::local: whole, after the group's pieces.
  std::set<const TensorImpl*> local;
  for (const Tensor& t : options_.local) local.insert(t.impl());
  std::vector<optim::ParamGroup> shard_groups;
  for (const optim::ParamGroup& g : groups_)
    shard_groups.push_back({{}, g.weight_decay, g.lr_scale});
  size_t next_piece = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (; next_piece < pieces_.size() && pieces_[next_piece].group == int(g); ++next_piece) {
      const Piece& p = pieces_[next_piece];
      shard_groups[g].params.push_back(
          {segments_[size_t(p.segment)].params[size_t(p.param)].name, p.value});
      wrapped_.push_back({int(next_piece), {}});
    }
    for (const NamedTensor& p : groups_[g].params)
      if (local.count(p.tensor.impl())) {
        shard_groups[g].params.push_back(p);
        wrapped_.push_back({-1, p});
        local_.push_back(p);
      }
  }
  CHECK_EQ(local_.size(), local.size()) << "ZeRO: a local parameter is in no group";
  optimizer_ = make_optimizer(std::move(shard_groups));
  CHECK(optimizer_) << "ZeRO-1: the optimizer factory returned null";
}

// ---- gradients ----

void ZeroOptimizer::reduce_standalone() {
  // Which parameters have a gradient on some rank (counts per parameter).
  std::vector<float> counts;
  for (const ZeroSegment& seg : segments_)
    for (const NamedTensor& p : seg.params) counts.push_back(p.tensor.grad().defined() ? 1 : 0);
  for (comm::Communicator* over : {comm_.get(), options_.replicate.get()})
    if (over && over->size() > 1 && !counts.empty())
      comm::allreduce(*over, counts.data(), counts.size(), DType::f32,
                      {.op = comm::ReduceOp::sum, .timeout = options_.collective.timeout});
  comm::CollectiveOptions rs = options_.collective;
  rs.op = comm::ReduceOp::avg;
  rs.shared_region = shared_;
  size_t k = 0;
  for (size_t s = 0; s < segments_.size(); ++s) {
    const ZeroSegment& seg = segments_[s];
    SegmentBuffers& buf = buffers_[s];
    // Pack the local gradients (zeros where there is none, and in the padding).
    for (size_t i = 0; i < seg.params.size(); ++i, ++k) {
      buf.has_grad[i] = counts[k] > 0;
      const Tensor& param = seg.params[i].tensor;
      int64_t n = param.numel();
      Tensor grad = param.grad();
      if (grad.defined() && (grad.shape() != param.shape() || grad.dtype() != dtype_))
        throw Error(cat("ZeRO-1: the gradient of '", seg.params[i].name, "' is ", grad.dtype(), " ",
                        grad.shape_str(), ", expected ", dtype_, " ", param.shape_str()));
      if (grad.defined() && grad.is_contiguous() && grad.device().is_cpu())
        std::memcpy(bytes_at(buf.flat, seg.offsets[i]), grad.data_ptr(), byte_count(dtype_, n));
      else if (grad.defined())
        make_view(buf.flat, param.shape(), contiguous_strides(param.shape()), seg.offsets[i])
            .copy_(grad);
      else
        std::memset(bytes_at(buf.flat, seg.offsets[i]), 0, byte_count(dtype_, n));
    }
    std::memset(bytes_at(buf.flat, seg.numel), 0, byte_count(dtype_, buf.flat.numel() - seg.numel));
    char* block = bytes_at(buf.flat, int64_t(rank()) * seg.shard_numel);
    // The collective copies its input first, so its output may be inside it.
    comm::reduce_scatter(*comm_, buf.flat.data_ptr(), block, size_t(seg.shard_numel), dtype_, rs);
    average_over_replicas(options_.replicate, block, seg.shard_numel, dtype_, rs.timeout);
    buf.reduced = true;
  }
}

comm::Work ZeroOptimizer::reduce_bucket(const Bucket& bucket) {
  CHECK(options_.buckets) << "ZeRO-1: reduce_bucket without buckets in ZeroOptions";
  CHECK(bucket.index >= 0 && size_t(bucket.index) < segments_.size())
      << "ZeRO-1: bucket " << bucket.index << " of " << segments_.size();
  if (options_.stage > 1) return reduce_transient_bucket(bucket);
  const ZeroSegment& seg = segments_[size_t(bucket.index)];
  SegmentBuffers& buf = buffers_[size_t(bucket.index)];
  const bool in_place = bucket.flat.data_ptr() == buf.flat.data_ptr();
  CHECK((bucket.numel() == seg.numel || in_place) && bucket.flat.dtype() == dtype_ &&
        bucket.flat.is_contiguous())
      << "ZeRO-1: bucket " << bucket.index << " is " << bucket.flat.dtype() << " "
      << bucket.flat.shape_str() << ", the layout has " << seg.numel << " x " << dtype_;
  // In place, the gradients are where the collective reads them.
  if (!in_place && bucket.flat.device().is_cpu())
    std::memcpy(buf.flat.data_ptr(), bucket.flat.data_ptr(), byte_count(dtype_, seg.numel));
  else if (!in_place)  // device -> host on the backward thread, after the bucket's gradients
    make_view(buf.flat, {seg.numel}, {1}, 0).copy_(bucket.flat);
  std::memset(bytes_at(buf.flat, seg.numel), 0, byte_count(dtype_, buf.flat.numel() - seg.numel));
  comm::CollectiveOptions rs = options_.collective;
  rs.op = comm::ReduceOp::avg;
  rs.shared_region = shared_;
  char* block = bytes_at(buf.flat, int64_t(rank()) * seg.shard_numel);
  comm::Work w = comm::reduce_scatter_async(*comm_, buf.flat.data_ptr(), block,
                                            size_t(seg.shard_numel), dtype_, rs);
  // On the progress thread after it, in the same bucket order on every rank.
  if (options_.replicate && options_.replicate->size() > 1) {
    pending_.push_back(w);
    w = comm_->enqueue([this, block, n = seg.shard_numel, timeout = rs.timeout] {
      average_over_replicas(options_.replicate, block, n, dtype_, timeout);
    });
  }
  pending_.push_back(w);
  buf.reduced = true;
  buf.has_grad.assign(seg.params.size(), true);  // DataParallel: a missing gradient counts as zero
  return w;
}

Tensor ZeroOptimizer::transient_buffer(int64_t numel, DType) {
  // Whatever the gradients' dtype, the bucket holds them in the reduce dtype.
  if (slots_.empty()) return empty({numel}, reduce_dtype_);
  Slot& slot = slots_[next_slot_];
  CHECK(numel <= slot.buffer.numel()) << "ZeRO-" << options_.stage << ": a transient bucket of "
                                      << numel << " elements in a slot of " << slot.buffer.numel();
  slot.reduced.wait();  // peers have read it too: the reduce-scatter's last wait
  return make_view(slot.buffer, {numel}, {1}, 0);
}

comm::Work ZeroOptimizer::reduce_transient_bucket(const Bucket& bucket) {
  const ZeroSegment& seg = segments_[size_t(bucket.index)];
  SegmentBuffers& buf = buffers_[size_t(bucket.index)];
  // In the slot transient_buffer handed out: in place over the shared region.
  Slot* slot = nullptr;
  if (!slots_.empty() && bucket.flat.data_ptr() == slots_[next_slot_].buffer.data_ptr()) {
    slot = &slots_[next_slot_];
    next_slot_ = (next_slot_ + 1) % slots_.size();
  }
  CHECK(bucket.flat.numel() == seg.shard_numel * world_size() &&
        bucket.flat.dtype() == reduce_dtype_ && bucket.flat.is_contiguous() &&
        bucket.flat.device().is_cpu())
      << "ZeRO-" << options_.stage << ": bucket " << bucket.index << " is " << bucket.flat.dtype()
      << " " << bucket.flat.shape_str() << ", expected " << seg.shard_numel * world_size() << " x "
      << reduce_dtype_ << " (padded, on the CPU; from transient_buffer)";
  comm::CollectiveOptions rs = options_.collective;
  rs.op = comm::ReduceOp::avg;
  rs.shared_region = slot != nullptr;
  // This rank's block of the bucket receives the reduction (the collective
  // reads each piece of it before writing), then is added into the shard's gradients.
  const int64_t n = seg.shard_numel;
  Tensor block = make_view(bucket.flat, {n}, {1}, int64_t(rank()) * n);
  pending_.push_back(comm::reduce_scatter_async(*comm_, bucket.flat.data_ptr(), block.data_ptr(),
                                                size_t(n), reduce_dtype_, rs));
  comm::Work added = comm_->enqueue([this, &buf, block, n, rs] {
    average_over_replicas(options_.replicate, block.data_ptr(), n, reduce_dtype_, rs.timeout);
    // Reduced in a narrower dtype: widened first.
    const Tensor wide = reduce_dtype_ == dtype_ ? block : block.to(dtype_);
    if (!buf.accumulated)
      std::memcpy(buf.flat.data_ptr(), wide.data_ptr(), byte_count(dtype_, n));
    else if (dtype_ == DType::f64)
      add_into(buf.flat.data<double>(), wide.data<double>(), n);
    else
      add_into(buf.flat.data<float>(), wide.data<float>(), n);
    buf.accumulated = true;
  });
  pending_.push_back(added);
  if (slot) slot->reduced = added;
  buf.reduced = true;
  buf.has_grad.assign(seg.params.size(), true);  // DataParallel: a missing gradient counts as zero
  return added;
}

void ZeroOptimizer::reduce_gradients() {
  if (reduced_) return;
  if (options_.buckets) {
    for (const comm::Work& w : pending_) w.wait();
    pending_.clear();
    for (size_t s = 0; s < segments_.size(); ++s)
      if (!buffers_[s].reduced)
        throw Error(cat("ZeRO-", options_.stage, ": bucket ", s,
                        " was not reduced this step; DataParallel's reduce "
                        "must be zero_bucket_reduce() and dp.finish() must run before step()"));
  } else {
    reduce_standalone();
  }
  // Staged: the reduced blocks go to the device, where the optimizer runs.
  if (staged_)
    for (size_t s = 0; s < segments_.size(); ++s)
      buffers_[s].grad.copy_(make_view(buffers_[s].flat, {segments_[s].shard_numel}, {1},
                                       int64_t(rank()) * segments_[s].shard_numel));
  for (SegmentBuffers& buf : buffers_)
    buf.stepped = std::find(buf.has_grad.begin(), buf.has_grad.end(), true) != buf.has_grad.end();
  // A piece of a parameter that has no gradient on any rank gets none: the optimizer skips it.
  for (const Piece& p : pieces_)
    p.value.set_grad(buffers_[size_t(p.segment)].has_grad[size_t(p.param)] ? p.grad : Tensor());
  reduced_ = true;
}

void ZeroOptimizer::update_reduced_gradient(
    const Tensor& param, const std::function<void(Tensor&, int64_t, int64_t)>& f) {
  reduce_gradients();
  for (Piece& p : pieces_) {
    if (segments_[size_t(p.segment)].params[size_t(p.param)].tensor.impl() != param.impl())
      continue;
    f(p.host_grad, p.begin, p.end);
    if (staged_) p.grad.copy_(p.host_grad);
  }
}

double ZeroOptimizer::clip_grad_norm(double max_norm) {
  reduce_gradients();
  double sumsq = 0;
  for (const Piece& p : pieces_) {
    if (!p.value.grad().defined()) continue;
    if (norm_skips_.count(segments_[size_t(p.segment)].params[size_t(p.param)].tensor.impl()))
      continue;
    // The host copy of the block holds the same reduced values.
    sumsq += dtype_ == DType::f64 ? sum_of_squares(p.host_grad.data<double>(), p.host_grad.numel())
                                  : sum_of_squares(p.host_grad.data<float>(), p.host_grad.numel());
  }
  // Local parameters: held by local_copies ranks of comm, each counted once.
  double local_sumsq = 0;
  for (const NamedTensor& p : local_)
    if (p.tensor.grad().defined() && !norm_skips_.count(p.tensor.impl())) {
      const Tensor g = p.tensor.grad().contiguous();
      local_sumsq += dtype_ == DType::f64 ? sum_of_squares(g.data<double>(), g.numel())
                                          : sum_of_squares(g.data<float>(), g.numel());
    }
  sumsq += local_sumsq / std::max(options_.local_copies, 1);
  if (world_size() > 1)
    comm::allreduce(*comm_, &sumsq, 1, DType::f64,
                    {.op = comm::ReduceOp::sum, .timeout = options_.collective.timeout});
  for (const std::shared_ptr<comm::Communicator>& over : options_.norm_also_over)
    if (over && over->size() > 1)
      comm::allreduce(*over, &sumsq, 1, DType::f64,
                      {.op = comm::ReduceOp::sum, .timeout = options_.collective.timeout});
  double norm = std::sqrt(sumsq);
  double factor = max_norm / (norm + 1e-6);  // optim::clip_grad_norm's rule
  if (!(factor >= 1.0)) {
    for (const Piece& p : pieces_)
      if (p.value.grad().defined()) mul_(p.grad, factor);
    for (const NamedTensor& p : local_)
      if (p.tensor.grad().defined()) mul_(p.tensor.grad(), factor);
  }
  return norm;
}

// ---- the update ----

void ZeroOptimizer::step() {
  autograd::NoGradGuard no_grad;
  reduce_gradients();
  // The block starts from the current parameters (a checkpoint may have
  // replaced them); under ZeRO-3 it is the parameters.
  for (const Piece& p : pieces_) {
    if (options_.stage == 3) break;
    const Tensor& param = segments_[size_t(p.segment)].params[size_t(p.param)].tensor;
    if (staged_)
      Tensor(p.value).copy_(make_view(param, {p.end - p.begin}, {1}, param.offset() + p.begin));
    else
      std::memcpy(p.value.data_ptr(), bytes_at(param, p.begin),
                  byte_count(dtype_, p.end - p.begin));
  }
  optimizer_->step();
  if (options_.stage == 1)
    gather_parameters();
  else if (options_.stage == 2)
    gather_parameters_transient();
  for (SegmentBuffers& buf : buffers_) buf.reduced = buf.accumulated = false;
  for (const Piece& p : pieces_) p.value.set_grad(Tensor());
  reduced_ = false;
}

void ZeroOptimizer::gather_parameters_transient() {
  if (shared_) return copy_parameters_from_region();
  for (size_t s = 0; s < segments_.size(); ++s) {
    const ZeroSegment& seg = segments_[s];
    if (!buffers_[s].stepped) continue;  // the same on every rank: no parameter had a gradient
    Tensor flat = empty({seg.shard_numel * world_size()}, dtype_);
    gather_segment_async(int(s), flat).wait();
    for (size_t i = 0; i < seg.params.size(); ++i)
      if (buffers_[s].has_grad[i])
        std::memcpy(seg.params[i].tensor.data_ptr(), bytes_at(flat, seg.offsets[i]),
                    byte_count(dtype_, seg.params[i].tensor.numel()));
  }
}

void ZeroOptimizer::shard_parameters() {
  for (size_t s = 0; s < segments_.size(); ++s) {
    const ZeroSegment& seg = segments_[s];
    auto [first, last] = seg.shard_range(rank());
    char* master = static_cast<char*>(buffers_[s].master.data_ptr());
    for (size_t i = 0; i < seg.params.size(); ++i) {
      const int64_t lo = std::max(seg.offsets[i], first),
                    hi = std::min(seg.offsets[i] + seg.params[i].tensor.numel(), last);
      if (lo < hi)
        std::memcpy(master + byte_count(dtype_, lo - first),
                    bytes_at(seg.params[i].tensor, lo - seg.offsets[i]),
                    byte_count(dtype_, hi - lo));
    }
  }
}

Tensor ZeroOptimizer::gathered_in_place(int segment) const {
  if (in_place_.empty()) return Tensor();
  const Tensor& view = in_place_[size_t(segment)];
  // What the all-gather this replaces would count (comm/traffic.h).
  comm::count_traffic(comm::TrafficKind::allgather,
                      comm::scatter_gather_bus_bytes(world_size(), uint64_t(view.nbytes())));
  return view;
}

void ZeroOptimizer::sync_blocks() {
  if (!in_place_.empty()) comm::barrier(*comm_, options_.collective);
}

comm::Work ZeroOptimizer::gather_segment_async(int segment, const Tensor& flat) {
  const ZeroSegment& seg = segments_[size_t(segment)];
  const bool rounded = flat.dtype() != dtype_ && !gather_slots_.empty();
  CHECK(flat.numel() == seg.shard_numel * world_size() &&
        (flat.dtype() == dtype_ || (rounded && flat.dtype() == gather_dtype_)) &&
        flat.is_contiguous() && flat.device().is_cpu())
      << "ZeRO-3: segment " << segment << " gathers into " << seg.shard_numel * world_size()
      << " x " << dtype_ << " or " << gather_dtype_ << ", not " << flat.dtype() << " "
      << flat.shape_str();
  comm::CollectiveOptions ag = options_.collective;
  ag.shared_region = shared_;  // the blocks lie in a shared region: read where they lie
  const size_t bytes = byte_count(flat.dtype(), seg.shard_numel);
  const Tensor& master = buffers_[size_t(segment)].master;
  if (!rounded) return comm::allgather_async(*comm_, master.data_ptr(), flat.data_ptr(), bytes, ag);
  // In a narrower dtype: this rank's block rounded into the next slot, once
  // the gather that used it last has finished (every peer has read it).
  GatherSlot& slot = gather_slots_[next_gather_slot_];
  next_gather_slot_ = (next_gather_slot_ + 1) % gather_slots_.size();
  slot.gathered.wait();
  Tensor block = make_view(slot.buffer, {seg.shard_numel}, {1}, 0);
  block.copy_(master);
  slot.gathered = comm::allgather_async(*comm_, block.data_ptr(), flat.data_ptr(), bytes, ag);
  return slot.gathered;
}

void ZeroOptimizer::copy_parameters_from_region() {
  // Every rank's blocks are updated; then each parameter is copied from the
  // blocks that hold it, where they lie (no gathered buffer, one copy).
  comm::barrier(*comm_, options_.collective);
  const size_t item = dtype_size(dtype_);
  for (size_t s = 0; s < segments_.size(); ++s) {
    const ZeroSegment& seg = segments_[s];
    const SegmentBuffers& buf = buffers_[s];
    if (!buf.stepped) continue;  // the same on every rank: no parameter had a gradient
    const std::shared_ptr<comm::ShmRegion> region =
        comm_->shm()->find_region(buf.master.data_ptr(), buf.master.nbytes());
    CHECK(region) << "ZeRO-2: segment " << s << "'s block lies in no shared region";
    const size_t at = region->offset_of(buf.master.data_ptr());
    // What the all-gather this replaces would count (comm/traffic.h).
    comm::count_traffic(
        comm::TrafficKind::allgather,
        comm::scatter_gather_bus_bytes(world_size(), uint64_t(world_size()) * buf.master.nbytes()));
    for (size_t i = 0; i < seg.params.size(); ++i) {
      if (!buf.has_grad[i]) continue;
      const int64_t lo = seg.offsets[i], hi = lo + seg.params[i].tensor.numel();
      char* dst = static_cast<char*>(seg.params[i].tensor.data_ptr());
      for (int r = 0; r < world_size(); ++r) {
        auto [first, last] = seg.shard_range(r);
        const int64_t a = std::max(lo, first), b = std::min(hi, last);
        if (a < b)
          std::memcpy(dst + size_t(a - lo) * item, region->of(r) + at + size_t(a - first) * item,
                      size_t(b - a) * item);
      }
    }
  }
  // Nobody changes its blocks while a peer may still read them.
  comm::barrier(*comm_, options_.collective);
}

std::map<const TensorImpl*, ParameterShard> ZeroOptimizer::parameter_shards() const {
  std::map<const TensorImpl*, ParameterShard> out;
  for (const ZeroSegment& seg : segments_)
    for (const NamedTensor& p : seg.params) out.emplace(p.tensor.impl(), ParameterShard{});
  for (const Piece& p : pieces_)
    out[segments_[size_t(p.segment)].params[size_t(p.param)].tensor.impl()] =
        ParameterShard{p.begin, p.end, p.value};
  return out;
}

void ZeroOptimizer::gather_parameters() {
  comm::CollectiveOptions ag = options_.collective;
  ag.shared_region = shared_;
  for (size_t s = 0; s < segments_.size(); ++s) {
    const ZeroSegment& seg = segments_[s];
    SegmentBuffers& buf = buffers_[s];
    if (!buf.stepped) continue;  // the same on every rank: no parameter had a gradient
    char* block = bytes_at(buf.flat, int64_t(rank()) * seg.shard_numel);
    if (staged_)
      make_view(buf.flat, {seg.shard_numel}, {1}, int64_t(rank()) * seg.shard_numel)
          .copy_(buf.master);
    else
      std::memcpy(block, buf.master.data_ptr(), byte_count(dtype_, seg.shard_numel));
    comm::allgather(*comm_, block, buf.flat.data_ptr(), byte_count(dtype_, seg.shard_numel), ag);
    for (size_t i = 0; i < seg.params.size(); ++i)
      if (buf.has_grad[i]) {
        Tensor param = seg.params[i].tensor;  // a handle on the model's tensor
        if (staged_)
          param.copy_(make_view(buf.flat, param.shape(), contiguous_strides(param.shape()),
                                seg.offsets[i]));
        else
          std::memcpy(param.data_ptr(), bytes_at(buf.flat, seg.offsets[i]),
                      byte_count(dtype_, param.numel()));
      }
  }
}

void ZeroOptimizer::zero_grad(bool set_to_none) {
  // A step skipped after its reduction (a non-finite loss) must not leave it for the next one.
  for (const comm::Work& w : pending_) w.wait();
  pending_.clear();
  for (SegmentBuffers& buf : buffers_) buf.reduced = buf.accumulated = false;
  for (const Piece& p : pieces_) p.value.set_grad(Tensor());
  reduced_ = false;
  optim::zero_grads(groups_, set_to_none);
}

// ---- state ----

std::string ZeroOptimizer::layout_name() const { return cat("zero1.rank", rank(), ".layout"); }

Tensor ZeroOptimizer::layout_tensor() const {
  std::vector<int64_t> v{world_size(), rank(), int64_t(segments_.size())};
  for (const ZeroSegment& s : segments_) v.push_back(s.numel);
  // Blocks rounded to pages (gather_in_place) end elsewhere: the multiple after the segments.
  if (block_align_ > 1) v.push_back(block_align_);
  return from_vector(v);
}

std::vector<std::pair<std::string, std::string>> ZeroOptimizer::state_names() const {
  std::vector<NamedTensor> inner = optimizer_->state();
  std::vector<std::pair<std::string, std::string>> out;
  if (wrapped_.empty()) return out;
  CHECK_EQ(inner.size() % wrapped_.size(), size_t(0)) << "ZeRO-1: state entries per piece";
  const size_t per_piece = inner.size() / wrapped_.size();
  for (size_t i = 0; i < inner.size(); ++i) {
    const Wrapped& w = wrapped_[i / per_piece];
    const Piece* p = w.piece >= 0 ? &pieces_[size_t(w.piece)] : nullptr;
    const std::string& param =
        p ? segments_[size_t(p->segment)].params[size_t(p->param)].name : w.local.name;
    CHECK(inner[i].name.rfind(param + ".", 0) == 0)
        << "ZeRO-1: state entry " << inner[i].name << " is not of " << param;
    // A local parameter's state is whole: named as without ZeRO.
    out.push_back(
        {inner[i].name, p ? cat(inner[i].name, "[", p->begin, ":", p->end, "]") : inner[i].name});
  }
  return out;
}

void ZeroOptimizer::load_whole_state(const std::map<std::string, Tensor>& whole) {
  std::vector<NamedTensor> inner = optimizer_->state();
  std::vector<NamedTensor> inner_state;
  if (wrapped_.empty()) return;
  const size_t per_piece = inner.size() / wrapped_.size();
  for (size_t i = 0; i < inner.size(); ++i) {
    const Wrapped& w = wrapped_[i / per_piece];
    Piece whole_piece;
    whole_piece.end = w.local.tensor.defined() ? w.local.tensor.numel() : 0;
    const Piece& p = w.piece >= 0 ? pieces_[size_t(w.piece)] : whole_piece;
    const NamedTensor& param =
        w.piece >= 0 ? segments_[size_t(p.segment)].params[size_t(p.param)] : w.local;
    auto it = whole.find(inner[i].name);
    if (it == whole.end())
      throw Error(cat("optimizer state: no entry '", inner[i].name, "' for ZeRO-1 rank ", rank(),
                      "'s shard (was it saved with another optimizer or model?)"));
    const Tensor& t = it->second;
    if (inner[i].tensor.dim() == 0) {  // the step count
      if (t.numel() != 1)
        throw Error(cat("optimizer state: entry '", inner[i].name, "' is ", t.shape_str(),
                        ", expected a step count"));
      inner_state.push_back({inner[i].name, t.reshape({})});
      continue;
    }
    if (t.numel() != param.tensor.numel())
      throw Error(cat("optimizer state: entry '", inner[i].name, "' has ", t.numel(),
                      " elements, parameter '", param.name, "' ", param.tensor.numel()));
    if (w.piece < 0)  // local: whole, in the parameter's shape
      inner_state.push_back({inner[i].name, t.contiguous().reshape(param.tensor.shape())});
    else
      inner_state.push_back(
          {inner[i].name, t.contiguous().reshape({-1}).narrow(0, p.begin, p.end - p.begin)});
  }
  optimizer_->load_state(inner_state);
}

std::vector<NamedTensor> ZeroOptimizer::state() const {
  std::vector<NamedTensor> inner = optimizer_->state();
  std::vector<std::pair<std::string, std::string>> names = state_names();
  std::vector<NamedTensor> out{{layout_name(), layout_tensor()}};
  for (size_t i = 0; i < names.size(); ++i) out.push_back({names[i].second, inner[i].tensor});
  return out;
}

void ZeroOptimizer::load_state(const std::vector<NamedTensor>& state) {
  const std::string expected_layout = layout_name();
  const NamedTensor* layout = nullptr;
  for (const NamedTensor& e : state) {
    bool is_layout = e.name.rfind("zero1.rank", 0) == 0 && e.name.size() > 7 &&
                     e.name.compare(e.name.size() - 7, 7, ".layout") == 0;
    if (!is_layout) continue;
    if (e.name != expected_layout)
      throw Error(cat("ZeRO-1 state: it is the shard of another rank ('", e.name,
                      "'); this is rank ", rank(), " of ", world_size(),
                      ", which loads the shard with '", expected_layout, "'"));
    layout = &e;
  }
  if (!layout)
    throw Error(cat("ZeRO-1 state: no '", expected_layout,
                    "' entry, so it was not saved by ZeRO-1 (sharded optimizer state); resume "
                    "with the optimizer sharding it was saved with"));
  Tensor mine = layout_tensor();
  std::vector<int64_t> want = mine.to_vector<int64_t>();
  std::vector<int64_t> got;
  if (layout->tensor.defined() && layout->tensor.dtype() == DType::i64 && layout->tensor.dim() == 1)
    got = layout->tensor.to_vector<int64_t>();
  if (got.size() < 3 || (got.size() != size_t(3 + got[2]) && got.size() != size_t(4 + got[2])))
    throw Error(cat("ZeRO-1 state: entry '", expected_layout,
                    "' is malformed (expected i64 [world size, rank, segments, numel...])"));
  if (got != want)
    throw Error(cat("ZeRO-1 state: saved on a different layout: world size ", got[0],
                    " with segments of ", numels_str(got, 3), " elements; this run has world size ",
                    want[0], " with segments of ", numels_str(want, 3),
                    " elements. Resume with the same data-parallel size, model and bucket sizes"));
  std::map<std::string, std::string> inner_of;
  for (const auto& [inner, outer] : state_names()) inner_of[outer] = inner;
  std::vector<NamedTensor> inner_state;
  std::set<std::string> seen;
  for (const NamedTensor& e : state) {
    if (&e == layout) continue;
    auto it = inner_of.find(e.name);
    if (it == inner_of.end())
      throw Error(cat("ZeRO-1 state: unexpected entry '", e.name, "' (not a slot of rank ", rank(),
                      "'s shard on this layout)"));
    seen.insert(e.name);
    inner_state.push_back({it->second, e.tensor});
  }
  for (const auto& [outer, inner] : inner_of)
    if (!seen.count(outer)) throw Error(cat("ZeRO-1 state: missing entry '", outer, "'"));
  optimizer_->load_state(inner_state);
}

BucketReduceFn zero_bucket_reduce(const std::shared_ptr<ZeroOptimizer>* zero) {
  CHECK(zero) << "zero_bucket_reduce needs the address of the ZeroOptimizer pointer";
  return [zero](comm::Communicator&, const Bucket& bucket) {
    CHECK(*zero) << "ZeRO-1: a bucket was reduced before the ZeroOptimizer was built";
    return (*zero)->reduce_bucket(bucket);
  };
}

}  // namespace trainer::parallel
