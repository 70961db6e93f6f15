// A training session: everything a recipe builds (model, batch source,
// optimizer, LR schedule), with its checkpoint round trip. The step
// executor (trainer/step_executor.h) runs its steps; the loop
// (trainer/train.cpp) drives it.
//
// The data sits behind a BatchSource (trainer/batch_source.h): images for
// classifiers, token windows for language models (model gpt or lstm_lm,
// data text), which decides the loss and the evaluation. The best
// checkpoint is the one with the best EvalMetrics::best_metric(). A
// checkpoint of a language model also records its vocabulary.
//
// The optimizer is built once, on first use, after the parallelisms have
// split the model (DistributedRun): the recipe's SGD or AdamW over what this
// rank trains (trained_param_groups). Under parallel.zero1 on several dp
// ranks DistributedRun builds this rank's shard of it over DataParallel's
// buckets and hands it over (set_sharded_optimizer) before the first step,
// and parameter servers hand over theirs (set_remote_optimizer); both make
// their local optimizers with make_optimizer. A sharded checkpoint holds
// one optimizer file per rank (trainer/checkpoint.h).
//
// Determinism (docs/architecture.md): initialisation from Generator(seed, kStreamInit);
// batches from (seed, epoch, sample index) via the sampler and transforms;
// dropout re-keyed before every micro-step from (seed, layer, micro-step)
// (rekey_dropout), so nothing random needs saving and a resumed run
// continues bit for bit with the same thread count.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "layers/block_list.h"
#include "layers/module.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "parallel/parallel_plan.h"
#include "parallel/pipeline.h"
#include "trainer/batch_source.h"
#include "trainer/checkpoint.h"
#include "trainer/distributed.h"
#include "trainer/model_setup.h"
#include "trainer/recipe.h"

namespace trainer {

class Session {
 public:
  // Builds everything from the recipe (throws Error on a bad combination,
  // naming the recipe key). DataAccess::assume_if_missing: for dry runs and
  // plans, which build the model and probe it but read no batch.
  explicit Session(Recipe recipe, RankLayout layout = {}, DataAccess access = DataAccess::read);

  const Recipe& recipe() const { return recipe_; }
  Model& model() { return *model_; }
  const std::shared_ptr<Model>& model_ptr() const { return model_; }
  const RankLayout& layout() const { return layout_; }
  BatchSource& data() { return *source_; }
  bool is_language_model() const { return source_->is_language_model(); }
  // The corpus's vocabulary or tokenizer (language models only).
  const data::Tokenizer& vocab() const { return source_->vocab(); }
  // "char" for char and byte vocabularies, "token" for subwords.
  std::string token_unit() const;
  // The optimizer, built on the first call (see above); when sharded, only
  // once set_sharded_optimizer() has run.
  optim::Optimizer& optimizer() const;
  // parallel.zero1 on several dp ranks: the optimizer is this rank's shard.
  bool shards_optimizer() const { return layout_.shards_optimizer(); }
  // Takes the sharded optimizer DistributedRun built (shards_optimizer() only).
  void set_sharded_optimizer(std::shared_ptr<parallel::ZeroOptimizer> zero);
  // Under ZeRO-3 a rank holds its shard of each parameter only: shards()
  // returns every sharded parameter, by the model's tensor, with the
  // elements this rank holds; each rank writes those pieces to checkpoints
  // (no gather). Empty while the parameters are still whole (not sharded yet).
  using ParameterShards = std::function<std::map<const TensorImpl*, parallel::ParameterShard>()>;
  void set_parameter_shards(ParameterShards shards) { parameter_shards_ = std::move(shards); }
  // Takes the optimizer of parameter servers (its state is the servers';
  // checkpoints see a local optimizer's).
  void set_remote_optimizer(std::shared_ptr<optim::Optimizer> optimizer);
  const optim::LrSchedule& schedule() const { return *schedule_; }
  int64_t micro_batch() const { return micro_batch_; }
  // The micro-batches of one optimizer step: parallel.micro_batches on a
  // pipeline (pp > 1), else training.grad_accum.
  int64_t micro_batches() const { return micro_batches_; }

