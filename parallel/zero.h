// ZeRO stage 1: the optimizer state sharded across the data-parallel group.
//
// The parameters are laid out in flat segments, each split into world_size
// equal blocks (the last ones padded), and rank r owns block r of every
// segment. One step: the gradients are reduce-scattered (averaged) so each
// rank holds the averaged gradient of its blocks; the wrapped optimizer
// (SGD or AdamW, the same update math as without ZeRO) updates those blocks
// only, so each rank keeps 1/world_size of the optimizer state; the updated
// blocks are all-gathered back into every rank's parameters.
//
// Standalone (after a plain backward, no DataParallel reduction):
//   ZeroOptimizer opt(dp_comm, groups, [&](std::vector<optim::ParamGroup> g) {
//     return std::make_unique<optim::AdamW>(std::move(g), adamw_options);
//   });
//   loss.backward();
//   opt.set_lr(lr);
//   opt.clip_grad_norm(1.0);     // optional: the norm of the averaged gradient
//   opt.step();                  // reduce-scatter, shard update, all-gather
//   opt.zero_grad();
//
// Under DataParallel the segments are its buckets and each bucket is
// reduce-scattered as soon as backward has produced it (overlap):
//   std::shared_ptr<ZeroOptimizer> zero;   // outlives every backward
//   DataParallelOptions dpo;
//   dpo.reduce = zero_bucket_reduce(&zero);
//   DataParallel dp(model, dp_comm, dpo);
//   zero = std::make_shared<ZeroOptimizer>(dp_comm, groups, make_optimizer,
//                                          ZeroOptions{.buckets = &dp.buckets()});
//   ... backward; dp.finish(); zero->step(); zero->zero_grad(); dp.zero_grad();
//
// Parameters on a GPU: the collectives run on host buffers; the optimizer
// updates this rank's block on the GPU (ZeroOptions::stage_through_host).
//
// Layout (deterministic from the parameter list and the world size): without
// buckets one segment holds the parameters of the groups in order; with
// buckets each bucket is a segment in its own order. A segment of numel
// elements has blocks of shard_numel = ceil(numel / world_size) (rounded up
// to whole pages under ZeroOptions::gather_in_place); rank r owns
// elements [r * shard_numel, min(numel, (r + 1) * shard_numel)). The part of
// one parameter inside a rank's block is a piece; the wrapped optimizer sees
// each piece as a 1-d parameter of the piece's group (same weight decay and
// lr scale) under the parameter's name.
//
// Parameters without gradients follow torch: a parameter with no gradient on
// any rank is skipped (its state and step count do not advance); one with a
// gradient on some ranks only counts as zero on the others (as DDP averages).
//
// State: each rank's shard, names recording the layout:
//   "<param>.<slot>[<begin>:<end>]"  the piece's slot, elements begin..end of the
//                                    flattened parameter ("fc.weight.exp_avg[0:640]")
//   "zero1.rank<r>.layout"           i64 [3 + segments (+ 1)]: world size, rank,
//                                    segment count, numel of each segment (and
//                                    the blocks' multiple when it is not 1)
// load_state() refuses a state saved with another layout (world size, rank,
// segments) or without ZeRO-1 with an Error saying what differs.
//
// Glossary: rank/world = index and size of the data-parallel communicator;
// segment = a flat buffer of parameters sharded as a whole; block/shard =
// one rank's part of a segment; piece = one parameter's part of a block.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "comm/collectives.h"
#include "comm/communicator.h"
#include "comm/work.h"
#include "optim/optimizer.h"
#include "parallel/ddp.h"

