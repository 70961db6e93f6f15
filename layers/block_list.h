// Models as block lists: a model's forward is an ordered list of blocks, each
// reading named tensors and writing named tensors, so a pipeline stage can be
// a contiguous slice of it and own only that slice's parameters (names kept
// global, as PyTorch's state_dict names them).
//
//   BlockList blocks({"tokens"}, {"logits"},
//                    {{.name = "embed", .members = {{"transformer.wte", wte}},
//                      .inputs = {"tokens"}, .outputs = {"x"},
//                      .fn = [=](const TensorList& in) { return TensorList{(*wte)(in[0])}; }},
//                     ...});
//   Tensor logits = blocks.run({tokens})[0];             // the whole forward
//   TensorList mid = blocks.run(0, 3, {tokens});         // blocks [0, 3): boundary(3)'s tensors
//   TensorList out = blocks.run(3, blocks.size(), mid);  // the rest: the same bits
//
// Glossary. A block's members are the modules it runs, each under its global
// parameter prefix ("layer1.0", "transformer.h.3"); its parameters are theirs.
// A boundary i (0 .. size) is the cut before block i: boundary(i) names the
// tensors live there (written before i, or model inputs, and read at or after
// i, or model outputs), in a fixed order. A long skip connection is a tensor
// one block writes under its own name and a later block reads (torchgpipe's
// portal): it is live, and so sent, across every boundary in between. Carried
// state (an LSTM's h and c) is a model input and a model output like any other.
// A tied parameter (GPT's head and token embedding) is one tensor in the
// members of two blocks; tied() lists it under both names.
//
// Names are resolved to slots once, at construction: running a block gathers
// its inputs and scatters its outputs by index, with no string lookups.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "layers/context_parallel.h"
#include "layers/module.h"
#include "layers/moe.h"
#include "layers/tensor_parallel.h"

namespace trainer {

// A module a block runs, under its global name prefix (no trailing dot).
struct BlockMember {
  std::string prefix;
  std::shared_ptr<Module> module;
};

// The computation of a block: its inputs (in BlockSpec::inputs order) to its
// outputs (in BlockSpec::outputs order). An input may be undefined when the
// model input it stands for is optional (an LSTM's zero initial state).
using BlockFn = std::function<TensorList(const TensorList& inputs)>;

struct BlockSpec {
  std::string name = {};  // "layer1.0", "transformer.h.3", "stem", "head"
  std::vector<BlockMember> members = {};
  std::vector<std::string> inputs = {"x"};
  std::vector<std::string> outputs = {"x"};
  BlockFn fn = {};
};

// Behaviour around each block's run: recomputation (keep the inputs, run
// again in backward), and the ones parallelisms add (gather a block's
// parameters before it and free them after, scatter a sequence). run gets
// the block and its inputs and must call next (the inner wrappers, then the
// block's function) at least once; it may call it under a guard, again in
// backward, or not record a graph.
struct BlockWrapper {
  std::string name;  // "recompute"; unique in a BlockList
  std::function<TensorList(const BlockSpec& block, const TensorList& inputs, const BlockFn& next)>
      run;
};

// Two global names of one parameter tensor (GPT's lm_head.weight and
// transformer.wte.weight), with the blocks that hold each.
struct TiedParameter {
  std::string name, tied_to;
  size_t block = 0, tied_block = 0;
};

class BlockList {
 public:
  BlockList() = default;
  // Checks that every input a block reads is written by an earlier block or
  // is a model input, and that every model output is written or passed through.
  BlockList(std::vector<std::string> model_inputs, std::vector<std::string> model_outputs,
            std::vector<BlockSpec> blocks);

  size_t size() const { return blocks_.size(); }
  const BlockSpec& operator[](size_t i) const { return blocks_[i]; }
  const std::vector<BlockSpec>& blocks() const { return blocks_; }
  // The tensors live at boundary i: boundary(0) is the model inputs,
  // boundary(size()) the model outputs.
  const std::vector<std::string>& boundary(size_t i) const { return boundaries_[i].names; }

  // Runs blocks [first, last) from boundary(first)'s tensors (in its order),
  // returning boundary(last)'s.
  TensorList run(size_t first, size_t last, const TensorList& inputs) const;
  TensorList run(const TensorList& inputs) const { return run(0, size(), inputs); }

  // Parameters (and buffers, for state) of blocks [first, last) under their
  // global names; a tensor two of those blocks share is listed once in
  // parameters and under every name in state, as PyTorch does.
  std::vector<NamedTensor> named_parameters(size_t first, size_t last) const;
  std::vector<NamedTensor> state(size_t first, size_t last) const;
  // Parameters held by several blocks under different names.
  const std::vector<TiedParameter>& tied() const { return tied_; }

