// DataParallel: data-parallel training of any Module over a communicator
// (docs/architecture.md "Parallelism"), in the manner of PyTorch's DistributedDataParallel.
//
// At construction the parameters and buffers are broadcast from rank 0, so
// every replica starts equal. The parameters that require a gradient are
// grouped into buckets in reverse registration order (the order backward
// produces their gradients), each bucket a flat buffer of at most
// bucket_bytes (the first one smaller, first_bucket_bytes, so communication
// starts early; and the last one, the first-registered parameters up to
// last_bucket_bytes, whose gradients come at the very end of backward, on
// its own, so the reduction nothing can hide is small). Each parameter's grad() is a view into its
// bucket's buffer, so the reduction needs no copies. A gradient hook on every parameter counts the
// gradients of the step; once all of a bucket's have arrived its reduction (allreduce, averaged
// over the ranks) starts on the communicator's progress thread while backward goes on with the
// layers below. Buckets start strictly in index order on every rank, so the ranks issue the same
// collectives in the same order. finish() starts whatever did not start (parameters that got no
// gradient contribute zeros) and waits for all; the optimizer steps after it.
//
//   DataParallel dp(model, dp_comm, {.bucket_bytes = 25 << 20});
//   for (int micro = 0; micro < accum; ++micro) {
//     DataParallel::NoSync guard = dp.no_sync(micro + 1 < accum);  // local accumulation
//     (loss_fn(dp.forward(x[micro]), y[micro]) * (1.0 / accum)).backward();
//   }
//   dp.finish();          // gradients are now the average over the ranks
//   opt.step();
//   dp.zero_grad();       // releases the gradients (set_to_none); the buckets stay
//
// Gradient accumulation: inside a NoSync scope (or with set_sync(false)) the
// hooks only accumulate; the next synchronised backward reduces the sum.
// With overlap off every bucket is reduced in finish(), after backward (for
// comparison). Each parameter's bucket view is its grad destination
// (Tensor::set_grad_destination): after zero_grad() (or
// optimizer.zero_grad(), set_to_none) the first gradient of the next step is
// written there by the op that makes it (conv2d and linear write in place;
// other gradients are copied in), and later ones of the step accumulate
// there. Zeroing the buckets and adding into them would cost a fill and a
// read more of every gradient byte.
//
// Glossary: rank/world = index and size of the data-parallel communicator;
// bucket = a group of parameters whose gradients are reduced as one message;
// ready = all gradients of a bucket for this backward have arrived; sync
// step = a backward whose gradients are reduced (not a NoSync micro-step).
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "comm/collectives.h"
#include "comm/communicator.h"
#include "comm/work.h"
#include "core/tensor.h"
#include "layers/module.h"
#include "parallel/trace.h"

