#include "trainer/session.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/allocator.h"
#include "core/ops.h"
#include "data/idx.h"
#include "data/image_folder.h"
#include "layers/linear.h"
#include "models/lstm_lm.h"
#include "models/registry.h"
#include "trainer/device.h"
#include "trainer/safetensors.h"

namespace trainer {

namespace {

using json = nlohmann::json;

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

data::TransformOptions transform_options(const Recipe& r, bool train, int channels) {
  data::TransformOptions t;
  t.size = int(r.data.image_size);
  t.seed = uint64_t(r.seed);
  if (r.data.name == "fashion_mnist") {
    t.mode = data::TransformMode::plain;
    t.mean = {data::kFashionMnistMean};
    t.std = {data::kFashionMnistStd};
  } else {
    t.mode = train && r.data.augment ? data::TransformMode::train : data::TransformMode::eval;
    t.resize =
        r.data.resize > 0 ? int(r.data.resize) : int(std::lround(r.data.image_size * 8.0 / 7.0));
    if (channels == 1) t.mean = {0.5f}, t.std = {0.5f};
  }
  return t;
}

int64_t epochs_to_steps(double epochs, int64_t steps_per_epoch) {
  return int64_t(std::llround(epochs * double(steps_per_epoch)));
}

std::string with_commas(int64_t v) {
  std::string digits = std::to_string(v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

// The optimizer state file of a checkpoint: one, or this rank's shard.
std::string optimizer_file(const std::string& dir, bool sharded, int rank) {
  return sharded ? cat(dir, "/optimizer.rank", rank, ".safetensors")
                 : dir + "/optimizer.safetensors";
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

Session::Session(Recipe recipe, RankLayout layout) : recipe_(std::move(recipe)), layout_(layout) {
  const Recipe& r = recipe_;
  // First: a recipe asking for an absent GPU fails before any data is read.
  const Device device = training_device(r, layout_.world_size);
  const int64_t world = layout_.world_size;
  const TrainingRecipe& t = r.training;
  if (t.global_batch % (t.grad_accum * world) != 0)
    throw Error(cat(r.source, ": training.global_batch ", t.global_batch,
                    " is not divisible by training.grad_accum x world size (", t.grad_accum * world,
                    ")"));
  micro_batch_ = t.global_batch / (t.grad_accum * world);

  // ---- data ----
  if (trainer::is_language_model(r.model.name) != (r.data.name == "text"))
    throw Error(cat(r.source, ": model.name '", r.model.name, "' cannot read data.name '",
                    r.data.name, "': language models (gpt, lstm_lm) read text, the others images"));
  if (r.data.sampling != "random" && r.data.name != "text")
    throw Error(cat(r.source, ": data.sampling '", r.data.sampling,
                    "' is for text; images are read by the shuffling sampler"));
  if (r.data.name == "text")
    build_text_data();
  else
    build_image_data();

  steps_per_epoch_ = (corpus_ ? train_windows_->windows_per_epoch() / micro_batch_
                              : train_loader_->batches_per_epoch()) /
                     t.grad_accum;
  if (steps_per_epoch_ == 0)
    throw Error(cat(r.source, ": training.global_batch ", t.global_batch, " is larger than the ",
                    corpus_ ? cat(train_windows_->windows_per_epoch(), " training windows")
                            : cat(train_set_->size(), " training samples"),
                    " of an epoch"));
  total_steps_ = t.steps > 0 ? t.steps : t.epochs * steps_per_epoch_;

  // ---- model and optimizer ----
  model_ = build_model(r, corpus_ ? corpus_->vocab().size() : 0);
  lstm_ = std::dynamic_pointer_cast<LSTMLM>(model_);
  move_module(*model_, device);  // before the optimizer builds its state beside the parameters
  // Sharded: DistributedRun builds it (the full one would cost the memory zero1 saves).
  if (!shards_optimizer())
    optimizer_ = std::make_unique<TrainOptimizer>(make_optimizer(r, param_groups(r, *model_)));

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

void Session::build_image_data() {
  const Recipe& r = recipe_;
  if (r.data.name == "fashion_mnist") {
    std::string dir = r.data.root.empty() ? data::kFashionMnistDir : r.data.root;
    train_set_ =
        std::make_unique<data::MnistDataset>(data::load_fashion_mnist(dir, data::Split::train));
    val_set_ =
        std::make_unique<data::MnistDataset>(data::load_fashion_mnist(dir, data::Split::val));
  } else if (r.data.name == "image_folder") {
    if (r.data.root.empty())
      throw Error(
          cat(r.source, ": data.root must name a folder with train/ and val/ for image_folder"));
    auto train = std::make_unique<data::ImageFolder>(r.data.root + "/train");
    auto val = std::make_unique<data::ImageFolder>(r.data.root + "/val");
    data::check_same_classes(*train, *val);
    train_set_ = std::move(train);
    val_set_ = std::move(val);
  } else {
    throw Error(cat(r.source, ": data.name '", r.data.name, "' has no image reader"));
  }
  if (train_set_->num_classes() != r.model.num_classes)
    throw Error(cat(r.source, ": model.num_classes is ", r.model.num_classes,
                    " but the dataset has ", train_set_->num_classes(), " classes"));
  if (train_set_->channels() != r.model.in_channels)
    throw Error(cat(r.source, ": model.in_channels is ", r.model.in_channels,
                    " but the dataset's images have ", train_set_->channels(), " channels"));

  data::LoaderOptions lo;
  lo.batch_size = micro_batch_;
  lo.num_workers = int(r.data.workers);
  lo.prefetch_batches = int(r.data.prefetch);
  lo.bad_files =
      r.data.bad_files == "error" ? data::BadFilePolicy::error : data::BadFilePolicy::skip;
  lo.report_epochs = false;
  lo.drop_last = true;  // every step sees the same batch size
  data::SamplerOptions so{.dataset_size = train_set_->size(),
                          .rank = layout_.rank,
                          .world_size = layout_.world_size,
                          .seed = uint64_t(r.seed)};
  train_loader_ = std::make_unique<data::Loader>(
      *train_set_,
      data::ImageTransform(transform_options(r, true, train_set_->channels()),
                           train_set_->channels()),
      data::DistributedSampler(so), lo);
  // Each rank evaluates its share, every image exactly once.
  data::SamplerOptions vo{.dataset_size = val_set_->size(),
                          .rank = layout_.rank,
                          .world_size = layout_.world_size,
                          .shuffle = false,
                          .exact = true};
  lo.drop_last = false;
  val_loader_ = std::make_unique<data::Loader>(
      *val_set_,
      data::ImageTransform(transform_options(r, false, val_set_->channels()), val_set_->channels()),
      data::DistributedSampler(vo), lo);
}

void Session::rekey_dropout(int64_t micro) {
  uint64_t layer = 0;
  model_->apply([&](Module& m) {
    auto* d = dynamic_cast<Dropout*>(&m);
    if (!d) return;
    // Stream: purpose in the low 8 bits, the layer above; offset: 2^32
    // blocks per micro-step and rank, far more than any layer draws.
    const uint64_t block = uint64_t(micro) * uint64_t(layout_.world_size) + uint64_t(layout_.rank);
    d->generator() =
        Generator(uint64_t(recipe_.seed), kStreamDropout | (++layer << 8), block << 32);
  });
}

TrainOptimizer& Session::optimizer() {
  CHECK(optimizer_) << "the sharded optimizer is used before DistributedRun built it";
  return *optimizer_;
}

void Session::set_sharded_optimizer(std::shared_ptr<parallel::ZeroOptimizer> zero) {
  CHECK(shards_optimizer()) << "a sharded optimizer for a session without parallel.zero1";
  optimizer_ = std::make_unique<TrainOptimizer>(std::move(zero));
}

const data::Vocab& Session::vocab() const {
  CHECK(corpus_) << "vocab() of a model that is not a language model";
  return corpus_->vocab();
}

void Session::start_epoch(int64_t epoch, int64_t position) {
  if (!corpus_) return train_loader_->start_epoch(epoch, position);
  text_epoch_ = epoch;
  text_position_ = position;
  // A new epoch's streams start from zeros; a resumed one from the saved state.
  if (position == 0) carried_ = RNNState{};
}

bool Session::next_batch(StepBatch& batch) {
  if (!corpus_) {
    data::Batch b;
    if (!train_loader_->next(b)) return false;
    batch = StepBatch{b.images, b.labels, b.position, b.labels.numel()};
  } else if (!next_text_batch(batch)) {
    return false;
  }
  const Device device = module_device(*model_);
  batch.inputs = to_device(batch.inputs, device);
  batch.targets = to_device(batch.targets, device);
  return true;
}

Tensor Session::loss(const StepBatch& batch) {
  if (corpus_) return text_loss(batch);
  return cross_entropy(forward(batch.inputs), to_device(batch.targets, module_device(*model_)));
}

Tensor Session::forward(const Tensor& images) {
  return (*model_)(to_device(images, module_device(*model_)).permute({0, 3, 1, 2}));
}

EvalMetrics eval_metrics(const EvalSums& sums, bool language_model) {
  EvalMetrics m;
  m.samples = sums.samples;
  if (sums.samples == 0) return m;
  m.loss = sums.loss / double(sums.samples);
  if (language_model) {
    m.bits_per_char = m.loss / std::log(2.0);
  } else {
    m.top1 = 100.0 * double(sums.top1) / double(sums.samples);
    m.top5 = 100.0 * double(sums.top5) / double(sums.samples);
  }
  return m;
}

EvalMetrics Session::evaluate() {
  CHECK_EQ(layout_.world_size, 1)
      << "Session::evaluate on one rank of several; use DistributedRun::evaluate";
  return eval_metrics(evaluate_shard(), is_language_model());
}

EvalSums Session::evaluate_shard() { return corpus_ ? evaluate_text() : evaluate_images(); }

EvalSums Session::evaluate_images() {
  autograd::NoGradGuard no_grad;
  model_->eval();
  EvalSums sums;
  val_loader_->start_epoch(0);
  data::Batch batch;
  CrossEntropyOptions sum_loss;
  sum_loss.reduction = CrossEntropyOptions::Reduction::sum;
  while (val_loader_->next(batch)) {
    Tensor logits = forward(batch.images);
    sums.loss +=
        cross_entropy(logits, to_device(batch.labels, logits.device()), sum_loss).item<double>();
    std::vector<float> l = logits.to_vector<float>();
    std::vector<int64_t> y = batch.labels.to_vector<int64_t>();
    int64_t C = logits.size(1);
    for (size_t n = 0; n < y.size(); ++n) {
      // Rank of the target: how many classes score strictly higher.
      float target = l[n * size_t(C) + size_t(y[n])];
      int64_t higher = 0;
      for (int64_t c = 0; c < C; ++c) higher += l[n * size_t(C) + size_t(c)] > target;
      sums.top1 += higher < 1;
      sums.top5 += higher < 5;
    }
    sums.samples += int64_t(y.size());
  }
  model_->train();
  return sums;
}

void Session::save(const std::string& dir, const TrainState& s) const {
  CHECK(optimizer_) << "save() before the sharded optimizer was built";
  const bool sharded = shards_optimizer();
  if (sharded || layout_.rank == 0)
    write_safetensors(optimizer_file(dir, sharded, layout_.rank), optimizer_->state());
  if (carries_state()) save_stream_state(dir);
  if (layout_.rank != 0) return;
  write_safetensors(dir + "/model.safetensors", model_->state(), {{"format", "pt"}});
  json j;
  j["step"] = s.step;
  j["epoch"] = s.epoch;
  j["position"] = s.position;
  j["best_metric"] = s.best_metric;
  j["nonfinite_skipped"] = s.nonfinite_skipped;
  j["lr"] = optimizer_->lr();
  j["rng"] = {{"seed", recipe_.seed},
              {"init_stream", uint64_t(kStreamInit)},
              {"dropout", "re-keyed per micro-step from (seed, layer, micro-step, rank)"},
              {"augment", "keyed by (seed, epoch, sample index)"}};
  j["parallel"] = {{"world_size", layout_.world_size},
                   {"dp", layout_.world_size},
                   {"pp", 1},
                   {"tp", 1},
                   {"zero1", sharded}};
  if (corpus_) j["vocab"] = corpus_->vocab().symbols();
  j["recipe"] = recipe_to_yaml(recipe_);
  write_file_atomic(dir + "/trainer_state.json", j.dump(2) + "\n");
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
  SafetensorsFile model_file = read_safetensors(dir + "/model.safetensors");
  model_->upgrade_loaded_state(model_file.tensors, dir + "/model.safetensors");
  std::vector<std::string> problems = load_named(model_->state(), model_file.tensors);
  if (!problems.empty())
    throw Error(
        cat(dir, "/model.safetensors does not match the recipe's model:", join_lines(problems)));
  std::string state_path = dir + "/trainer_state.json";
  json j;
  try {
    j = json::parse(read_file(state_path));
  } catch (const json::exception& e) {
    throw Error(cat(state_path, ": not valid JSON (", e.what(), "); use an earlier checkpoint"));
  }
  TrainState s;
  try {
    s.step = j.at("step").get<int64_t>();
    s.epoch = j.at("epoch").get<int64_t>();
    s.position = j.at("position").get<int64_t>();
    s.best_metric = j.at("best_metric").get<double>();
    s.nonfinite_skipped = j.at("nonfinite_skipped").get<int64_t>();
  } catch (const json::exception& e) {
    throw Error(cat(state_path, ": missing or wrong field (", e.what(), ")"));
  }
  if (s.step < 0 || s.epoch < 0 || s.position < 0)
    throw Error(cat(state_path, ": negative step, epoch or position"));
  s.world_size = j.contains("parallel") ? j["parallel"].value("world_size", int64_t(1)) : 1;
  const bool saved_sharded = j.contains("parallel") && j["parallel"].value("zero1", false);
  if (corpus_ && j.contains("vocab")) {
    std::vector<int64_t> symbols;
    try {
      symbols = j.at("vocab").get<std::vector<int64_t>>();
    } catch (const json::exception& e) {
      throw Error(cat(state_path, ": 'vocab' is not a list of bytes (", e.what(), ")"));
    }
    if (!(data::Vocab::from_symbols(symbols) == corpus_->vocab()))
      throw Error(cat(state_path, ": the checkpoint's vocabulary of ", symbols.size(),
                      " symbols differs from the ", corpus_->vocab().size(), " of ",
                      corpus_->name(), "; the corpus or data.vocab changed since it was written"));
  }
  if (with_optimizer) {
    // The sample position counts one rank's samples, and a shard holds one
    // rank's part of the optimizer state: both mean the same only on the same layout.
    if (s.world_size != layout_.world_size)
      throw Error(cat(dir, " was written by ", s.world_size,
                      " data-parallel ranks; resume it on as many (parallel.dp=", s.world_size,
                      "), not ", layout_.world_size));
    const bool sharded = shards_optimizer();
    if (saved_sharded != sharded)
      throw Error(cat(dir, " was written with parallel.zero1=", saved_sharded ? "true" : "false",
                      " (the optimizer state ",
                      saved_sharded ? "sharded over the ranks" : "whole on every rank",
                      "); resume it with parallel.zero1=", saved_sharded ? "true" : "false"));
    const std::string optim_path = optimizer_file(dir, sharded, layout_.rank);
    SafetensorsFile optim_file = read_safetensors(optim_path);
    model_->upgrade_loaded_state(optim_file.tensors, optim_path);  // entries <parameter>.<slot>
    std::vector<NamedTensor> optim_state;
    for (const auto& [name, t] : optim_file.tensors) optim_state.push_back({name, t});
    // Everything validated: now change the optimizer (it refuses another layout) and the model.
    optimizer().load_state(optim_state);
    if (carries_state()) load_stream_state(dir, s.position);
  }
  copy_named(model_->state(), model_file.tensors);
  return s;
}

void Session::init_from(const std::string& path, bool strict) {
  SafetensorsFile f = read_safetensors(path);
  model_->upgrade_loaded_state(f.tensors, path);
  std::vector<std::string> problems = load_named(model_->state(), f.tensors);
  if (!problems.empty()) {
    if (strict)
      throw Error(cat(path,
                      " does not match the model (pass --init-non-strict to load what matches):",
                      join_lines(problems)));
    std::fprintf(stderr, "init-from %s: loading what matches; skipped:%s\n", path.c_str(),
                 join_lines(problems).c_str());
  }
  copy_named(model_->state(), f.tensors);
}

std::string Session::summary() {
  std::ostringstream out;
  out << "model " << recipe_.model.name << ":\n";
  for (const auto& [name, child] : model_->children())
    out << "  " << name << "  " << with_commas(child->num_parameters()) << "\n";
  int64_t params = model_->num_parameters();
  out << "  total  " << with_commas(params) << " parameters\n";
  if (corpus_) {
    const data::TextCorpus& c = *corpus_;
    out << "data " << c.name() << ": " << with_commas(c.size()) << " tokens (train "
        << with_commas(c.train_tokens()) << ", val " << with_commas(c.val_tokens()) << "), "
        << (c.vocab().kind() == data::VocabKind::bytes ? "byte" : "char") << " vocabulary of "
        << c.vocab().size() << ", windows of " << train_windows_->seq_len() << " tokens ("
        << with_commas(train_windows_->windows_per_epoch()) << " per epoch, "
        << with_commas(val_windows_->size()) << " per evaluation"
        << (train_windows_->contiguous() ? cat("; contiguous streams, ", micro_batch_, " per rank",
                                               carries_state() ? ", state carried" : "")
                                         : std::string())
        << ")\n";
  }

  // Memory: parameters, gradients and optimizer state exactly; activations
  // measured as the allocator's peak over one training step at batch 2,
  // scaled to the micro-batch.
  int64_t state_copies =
      recipe_.optimizer.name == "adamw" ? 2 : (recipe_.optimizer.momentum > 0 ? 1 : 0);
  // zero1: each rank keeps the state of about 1/world of the parameters.
  const int64_t world = layout_.world_size;
  const int64_t state_params = shards_optimizer() ? (params + world - 1) / world : params;
  Allocator& a = allocator(module_device(*model_));
  int64_t before = a.stats().current_bytes;
  a.reset_peak();
  {
    StepBatch two;
    if (corpus_) {
      const int64_t T = train_windows_->seq_len();
      two.inputs = zeros({2, T}, DType::i64);
      two.targets = zeros({2, T}, DType::i64);
    } else {
      two.inputs =
          zeros({2, recipe_.data.image_size, recipe_.data.image_size, recipe_.model.in_channels});
      two.targets = zeros({2}, DType::i64);
    }
    two.inputs = to_device(two.inputs, module_device(*model_));
    two.targets = to_device(two.targets, module_device(*model_));
    RNNState kept = carried_;  // the probe must not become the carried state
    loss(two).backward();
    carried_ = kept;
  }
  int64_t activations = (a.stats().peak_bytes - before - params * 4) / 2 * micro_batch_;
  model_->zero_grad();
  double mib = 1.0 / (1024.0 * 1024.0);
  char buf[256];
  std::snprintf(
      buf, sizeof buf,
      "memory estimate: parameters %.1f MiB, gradients %.1f MiB, optimizer state %.1f MiB%s, "
      "activations %.1f MiB (micro-batch %lld)\n",
      double(params) * 4 * mib, double(params) * 4 * mib,
      double(state_params) * 4 * double(state_copies) * mib,
      shards_optimizer() ? cat(" (zero1: sharded, 1/", world, " per rank)").c_str() : "",
      double(std::max<int64_t>(activations, 0)) * mib, (long long)micro_batch_);
  out << buf;
  return out.str();
}

}  // namespace trainer
