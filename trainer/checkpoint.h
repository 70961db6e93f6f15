// Checkpoint directories (DESIGN.md "Checkpoints").
//
// Layout under the run's checkpoint dir:
//   step_00001200/            one complete checkpoint
//     model.safetensors       parameters and buffers by their global names
//     optimizer.safetensors   optimizer state (shards: optimizer.rank<r>.safetensors)
//     trainer_state.json      step, epoch, sample position, RNG, recipe, parallel layout
//   step_00001200.tmp/        being written; never read
//   latest                    the name of the newest complete checkpoint
//   best                      the name of the best one (kept by keep-last-k)
//
// A checkpoint is written into step_N.tmp/, each file fsynced, then the
// directory is renamed to step_N (atomic) and `latest` is replaced last, so
// a crash at any point leaves the previous checkpoint intact and findable.
//
//   CheckpointDir ckpt("runs/x/checkpoints", /*keep_last=*/3);
//   std::string tmp = ckpt.begin(step);     // write files into tmp
//   ckpt.commit(step, /*is_best=*/false);   // rename, update latest, prune
//   std::optional<std::string> dir = ckpt.latest_complete();
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace trainer {

class CheckpointDir {
 public:
  CheckpointDir(std::string root, int64_t keep_last);

  // Creates an empty step_N.tmp directory (removing a stale one) and returns its path.
  std::string begin(int64_t step) const;
  // Publishes step_N: fsync, rename, update `latest` (and `best`), prune old ones.
  std::string commit(int64_t step, bool is_best);

  // The newest complete checkpoint: `latest` if it is valid, else the highest
  // step_N holding a trainer_state.json. Empty when there is none.
  std::optional<std::string> latest_complete() const;
  // Complete checkpoints, oldest first.
  std::vector<std::string> complete() const;

  static std::string step_name(int64_t step);
  static bool is_complete(const std::string& dir);
  const std::string& root() const { return root_; }

 private:
  void prune() const;
  std::optional<std::string> read_pointer(const std::string& name) const;

  std::string root_;
  int64_t keep_last_;
};

// fsyncs every regular file in dir, then dir itself.
void fsync_tree(const std::string& dir);

}  // namespace trainer