namespace trainer::parallel {

// A flat buffer of parameters split into world_size blocks.
struct ZeroSegment {
  std::vector<NamedTensor> params;
  std::vector<int64_t> offsets;  // element offset of each parameter in the segment
  int64_t numel = 0;
  int64_t shard_numel = 0;  // ceil(numel / world_size)
  // Rank r's elements [first, second) of the segment (empty past the end).
  std::pair<int64_t, int64_t> shard_range(int rank) const;
};

// Builds the segments over params_per_segment (empty lists are dropped),
// each block rounded up to a multiple of align elements.
std::vector<ZeroSegment> zero_segments(
    const std::vector<std::vector<NamedTensor>>& params_per_segment, int world_size,
    int64_t align = 1);

// ZeroOptions::gather_in_place: the elements of dtype in a page, the
// multiple every block is rounded to (and DataParallel's transient buckets
// to world_size times it, DataParallelOptions::bucket_numel_multiple).
int64_t gather_in_place_align(DType dtype);

// This rank's elements [begin, end) of a flattened parameter and their
// values (begin == end: it holds none of it).
struct ParameterShard {
  int64_t begin = 0, end = 0;
  Tensor values;
};

// Builds the wrapped optimizer over the pieces of this rank, grouped as the
// parameters were (the ZeroOptimizer keeps the groups' weight decay and lr scale).
using OptimizerFactory =
    std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>;

struct ZeroOptions {
  // What is sharded besides the optimizer state. 1: nothing (ZeRO-1). 2:
  // the gradients (ZeRO-2): each bucket (transient, DataParallelOptions::
  // transient_buckets, padded to a multiple of the world size) is
  // reduce-scattered into this rank's block and added there, so micro-steps
  // accumulate in the shard; no full-size buffer lives between steps. 3: the
  // parameters too (ZeRO-3): this rank's block of each segment is the only
  // lasting copy of its parameters; the segments are DataParallel's units,
  // gathered before use (gather_segment_async, parallel/fsdp.h) and step()
  // gathers nothing. Stages 2 and 3 need buckets and CPU parameters.
  int stage = 1;
  // DataParallel's buckets as the segments; their reduction must be
  // zero_bucket_reduce(). Null: one segment over the groups' parameters,
  // reduced in step().
  const std::vector<Bucket>* buckets = nullptr;
  // Stage 1 on the CPU: the buckets' flat buffers are the segments' own
  // (DataParallelOptions::reduce_in_place, padded to a multiple of the world
  // size): the gradients are reduce-scattered where backward wrote them,
  // and the updated parameters all-gathered there, without a second buffer
  // the size of the model. In place over a shared region when DataParallel
  // shared them. Afterwards the parameters' gradients (views of the buckets)
  // hold other values until zero_grad().
  bool reduce_in_buckets = false;
  comm::CollectiveOptions collective{};  // segment size and timeout of both collectives
  // Parameters on a device (a GPU) are always staged: the collectives run on
  // host buffers, the gradients are copied device -> host into them, the
  // reduced block host -> device, where the wrapped optimizer updates the
  // block, and the updated block back through the host for the all-gather.
  // True stages CPU parameters the same way (tests of the GPU's data flow).
  bool stage_through_host = false;
  // Unstaged segments live in a shared region (comm/shm_region.h) when every
  // rank runs on this host, so the reduce-scatter and all-gather run in place
  // over the shared-memory channel instead of the ring (stages 2 and 3: the
  // blocks of parameters, which each gather reads where they lie). Every
  // rank must pass the same value (creation is collective).
  bool shared_buffers = true;
  // Hybrid sharding (HSDP): the replica groups of the same shards. comm is
  // then one group of sharding ranks; each reduced block (averaged over
  // comm) is averaged again over replicate, so the gradient is the mean
  // over both. Null: no replicas.
  std::shared_ptr<comm::Communicator> replicate;
  // Mixed precision, as FSDP2's policy (unset: the parameters' dtype).
  // param_dtype (stage 3): the dtype the parameters are gathered in. bf16
  // rounds this rank's f32 block into a small slot at each gather (in the
  // shared region too) and gathers that (half the bytes); the gathered
  // parameters are bf16 tensors until freed, so forward computes with them
  // and their gradients arrive in bf16.
  // reduce_dtype (stages 2 and 3): the transient buckets' dtype and their
  // reduce-scatter's; a bf16 reduced block is added into the f32 gradient
  // shard. The master block and the optimizer state stay in the parameters' dtype.
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
  // Stage 3 with every rank on this host (the blocks in a shared region) and
  // the parameters gathered in their own dtype: each block starts on a page
  // and fills whole pages (gather_in_place_align), and a segment's gathered
  // parameters are one read-only mapping of the ranks' blocks side by side
  // (gathered_in_place), read where they lie: a gather copies nothing. The
  // ranks wait for each other (sync_blocks) after the blocks change. Where
  // the mapping cannot be made, gathers copy as without it.
  bool gather_in_place = false;
  // Parameters of the groups held whole on this rank, outside the segments
  // and their collectives (the experts of expert parallelism): the wrapped
  // optimizer updates them with the gradients they hold, which the caller
  // has averaged; their state is saved whole, named as without ZeRO
  // ("<param>.<slot>"). local_copies: how many ranks of comm hold each (the
  // gradient norm counts it once).
  std::vector<Tensor> local;
  int local_copies = 1;
  // The gradient norm of clip_grad_norm also sums over these communicators
  // (the other pipeline stages, the other tensor-parallel ranks: they hold
  // the model's other parameters, or other parts of them); nulls are skipped.
  std::vector<std::shared_ptr<comm::Communicator>> norm_also_over;
  // Parameters clip_grad_norm leaves out because another rank counts them
  // (the second copy of a weight tied across pipeline stages; a parameter
  // every tensor-parallel rank holds whole, counted by the first).
  std::vector<Tensor> norm_skips;
};

// An optim::Optimizer: the loop steps, clips and checkpoints it as it does
// the optimizer it wraps.
class ZeroOptimizer final : public optim::Optimizer {
 public:
  // Collective over comm (all ranks pass the same groups). Throws Error for
  // parameters of mixed dtypes, or buckets holding a parameter of no group.
  ZeroOptimizer(std::shared_ptr<comm::Communicator> comm, std::vector<optim::ParamGroup> groups,
                const OptimizerFactory& make_optimizer, const ZeroOptions& options = {});
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  // Averages the gradients over the ranks into this rank's blocks (standalone:
  // a reduce-scatter per segment; with buckets: waits for their reductions).
  // Once per step; step() calls it if it was not called.
  void reduce_gradients();
  // Clips the averaged gradient to a global 2-norm of max_norm (as
  // optim::clip_grad_norm on the full averaged gradient) and returns the norm
  // before clipping. Reduces first if needed. Collective.
  double clip_grad_norm(double max_norm) override;
  // Updates this rank's blocks with the wrapped optimizer and all-gathers the
  // parameters. Collective.
  void step() override;
  // Drops the parameters' gradients (set_to_none) or fills them with zeros,
  // and forgets a reduction whose step was skipped. Every iteration.
  void zero_grad(bool set_to_none = true) override;

