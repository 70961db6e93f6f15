#include "parallel/fsdp.h"

#include <algorithm>
#include <functional>
#include <set>
#include <utility>

#include "comm/collectives.h"
#include "core/autograd.h"

namespace trainer::parallel {

struct ShardedParameters::Unit {
  std::string name;            // its blocks' names, "transformer.h.3" or "embed+head"
  std::vector<size_t> blocks;  // increasing
  // Of the ZeroOptimizer (= DataParallel buckets): the unit's, and one per
  // parameter with a bucket of its own (DataParallelOptions::own_bucket).
  // Empty: nothing sharded.
  std::vector<int> segments;
  std::vector<Tensor> flats;        // gathered: one per segment; empty when freed
  std::vector<comm::Work> pending;  // gathers in flight into flats; empty once waited for
  bool pointed = false;             // the parameters point into flats
  bool keep_after_forward = false;
  size_t started = 0;  // its buckets whose reduction started in this backward
  bool gathered() const { return pointed; }
};

namespace {

// Identity on a unit's outputs whose backward first runs a hook (the
// unit's gather): gradients flow on unchanged.
struct BeforeBackwardOp {
  struct Saved {
    std::function<void()> hook;
  };
  static constexpr const char* name = "before_backward";
  static TensorList forward(Saved& s, const TensorList& xs, const std::function<void()>& hook) {
    s.hook = hook;
    return xs;
  }
  static TensorList backward(Saved& s, const TensorList& grad_out, const autograd::GradMask&) {
    s.hook();
    return grad_out;
  }
};

}  // namespace

std::vector<std::vector<size_t>> sharding_units(const BlockList& blocks,
                                                const std::vector<size_t>& only) {
  std::vector<size_t> chosen = only;
  if (chosen.empty())
    for (size_t b = 0; b < blocks.size(); ++b) chosen.push_back(b);
  std::sort(chosen.begin(), chosen.end());
  // Union-find over blocks that share a parameter.
  std::vector<size_t> root(blocks.size());
  for (size_t b = 0; b < root.size(); ++b) root[b] = b;
  std::function<size_t(size_t)> find = [&](size_t b) {
    return root[b] == b ? b : root[b] = find(root[b]);
  };
  std::map<const TensorImpl*, size_t> first_block;
  for (size_t b : chosen)
    for (const NamedTensor& p : blocks.named_parameters(b, b + 1)) {
      auto [it, fresh] = first_block.emplace(p.tensor.impl(), b);
      if (!fresh) root[find(b)] = find(it->second);
    }
  std::map<size_t, std::vector<size_t>> by_root;
  for (size_t b : chosen) by_root[find(b)].push_back(b);
  std::vector<std::vector<size_t>> units;
  for (auto& [r, members] : by_root) units.push_back(std::move(members));
  std::sort(units.begin(), units.end());  // by first block
  return units;
}

std::vector<std::vector<size_t>> merge_units(const BlockList& blocks,
                                             std::vector<std::vector<size_t>> units,
                                             int64_t min_numel) {
  if (min_numel <= 0 || units.empty()) return units;
  const std::vector<std::vector<Tensor>> params = unit_parameters(blocks, units);
  // A unit of blocks apart (a tied weight's) stays alone: merged, the
  // blocks between would stay gathered with it.
  auto apart = [](const std::vector<size_t>& unit) {
    return unit.back() - unit.front() + 1 != unit.size();
  };
  std::vector<std::vector<size_t>> out;
  int64_t held = 0;  // elements of out.back()
  for (size_t u = 0; u < units.size(); ++u) {
    int64_t numel = 0;
    for (const Tensor& p : params[u]) numel += p.numel();
    // A unit as large as min_numel stays alone: merging it would only make
    // the largest gathered unit (and ZeRO-2's slots) larger.
    if (out.empty() || held >= min_numel || numel >= min_numel || apart(units[u]) ||
        apart(out.back())) {
      out.emplace_back();
      held = 0;
    }
    out.back().insert(out.back().end(), units[u].begin(), units[u].end());
    held += numel;
  }
  for (std::vector<size_t>& unit : out) std::sort(unit.begin(), unit.end());
  return out;
}

std::vector<std::vector<Tensor>> unit_parameters(const BlockList& blocks,
                                                 const std::vector<std::vector<size_t>>& units) {
  std::set<const TensorImpl*> seen;
  std::vector<std::vector<Tensor>> out;
  for (const std::vector<size_t>& unit : units) {
    out.emplace_back();
    for (size_t b : unit)
      for (const NamedTensor& p : blocks.named_parameters(b, b + 1))
        if (p.tensor.requires_grad() && seen.insert(p.tensor.impl()).second)
          out.back().push_back(p.tensor);
  }
  return out;
}

ShardedParameters::ShardedParameters(Model& model, std::vector<std::vector<size_t>> units,
                                     const DataParallel& dp,
                                     const std::shared_ptr<ZeroOptimizer>* zero,
                                     ShardingOptions options)
    : model_(model), comm_(&dp.comm()), zero_(zero), options_(options) {
  const BlockList& blocks = model.blocks();
  block_unit_.assign(blocks.size(), kNoUnit);
  std::map<const TensorImpl*, size_t> unit_of_param;
  for (size_t u = 0; u < units.size(); ++u) {
    Unit unit;
    unit.blocks = std::move(units[u]);
    CHECK(!unit.blocks.empty()) << "ShardedParameters: an empty unit";
    for (size_t b : unit.blocks) {
      unit.name += (unit.name.empty() ? "" : "+") + blocks[b].name;
      block_unit_[b] = u;
      for (const NamedTensor& p : blocks.named_parameters(b, b + 1))
        unit_of_param.emplace(p.tensor.impl(), u);
    }
    units_.push_back(std::move(unit));
  }
  for (const Bucket& bucket : dp.buckets()) {
    auto u = unit_of_param.find(bucket.params.front().tensor.impl());
    CHECK(u != unit_of_param.end())
        << "ShardedParameters: bucket " << bucket.index << " holds parameters of no unit";
    units_[u->second].segments.push_back(bucket.index);
    unit_of_bucket_[bucket.index] = u->second;
  }
  for (const Unit& unit : units_) first_block_ = std::min(first_block_, unit.blocks.front());
  // The units that finish last in forward: their backward comes first.
  std::vector<size_t> by_end(units_.size());
  for (size_t u = 0; u < by_end.size(); ++u) by_end[u] = u;
  std::sort(by_end.begin(), by_end.end(),
            [&](size_t a, size_t b) { return units_[a].blocks.back() < units_[b].blocks.back(); });
  for (size_t k = 0; k < by_end.size(); ++k)
    units_[by_end[k]].keep_after_forward =
        !options_.reshard_after_forward ||
        k + size_t(std::max(options_.keep_last, 0)) >= by_end.size();
  model_.add_block_wrapper(
      {.name = "shard_parameters",
       .run = [this](const BlockSpec& block, const TensorList& inputs,
                     const BlockFn& next) { return run_block(block, inputs, next); }},
      /*outermost=*/true);
}

ShardedParameters::~ShardedParameters() {
  model_.remove_block_wrapper("shard_parameters");
  for (Unit& u : units_)
    for (comm::Work& w : u.pending) {
      try {
        w.wait();
      } catch (const std::exception&) {  // reported where it was waited for, or moot now
      }
    }
}

void ShardedParameters::shard_once() {
  if (sharded_) return;
  // The parameters hold their values until now (a checkpoint loaded into
  // them): each rank takes its block, and the model's copies are freed.
  (*zero_)->shard_parameters();
  for (size_t u = 0; u < units_.size(); ++u) release(u);
  (*zero_)->sync_blocks();  // every block taken before any rank reads one in place
  sharded_ = true;
}

int64_t ShardedParameters::vote(bool running) {
  double n = running ? 1 : 0;
  comm::allreduce(*comm_, &n, 1, DType::f64, {.op = comm::ReduceOp::sum});
  return int64_t(n);
}

void ShardedParameters::begin_lockstep() {
  shard_once();
  lockstep_ = true;
}

void ShardedParameters::end_lockstep() {
  // The units in the order a forward pass gathers them: by first block.
  while (vote(false) > 0)
    for (size_t u = 0; u < units_.size(); ++u) {
      gather(u);
      release(u);
    }
  lockstep_ = false;
}

TensorList ShardedParameters::run_block(const BlockSpec& block, const TensorList& inputs,
                                        const BlockFn& next) {
  shard_once();
  const size_t index = size_t(&block - &model_.blocks()[0]);
  CHECK(index < block_unit_.size())
      << "ShardedParameters: block " << block.name << " is not of the model it wraps";
  const size_t u = block_unit_[index];
  CHECK(u != kNoUnit) << "ShardedParameters: block " << block.name << " is in no unit";
  if (lockstep_ && index == first_block_) vote(true);  // a forward pass begins
  gather(u);
  prefetch(index, +1);
  TensorList out = next(inputs);
  const bool recording = autograd::grad_enabled() && autograd::detail::any_requires_grad(out);
  if (recording && !units_[u].segments.empty()) {
    TensorList marked = autograd::apply<BeforeBackwardOp>(
        out, std::function<void()>([this, u, index] { before_backward(u, index); }));
    out = std::move(marked);
  }
  // After the unit's last block: freed unless backward comes right after
  // (or the units stay for the step).
  if (index == units_[u].blocks.back() && !options_.keep_for_step &&
      (!recording || !units_[u].keep_after_forward))
    release(u);
  return out;
}

void ShardedParameters::before_backward(size_t u, size_t block) {
  gather(u);
  prefetch(block, -1);
}

void ShardedParameters::check_order(size_t u) {
  if (order_checked_) return;
  comm::Communicator& comm = *comm_;
  std::vector<int64_t> all(size_t(comm.size()));
  const int64_t mine = int64_t(u);
  comm::allgather(comm, &mine, all.data(), sizeof mine);
  for (int r = 1; r < comm.size(); ++r)
    if (all[size_t(r)] != all[0]) {
      auto name = [&](int64_t k) {
        return k >= 0 && size_t(k) < units_.size() ? units_[size_t(k)].name : cat("#", k);
      };
      throw Error(cat("ZeRO-3: rank ", r, " of the data-parallel group gathers the parameters of ",
                      name(all[size_t(r)]), " where rank 0 gathers those of ", name(all[0]),
                      ": every rank must run the same blocks in the same order"));
    }
}

void ShardedParameters::start_gather(size_t u) {
  Unit& unit = units_[u];
  ZeroOptimizer& zero = **zero_;
  for (int segment : unit.segments) {
    // On one host, the ranks' blocks where they lie (ZeroOptions::gather_in_place).
    if (Tensor in_place = zero.gathered_in_place(segment); in_place.defined()) {
      unit.flats.push_back(in_place);
      continue;
    }
    const ZeroSegment& seg = zero.segments()[size_t(segment)];
    unit.flats.push_back(empty({seg.shard_numel * zero.world_size()}, zero.gather_dtype()));
    unit.pending.push_back(zero.gather_segment_async(segment, unit.flats.back()));
  }
}

void ShardedParameters::gather(size_t u) {
  Unit& unit = units_[u];
  if (unit.segments.empty() || unit.gathered()) return;
  if (unit.flats.empty()) {  // not prefetched
    check_order(u);
    TraceScope span(options_.timeline, "zero3 gather", Track::comm);
    start_gather(u);
    ++gathers_;
  }
  for (comm::Work& w : unit.pending) w.wait();
  unit.pending.clear();
  // The parameters point into the gathered buffers, in their dtype until freed.
  for (size_t k = 0; k < unit.segments.size(); ++k) {
    const ZeroSegment& seg = (*zero_)->segments()[size_t(unit.segments[k])];
    for (size_t i = 0; i < seg.params.size(); ++i) {
      TensorImpl* p = seg.params[i].tensor.impl();
      p->storage = unit.flats[k].storage();
      p->offset = seg.offsets[i];
      p->dtype = unit.flats[k].dtype();
    }
  }
  unit.pointed = true;
}

void ShardedParameters::prefetch(size_t block, int direction) {
  if (!options_.prefetch || !order_checked_) return;
  const size_t here = block_unit_[block];
  for (int64_t b = int64_t(block) + direction; b >= 0 && b < int64_t(block_unit_.size());
       b += direction) {
    const size_t u = block_unit_[size_t(b)];
    if (u == here) continue;
    if (u == kNoUnit) return;  // another pipeline stage's block
    Unit& unit = units_[u];
    if (!unit.segments.empty() && unit.flats.empty()) {
      start_gather(u);
      ++prefetches_;
    }
    return;
  }
}

void ShardedParameters::release(size_t u) {
  Unit& unit = units_[u];
  if (unit.segments.empty()) return;
  for (comm::Work& w : unit.pending) w.wait();
  unit.pending.clear();
  for (int segment : unit.segments)
    for (const NamedTensor& p : (*zero_)->segments()[size_t(segment)].params) {
      release_storage(p.tensor);
      p.tensor.impl()->dtype = (*zero_)->master_dtype();
    }
  unit.flats.clear();
  unit.pointed = false;
}

void ShardedParameters::bucket_started(int bucket) {
  auto it = unit_of_bucket_.find(bucket);
  if (it == unit_of_bucket_.end()) return;
  // Once all of the unit's buckets are on their way (unless kept for the step).
  Unit& unit = units_[it->second];
  if (++unit.started < unit.segments.size()) return;
  unit.started = 0;
  if (!options_.keep_for_step) release(it->second);
}

void ShardedParameters::end_step() {
  for (size_t u = 0; u < units_.size(); ++u) release(u);
  // Every rank's blocks updated before the next forward reads them in place.
  if (sharded_) (*zero_)->sync_blocks();
  if (sharded_) order_checked_ = true;
}

std::map<const TensorImpl*, Tensor> ShardedParameters::gathered_copies() {
  std::map<const TensorImpl*, Tensor> out;
  ZeroOptimizer& zero = **zero_;
  for (const Unit& unit : units_)
    for (int segment : unit.segments) {
      const ZeroSegment& seg = zero.segments()[size_t(segment)];
      Tensor flat = empty({seg.shard_numel * zero.world_size()}, zero.master_dtype());
      if (sharded_) zero.gather_segment_async(segment, flat).wait();
      for (size_t i = 0; i < seg.params.size(); ++i) {
        const Tensor& p = seg.params[i].tensor;
        Tensor copy = make_view(flat, p.shape(), contiguous_strides(p.shape()), seg.offsets[i]);
        if (!sharded_) copy.copy_(p);  // not sharded yet: the parameters hold the values
        out.emplace(p.impl(), copy);
      }
    }
  return out;
}

}  // namespace trainer::parallel