  // ---- tensor parallelism (tp > 1) ----
  // Splits the model over g (Model::shard_tensor_parallel) and rebuilds the
  // optimizer over this rank's parts. Every rank built the whole model from
  // the same seed first, deferred (core/tensor.h), so the parts are those of
  // one process's model and only they get memory: each is made from its
  // whole tensor's record in turn (under a pipeline, by set_pipeline).
  // Checkpoints then gather the split tensors over g (save is collective
  // over g) and loading keeps this rank's part of each whole tensor, so a
  // checkpoint loads on any tp. Throws Error naming the recipe key when the
  // model does not divide.
  void set_tensor_parallel(std::shared_ptr<TensorParallelGroup> g);
  // Null unless set_tensor_parallel ran.
  TensorParallelGroup* tensor_parallel() const { return tp_.get(); }
  // What the split changed that a user should hear of, one line ("" for
  // nothing): a vocabulary padded to a multiple of tp (models/gpt.h).
  const std::string& tensor_parallel_note() const { return tensor_parallel_note_; }

  // ---- context parallelism (cp > 1) ----
  // The model's attention over g and the batches' tokens this rank's of
  // g's layout (Model::set_context_parallel, BatchSource::set_context_parallel).
  // Throws Error naming the recipe when the model or data has no such form.
  void set_context_parallel(std::shared_ptr<ContextParallelGroup> g);

  // ---- pipeline stages (pp > 1) ----
  // Makes this rank stage `stage` of split: what it trains, optimizes and
  // saves becomes its blocks' parameters and buffers (global names). Under
  // pp > 1 the session builds the model deferred (core/tensor.h
  // DeferredInit): its structure whole, from the same seed as one process,
  // but memory and values only for what set_pipeline materialises, this
  // stage's tensors. Nothing reads the other stages' (evaluation runs
  // stage by stage too, DistributedRun::evaluate).
  void set_pipeline(const parallel::StageSplit& split, int stage);
  // Keeps the other stages' tensors as shapes (no memory).
  void release_other_stages();
  // Every tensor of the model made (a dry run's whole-model measurement).
  void materialize_model();
  // The tensors this rank holds: its stage's under a pipeline, else the model's.
  std::vector<NamedTensor> held_state() const;
  // Null unless set_pipeline ran.
  const parallel::PipelinePlan* pipeline_plan() const { return plan_ ? &*plan_ : nullptr; }
  int stage() const { return stage_; }
  // The model's block list.
  const BlockList& blocks() const { return model_->blocks(); }
  // What this rank trains: its stage's parameters, or the whole model.
  std::shared_ptr<Module> trained_ptr() const {
    return stage_module_ ? stage_module_ : std::shared_ptr<Module>(model_);
  }
  Module& trained() const { return *trained_ptr(); }
  // The recipe's parameter groups over trained(), under the model's global
  // names (a weight tied across stages under its first name).
  std::vector<optim::ParamGroup> trained_param_groups() const;
  // A parameter held by two stages (GPT's tied embedding and head): the
  // stages keep it in step by summing their gradients each step.
  struct TiedAcrossStages {
    std::string name;  // its first global name
    Tensor param;
    int peer = 0;        // the other stage
    bool owner = false;  // this stage holds its first name (and saves its optimizer state)
  };
  const std::vector<TiedAcrossStages>& tied_across_stages() const { return tied_; }
  // Every parameter of the model in the order of the whole model's
  // optimizer (its parameter groups), for a gradient norm summed in the same
  // order on every layout.
  const std::vector<NamedTensor>& global_parameters() const { return global_params_; }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t total_steps() const { return total_steps_; }

  // Re-keys every Dropout layer for micro-step `micro` (counted over the run).
  void rekey_dropout(int64_t micro);

  // The training batches of an epoch from a resume position: start_epoch,
  // then next_batch until it returns false.
  void start_epoch(int64_t epoch, int64_t position) { source_->start_epoch(epoch, position); }
  bool next_batch(StepBatch& batch) { return source_->next(batch); }
  // Mean cross-entropy of a micro-batch, over its images or every token.
  Tensor loss(const StepBatch& batch) { return source_->loss(batch); }

  // The validation set on a single process (DistributedRun::evaluate
  // combines the ranks' shares).
  EvalMetrics evaluate();
  // Sums over this dp rank's share of the validation set.
  EvalSums evaluate_shard() { return source_->evaluate_shard(); }