  void set_lr(double lr) override { optimizer_->set_lr(lr); }
  double lr() const override { return optimizer_->lr(); }
  // The full parameter groups (as given).
  const std::vector<optim::ParamGroup>& param_groups() const override { return groups_; }
  const std::vector<ZeroSegment>& segments() const { return segments_; }
  // The wrapped optimizer over this rank's pieces.
  const optim::Optimizer& shard_optimizer() const { return *optimizer_; }
  int rank() const { return comm_->rank(); }
  int world_size() const { return comm_->size(); }
  // Whether the flat buffers (stage 1), or the blocks of parameters (stages
  // 2 and 3), lie in a shared region (collectives in place).
  bool shared_buffers() const { return shared_; }

  // This rank's shard of the state (names as in the header comment), aliasing
  // the live buffers.
  std::vector<NamedTensor> state() const override;
  // Restores a state saved by state() on the same layout and rank; otherwise
  // throws Error saying what differs and changes nothing.
  void load_state(const std::vector<NamedTensor>& state) override;
  // Restores this rank's shard from a whole state ("<param>.<slot>" of the
  // parameter's shape, "<param>.step"), as one process or any other sharding
  // saved it: each piece takes its elements. Error naming a missing or
  // misshapen entry, changing nothing.
  void load_whole_state(const std::map<std::string, Tensor>& whole);

  // Calls f on this rank's part of param's averaged gradient (reducing
  // first): a 1-d host view of elements [begin, end) of the flattened
  // parameter, which f may change (a staged copy follows). Not called when
  // this rank's blocks hold none of param. A parameter alone in its segment
  // (DataParallelOptions::own_bucket) has the same [begin, end) on every
  // model that holds it.
  void update_reduced_gradient(
      const Tensor& param, const std::function<void(Tensor& piece, int64_t begin, int64_t end)>& f);

  // The reduction of one DataParallel bucket: its gradients reduce-scattered
  // (averaged) into this rank's block. Used through zero_bucket_reduce().
  comm::Work reduce_bucket(const Bucket& bucket);

  // Stages 2 and 3: the flat buffer of the next transient bucket
  // (DataParallelOptions::transient_buffer), numel elements of dtype. Where
  // the ranks share a host, one of two slots of a shared region, each as
  // large as the largest bucket and taken in turn (after its previous
  // bucket's reduction has finished), so the reduce-scatter runs in place;
  // else a new tensor.
  Tensor transient_buffer(int64_t numel, DType dtype);

