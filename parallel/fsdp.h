// ShardedParameters: ZeRO-3 / fully sharded data parallelism over a model's
// blocks (docs/architecture.md "Parallelism"), as PyTorch's FSDP2
// (fully_shard per block) and DeepSpeed ZeRO-3 do.
//
// A unit is a set of the model's blocks whose parameters are sharded as one
// flat buffer: each block is a unit, except that blocks sharing a parameter
// (GPT's tied token embedding and head) form one. DataParallel takes the
// units as its buckets (DataParallelOptions::units, transient) and
// ZeroOptimizer (stage 3) holds this rank's block of each as the only
// lasting copy of the parameters. This class is the block wrapper
// "shard_parameters", outermost (around recomputation):
//
//   forward of a block   its unit is all-gathered into a new flat buffer (or
//                        a prefetch of it awaited), the parameters pointed
//                        into it, the next unit's gather started (prefetch);
//                        after the unit's last block the buffer is freed
//                        (reshard_after_forward), except for the last
//                        keep_last units, whose backward comes first;
//   backward of a unit   an identity on the unit's outputs gathers it again
//                        before its gradients are computed, and prefetches
//                        the unit before it; once DataParallel has started
//                        the unit's reduce-scatter the buffer is freed.
//
// Parameters that are freed keep their shape, dtype and device but no
// memory (release_storage); the optimizer and the loop never read them.
// Gathered in a narrower dtype (ZeroOptions::param_dtype, bf16 under
// precision bf16) they are tensors of that dtype while gathered, and f32
// again when freed. A
// tensor a block saved for backward that is a view of a gathered buffer
// keeps that buffer alive, so values stay right whatever is freed.
//
// The first step checks the order: before each gather every rank says which
// unit it gathers, and a rank that differs from rank 0 is an Error naming
// both units on every rank (not a hang). Prefetching starts after it.
//
//   std::shared_ptr<ZeroOptimizer> zero;     // stage 3, over dp.buckets()
//   ShardedParameters sharded(model, units, dp, &zero, {.keep_last = 1});
//   dp_options.on_bucket_started = [&](int b) { sharded.bucket_started(b); };
//
// Glossary: unit = blocks sharded together; gathered = the unit's
// parameters have memory (a flat buffer of the whole unit); prefetch = a
// gather started before the unit is needed.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/work.h"
#include "layers/block_list.h"
#include "parallel/ddp.h"
#include "parallel/trace.h"
#include "parallel/zero.h"

namespace trainer::parallel {

struct ShardingOptions {
  bool reshard_after_forward = true;
  int keep_last = 1;  // the last units in forward order stay gathered after forward
  bool prefetch = true;
  // Units stay gathered from their first use to the end of the step
  // (end_step): a pipeline stage's micro-batches then gather each unit once
  // per step instead of twice per micro-batch, at the memory of its whole
  // parameters for the step.
  bool keep_for_step = false;
  Timeline* timeline = nullptr;  // records each gather as a comm span
};

// The units of blocks: block indices, in order; blocks that share a
// parameter tensor in one unit (which runs from the first to the last of
// them). `only`: these blocks (a pipeline stage's), empty: all.
std::vector<std::vector<size_t>> sharding_units(const BlockList& blocks,
                                                const std::vector<size_t>& only = {});
// units smaller than min_numel elements of trainable parameters merged
// with their neighbours in order (by first block) until each holds at
// least that many (a unit as large stays alone; the last may hold fewer; a
// unit of blocks apart, as a tied embedding and head, stays alone):
// fewer, larger gathers and reduce-scatters for a model of many small
// blocks (ResNet-50's first stages). min_numel 0: as given.
std::vector<std::vector<size_t>> merge_units(const BlockList& blocks,
                                             std::vector<std::vector<size_t>> units,
                                             int64_t min_numel);
// The trainable parameters of each unit, for DataParallelOptions::units (a
// tensor listed once, in the first unit that holds it).
std::vector<std::vector<Tensor>> unit_parameters(const BlockList& blocks,
                                                 const std::vector<std::vector<size_t>>& units);

class ShardedParameters {
 public:
  // model's blocks, split into units (sharding_units; a pipeline stage's
  // blocks only: the others never run here); *zero is set after this is
  // built and must be a stage-3 ZeroOptimizer over dp's buckets.
  ShardedParameters(Model& model, std::vector<std::vector<size_t>> units, const DataParallel& dp,
                    const std::shared_ptr<ZeroOptimizer>* zero, ShardingOptions options = {});
  ~ShardedParameters();
  ShardedParameters(const ShardedParameters&) = delete;
  ShardedParameters& operator=(const ShardedParameters&) = delete;

  // DataParallelOptions::on_bucket_started: the unit's gradients are on
  // their way to the shards, so its parameters are freed.
  void bucket_started(int bucket);
  // Every sharded parameter's value, all-gathered into new memory that does
  // not alias the model's (a checkpoint's copy). Collective.
  std::map<const TensorImpl*, Tensor> gathered_copies();
  // Forward passes whose number differs between the ranks (an evaluation's
  // shares of the validation set), each unit gathered as it runs: between
  // begin_lockstep() and end_lockstep() every forward pass starts with a
  // vote over the ranks, and end_lockstep() serves the gathers of the
  // ranks still running (each unit in forward order, gathered and freed)
  // until every rank has called it. Collective.
  void begin_lockstep();
  void end_lockstep();
  // After each optimizer step: frees every unit still gathered (the shards
  // changed) and, after the first, ends the order check (prefetching begins).
  void end_step();

  // Whether the parameters are sharded yet (at the first forward or
  // begin_lockstep()):
  // until then they hold their whole values.
  bool sharded() const { return sharded_; }
  int64_t gathers() const { return gathers_; }
  int64_t prefetches() const { return prefetches_; }

 private:
  struct Unit;
  TensorList run_block(const BlockSpec& block, const TensorList& inputs, const BlockFn& next);
  void before_backward(size_t unit, size_t block);
  void gather(size_t unit);
  void start_gather(size_t unit);
  void prefetch(size_t block, int direction);
  void release(size_t unit);
  void check_order(size_t unit);
  void shard_once();
  // The ranks still running forward passes, this one counting if running.
  int64_t vote(bool running);

  Model& model_;
  comm::Communicator* comm_;  // the data-parallel group's (DataParallel's)
  const std::shared_ptr<ZeroOptimizer>* zero_;
  ShardingOptions options_;
  std::vector<Unit> units_;
  std::map<int, size_t> unit_of_bucket_;
  static constexpr size_t kNoUnit = size_t(-1);
  std::vector<size_t> block_unit_;   // per block index; kNoUnit: not sharded here
  size_t first_block_ = size_t(-1);  // where a forward pass begins
  bool sharded_ = false;
  bool order_checked_ = false;
  bool lockstep_ = false;
  int64_t gathers_ = 0, prefetches_ = 0;
};

}  // namespace trainer::parallel