namespace trainer::parallel {

// One bucket of gradients.
struct Bucket {
  int index = 0;
  Tensor flat;                      // [numel] contiguous; the gradients live here
  std::vector<NamedTensor> params;  // in bucket order (reverse registration)
  std::vector<int64_t> offsets;     // element offset of each parameter's gradient in flat
  TensorList grads;                 // params[i]'s gradient: a view of flat at offsets[i]
  int64_t numel() const { return flat.numel(); }
};

// Starts the reduction of one bucket's flat gradients; the result must be in
// bucket.flat when the returned Work finishes. The default averages with
// allreduce_async. ZeRO replaces it (reduce-scatter into its shard).
using BucketReduceFn = std::function<comm::Work(comm::Communicator&, const Bucket&)>;

struct DataParallelOptions {
  size_t bucket_bytes = size_t(25) << 20;
  size_t first_bucket_bytes = size_t(1) << 20;  // the last layers' bucket, reduced first
  // The first layers' bucket, reduced last: the leading parameters up to this
  // size (at least one) when the rest are left for other buckets; 0: none.
  size_t last_bucket_bytes = size_t(1) << 20;
  bool overlap = true;  // false: reduce every bucket in finish(), after backward
  // CPU buckets live in a shared region (comm/shm_region.h) when every rank
  // runs on this host, so the default reduction reads and writes the peers'
  // buckets in place instead of copying through staging areas. Ignored with
  // a custom reduce, unless reduce_in_place. Every rank must pass the same
  // value (creation is collective).
  bool shared_buckets = true;
  // The custom reduce works on the buckets where they lie (ZeRO-1 reduces
  // in place in them): CPU buckets are then shared as above all the same,
  // and every bucket is padded to bucket_numel_multiple elements (zeros
  // past its gradients).
  bool reduce_in_place = false;
  bool broadcast_at_start = true;  // parameters and buffers from rank 0
  // The communicator's progress thread polls (spins) while it waits for
  // peers, taking compute time from backward where every core runs a rank.
  // true lowers that thread to nice 19: it then reduces in the gaps and at
  // full speed once the ranks wait in finish(). Off by default: on a machine
  // shared with other work the reductions starve (measured: 4.3 s per step
  // for ResNet-18's 47 MB at load 11 on 2 cores, against 0.5 s).
  bool low_priority_progress = false;
  // Algorithm and segment size of the default reduction (its op is always avg).
  comm::AllreduceOptions allreduce = {.op = comm::ReduceOp::avg};
  BucketReduceFn reduce = nullptr;  // empty: allreduce(avg) with the options above
  Timeline* timeline = nullptr;     // records each bucket's reduction as a comm span
  // Parameters that get a bucket of their own: its layout (and a ZeRO-1
  // shard of it) is then the same wherever the parameter is (a weight tied
  // across pipeline stages, whose two copies' gradients are added shard by shard).
  std::vector<Tensor> own_bucket;
  // Parameters left out: no bucket, no reduction, no broadcast (an expert
  // of expert parallelism, which other dp ranks do not hold alike).
  std::vector<Tensor> exclude;
  // The buckets as given: one per unit (a set of blocks whose parameters
  // are sharded together, parallel/fsdp.h), in forward order; the buckets
  // take them in reverse, each unit's parameters in reverse registration
  // order; an own_bucket parameter of a unit has a bucket of its own after
  // the unit's. Every parameter that requires a gradient must be in
  // exactly one. Empty: buckets by size, as above.
  std::vector<std::vector<Tensor>> units;
  // Sharded gradients (ZeRO-2 and -3): no bucket memory lives between
  // reductions. Backward puts each gradient in its parameter's grad() as
  // without data parallelism; once a bucket's have all arrived they are
  // copied into a new flat buffer of bucket_numel_multiple-padded size, the
  // parameters' gradients are dropped, and the reduction starts. Every
  // backward reduces (NoSync is ignored: the reduction accumulates in the
  // shard); end_backward() starts what did not start. The flat buffers are
  // freed once their reductions finish.
  bool transient_buckets = false;
  // Transient buckets, and those of reduce_in_place, are padded to a
  // multiple of this many elements.
  int64_t bucket_numel_multiple = 1;
  // Where a transient bucket's flat buffer comes from (numel, the
  // parameters' dtype), on the backward thread, in bucket order; empty: a
  // new tensor. ZeRO hands out slots of a shared region, so the
  // reduce-scatter runs in place, in its reduce dtype (the gradients are
  // converted into it).
  std::function<Tensor(int64_t numel, DType dtype)> transient_buffer;
  // Called on the backward thread after bucket `index` started its reduction
  // (transient buckets: the unit's gradients are complete).
  std::function<void(int index)> on_bucket_started;
};

// Flat CPU buffers of the given element counts and dtypes in one shared
// region of comm (comm/shm_region.h), each aligned to align bytes (a power
// of two) and zero-filled, so collectives on them run in place; empty when
// there is no region (one rank, ranks on several hosts). Collective: every
// rank passes the same list.
std::vector<Tensor> shared_flat_buffers(comm::Communicator& comm,
                                        const std::vector<std::pair<int64_t, DType>>& sizes,
                                        size_t align = 64);

class DataParallel {
 public:
  DataParallel(std::shared_ptr<Module> module, std::shared_ptr<comm::Communicator> comm,
               DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // The wrapped module's forward.
  Tensor forward(const Tensor& x) { return module_->forward(x); }
  Tensor operator()(const Tensor& x) { return forward(x); }

  Module& module() const { return *module_; }
  const std::shared_ptr<Module>& module_ptr() const { return module_; }
  comm::Communicator& comm() const { return *comm_; }
  int rank() const { return comm_->rank(); }
  int world_size() const { return comm_->size(); }
  const DataParallelOptions& options() const { return options_; }
  const std::vector<Bucket>& buckets() const;

  // Copies rank root's parameters and buffers to every rank (collective).
  void broadcast_state(int root = 0);
  // Copies rank root's buffers (BatchNorm running statistics) to every rank
  // (collective): before a sharded evaluation, so every rank evaluates the
  // same model, as DDP's broadcast_buffers does before each forward.
  void broadcast_buffers(int root = 0);

  // Whether the next backward reduces its gradients (default true).
  void set_sync(bool sync);
  bool sync() const;
  // Turns synchronisation off for its lifetime when active (a non-final
  // micro-step of gradient accumulation), then restores the previous setting.
  class NoSync {
   public:
    NoSync(DataParallel* dp, bool active);
    ~NoSync();
    NoSync(NoSync&& other) noexcept;
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    DataParallel* dp_;
    bool previous_ = true;
  };
  NoSync no_sync(bool active = true) { return NoSync(this, active); }

  // After a sync step's backward, before the optimizer: starts the buckets
  // that did not start and waits for all. Afterwards every parameter's grad()
  // is its bucket view holding the average over the ranks. Rethrows a
  // communication error (a dead peer) as trainer::Error. Does nothing after
  // a NoSync backward.
  void finish();

  // Releases every parameter's gradient, as optimizer.zero_grad(set_to_none)
  // does; the next backward's gradients land in the bucket views.
  void zero_grad();

  // After each backward with transient buckets: starts the buckets that did
  // not start (their missing gradients count as zeros) so the next backward
  // begins afresh. Nothing otherwise.
  void end_backward();

  // Buckets whose reduction started in backward, before finish(), in the
  // last sync step (0 with overlap off).
  int buckets_started_in_backward() const;

  struct Impl;

 private:
  std::shared_ptr<Module> module_;
  std::shared_ptr<comm::Communicator> comm_;
  DataParallelOptions options_;
  std::shared_ptr<Impl> impl_;  // shared with the gradient hooks (they outlive this object)
};

}  // namespace trainer::parallel