  // ---- stage 3 ----
  // Takes this rank's block of every segment from the parameters' current
  // values (once, before the first gather: after a checkpoint has loaded).
  void shard_parameters();
  // All-gathers segment s's parameters into flat ([world_size * shard_numel]
  // on the CPU, alive until the returned work finishes), in the order of
  // the segment's parameters and offsets, in flat's dtype: master_dtype(),
  // or gather_dtype() (the block rounded to it first).
  comm::Work gather_segment_async(int segment, const Tensor& flat);
  // ZeroOptions::gather_in_place: segment s's parameters gathered, a
  // read-only view of every rank's block where it lies ([world_size *
  // shard_numel] of master_dtype()); undefined when gathers copy.
  Tensor gathered_in_place(int segment) const;
  bool gathers_in_place() const { return !in_place_.empty(); }
  // After this rank's blocks changed (a step, a checkpoint loaded, the
  // first sharding) and before any rank reads them in place: waits for
  // every rank to get here. Collective; nothing when gathers copy.
  void sync_blocks();
  // Every parameter of the segments, by tensor, with this rank's part of it:
  // views of the master blocks (a checkpoint's pieces, written without a gather).
  std::map<const TensorImpl*, ParameterShard> parameter_shards() const;
  int stage() const { return options_.stage; }
  // The parameters' dtype (the master blocks') and the one stage 3 gathers
  // them in (ZeroOptions::param_dtype).
  DType master_dtype() const { return dtype_; }
  DType gather_dtype() const { return gather_dtype_; }

 private:
  struct Piece;
  struct SegmentBuffers;
  // The segments' flat buffers and blocks of parameters, and the slots of
  // transient buckets: in a shared region where the ranks share a host.
  void allocate_buffers();
  // ZeroOptions::gather_in_place where it applies (stage 3, more than one
  // rank, gathered in the master dtype, not staged), and its mappings.
  bool in_place_wanted() const;
  void map_in_place();
  void build_pieces(const OptimizerFactory& make_optimizer);
  void reduce_standalone();
  comm::Work reduce_transient_bucket(const Bucket& bucket);
  // After the update: the stepped blocks all-gathered into the parameters
  // (stage 1 through the flat buffers, stage 2 through a transient one).
  void gather_parameters();
  void gather_parameters_transient();
  // Stage 2 with the blocks in a shared region: the parameters copied
  // straight from every rank's blocks.
  void copy_parameters_from_region();
  void mark_missing_gradients(const std::vector<bool>& has_grad);
  std::string layout_name() const;
  Tensor layout_tensor() const;
  // The state names of the wrapped optimizer mapped to the layout names.
  std::vector<std::pair<std::string, std::string>> state_names() const;

  std::shared_ptr<comm::Communicator> comm_;
  std::vector<optim::ParamGroup> groups_;
  ZeroOptions options_;
  DType dtype_ = DType::f32;
  DType gather_dtype_ = DType::f32;  // options_.param_dtype, else dtype_
  DType reduce_dtype_ = DType::f32;  // options_.reduce_dtype, else dtype_
  Device device_;                    // the parameters'
  bool staged_ = false;              // the collectives' buffers are host copies of device ones
  bool shared_ = false;  // the flat buffers lie in a shared region: collectives in place
  std::vector<ZeroSegment> segments_;
  std::vector<SegmentBuffers> buffers_;  // per segment
  std::vector<Piece> pieces_;            // this rank's, by group
  // The wrapped optimizer's parameters in its order: a piece (its index) or
  // a local parameter (piece -1).
  struct Wrapped {
    int piece = -1;
    NamedTensor local;
  };
  std::vector<Wrapped> wrapped_;
  std::vector<NamedTensor> local_;  // ZeroOptions::local, by group
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::set<const TensorImpl*> norm_skips_;  // options_.norm_skips
  std::vector<comm::Work> pending_;         // bucket reductions of this step
  // Stages 2 and 3 on one host: the transient buckets' slots, taken in
  // turn, each with the reduction of the bucket that used it last.
  struct Slot {
    Tensor buffer;
    comm::Work reduced;
  };
  std::vector<Slot> slots_;
  size_t next_slot_ = 0;
  // Stage 3 gathering in a narrower dtype: this rank's block is rounded into
  // one of two slots (shared where the buffers are), taken in turn, each
  // with the gather that read it last (at most two are in flight: a unit's
  // and the next one's prefetch).
  struct GatherSlot {
    Tensor buffer;
    comm::Work gathered;
  };
  std::vector<GatherSlot> gather_slots_;
  size_t next_gather_slot_ = 0;
  std::vector<Tensor> in_place_;  // per segment, ZeroOptions::gather_in_place's views
  int64_t block_align_ = 1;       // each block a multiple of it (zero_segments)
  bool reduced_ = false;
};

// DataParallelOptions::reduce for ZeRO-1: forwards each bucket to
// (*zero)->reduce_bucket. *zero is set after DataParallel is built (the
// optimizer needs its buckets) and must stay alive while backward runs.
BucketReduceFn zero_bucket_reduce(const std::shared_ptr<ZeroOptimizer>* zero);

}  // namespace trainer::parallel
