// A training session: everything a recipe builds (model, datasets, loaders,
// optimizer, LR schedule) and the state that moves as training runs, with
// its checkpoint round trip. The loop (trainer/train.cpp) drives it.
//
// The optimizer: the session builds the recipe's SGD or AdamW over every
// parameter, except under parallel.zero1 on several ranks, where
// DistributedRun builds this rank's shard of it over DataParallel's buckets
// and hands it over (set_sharded_optimizer) before the first step. A
// checkpoint then holds one optimizer file per rank (trainer/checkpoint.h).
//
// Two kinds of model share the loop: classifiers read images through the
// data::Loader; language models (model gpt or lstm_lm, data text) read
// random token windows of a corpus (data/text.h). Their loss is the mean
// cross-entropy over every token; evaluation reports it and bits per
// character (loss / ln 2) over sequential validation windows, and the best
// checkpoint is the one with the lowest validation loss. A checkpoint of a
// language model also records its vocabulary.
//
// Determinism (DESIGN.md): initialisation from Generator(seed, kStreamInit);
// batches from (seed, epoch, sample index) via the sampler and transforms;
// dropout re-keyed before every micro-step from (seed, layer, micro-step)
// (rekey_dropout), so nothing random needs saving and a resumed run
// continues bit for bit with the same thread count.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "data/loader.h"
#include "data/text.h"
#include "layers/module.h"
#include "layers/rnn.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "trainer/distributed.h"
#include "trainer/recipe.h"

namespace trainer {

class LSTMLM;

// What moves during training; saved in trainer_state.json.
struct TrainState {
  int64_t step = 0;      // optimizer steps taken
  int64_t epoch = 0;     // the epoch in progress
  int64_t position = 0;  // this rank's samples consumed in that epoch
  double best_metric = -1;
  int64_t nonfinite_skipped = 0;
  int64_t world_size = 1;  // data-parallel ranks of the run (position counts one rank's samples)
};

struct EvalMetrics {
  double loss = 0;
  double top1 = 0;           // percent (classifiers)
  double top5 = 0;           // percent (classifiers)
  double bits_per_char = 0;  // loss / ln 2 (language models)
  int64_t samples = 0;       // images, or tokens
};

// Sums over a share of the validation set. Data-parallel ranks each evaluate
// a disjoint share and add the shares up in rank order (identical bits on
// every rank) before eval_metrics() divides.
struct EvalSums {
  double loss = 0;  // summed cross-entropy
  int64_t top1 = 0, top5 = 0;
  int64_t samples = 0;  // images, or tokens
};
EvalMetrics eval_metrics(const EvalSums& sums, bool language_model);

// One micro-batch of training data: images [N, H, W, C] and labels [N] for
// a classifier; token windows i64 [N, T] and their next tokens [N, T] for
// a language model.
struct StepBatch {
  Tensor inputs, targets;
  int64_t position = 0;  // this rank's samples (or windows) of the epoch consumed after it
  int64_t items = 0;     // images or tokens, for throughput
};

// This process's place among the data-parallel ranks: the training data is
// sharded by rank, the global batch split over world_size.
struct RankLayout {
  int rank = 0;
  int world_size = 1;
};

// The recipe's parameter groups: one, or with weight decay and without it
// (norm weights and biases) unless optimizer.decay_norm_and_bias.
std::vector<optim::ParamGroup> param_groups(const Recipe& recipe, const Module& model);
// The recipe's optimizer (optimizer.name: SGD or AdamW) over groups.
std::unique_ptr<optim::Optimizer> make_optimizer(const Recipe& recipe,
                                                 std::vector<optim::ParamGroup> groups);

class Session {
 public:
  // Builds everything from the recipe (throws Error on a bad combination,
  // naming the recipe key).
  explicit Session(Recipe recipe, RankLayout layout = {});

