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
#include "models/lstm_lm.h"
#include "models/registry.h"
#include "parallel/placement.h"
#include "parallel/tensor_parallel.h"
#include "parallel/zero.h"
#include "trainer/device.h"
#include "trainer/safetensors.h"

namespace trainer {

namespace {

// What the activation figure of the memory estimate counts under parallel.recompute.
const char* recompute_note(const std::string& recompute) {
  if (recompute == "blocks") return ", recompute blocks: block inputs + one block recomputed";
  if (recompute == "selective")
    return ", recompute selective: as none, the fused attention keeps no T x T scores";
  return "";
}

}  // namespace

Session::Session(Recipe recipe, RankLayout layout, DataAccess access)
    : recipe_(std::move(recipe)), layout_(layout) {
  const Recipe& r = recipe_;
  set_cpu_memory_limit(r.training.memory_limit_mb << 20);
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
  if (r.parallel.recompute == "blocks") model_->set_recompute(true);
  move_module(*model_, device);  // before the optimizer builds its state beside the parameters
  for (const optim::ParamGroup& g : param_groups(r, *model_))
    global_params_.insert(global_params_.end(), g.params.begin(), g.params.end());
  source_->bind(model_);

  schedule_.emplace(lr_schedule_options(r, steps_per_epoch_, total_steps_));
  place_tensors();
}

void Session::record_pass(std::string name, std::string detail) {
  parallel_plan_.record(std::move(name), std::move(detail));
  place_tensors();
}

void Session::place_tensors() {
  parallel_plan_.mesh = layout_.job.mesh;
  parallel_plan_.coord = layout_.coord;
  parallel_plan_.shards_optimizer = zero_ != nullptr;
  parallel_plan_.placements.clear();
  const std::map<std::string, ParameterSplit> splits = model_->parameter_splits();
  for (const NamedTensor& t : held_state()) {
    auto split = splits.find(t.name);
    parallel::TensorPlacement p = parallel::tensor_parallel_placement(
        t.tensor.shape(), split == splits.end() ? nullptr : &split->second);
    // A pipeline stage owns the tensors it holds (a weight tied across
    // stages: each stage its own name of it).
    if (plan_) p = p.with(parallel::Dim::pp, parallel::Placement::owned(stage_));
    // Expert parallelism: an expert is held (and written) by its ep rank only.
    if (t.name.find(".mlp.experts.") != std::string::npos)
      p = p.with(parallel::Dim::ep, parallel::Placement::owned(layout_.coord[parallel::Dim::ep]));
    parallel_plan_.place(t.name, std::move(p));
  }
  // The data-parallel replicas share the writing of what they all hold;
  // not under parameter servers, whose workers' copies may differ (asp,
  // ssp) and whose optimizer state only the first worker fetches.
  std::map<std::string, int64_t> bytes;
  for (const NamedTensor& t : held_state()) bytes[t.name] = int64_t(t.tensor.nbytes());
  if (remote_optimizer_)
    parallel_plan_.replica_writer.clear();
  else
    parallel_plan_.spread_writers(bytes);
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

void Session::set_context_parallel(std::shared_ptr<ContextParallelGroup> g) {
  try {
    model_->set_context_parallel(g);
    source_->set_context_parallel(std::move(g));
  } catch (const Error& e) {
    throw Error(cat(recipe_.source, ": ", e.what()));
  }
}

void Session::set_tensor_parallel(std::shared_ptr<TensorParallelGroup> g) {
  CHECK(!tp_ && !plan_ && !optimizer_) << "set_tensor_parallel after the model was split";
  try {
    model_->shard_tensor_parallel(g);
  } catch (const Error& e) {
    throw Error(cat(recipe_.source, ": ", e.what()));
  }
  tensor_parallel_note_ = model_->tensor_parallel_note();
  tp_ = std::move(g);
  // This rank's parts, each made from its whole tensor's record in turn;
  // under a pipeline, only its stage's (set_pipeline).
  if (layout_.job.mesh[parallel::Dim::pp] == 1) materialize_model();
  global_params_.clear();
  for (const optim::ParamGroup& group : param_groups(recipe_, *model_))
    global_params_.insert(global_params_.end(), group.params.begin(), group.params.end());
}

optim::Optimizer& Session::optimizer() const {
  if (!optimizer_) {
    CHECK(!shards_optimizer()) << "the sharded optimizer is used before DistributedRun built it";
    optimizer_ = make_optimizer(recipe_, trained_param_groups());
  }
  return *optimizer_;
}

void Session::set_pipeline(const parallel::StageSplit& split, int stage) {
  CHECK(!optimizer_) << "set_pipeline after the optimizer was built";
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
  zero_ = zero;
  optimizer_ = std::move(zero);
  parallel_plan_.shards_optimizer = true;
}

void Session::set_remote_optimizer(std::shared_ptr<optim::Optimizer> optimizer) {
  optimizer_ = std::move(optimizer);
  remote_optimizer_ = true;
}

EvalMetrics Session::evaluate() {
  CHECK_EQ(layout_.dp_size(), 1)
      << "Session::evaluate on one rank of several; use DistributedRun::evaluate";
  return eval_metrics(evaluate_shard(), is_language_model(), token_unit());
}

std::string Session::token_unit() const {
  return is_language_model() && !dynamic_cast<const data::Vocab*>(&vocab()) ? "token" : "char";
}

void Session::materialize_model() {
  for (const NamedTensor& t : model_->state()) materialize(t.tensor);
}

std::vector<NamedTensor> Session::held_state() const {
  return stage_module_ ? stage_module_->state() : model_->state();
}

int64_t Session::measure_activation_bytes() {
  // The activations are measured over the whole model, whatever this rank holds.
  materialize_model();
  int64_t param_bytes = 0;
  for (const Tensor& p : model_->parameters()) param_bytes += int64_t(p.nbytes());
  Allocator& a = allocator(module_device(*model_));
  int64_t before = a.stats().current_bytes;
  a.reset_peak();
  source_->probe_loss(2).backward();
  int64_t activations = (a.stats().peak_bytes - before - param_bytes) / 2 * micro_batch_;
  model_->zero_grad();
  return std::max<int64_t>(activations, 0);
}

std::string Session::summary(int64_t activation_bytes) const {
  std::ostringstream out;
  out << "model " << recipe_.model.name << ":\n";
  for (const auto& [name, child] : model_->children())
    out << "  " << name << "  " << with_commas(child->num_parameters()) << "\n";
  out << "  total  " << with_commas(model_->num_parameters()) << " parameters\n";
  if (!tensor_parallel_note_.empty()) out << tensor_parallel_note_ << "\n";
  out << source_->summary();

  // Memory: parameters, gradients (as the parameters) and optimizer state
  // (this rank's, sharded or not) exactly, from their dtypes; activations
  // as measure_activation_bytes found them.
  int64_t param_bytes = 0;
  for (const Tensor& p : model_->parameters()) param_bytes += int64_t(p.nbytes());
  // Before DistributedRun built the shard, a full optimizer tells its size.
  const int64_t state_bytes =
      optimizer_ ? optimizer_->state_bytes()
                 : make_optimizer(recipe_, param_groups(recipe_, *model_))->state_bytes() /
                       layout_.job.shard_group();
  double mib = 1.0 / (1024.0 * 1024.0);
  char buf[256];
  std::snprintf(
      buf, sizeof buf,
      "memory estimate: parameters %.1f MiB, gradients %.1f MiB, optimizer state %.1f MiB%s, "
      "activations %.1f MiB (micro-batch %lld%s)\n",
      double(param_bytes) * mib, double(param_bytes) * mib, double(state_bytes) * mib,
      shards_optimizer() ? cat(" (sharded, 1/", layout_.job.shard_group(), " per rank)").c_str()
                         : "",
      double(activation_bytes) * mib, (long long)micro_batch_,
      recompute_note(recipe_.parallel.recompute));
  out << buf;
  return out.str();
}

}  // namespace trainer