  // Writes this rank's part of a checkpoint into dir (trainer/checkpoint.h):
  // the pieces of the model and the optimizer state its placements say it
  // writes, its stream state, and on rank 0 trainer_state.json. Every rank
  // calls it, once dir exists.
  void save(const std::string& dir, const TrainState& state) const;
  // What save() writes, aliasing the live tensors (CheckpointWriter stages
  // a copy to write it in the background).
  CheckpointPart checkpoint_part(const TrainState& state) const;
  // Resumes: restores model, optimizer and state from a checkpoint written
  // on any layout (mesh, zero1): the optimizer state is re-sliced by
  // parameter name (ZeRO-1 shards joined first) and the epoch's data
  // position converted to this dp size (throws Error when it is not a whole
  // number of this layout's steps, or for an LSTM's carried stream state).
  TrainState load(const std::string& dir);
  // What the last load() changed of the layout ("" for nothing): "dp 2 -> 4; ...".
  const std::string& resharded() const { return resharded_; }
  // Restores the model and the state alone (evaluation, sampling: any layout).
  TrainState load_model(const std::string& dir);
  // Loads parameters and buffers by name from a safetensors file; strict:
  // missing, unexpected or mis-shaped tensors are an Error listing them all.
  void init_from(const std::string& path, bool strict);

  // The parallel plan (parallel/parallel_plan.h): the passes applied to
  // this rank's share of the model and the placement of every tensor it
  // holds, read by the checkpoint writer and the gradient norm.
  const parallel::ParallelPlan& parallel_plan() const { return parallel_plan_; }
  // Records a pass DistributedRun applied, and places the tensors anew.
  void record_pass(std::string name, std::string detail);

  // The activation memory of one training step at the micro-batch size
  // (at least 0): the allocator's peak over one forward and backward of the
  // whole model (materialized first) at batch 2, less the parameters,
  // scaled to the micro-batch (with recompute: the blocks' inputs plus the
  // block being recomputed, as the step runs). Clears the gradients after.
  int64_t measure_activation_bytes();
  // "conv1  320\nbn1  64\n...\ntotal  421,834" and a memory estimate whose
  // activations are activation_bytes (measure_activation_bytes()).
  std::string summary(int64_t activation_bytes) const;

 private:
  // load() with the optimizer, load_model() without it.
  TrainState load_checkpoint(const std::string& dir, bool with_optimizer);
  // The saved epoch position as this layout's dp ranks count it (checked).
  int64_t resumed_position(const std::string& dir, const ParallelLayout& saved,
                           const TrainState& saved_state, bool resharded) const;
  // Places every tensor this rank holds in parallel_plan_: split over tp as
  // tensor parallelism recorded, owned by this stage under a pipeline, else
  // replicated.
  void place_tensors();
  // The pieces of the optimizer state this rank writes to a checkpoint.
  std::vector<TensorPiece> optimizer_pieces() const;
  // The checkpoint's optimizer entries this rank needs: its own shard
  // (own_shard: a ZeRO-1 checkpoint of the earlier format on this layout),
  // else whole tensors (pieces or shards joined); *file names them.
  std::map<std::string, Tensor> read_optimizer_tensors(const std::string& dir,
                                                       const ParallelLayout& saved, bool own_shard,
                                                       const CheckpointReadOptions& reading,
                                                       std::string* file) const;
  // Drops the entries of parameters another pipeline stage trains.
  void keep_own_entries(std::map<std::string, Tensor>& optim_tensors) const;

  Recipe recipe_;
  RankLayout layout_;
  std::unique_ptr<BatchSource> source_;
  std::shared_ptr<Model> model_;
  // Built by optimizer() on first use, or handed over (sharded, remote).
  mutable std::shared_ptr<optim::Optimizer> optimizer_;
  std::shared_ptr<parallel::ZeroOptimizer> zero_;  // the sharded one, when it is
  ParameterShards parameter_shards_;               // ZeRO-3's
  bool remote_optimizer_ = false;                  // on parameter servers
  std::string resharded_;
  std::optional<optim::LrSchedule> schedule_;
  int64_t micro_batch_ = 0;
  int64_t micro_batches_ = 1;
  std::shared_ptr<TensorParallelGroup> tp_;
  std::string tensor_parallel_note_;
  std::optional<parallel::PipelinePlan> plan_;
  int stage_ = 0;
  std::shared_ptr<Module> stage_module_;
  std::vector<Tensor> other_stages_;  // the model's tensors this stage does not hold
  std::vector<TiedAcrossStages> tied_;
  std::vector<NamedTensor> global_params_;
  parallel::ParallelPlan parallel_plan_;
  int64_t steps_per_epoch_ = 0;
  int64_t total_steps_ = 0;
};

// Restores named tensors into targets by name (shapes and dtypes must match).
// Returns the problems found (missing, unexpected, mis-shaped), one per line.
std::vector<std::string> load_named(const std::vector<NamedTensor>& targets,
                                    const std::map<std::string, Tensor>& source);

}  // namespace trainer