  const Recipe& recipe() const { return recipe_; }
  Module& model() { return *model_; }
  const std::shared_ptr<Module>& model_ptr() const { return model_; }
  const RankLayout& layout() const { return layout_; }
  // The optimizer; when sharded, only once set_sharded_optimizer() has run.
  TrainOptimizer& optimizer();
  // parallel.zero1 on several ranks: the optimizer is this rank's shard.
  bool shards_optimizer() const { return trainer::shards_optimizer(recipe_, layout_.world_size); }
  // Takes the sharded optimizer DistributedRun built (shards_optimizer() only).
  void set_sharded_optimizer(std::shared_ptr<parallel::ZeroOptimizer> zero);
  const optim::LrSchedule& schedule() const { return *schedule_; }
  // The image loaders (classifiers only).
  data::Loader& train_loader() { return *train_loader_; }
  data::Loader& val_loader() { return *val_loader_; }
  int64_t micro_batch() const { return micro_batch_; }
  bool is_language_model() const { return corpus_ != nullptr; }
  // The corpus's vocabulary (language models only).
  const data::Vocab& vocab() const;
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t total_steps() const { return total_steps_; }

  // Re-keys every Dropout layer for micro-step `micro` (counted over the run).
  void rekey_dropout(int64_t micro);

  // The training batches of an epoch from a resume position: start_epoch,
  // then next_batch until it returns false.
  void start_epoch(int64_t epoch, int64_t position);
  bool next_batch(StepBatch& batch);
  // Mean cross-entropy of a micro-batch, over its images or every token.
  Tensor loss(const StepBatch& batch);

  // Logits for a batch of NHWC images [N, H, W, C] (viewed as NCHW channels-last).
  Tensor forward(const Tensor& images);
  // The validation set on a single process (DistributedRun::evaluate
  // combines the ranks' shares).
  EvalMetrics evaluate();
  // Sums over this rank's share: images r, r + world, ... of the validation
  // set, or batches of windows r, r + world, ...
  EvalSums evaluate_shard();

  // Writes this rank's part of a checkpoint into dir: rank 0 the model,
  // trainer_state.json and the optimizer state (optimizer.safetensors);
  // when sharded every rank its shard (optimizer.rank<r>.safetensors).
  // Every rank calls it, once dir exists.
  void save(const std::string& dir, const TrainState& state) const;
  // Resumes: restores model, optimizer (this rank's file) and state from a
  // checkpoint written on the same layout (data-parallel ranks, zero1);
  // otherwise throws Error saying what differs.
  TrainState load(const std::string& dir);
  // Restores the model and the state alone (evaluation, sampling: any layout).
  TrainState load_model(const std::string& dir);
  // Loads parameters and buffers by name from a safetensors file; strict:
  // missing, unexpected or mis-shaped tensors are an Error listing them all.
  void init_from(const std::string& path, bool strict);

  // "conv1  320\nbn1  64\n...\ntotal  421,834" and a memory estimate.
  std::string summary();

 private:
  void build_image_data();
  // Language models (trainer/session_lm.cpp).
  void build_text_data();
  bool next_text_batch(StepBatch& batch);
  Tensor text_loss(const StepBatch& batch);
  // Whether the LSTM LM carries its state between micro-batches
  // (data.sampling: contiguous), saved per rank with checkpoints.
  bool carries_state() const;
  void save_stream_state(const std::string& dir) const;
  void load_stream_state(const std::string& dir, int64_t position);
  EvalSums evaluate_images();
  EvalSums evaluate_text();
  // load() with the optimizer, load_model() without it.
  TrainState load_checkpoint(const std::string& dir, bool with_optimizer);

  Recipe recipe_;
  RankLayout layout_;
  std::shared_ptr<Module> model_;
  std::unique_ptr<data::Dataset> train_set_, val_set_;
  std::unique_ptr<data::Loader> train_loader_, val_loader_;
  // Language models: the corpus, its windows, and the epoch being read.
  std::unique_ptr<data::TextCorpus> corpus_;
  std::unique_ptr<data::TextWindows> train_windows_;
  std::unique_ptr<data::EvalWindows> val_windows_;
  int64_t text_epoch_ = 0, text_position_ = 0;
  std::shared_ptr<LSTMLM> lstm_;  // model_ when it is the LSTM LM
  RNNState carried_;              // its state after the last micro-batch
  std::unique_ptr<TrainOptimizer> optimizer_;
  std::optional<optim::LrSchedule> schedule_;
  int64_t micro_batch_ = 0;
  int64_t steps_per_epoch_ = 0;
  int64_t total_steps_ = 0;
};

// Restores named tensors into targets by name (shapes and dtypes must match).
// Returns the problems found (missing, unexpected, mis-shaped), one per line.
std::vector<std::string> load_named(const std::vector<NamedTensor>& targets,
                                    const std::map<std::string, Tensor>& source);

}  // namespace trainer
