#include "trainer/session.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <set>
#include <sstream>

#include "core/allocator.h"
#include "core/ops.h"
#include "layers/linear.h"
#include "models/gpt.h"
#include "models/lstm_lm.h"
#include "models/registry.h"
#include "parallel/tensor_parallel.h"
#include "parallel/zero.h"
#include "trainer/device.h"
#include "trainer/safetensors.h"

namespace trainer {

namespace {

// vocab: the data's vocabulary size (language models).
std::shared_ptr<Module> build_model(const Recipe& r, int64_t vocab) {
  const ModelRecipe& m = r.model;
  if (is_language_model(m.name) && m.vocab_size > 0 && m.vocab_size < vocab)
    throw Error(cat(r.source, ": model.vocab_size ", m.vocab_size, " is smaller than the ", vocab,
                    " symbols of the corpus's vocabulary; use 0 (the corpus's)"));
  try {
    return make_model(m.name, {.num_classes = m.num_classes,
                               .in_channels = m.in_channels,
                               .image_size = r.data.image_size,
                               .zero_init_residual = m.zero_init_residual,
                               .dropout = m.dropout,
                               .vocab_size = m.vocab_size > 0 ? m.vocab_size : vocab,
                               .context = m.context,
                               .n_layer = m.n_layer,
                               .n_head = m.n_head,
                               .d_model = m.d_model,
                               .hidden = m.hidden,
                               .tie_weights = m.tie_weights,
                               .gelu = m.gelu == "tanh" ? GeluApprox::tanh : GeluApprox::none,
                               .seed = uint64_t(r.seed)});
  } catch (const Error& e) {
    throw Error(cat(r.source, ": ", e.what()));  // the message names the model.<key>
  }
}

// What the activation figure of the memory estimate counts under parallel.recompute.
const char* recompute_note(const std::string& recompute) {
  if (recompute == "blocks") return ", recompute blocks: block inputs + one block recomputed";
  if (recompute == "selective")
    return ", recompute selective: as none, the fused attention keeps no T x T scores";
  return "";
}

int64_t epochs_to_steps(double epochs, int64_t steps_per_epoch) {
  return int64_t(std::llround(epochs * double(steps_per_epoch)));
}

}  // namespace

std::vector<optim::ParamGroup> param_groups(const Recipe& r, const Module& model) {
  if (r.optimizer.decay_norm_and_bias) return {optim::ParamGroup{model.named_parameters()}};
  WeightDecaySplit split = split_weight_decay(model);
  return {optim::ParamGroup{split.decay}, optim::ParamGroup{split.no_decay, 0.0}};
}

std::unique_ptr<optim::Optimizer> make_optimizer(const Recipe& r,
                                                 std::vector<optim::ParamGroup> groups) {
  const OptimizerRecipe& o = r.optimizer;
  if (o.name == "sgd")
    return std::make_unique<optim::SGD>(
        std::move(groups),
        optim::SGDOptions{o.lr, o.momentum, o.dampening, o.nesterov, o.weight_decay});
  optim::AdamWOptions a;
  a.lr = o.lr;
  a.betas = {o.beta1, o.beta2};
  a.eps = o.eps;
  a.weight_decay = o.weight_decay;
  return std::make_unique<optim::AdamW>(std::move(groups), a);
}

Session::Session(Recipe recipe, RankLayout layout, DataAccess access)
    : recipe_(std::move(recipe)), layout_(layout) {
  const Recipe& r = recipe_;
  // First: a recipe asking for an absent GPU fails before any data is read.
  const Device device = training_device(r, layout_.world_size());
  const int64_t dp = layout_.dp_size();
  const TrainingRecipe& t = r.training;
  const bool pipeline = layout_.job.mesh[parallel::Dim::pp] > 1;
  const char* split_key = pipeline ? "parallel.micro_batches" : "training.grad_accum";
  CHECK(!pipeline || t.grad_accum == 1)
      << "a pipeline with training.grad_accum " << t.grad_accum << " (parallel_layout refuses it)";
  // 0 (auto) as join_job resolved it, for sessions built without it.
  recipe_.parallel.micro_batches = resolved_micro_batches(r, dp);
  micro_batches_ = pipeline ? r.parallel.micro_batches : t.grad_accum;
  if (t.global_batch % (micro_batches_ * dp) != 0)
    throw Error(cat(r.source, ": training.global_batch ", t.global_batch, " is not divisible by ",
                    split_key, " x data-parallel ranks (", micro_batches_ * dp, ")"));
  micro_batch_ = t.global_batch / (micro_batches_ * dp);

  // ---- data ----
  source_ = make_batch_source(r, layout_, micro_batch_, access);
  steps_per_epoch_ = source_->batches_per_epoch() / micro_batches_;
  if (steps_per_epoch_ == 0)
    throw Error(cat(r.source, ": training.global_batch ", t.global_batch, " is larger than the ",
                    source_->epoch_text(), " of an epoch"));
  total_steps_ = t.steps > 0 ? t.steps : t.epochs * steps_per_epoch_;

  // ---- model and optimizer ----
  const bool split_model = pipeline || layout_.job.mesh[parallel::Dim::tp] > 1;
  if (split_model) {
    // A pipeline stage gives memory only to its own blocks (set_pipeline), a
    // tensor-parallel rank only to its parts (set_tensor_parallel): until
    // then the weights are recorded, not made (core/tensor.h).
    DeferredInit deferred;
    model_ = build_model(r, source_->vocab_size());
  } else {
    model_ = build_model(r, source_->vocab_size());
  }
  if (r.parallel.recompute == "blocks") {
    auto* blocks = dynamic_cast<Model*>(model_.get());
    if (!blocks)
      throw Error(cat(r.source, ": parallel.recompute = blocks: model '", r.model.name,
                      "' is not built from blocks; use parallel.recompute = none"));
    blocks->set_recompute(true);
  }
  move_module(*model_, device);  // before the optimizer builds its state beside the parameters
  for (const optim::ParamGroup& g : param_groups(r, *model_))
    global_params_.insert(global_params_.end(), g.params.begin(), g.params.end());
  source_->bind(model_);
  // Sharded: DistributedRun builds it (the full one would cost the memory zero1 saves);
  // a pipeline stage's comes with its stage (set_pipeline), a tensor-parallel
  // rank's with its parts (set_tensor_parallel).
  if (!shards_optimizer() && !split_model) optimizer_ = make_optimizer(r, param_groups(r, *model_));

  const OptimizerRecipe& o = r.optimizer;
  const ScheduleRecipe& s = r.schedule;
  optim::ScheduleOptions so_lr;
  so_lr.kind = s.name == "step"        ? optim::ScheduleKind::step
               : s.name == "multistep" ? optim::ScheduleKind::multistep
               : s.name == "cosine"    ? optim::ScheduleKind::cosine
                                       : optim::ScheduleKind::constant;
  so_lr.base_lr = o.lr;
  so_lr.step_size = std::max<int64_t>(1, epochs_to_steps(s.step_size, steps_per_epoch_));
  for (double m : s.milestones) so_lr.milestones.push_back(epochs_to_steps(m, steps_per_epoch_));
  so_lr.gamma = s.gamma;
  so_lr.t_max = total_steps_;
  so_lr.min_lr = s.min_lr;
  so_lr.warmup = s.warmup_steps + epochs_to_steps(s.warmup_epochs, steps_per_epoch_);
  if (o.scale_lr) so_lr.global_batch = t.global_batch;
  schedule_.emplace(so_lr);
}

void Session::rekey_dropout(int64_t micro) {
  uint64_t layer = 0;
  const uint64_t rank = uint64_t(layout_.dp_rank()), ranks = uint64_t(layout_.dp_size());
  model_->apply([&](Module& m) {
    auto* d = dynamic_cast<Dropout*>(&m);
    if (!d) return;
    // Stream: purpose in the low 8 bits, the layer above, a tensor-parallel
    // rank's own masks (stream_rank > 0) above bit 40; offset: 2^32 blocks
    // per micro-step and rank, far more than any layer draws.
    const uint64_t block = uint64_t(micro) * ranks + rank;
    d->generator() =
        Generator(uint64_t(recipe_.seed),
                  kStreamDropout | (++layer << 8) | (d->stream_rank() << 40), block << 32);
  });
}

void Session::set_tensor_parallel(std::shared_ptr<TensorParallelGroup> g) {
  CHECK(!tp_ && !plan_) << "set_tensor_parallel after the model was split";
  auto* model = dynamic_cast<Model*>(model_.get());
  if (!model)
    throw Error(cat(recipe_.source, ": model '", recipe_.model.name,
                    "' has no tensor-parallel form; use parallel.tp = 1"));
  try {
    model->shard_tensor_parallel(g);
  } catch (const Error& e) {
    throw Error(cat(recipe_.source, ": ", e.what()));
  }
  if (const auto* gpt = dynamic_cast<const GPT*>(model);
      gpt && gpt->vocab_rows() != gpt->options().vocab_size)
    tensor_parallel_note_ =
        cat("model: vocabulary ", gpt->options().vocab_size, " padded to ", gpt->vocab_rows(),
            " rows for parallel.tp=", g->size(),
            "; the padded rows are never sampled or predicted (zero, and left out of the loss)");
  tp_ = std::move(g);
  // This rank's parts, each made from its whole tensor's record in turn;
  // under a pipeline, only its stage's (set_pipeline).
  if (layout_.job.mesh[parallel::Dim::pp] == 1) materialize_model();
  global_params_.clear();
  for (const optim::ParamGroup& group : param_groups(recipe_, *model_))
    global_params_.insert(global_params_.end(), group.params.begin(), group.params.end());
  if (!shards_optimizer() && layout_.job.mesh[parallel::Dim::pp] == 1)
    optimizer_ = make_optimizer(recipe_, param_groups(recipe_, *model_));
}

optim::Optimizer& Session::optimizer() {
  CHECK(optimizer_) << "the optimizer is used before DistributedRun built it (sharded, or a "
                       "pipeline stage's)";
  return *optimizer_;
}

const BlockList& Session::blocks() const {
  auto* model = dynamic_cast<Model*>(model_.get());
  if (!model)
    throw Error(cat(recipe_.source, ": model '", recipe_.model.name,
                    "' is not built from blocks, so it cannot run as pipeline stages"));
  return model->blocks();
}

void Session::set_pipeline(const parallel::StageSplit& split, int stage) {
  const BlockList& b = blocks();
  plan_.emplace(b, split);
  stage_ = stage;
  const auto ranges = plan_->blocks_of_stage(stage);
  stage_module_ = std::make_shared<parallel::StageModule>(b, ranges);
  for (const NamedTensor& t : stage_module_->state()) materialize(t.tensor);
  // Every tensor of the model's state belongs to some stage.
  {
    std::set<std::string> staged;
    for (int s = 0; s < split.stages; ++s)
      for (const NamedTensor& t : parallel::StageModule(b, plan_->blocks_of_stage(s)).state())
        staged.insert(t.name);
    for (const NamedTensor& t : model_->state())
      CHECK(staged.count(t.name)) << "'" << t.name << "' is in no block of model "
                                  << recipe_.model.name << ", so no pipeline stage holds it";
  }
  // Weights tied across stages: the stages of the blocks holding each name.
  std::vector<int> stage_of_block(b.size());
  for (int v = 0; v < plan_->pieces(); ++v)
    for (size_t k = plan_->piece(v).first; k < plan_->piece(v).last; ++k)
      stage_of_block[k] = split.stage_of(v);
  tied_.clear();
  for (const TiedParameter& t : b.tied()) {
    const int first = stage_of_block[t.tied_block], second = stage_of_block[t.block];
    if (first == second || (stage != first && stage != second)) continue;
    Tensor param;
    for (const NamedTensor& p : global_params_)
      if (p.name == t.tied_to) param = p.tensor;
    CHECK(param.defined()) << "tied parameter '" << t.tied_to << "'";
    tied_.push_back({t.tied_to, param, stage == first ? second : first, stage == first});
  }
  // Whether this stage's blocks read the carried state (an LSTM's h and c:
  // names that are both model inputs and model outputs).
  auto listed = [](const std::vector<std::string>& names, const std::string& n) {
    return std::find(names.begin(), names.end(), n) != names.end();
  };
  bool holds_state = false;
  for (const auto& [first, last] : ranges)
    for (size_t k = first; k < last; ++k)
      for (const std::string& n : b[k].inputs)
        holds_state = holds_state || (listed(b.boundary(0), n) && listed(b.boundary(b.size()), n));
  source_->set_holds_carried_state(holds_state);
  // A stage that reads no model input and computes no loss needs only the
  // batches' positions (a middle stage: no image decoded for nothing).
  bool reads_batches = false;
  for (const auto& [first, last] : ranges) {
    reads_batches = reads_batches || last == b.size();
    for (size_t k = first; k < last; ++k)
      for (const std::string& n : b[k].inputs)
        reads_batches = reads_batches || listed(b.boundary(0), n);
  }
  source_->set_reads_batches(reads_batches);
  if (!shards_optimizer()) optimizer_ = make_optimizer(recipe_, trained_param_groups());
  std::set<const TensorImpl*> mine, others;
  for (const NamedTensor& t : stage_module_->state()) mine.insert(t.tensor.impl());
  other_stages_.clear();
  for (const NamedTensor& t : model_->state())
    if (!mine.count(t.tensor.impl()) && others.insert(t.tensor.impl()).second)
      other_stages_.push_back(t.tensor);
}

void Session::release_other_stages() {
  for (const Tensor& t : other_stages_) release_storage(t);
}

std::vector<optim::ParamGroup> Session::trained_param_groups() const {
  std::vector<optim::ParamGroup> groups = param_groups(recipe_, *model_);
  if (!stage_module_) return groups;
  std::set<const TensorImpl*> mine;
  for (const Tensor& t : stage_module_->parameters()) mine.insert(t.impl());
  for (optim::ParamGroup& g : groups)
    std::erase_if(g.params, [&](const NamedTensor& p) { return !mine.count(p.tensor.impl()); });
  return groups;
}

void Session::set_sharded_optimizer(std::shared_ptr<parallel::ZeroOptimizer> zero) {
  CHECK(shards_optimizer()) << "a sharded optimizer for a session without parallel.zero1";
  optimizer_ = std::move(zero);
}

void Session::set_remote_optimizer(std::shared_ptr<optim::Optimizer> optimizer) {
  optimizer_ = std::move(optimizer);
}

EvalMetrics Session::evaluate() {
  CHECK_EQ(layout_.dp_size(), 1)
      << "Session::evaluate on one rank of several; use DistributedRun::evaluate";
  return eval_metrics(evaluate_shard(), is_language_model());
}

void Session::save(const std::string& dir, const TrainState& state) const {
  CHECK(optimizer_) << "save() before the sharded optimizer was built";
  const bool sharded = shards_optimizer();
  const bool main = layout_.rank == 0;
  CheckpointPart part;
  if (tp_) {
    // The split tensors gathered whole over the tensor-parallel group
    // (collective); its first rank writes them, as one process would.
    const bool writes = layout_.dp_rank() == 0 && layout_.coord[parallel::Dim::tp] == 0;
    std::vector<NamedTensor> model =
        parallel::gather_whole(plan_ ? stage_module_->state() : model_->state(), *model_, *tp_);
    // ZeRO-1: every rank writes its shard of its part, as it holds it.
    std::vector<NamedTensor> optim =
        sharded ? optimizer_->state() : parallel::gather_whole(optimizer_->state(), *model_, *tp_);
    if (plan_) {
      part.model_part = part.optimizer_part = stage_;
      part.model_parts = part.optimizer_parts = plan_->split().stages;
      for (const TiedAcrossStages& t : tied_)
        if (!t.owner)
          std::erase_if(optim,
                        [&](const NamedTensor& e) { return e.name.starts_with(t.name + "."); });
    }
    if (writes) part.model = std::move(model);
    if (writes || sharded) part.optimizer = std::move(optim);
    // ZeRO-1 shards of this rank's parts: how to join them into whole tensors.
    if (sharded) {
      part.optimizer_metadata["tp"] =
          cat(layout_.coord[parallel::Dim::tp], " ", layout_.job.mesh[parallel::Dim::tp]);
      for (const auto& [name, split] : model_->parameter_splits())
        if (split.kind == ParameterSplit::Kind::sharded)
          part.optimizer_metadata["tp_split." + name] = cat(split.dim, " ", split.parts);
    }
  } else if (!plan_) {
    // Every rank holds the whole replicated model: rank 0 writes it.
    if (main) part.model = model_->state();
    if (sharded || main) part.optimizer = optimizer_->state();
  } else {
    // Each stage's first replica writes its tensors as one part of the model
    // and of the optimizer state; a weight tied across stages goes in once.
    const bool writes = layout_.dp_rank() == 0 && layout_.coord[parallel::Dim::tp] == 0;
    part.model_part = part.optimizer_part = stage_;
    part.model_parts = part.optimizer_parts = plan_->split().stages;
    if (writes) part.model = stage_module_->state();
    if (sharded || writes) {
      std::vector<NamedTensor> state = optimizer_->state();
      for (const TiedAcrossStages& t : tied_)
        if (!t.owner)
          std::erase_if(state,
                        [&](const NamedTensor& e) { return e.name.starts_with(t.name + "."); });
      part.optimizer = std::move(state);
    }
  }
  part.optimizer_sharded = sharded;
  part.stream_state = source_->stream_state();
  write_checkpoint_part(dir, layout_.rank, part);
  if (!main) return;
  TrainerStateFile file;
  file.state = state;
  file.state.layout = layout_.job;
  file.lr = optimizer_->lr();
  file.seed = recipe_.seed;
  if (is_language_model())
    for (uint8_t symbol : vocab().symbols()) file.vocab.push_back(symbol);
  file.recipe_yaml = recipe_to_yaml(recipe_);
  write_trainer_state(dir, file);
}

std::vector<std::string> load_named(const std::vector<NamedTensor>& targets,
                                    const std::map<std::string, Tensor>& source) {
  std::vector<std::string> problems;
  std::map<std::string, bool> used;
  for (const NamedTensor& t : targets) {
    auto it = source.find(t.name);
    if (it == source.end()) {
      problems.push_back(cat("missing: ", t.name, " ", t.tensor.shape_str()));
      continue;
    }
    used[t.name] = true;
    if (it->second.shape() != t.tensor.shape() || it->second.dtype() != t.tensor.dtype()) {
      problems.push_back(cat("mis-shaped: ", t.name, " is ", it->second.shape_str(), " ",
                             it->second.dtype(), " in the file, ", t.tensor.shape_str(), " ",
                             t.tensor.dtype(), " in the model"));
    }
  }
  for (const auto& [name, tensor] : source)
    if (!used.count(name)) problems.push_back(cat("unexpected: ", name, " ", tensor.shape_str()));
  return problems;
}

namespace {
void copy_named(const std::vector<NamedTensor>& targets,
                const std::map<std::string, Tensor>& source) {
  autograd::NoGradGuard no_grad;
  for (const NamedTensor& t : targets) {
    auto it = source.find(t.name);
    if (it != source.end() && it->second.shape() == t.tensor.shape() &&
        it->second.dtype() == t.tensor.dtype()) {
      Tensor dst = t.tensor;  // a handle on the model's tensor
      dst.copy_(it->second);
    }
  }
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += "\n  " + l;
  return out;
}

}  // namespace

TrainState Session::load(const std::string& dir) { return load_checkpoint(dir, true); }

TrainState Session::load_model(const std::string& dir) { return load_checkpoint(dir, false); }

TrainState Session::load_checkpoint(const std::string& dir, bool with_optimizer) {
  // Loaded weights, buffers and optimizer state must be finite (a NaN would
  // train on silently: ReLU hides it from the loss); the readers name the
  // file holding each tensor. training.allow_non_finite loads one anyway.
  const CheckpointReadOptions reading{.refuse_non_finite = !recipe_.training.allow_non_finite};
  std::map<std::string, Tensor> model = read_model(dir, reading);
  model_->upgrade_loaded_state(model, model_file(dir));
  // Whole tensors in the file: this rank keeps its parts (tensor parallelism).
  if (tp_) parallel::take_shards(model, *model_);
  std::vector<std::string> problems = load_named(model_->state(), model);
  if (!problems.empty())
    throw Error(cat(model_file(dir), " does not match the recipe's model:", join_lines(problems)));
  TrainerStateFile file = read_trainer_state(dir);
  if (!file.vocab.empty()) source_->check_vocab(trainer_state_file(dir), file.vocab);
  TrainState state = file.state;
  resharded_.clear();
  if (with_optimizer) {
    const ParallelLayout& saved = file.state.layout;
    const std::string changes = resharding(saved, layout_.job);
    // The data position: the samples every dp rank consumed, dealt out again.
    // The windows and images of an epoch are dealt to the ranks in turn (r,
    // r + dp, ...), so the first k samples of each of D ranks are the
    // epoch's first k D, under any D.
    if (saved.mesh.size(parallel::kDataParallel) != layout_.dp_size() && state.position > 0) {
      // A hostile position must not overflow here; load_stream_state names
      // it against the epoch's size below.
      if (state.position > std::numeric_limits<int64_t>::max() /
                               std::max<int64_t>(1, saved.mesh.size(parallel::kDataParallel)))
        throw Error(cat(trainer_state_file(dir), ": \"position\" ", state.position,
                        " is past any epoch; the file is damaged: use an earlier checkpoint"));
      const int64_t consumed = state.position * saved.mesh.size(parallel::kDataParallel);
      const int64_t per_step = micro_batch_ * micro_batches_ * layout_.dp_size();
      if (consumed % per_step != 0)
        throw Error(cat(dir, " stopped ", consumed, " samples into epoch ", state.epoch,
                        ", which is not a whole number of steps of training.global_batch = ",
                        recipe_.training.global_batch,
                        "; resume with the global batch it was written with"));
      state.position = consumed / layout_.dp_size();
    }
    if (!changes.empty() && state.position > 0 && recipe_.data.sampling == "contiguous" &&
        recipe_.model.name == "lstm_lm")
      throw Error(cat(dir, " carries the LSTM state of each rank's text streams ", state.position,
                      " windows into epoch ", state.epoch, "; the streams and the state's rows ",
                      "belong to its layout (", parallel::to_string(saved.mesh),
                      "): resume it on that layout, or from a checkpoint at an epoch's end"));
    // Entries are named <parameter>.<slot>: the model's renames apply to them too.
    std::map<std::string, Tensor> optim_tensors;
    std::string optim_file;
    if (saved.zero1 && changes.empty()) {
      optim_file = optimizer_file(dir, true, layout_.rank);
      for (NamedTensor& t : read_optimizer(dir, true, layout_.rank, reading))
        optim_tensors.emplace(t.name, std::move(t.tensor));
      // A weight tied across stages has its state saved once, by the owning
      // stage's rank of this dp (and tp) coordinate: its shard holds the same
      // elements (the weight has a bucket of its own on both stages).
      for (const TiedAcrossStages& t : tied_) {
        if (t.owner) continue;
        parallel::MeshCoord owner = layout_.coord;
        owner.set(parallel::Dim::pp, t.peer);
        const int owner_rank = parallel::mesh_rank(layout_.job.mesh, owner);
        for (NamedTensor& e : read_optimizer(dir, true, owner_rank, reading))
          if (e.name.starts_with(t.name + ".")) optim_tensors.emplace(e.name, std::move(e.tensor));
      }
    } else if (saved.zero1) {
      // Every rank's shard, joined into whole tensors (through each
      // tensor-parallel rank's parts, when split) of the shapes the
      // writer's layout held: a vocabulary padded for its tp (models/gpt.h),
      // fitted to this model's rows by upgrade_loaded_state below.
      std::map<std::string, Shape> shapes;
      const std::map<std::string, ParameterSplit> splits = model_->parameter_splits();
      for (const NamedTensor& p : global_params_) {
        auto split = splits.find(p.name);
        shapes[p.name] =
            split == splits.end() ? p.tensor.shape() : full_shape(p.tensor.shape(), split->second);
      }
      if (const auto* gpt = dynamic_cast<const GPT*>(model_.get()))
        for (const auto& [name, shape] : gpt->vocab_shapes(saved.mesh[parallel::Dim::tp]))
          if (shapes.count(name)) shapes[name] = shape;
      optim_file = dir + "/optimizer.rank*.safetensors";
      optim_tensors = read_sharded_optimizer_whole(dir, shapes, reading);
    } else {
      optim_file = optimizer_file(dir, false, layout_.rank);
      for (NamedTensor& t : read_optimizer(dir, false, layout_.rank, reading))
        optim_tensors.emplace(t.name, std::move(t.tensor));
    }
    model_->upgrade_loaded_state(optim_tensors, optim_file);
    if (tp_ && !(saved.zero1 && changes.empty())) parallel::take_shards(optim_tensors, *model_);
    // A whole optimizer state (one file, or one part per stage) holds every
    // parameter's entries: a stage takes its own, whatever layout wrote them.
    if (!shards_optimizer()) {
      std::set<std::string> mine;
      for (const NamedTensor& e : optimizer().state()) mine.insert(e.name);
      for (auto it = optim_tensors.begin(); it != optim_tensors.end();) {
        const std::string& name = it->first;
        const size_t dot = name.rfind('.');
        const bool known_param =
            dot != std::string::npos &&
            std::any_of(global_params_.begin(), global_params_.end(),
                        [&](const NamedTensor& p) { return p.name == name.substr(0, dot); });
        it = !mine.count(name) && known_param ? optim_tensors.erase(it) : std::next(it);
      }
    }
    std::vector<NamedTensor> optim_state;
    for (auto& [name, t] : optim_tensors) optim_state.push_back({name, t});
    // Everything validated: now change the optimizer (it refuses another layout) and the model.
    auto* zero = dynamic_cast<parallel::ZeroOptimizer*>(optimizer_.get());
    if (zero && !(saved.zero1 && changes.empty()))
      zero->load_whole_state(optim_tensors);  // re-sliced for this rank's shard
    else
      optimizer().load_state(optim_state);
    source_->load_stream_state(dir, state.position);
    if (!changes.empty())
      resharded_ =
          cat(changes,
              saved.zero1 || layout_.job.zero1 ? "; the optimizer state re-sliced by parameter name"
                                               : "",
              saved.mesh.size(parallel::kDataParallel) != layout_.dp_size() && state.position > 0
                  ? cat("; the epoch's data position kept: ", file.state.position,
                        " samples on each of ", saved.mesh.size(parallel::kDataParallel),
                        " ranks -> ", state.position, " on each of ", layout_.dp_size())
                  : "");
  }
  copy_named(held_state(), model);
  return state;
}

void Session::init_from(const std::string& path, bool strict) {
  SafetensorsFile f = read_safetensors(path);
  if (!recipe_.training.allow_non_finite) require_finite(f.tensors, path);
  model_->upgrade_loaded_state(f.tensors, path);
  if (tp_) parallel::take_shards(f.tensors, *model_);
  std::vector<std::string> problems = load_named(model_->state(), f.tensors);
  if (!problems.empty()) {
    if (strict)
      throw Error(cat(path,
                      " does not match the model (pass --init-non-strict to load what matches):",
                      join_lines(problems)));
    std::fprintf(stderr, "init-from %s: loading what matches; skipped:%s\n", path.c_str(),
                 join_lines(problems).c_str());
  }
  copy_named(held_state(), f.tensors);
}

void Session::materialize_model() {
  for (const NamedTensor& t : model_->state()) materialize(t.tensor);
}

std::vector<NamedTensor> Session::held_state() const {
  return stage_module_ ? stage_module_->state() : model_->state();
}

std::string Session::summary() {
  // The activations below are measured over the whole model.
  materialize_model();
  std::ostringstream out;
  out << "model " << recipe_.model.name << ":\n";
  for (const auto& [name, child] : model_->children())
    out << "  " << name << "  " << with_commas(child->num_parameters()) << "\n";
  out << "  total  " << with_commas(model_->num_parameters()) << " parameters\n";
  if (!tensor_parallel_note_.empty()) out << tensor_parallel_note_ << "\n";
  out << source_->summary();

  // Memory: parameters, gradients (as the parameters) and optimizer state
  // (this rank's, sharded or not) exactly, from their dtypes; activations
  // measured as the allocator's peak over one training step at batch 2,
  // scaled to the micro-batch (with recompute: the blocks' inputs plus the
  // block being recomputed, as the step runs).
  int64_t param_bytes = 0;
  for (const Tensor& p : model_->parameters()) param_bytes += int64_t(p.nbytes());
  // Before DistributedRun built the shard, a full optimizer tells its size.
  const int64_t state_bytes =
      optimizer_ ? optimizer_->state_bytes()
                 : make_optimizer(recipe_, param_groups(recipe_, *model_))->state_bytes() /
                       layout_.dp_size();
  Allocator& a = allocator(module_device(*model_));
  int64_t before = a.stats().current_bytes;
  a.reset_peak();
  source_->probe_loss(2).backward();
  int64_t activations = (a.stats().peak_bytes - before - param_bytes) / 2 * micro_batch_;
  model_->zero_grad();
  double mib = 1.0 / (1024.0 * 1024.0);
  char buf[256];
  std::snprintf(
      buf, sizeof buf,
      "memory estimate: parameters %.1f MiB, gradients %.1f MiB, optimizer state %.1f MiB%s, "
      "activations %.1f MiB (micro-batch %lld%s)\n",
      double(param_bytes) * mib, double(param_bytes) * mib, double(state_bytes) * mib,
      shards_optimizer() ? cat(" (zero1: sharded, 1/", layout_.dp_size(), " per rank)").c_str()
                         : "",
      double(std::max<int64_t>(activations, 0)) * mib, (long long)micro_batch_,
      recompute_note(recipe_.parallel.recompute));
  out << buf;
  return out.str();
}

}  // namespace trainer
