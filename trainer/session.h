// A training session: everything a recipe builds (model, datasets, loaders,
// optimizer, LR schedule) and the state that moves as training runs, with
// its checkpoint round trip. The loop (trainer/train.cpp) drives it.
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
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "trainer/recipe.h"

namespace trainer {

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

class Session {
 public:
  // Builds everything from the recipe (throws Error on a bad combination,
  // naming the recipe key).
  explicit Session(Recipe recipe, RankLayout layout = {});

  const Recipe& recipe() const { return recipe_; }
  Module& model() { return *model_; }
  const std::shared_ptr<Module>& model_ptr() const { return model_; }
  const RankLayout& layout() const { return layout_; }
  optim::Optimizer& optimizer() { return *optimizer_; }
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
  EvalMetrics evaluate();

  // Writes model.safetensors, optimizer.safetensors and trainer_state.json into dir.
  void save(const std::string& dir, const TrainState& state) const;
  // Restores model, optimizer and state from a checkpoint directory.
  TrainState load(const std::string& dir);
  // Loads parameters and buffers by name from a safetensors file; strict:
  // missing, unexpected or mis-shaped tensors are an Error listing them all.
  void init_from(const std::string& path, bool strict);

  // "conv1  320\nbn1  64\n...\ntotal  421,834" and a memory estimate.
  std::string summary();

 private:
  void build_image_data();
  void build_text_data();
  EvalMetrics evaluate_images();
  EvalMetrics evaluate_text();

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
  std::unique_ptr<optim::Optimizer> optimizer_;
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
