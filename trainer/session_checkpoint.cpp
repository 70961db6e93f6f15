// Session's checkpoint I/O: writing this rank's part of a checkpoint and
// resuming from one written on any layout (trainer/checkpoint.h).
#include <algorithm>
#include <limits>
#include <set>

#include "models/registry.h"
#include "parallel/tensor_parallel.h"
#include "parallel/zero.h"
#include "trainer/safetensors.h"
#include "trainer/session.h"

namespace trainer {

namespace {

// The coordinate with the data-parallel indices set to 0, and the cp and ep
// indices too when `sharded`: the ZeRO shards spread over the cp and ep
// ranks, which otherwise hold copies of the dense parameters
// (trainer/distributed_run.cpp, shard_comm).
parallel::MeshCoord first_replica(const parallel::ParallelPlan& plan, bool sharded) {
  parallel::MeshCoord coord = plan.coord;
  for (parallel::Dim d : parallel::kAllDims)
    if (parallel::kDataParallel.contains(d) ||
        (sharded && (d == parallel::Dim::cp || d == parallel::Dim::ep)))
      coord.set(d, 0);
  return coord;
}

}  // namespace

std::vector<TensorPiece> Session::optimizer_pieces() const {
  const parallel::ParallelPlan& plan = parallel_plan_;
  // Along the data-parallel dimensions a ZeRO-1 shard is distinct (every
  // index writes its own), a whole entry is written by the replica that
  // writes its parameter; the other dimensions as the parameter's placement.
  const parallel::MeshCoord coord = first_replica(plan, plan.shards_optimizer);
  const parallel::MeshCoord unsharded = first_replica(plan, false);  // whole entries beside shards
  const int replica = parallel::group_index(plan.mesh, plan.coord, parallel::kDataParallel);
  // Hybrid sharding: the first replica group writes the shards, the others hold copies.
  if (plan.shards_optimizer && layout_.job.hybrid() && plan.coord[parallel::Dim::dp_replicate] != 0)
    return {};
  std::set<std::string> copies;  // tied across stages: the owner writes their state
  for (const TiedAcrossStages& t : tied_)
    if (!t.owner) copies.insert(t.name);
  std::vector<TensorPiece> out;
  for (const NamedTensor& e : optimizer().state()) {
    if (e.name.starts_with("zero1.rank")) continue;  // a ZeRO-1 shard's layout record
    // "<param>.<slot>", or a ZeRO-1 shard's "<param>.<slot>[b:e]": elements
    // b to e of the parameter's flattened local tensor.
    std::string name = e.name;
    int64_t begin = 0, end = -1;
    if (const size_t open = name.rfind('['); open != std::string::npos && name.back() == ']') {
      long long b = 0, f = 0;
      CHECK(std::sscanf(name.c_str() + open, "[%lld:%lld]", &b, &f) == 2) << e.name;
      begin = b, end = f;
      name.resize(open);
    }
    const std::string param = name.substr(0, name.rfind('.'));
    if (copies.count(param)) continue;
    const parallel::TensorPlacement& placed = plan.placement(param);
    const bool range = end >= 0 && e.tensor.dim() == 1 && e.tensor.numel() == end - begin;
    // A whole entry beside the shards (an expert's, ZeroOptions::local):
    // written as without sharding, by one replica.
    const bool whole = plan.shards_optimizer && end < 0;
    // A slot is placed as its parameter; a step count and the like whole,
    // where the parameter is (one copy: a ZeRO-1 shard's, by the rank
    // holding the parameter's first element).
    const bool like_param = range || e.tensor.shape() == parallel::local_shape(placed, plan.mesh);
    if (!like_param && begin != 0) continue;
    parallel::TensorPlacement p = placed;
    if (!like_param) {
      p.global = e.tensor.shape();
      for (parallel::Placement& on : p.on)
        if (on.kind == parallel::Placement::Kind::shard) on = parallel::Placement::replicate();
    }
    if (!parallel::writes(p, whole ? unsharded : coord)) continue;
    if ((!plan.shards_optimizer || whole) && replica != plan.replica_writer_of(param)) continue;
    TensorPiece piece = piece_of(name, e.tensor, p, plan.mesh, plan.coord);
    if (range) piece.begin = begin, piece.end = end;
    out.push_back(std::move(piece));
  }
  return out;
}

CheckpointPart Session::checkpoint_part(const TrainState& state) const {
  // Each rank writes one copy of what it holds, as its placement says: its
  // part of a tensor split over tp, its stage's tensors, its ZeRO-1 or
  // ZeRO-3 shard; a replicated tensor on the first of its replicas. Nothing
  // is gathered.
  const parallel::ParallelPlan& plan = parallel_plan_;
  CheckpointPart part;
  // ZeRO-3: each rank writes its elements of the sharded parameters (the
  // first replica group, under hybrid sharding), as it does their state.
  const std::map<const TensorImpl*, parallel::ParameterShard> shards =
      parameter_shards_ ? parameter_shards_()
                        : std::map<const TensorImpl*, parallel::ParameterShard>();
  const parallel::MeshCoord shard_coord = first_replica(plan, true);
  const bool shard_writer = !layout_.job.hybrid() || plan.coord[parallel::Dim::dp_replicate] == 0;
  for (const NamedTensor& t : held_state()) {
    auto s = shards.find(t.tensor.impl());
    if (s == shards.end()) {
      if (plan.writes(t.name))
        part.model.push_back(
            piece_of(t.name, t.tensor, plan.placement(t.name), plan.mesh, plan.coord));
      continue;
    }
    const parallel::ParameterShard& mine = s->second;
    if (mine.begin == mine.end || !shard_writer ||
        !parallel::writes(plan.placement(t.name), shard_coord))
      continue;
    TensorPiece piece =
        piece_of(t.name, mine.values, plan.placement(t.name), plan.mesh, plan.coord);
    piece.begin = mine.begin, piece.end = mine.end;
    part.model.push_back(std::move(piece));
  }
  // What is not a parameter (batch-norm statistics and the like) changes
  // in the next forward pass.
  std::set<std::string> parameters;
  for (const NamedTensor& p : (stage_module_ ? *stage_module_ : *model_).named_parameters())
    parameters.insert(p.name);
  for (const TensorPiece& p : part.model)
    if (!parameters.count(p.name)) part.changes_in_forward.insert(p.name);
  part.optimizer = optimizer_pieces();
  part.stream_state = source_->stream_state();
  if (layout_.rank != 0) return part;
  TrainerStateFile file;
  file.state = state;
  file.state.layout = layout_.job;
  file.lr = optimizer().lr();
  file.seed = recipe_.seed;
  if (is_language_model()) source_->save_vocab(file);
  file.recipe_yaml = recipe_to_yaml(recipe_);
  part.trainer_state = std::move(file);
  return part;
}

void Session::save(const std::string& dir, const TrainState& state) const {
  write_checkpoint_part(dir, layout_.rank, checkpoint_part(state));
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

int64_t Session::resumed_position(const std::string& dir, const ParallelLayout& saved,
                                  const TrainState& saved_state, bool resharded) const {
  TrainState state = saved_state;
  // The data position: the samples every dp rank consumed, dealt out again.
  // The windows and images of an epoch are dealt to the ranks in turn (r,
  // r + dp, ...), so the first k samples of each of D ranks are the
  // epoch's first k D, under any D.
  if (saved.mesh.size(parallel::kBatchDims) != layout_.dp_size() && state.position > 0) {
    // A hostile position must not overflow here; load_stream_state names
    // it against the epoch's size below.
    if (state.position > std::numeric_limits<int64_t>::max() /
                             std::max<int64_t>(1, saved.mesh.size(parallel::kBatchDims)))
      throw Error(cat(trainer_state_file(dir), ": \"position\" ", state.position,
                      " is past any epoch; the file is damaged: use an earlier checkpoint"));
    const int64_t consumed = state.position * saved.mesh.size(parallel::kBatchDims);
    const int64_t per_step = micro_batch_ * micro_batches_ * layout_.dp_size();
    if (consumed % per_step != 0)
      throw Error(cat(dir, " stopped ", consumed, " samples into epoch ", state.epoch,
                      ", which is not a whole number of steps of training.global_batch = ",
                      recipe_.training.global_batch,
                      "; resume with the global batch it was written with"));
    state.position = consumed / layout_.dp_size();
  }
  if (resharded && state.position > 0 && recipe_.data.sampling == "contiguous" &&
      model_traits(recipe_.model.name).recurrent)
    throw Error(cat(dir, " carries the LSTM state of each rank's text streams ", state.position,
                    " windows into epoch ", state.epoch, "; the streams and the state's rows ",
                    "belong to its layout (", parallel::to_string(saved.mesh),
                    "): resume it on that layout, or from a checkpoint at an epoch's end"));
  return state.position;
}

std::map<std::string, Tensor> Session::read_optimizer_tensors(const std::string& dir,
                                                              const ParallelLayout& saved,
                                                              bool own_shard,
                                                              const CheckpointReadOptions& reading,
                                                              std::string* file) const {
  std::map<std::string, Tensor> optim_tensors;
  if (has_pieces(dir, "optimizer")) {
    *file = dir + "/optimizer-rank*.safetensors";
    optim_tensors = read_pieces(dir, "optimizer", reading);
  } else if (own_shard) {
    *file = optimizer_file(dir, true, layout_.rank);
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
    for (const auto& [name, shape] :
         model_->shapes_at_tensor_parallel(saved.mesh[parallel::Dim::tp]))
      if (shapes.count(name)) shapes[name] = shape;
    *file = dir + "/optimizer.rank*.safetensors";
    optim_tensors = read_sharded_optimizer_whole(dir, shapes, reading);
  } else {
    *file = optimizer_file(dir, false, layout_.rank);
    for (NamedTensor& t : read_optimizer(dir, false, layout_.rank, reading))
      optim_tensors.emplace(t.name, std::move(t.tensor));
  }
  return optim_tensors;
}

void Session::keep_own_entries(std::map<std::string, Tensor>& optim_tensors) const {
  // A whole optimizer state (one file, or one part per stage) holds every
  // parameter's entries: a stage takes its own, whatever layout wrote them.
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

TrainState Session::load_checkpoint(const std::string& dir, bool with_optimizer) {
  // Loaded weights, buffers and optimizer state must be finite (a NaN would
  // train on silently: ReLU hides it from the loss); the readers name the
  // file holding each tensor. training.allow_non_finite loads one anyway.
  const CheckpointReadOptions reading{.refuse_non_finite = !recipe_.training.allow_non_finite};
  std::map<std::string, Tensor> model = read_model(dir, reading);
  const std::string model_files =
      has_pieces(dir, "model") ? dir + "/model-rank*.safetensors" : model_file(dir);
  model_->upgrade_loaded_state(model, model_files);
  // Whole tensors in the file: this rank keeps its parts (tensor parallelism).
  if (tp_) parallel::take_shards(model, *model_);
  std::vector<std::string> problems = load_named(model_->state(), model);
  if (!problems.empty())
    throw Error(cat(model_files, " does not match the recipe's model:", join_lines(problems)));
  TrainerStateFile file = read_trainer_state(dir);
  source_->check_vocab(trainer_state_file(dir), file);
  TrainState state = file.state;
  resharded_.clear();
  if (with_optimizer) {
    const ParallelLayout& saved = file.state.layout;
    const std::string changes = resharding(saved, layout_.job);
    // A ZeRO-1 checkpoint of the earlier format on this layout: each rank
    // reads its own shard. Otherwise the state is read whole and re-sliced.
    const bool own_shard = saved.zero1 && changes.empty() && !has_pieces(dir, "optimizer");
    state.position = resumed_position(dir, saved, state, !changes.empty());
    // Entries are named <parameter>.<slot>: the model's renames apply to them too.
    std::string optim_file;
    std::map<std::string, Tensor> optim_tensors =
        read_optimizer_tensors(dir, saved, own_shard, reading, &optim_file);
    model_->upgrade_loaded_state(optim_tensors, optim_file);
    if (tp_ && !own_shard) parallel::take_shards(optim_tensors, *model_);
    if (!shards_optimizer()) keep_own_entries(optim_tensors);
    std::vector<NamedTensor> optim_state;
    for (auto& [name, t] : optim_tensors) optim_state.push_back({name, t});
    // Everything validated: now change the optimizer (it refuses another layout) and the model.
    if (zero_ && !own_shard)
      zero_->load_whole_state(optim_tensors);  // re-sliced for this rank's shard
    else
      optimizer().load_state(optim_state);
    source_->load_stream_state(dir, state.position);
    if (!changes.empty())
      resharded_ =
          cat(changes,
              saved.zero1 || layout_.job.zero1 ? "; the optimizer state re-sliced by parameter name"
                                               : "",
              saved.mesh.size(parallel::kBatchDims) != layout_.dp_size() && state.position > 0
                  ? cat("; the epoch's data position kept: ", file.state.position,
                        " samples on each of ", saved.mesh.size(parallel::kBatchDims), " ranks -> ",
                        state.position, " on each of ", layout_.dp_size())
                  : "");
  }
  copy_named(held_state(), model);
  return state;
}

void Session::init_from(const std::string& path, bool strict) {
  SafetensorsFile f = read_safetensors(path);
  if (!recipe_.training.allow_non_finite) require_finite(f.tensors, path);
  // Weights published in bf16 or f16 (most Hugging Face checkpoints) load
  // into the model's f32 parameters.
  for (const NamedTensor& t : model_->state()) {
    auto it = f.tensors.find(t.name);
    if (it != f.tensors.end() && is_floating(it->second.dtype()) && is_floating(t.tensor.dtype()) &&
        it->second.dtype() != t.tensor.dtype())
      it->second = it->second.to(t.tensor.dtype());
  }
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

}  // namespace trainer
