// A model as a pipeline of stages (docs/architecture.md "Parallelism"): which
// blocks of its block list (layers/block_list.h) each stage runs, which
// tensors travel between stages, and the stage's own parameters.
//
// A split cuts the block list into V x P contiguous pieces, the virtual
// stages: piece v runs on pipeline stage v % P as its chunk v / P (one chunk
// per stage unless the schedule is interleaved, parallel/schedule.h).
//
//   StageSplit split = even_split(blocks.size(), /*stages=*/2, /*chunks=*/1);
//   PipelinePlan plan(blocks, split);
//   for (const Transfer& t : plan.transfers()) ...   // "x" from piece 0 to piece 1
//   const Piece& p = plan.piece(1);                   // its blocks, inputs and outputs
//   StageModule stage(blocks, plan.blocks_of_stage(0));  // stage 0's parameters, global names
//
// Transfers. A piece reads a tensor either as a model input (each stage
// takes those from its own batch: tokens, images, an LSTM's carried state)
// or from the piece whose block wrote it last: that tensor is a Transfer
// from the producing piece straight to the consuming one, skipping the
// pieces in between (torchgpipe's portals, for long skip connections). A
// piece sends each tensor it writes once to every later piece that reads
// it; the gradient comes back along the same transfer. Model outputs go to
// the last piece (the loss), except carried state (a name that is both a
// model input and a model output), which stays on the piece that wrote it.
//
// Glossary: piece = virtual stage (a contiguous range of blocks); stage =
// pipeline rank (0 .. P-1); chunk = which of its pieces a stage runs.
#pragma once

#include <string>
#include <vector>

#include "layers/block_list.h"

namespace trainer::parallel {

struct StageSplit {
  int stages = 1;
  int chunks = 1;
  // Block boundaries of the pieces: piece v runs blocks [bounds[v], bounds[v + 1]).
  std::vector<size_t> bounds;
  int pieces() const { return stages * chunks; }
  int stage_of(int piece) const { return piece % stages; }
  int chunk_of(int piece) const { return piece / stages; }
  int piece(int stage, int chunk) const { return chunk * stages + stage; }
  bool operator==(const StageSplit&) const = default;
};

// Blocks spread as evenly as counts allow (earlier pieces get the extra ones).
StageSplit even_split(size_t blocks, int stages, int chunks);
// A split from the first block of every piece after the first ("auto" aside:
// parallel.stages = [3, 6] on 9 blocks gives [0, 3), [3, 6), [6, 9)).
// Error naming what is wrong: counts, order, range.
StageSplit split_at(size_t blocks, int stages, int chunks, const std::vector<int64_t>& starts);
// The split minimising the largest piece's cost (contiguous pieces, each of
// at least one block), given each block's cost; every piece's memory (the
// sum of its blocks' memory) must stay within memory_limit (<= 0: none).
// Error when no split fits.
StageSplit balanced_split(const std::vector<double>& block_cost,
                          const std::vector<double>& block_memory, double memory_limit, int stages,
                          int chunks);
// "[0, 3) [3, 6) [6, 9)".
std::string to_string(const StageSplit& split);

// A tensor sent from one piece to a later one.
struct Transfer {
  std::string name;
  int from = 0, to = 0;  // pieces
  // Filled in by the runtime's shape probe: what travels, and whether its
  // gradient comes back (floating-point tensors).
  Shape shape;
  DType dtype = DType::f32;
  bool has_gradient = true;
  // A channels-last [N, C, H, W] activation (core/ops_conv.h) travels as
  // its [N, H, W, C] bytes, and so does its gradient: no layout change.
  bool channels_last = false;
};

struct Piece {
  size_t first = 0, last = 0;  // blocks
  // Per entry of boundary(first): kModelInput (taken from the batch),
  // kAbsent (not read here: undefined), or the index of the Transfer that brings it.
  std::vector<int> input_source;
  // Per entry of boundary(last): the transfers that send it on (empty:
  // none), and whether it stays here as a model output (the loss's, on the
  // last piece; carried state on its piece).
  std::vector<std::vector<int>> output_transfers;
  std::vector<bool> output_kept;
  std::vector<int> receives;  // transfers into this piece, in order
  std::vector<int> sends;     // transfers out of it, in order
  static constexpr int kModelInput = -1;
  static constexpr int kAbsent = -2;
};

class PipelinePlan {
 public:
  PipelinePlan() = default;
  PipelinePlan(const BlockList& blocks, StageSplit split);

  const StageSplit& split() const { return split_; }
  const Piece& piece(int v) const { return pieces_[size_t(v)]; }
  int pieces() const { return int(pieces_.size()); }
  const std::vector<Transfer>& transfers() const { return transfers_; }
  std::vector<Transfer>& transfers() { return transfers_; }
  // The block ranges of a stage's chunks, in chunk order.
  std::vector<std::pair<size_t, size_t>> blocks_of_stage(int stage) const;

 private:
  StageSplit split_;
  std::vector<Piece> pieces_;
  std::vector<Transfer> transfers_;
};

// The parameters and buffers of some block ranges as one Module, under the
// model's global names (the members are the model's own modules, shared):
// what a stage's optimizer, data parallelism and checkpoint part see.
// forward() is not defined: a stage runs its blocks through the plan.
class StageModule : public Module {
 public:
  StageModule(const BlockList& blocks, const std::vector<std::pair<size_t, size_t>>& ranges);
  Tensor forward(const Tensor& x) override;
};

}  // namespace trainer::parallel
