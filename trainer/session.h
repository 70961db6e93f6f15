// A training session: everything a recipe builds (model, datasets, loaders,
// optimizer, LR schedule) and the state that moves as training runs, with
// its checkpoint round trip. The loop (trainer/train.cpp) drives it.
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
};

struct EvalMetrics {
  double loss = 0;
  double top1 = 0;  // percent
  double top5 = 0;  // percent
  int64_t samples = 0;
};

class Session {
 public:
  // Builds everything from the recipe (throws Error on a bad combination,
  // naming the recipe key).
  explicit Session(Recipe recipe);

  const Recipe& recipe() const { return recipe_; }
  Module& model() { return *model_; }
  optim::Optimizer& optimizer() { return *optimizer_; }
  const optim::LrSchedule& schedule() const { return *schedule_; }
  data::Loader& train_loader() { return *train_loader_; }
  data::Loader& val_loader() { return *val_loader_; }
  int64_t micro_batch() const { return micro_batch_; }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t total_steps() const { return total_steps_; }

  // Re-keys every Dropout layer for micro-step `micro` (counted over the run).
  void rekey_dropout(int64_t micro);

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
  Recipe recipe_;
  std::shared_ptr<Module> model_;
  std::unique_ptr<data::Dataset> train_set_, val_set_;
  std::unique_ptr<data::Loader> train_loader_, val_loader_;
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