  // Wrappers run around every block, the first added outermost (or, with
  // outermost, around all the others: the gather of sharded parameters
  // around recomputation). Adding a wrapper whose name is already there
  // replaces it in place.
  void add_wrapper(BlockWrapper wrapper, bool outermost = false);
  void remove_wrapper(const std::string& name);
  bool has_wrapper(const std::string& name) const;
  const std::vector<BlockWrapper>& wrappers() const { return wrappers_; }

  // Activation checkpointing, the wrapper "recompute": run() keeps of each block
  // only its inputs when it records a graph, and the backward runs the block
  // again (autograd::checkpoint) with the first run's dropout masks, leaving
  // generators and buffers (batch norm's running statistics) as they were:
  // the same gradients, bit for bit, for one block's activations at a time.
  // The masks are those of the Dropout layers under dropout_root (the
  // model), or without one those in the blocks' members.
  void set_recompute(bool on, Module* dropout_root = nullptr);
  bool recompute() const { return has_wrapper("recompute"); }

 private:
  struct Boundary {
    std::vector<std::string> names;
    std::vector<size_t> slots;
  };
  struct Slots {
    std::vector<size_t> in, out;
  };

  std::vector<BlockSpec> blocks_;
  std::vector<Slots> slots_;          // per block
  std::vector<Boundary> boundaries_;  // size() + 1
  size_t num_slots_ = 0;
  std::vector<TiedParameter> tied_;
  std::vector<BlockWrapper> wrappers_;

  // Block b's function through wrappers [w, end).
  TensorList call(size_t w, size_t b, const TensorList& inputs) const;
};

// A model: a Module whose forward is its block list. Single-input,
// single-output models inherit forward(); others (the LSTM LM with its
// state) add their own entry points over the same blocks.
class Model : public Module {
 public:
  const BlockList& blocks() const { return blocks_; }
  // blocks().run({x})[0], for models with one input and one output.
  Tensor forward(const Tensor& x) override;

  // Tensor parallelism (layers/tensor_parallel.h): splits the model's layers
  // over g in place, keeping this rank's part of each split parameter
  // (parameter_splits() records how; names stay global). Every rank of g
  // must have built the same model (same seed), so the parts fit together as
  // the whole model of one process. Models without a tensor-parallel form
  // throw Error; so do sizes g does not divide (naming the model.<key>).
  virtual void shard_tensor_parallel(std::shared_ptr<TensorParallelGroup> g);
  // Context parallelism (layers/context_parallel.h): the model runs on this
  // rank's tokens of each sequence (g's layout: positions stay global) and
  // its attention over g. Models without such a form throw Error.
  // The mixture-of-experts layers, in block order (none for a dense model).
  virtual std::vector<std::shared_ptr<MoEFeedForward>> moe_layers() const { return {}; }
  virtual void set_context_parallel(std::shared_ptr<ContextParallelGroup> g);
  // The training loss of the model's output: cross_entropy(logits, targets),
  // or its vocabulary-parallel form when the output holds this rank's part
  // of the vocabulary.
  virtual Tensor output_loss(const Tensor& logits, const Tensor& targets,
                             const CrossEntropyOptions& options = {}) const;
  // The whole shapes of the tensors whose shape depends on the
  // tensor-parallel size, by name: what a checkpoint written at tp holds
  // (GPT's vocabulary rows, padded to a multiple of tp). Empty for most models.
  virtual std::map<std::string, Shape> shapes_at_tensor_parallel(int /*tp*/) const { return {}; }
  // What shard_tensor_parallel changed that a user should hear of, one
  // line ("" for nothing).
  virtual std::string tensor_parallel_note() const { return ""; }
  // BlockList::set_recompute on the model's blocks (parallel.recompute: blocks).
  void set_recompute(bool on) { blocks_.set_recompute(on, this); }
  // BlockList::add_wrapper and remove_wrapper on the model's blocks.
  void add_block_wrapper(BlockWrapper wrapper, bool outermost = false) {
    blocks_.add_wrapper(std::move(wrapper), outermost);
  }
  void remove_block_wrapper(const std::string& name) { blocks_.remove_wrapper(name); }

 protected:
  // Called once at the end of the model's constructor.
  void set_blocks(BlockList blocks) { blocks_ = std::move(blocks); }

 private:
  BlockList blocks_;
};

}  // namespace trainer
