// Checkpoints: the files of one checkpoint, who writes each, the trainer
// state's JSON, and the directories they live in.
//
// Layout under the run's checkpoint dir:
//   step_00001200/            one complete checkpoint
//     model-rank<r>.safetensors       rank r's pieces of the parameters and buffers
//     optimizer-rank<r>.safetensors   rank r's pieces of the optimizer state
//                             (one format for every layout: "pieces" below)
//     stream_state.rank<r>.safetensors  rank r's carried LSTM state (contiguous text)
//     loss_scaler.safetensors the fp16 loss scaler's state (trainer/precision.h)
//     trainer_state.json      step, epoch, sample position, RNG, recipe, parallel layout,
//                             allreduce cost models
//   step_00001200.tmp/        being written; never read
//   latest                    the name of the newest complete checkpoint
//   best                      the name of the best one (kept by keep-last-k)
// Checkpoints of the earlier formats (trainer_state.json format 1 and 2)
// still load: model.safetensors or model-0000<k>-of-0000<n>.safetensors
// (pipeline stages), optimizer.safetensors, optimizer-0000<k>-of-0000<n>
// or the ZeRO-1 shards optimizer.rank<r>.safetensors.
//
// A checkpoint is written into step_N.tmp/, each file fsynced, then the
// directory is renamed to step_N (atomic) and `latest` is replaced last, so
// a crash at any point leaves the previous checkpoint intact and findable.
//
//   CheckpointDir ckpt("runs/x/checkpoints", /*keep_last=*/3);
//   std::string tmp = ckpt.begin(step);     // write files into tmp
//   ckpt.commit(step, /*is_best=*/false);   // rename, update latest, prune
//   std::optional<std::string> dir = ckpt.latest_complete();
//
// Each rank contributes its part of a checkpoint (write_checkpoint_part):
// the pieces of the model and the optimizer state it writes (one copy of
// each: parallel::writes), its stream state; the main rank adds
// trainer_state.json (write_trainer_state). No rank gathers another's.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "comm/alpha_beta.h"
#include "core/tensor.h"
#include "parallel/mesh.h"
#include "parallel/placement.h"

namespace trainer {

// ---- the files of one checkpoint directory (the earlier formats') ----
std::string model_file(const std::string& dir);  // the single writer's
std::string model_part_file(const std::string& dir, int part, int parts);
std::string optimizer_file(const std::string& dir, bool sharded, int rank);
// optimizer-0000<k>-of-0000<n>.safetensors: part k of n (pipeline stages).
std::string optimizer_part_file(const std::string& dir, int part, int parts);
std::string stream_state_file(const std::string& dir, int rank);
std::string loss_scaler_file(const std::string& dir);
std::string trainer_state_file(const std::string& dir);
// The version of trainer_state.json (and of the checkpoint's files) this
// build writes: 1 (no "format" key) recorded the layout as parallel.{dp,
// pp, tp}; 2 adds parallel.mesh, the size of every mesh dimension, written
// when a dimension other than dp_replicate, pp and tp is in use; 3 writes the
// tensors as every rank's pieces (model-rank<r>, optimizer-rank<r>). Older
// versions load; a newer one is refused.
inline constexpr int kTrainerStateFormat = 3;

// The job's parallel layout, recorded with every checkpoint: resuming needs
// the same (a sample position counts one dp rank's samples, a shard holds
// one rank's part of the optimizer state).
struct ParallelLayout {
  parallel::MeshShape mesh;  // its product is the world size
  bool zero1 = false;        // the optimizer state sharded over the dp ranks
  // What else is: 1 the optimizer state only, 2 the gradients too, 3 the
  // parameters too (parallel.shard); 0 when zero1 is off.
  int zero_stage = 0;
  int world_size() const { return mesh.size(); }
  // Hybrid sharding (parallel.dp_replicate) has the dp ranks in replica
  // groups of dp_shard ranks; otherwise they are one group along dp_replicate.
  bool hybrid() const { return mesh[parallel::Dim::dp_shard] > 1; }
  int replica_groups() const { return hybrid() ? mesh[parallel::Dim::dp_replicate] : 1; }
  // The ranks a ZeRO shard is one of: a replica group's dp ranks and the cp
  // ranks, which hold the same parameters.
  int shard_group() const {
    return mesh.size(parallel::kDataParallel) / replica_groups() * mesh[parallel::Dim::cp] *
           mesh[parallel::Dim::ep];
  }
  bool operator==(const ParallelLayout&) const = default;
};

// parallel.shard's names of the ZeRO stages 0 to 3.
inline constexpr const char* kShardNames[] = {"none", "optimizer", "gradients", "parameters"};

// What moves during training; saved in trainer_state.json.
struct TrainState {
  int64_t step = 0;      // optimizer steps taken
  int64_t epoch = 0;     // the epoch in progress
  int64_t position = 0;  // this dp rank's samples consumed in that epoch
  double best_metric = -1;
  int64_t nonfinite_skipped = 0;
  ParallelLayout layout;  // of the run that wrote it
  // The allreduce cost models its communicators chose algorithms by, keyed
  // by their members' world ranks (comm/alpha_beta.h): a resumed run on the
  // same world presets them, so that it chooses as the stopped run did.
  std::map<std::vector<int>, comm::LinkModel> link_models;
};

// trainer_state.json: the state and what a reader checks it against.
struct TrainerStateFile {
  TrainState state;
  double lr = 0;               // of the last step
  int64_t seed = 0;            // the recipe's (the RNG keys)
  std::vector<int64_t> vocab;  // a language model's vocabulary symbols; empty: none
  // A language model's SentencePiece tokenizer (data.name: tokens): the
  // checksum of its model file (16 hex digits; empty: none), its vocabulary
  // size and the path it was read from.
  std::string tokenizer_checksum;
  int64_t tokenizer_size = 0;
  std::string tokenizer_model;
  std::string recipe_yaml;  // the resolved recipe
};
// Written atomically (the main rank's part, last of the files).
void write_trainer_state(const std::string& dir, const TrainerStateFile& file);
// Throws Error naming the file on bad JSON, and the file and the field for a
// missing field, one of the wrong JSON type or out of range.
// A checkpoint without a "parallel" record was written by one process.
TrainerStateFile read_trainer_state(const std::string& dir);
// The same from the file's text; `path` names it in errors.
TrainerStateFile parse_trainer_state(const std::string& text, const std::string& path);
// What changes when a checkpoint written on `saved` resumes on `current`
// (every layout resumes on every other): "" for nothing, else e.g.
// "dp 2 -> 4, zero1 on -> off".
std::string resharding(const ParallelLayout& saved, const ParallelLayout& current);

// How the tensor readers below treat what they load.
struct CheckpointReadOptions {
  // A NaN or Inf in a floating tensor is an Error naming the tensor and the
  // file that holds it (a part of a pipeline checkpoint, a rank's shard):
  // weights or optimizer state poisoned by a diverged run would otherwise
  // train on silently. Off for training.allow_non_finite (inspecting such a run).
  bool refuse_non_finite = false;
};
// The first NaN or Inf of a floating-point tensor (CPU, as loaded) and its
// index, or -1.
std::pair<int64_t, double> first_non_finite(const Tensor& t);
// The check itself: Error naming `file`, the tensor, the first non-finite
// element and its index, and what to do.
void require_finite(const std::map<std::string, Tensor>& tensors, const std::string& file);

// A ZeRO-1 checkpoint's optimizer state as whole tensors: the shards of
// every rank's optimizer.rank<r>.safetensors ("<param>.<slot>[b:e]") joined
// into "<param>.<slot>" of the parameter's shape (from `shapes`, by name),
// step counts as they are. Written under tensor parallelism (metadata, see
// CheckpointPart), each tp rank's shards are joined into its part first and
// the parts into the whole; a parameter every tp rank holds whole is taken
// from tp rank 0's files. Error naming the file for a shard of an unknown
// parameter, for a shard whose elements another shard holds too (the
// ranges and both files named: a file extra or damaged), and for elements
// no shard holds (the range named: a rank's file missing). With the
// checkpoint's trainer_state.json, the files must be those of the ranks
// that wrote it: one per rank of its world, none beyond (Error naming the
// file missing or extra).
std::map<std::string, Tensor> read_sharded_optimizer_whole(
    const std::string& dir, const std::map<std::string, Shape>& shapes,
    const CheckpointReadOptions& options = {});

// ---- one format for every layout: pieces of logical tensors ----
// Every rank writes the pieces of the logical tensors it holds, as its
// placements say (parallel/placement.h), into <stem>-rank<r>.safetensors
// (stem "model" or "optimizer", r five digits). A piece that is a whole
// tensor is stored under its global name, so the file of one process is a
// plain state dict; any other piece under "<name>#<k>", with the file's
// metadata "<name>#<k>" describing it:
//   global=1152,384 dim=0 boxes=0+192,0+384;384+192,0+384;768+192,0+384 elements=0:-1
// the logical tensor's shape, the boxes of it that make up the rank's local
// tensor (concatenated along dim: the q, k and v slices of a
// tensor-parallel part), and the elements of the flattened local tensor the
// stored 1-d tensor holds (a ZeRO-1 shard; end -1: all of it, in the local
// shape). The metadata "trainer.pieces" = "1" marks the format. A reader
// joins every rank's pieces into whole tensors, checking that they cover
// each tensor exactly once, and then takes what its own layout holds: any
// layout reads a checkpoint written on any other.
struct TensorPiece {
  std::string name;                  // the logical tensor's global name
  Shape global;                      // its shape
  std::vector<parallel::Box> boxes;  // of it, concatenated along dim into the local tensor
  int dim = 0;
  int64_t begin = 0, end = -1;  // elements [begin, end) of the flattened local tensor; -1: all
  Tensor values;
};
std::string pieces_file(const std::string& dir, const std::string& stem, int rank);
// The piece of this rank's local tensor under placement (all of it).
TensorPiece piece_of(const std::string& name, const Tensor& local,
                     const parallel::TensorPlacement& placement, const parallel::MeshShape& mesh,
                     const parallel::MeshCoord& coord);
void write_pieces(const std::string& path, const std::vector<TensorPiece>& pieces);
// Whether dir holds <stem>-rank<r>.safetensors files (else it is a checkpoint
// of the earlier formats, read by the functions above).
bool has_pieces(const std::string& dir, const std::string& stem);
// Every rank's pieces joined: whole tensors by global name. Error naming the
// file for a damaged description, pieces that disagree on a tensor's shape
// or dtype, elements held twice, and elements no file holds.
std::map<std::string, Tensor> read_pieces(const std::string& dir, const std::string& stem,
                                          const CheckpointReadOptions& options = {});

// index.json of a checkpoint of pieces: for the model and the optimizer
// state, every logical tensor's dtype, shape and pieces (file, key, byte
// offsets in the file, local shape, boxes, element range), and every
// file's size; written when the checkpoint is committed, from the files'
// headers. For tools that read single tensors without joining the rest.
std::string checkpoint_index_file(const std::string& dir);
// Writes it (nothing for a checkpoint of the earlier formats).
void write_checkpoint_index(const std::string& dir);
// Error naming the index and the first tensor or file it gets wrong, when
// it does not describe the files in dir (nothing when there is no index).
void verify_checkpoint_index(const std::string& dir);

// One rank's part of a checkpoint.
struct CheckpointPart {
  std::vector<TensorPiece> model;      // pieces of the model's parameters and buffers
  std::vector<TensorPiece> optimizer;  // of the optimizer state
  // The carried stream state, when training carries one.
  std::optional<std::vector<NamedTensor>> stream_state;
  // The model pieces (by name) the next forward pass changes, the
  // buffers: a background writer copies these before training goes on,
  // and the rest (changed only by the next optimizer step) meanwhile.
  std::set<std::string> changes_in_forward;
  // The main rank's: trainer_state.json, written last.
  std::optional<TrainerStateFile> trainer_state;
};
// Writes part into dir (which exists) as rank `rank`: a file of pieces for
// each of model and optimizer that holds any, the stream state, and
// trainer_state.json last.
void write_checkpoint_part(const std::string& dir, int rank, const CheckpointPart& part);
// The logical model of a checkpoint: every rank's pieces joined, or (the
// earlier formats) model.safetensors, or every part file merged (Error
// naming the file for a missing part or a tensor in two).
std::map<std::string, Tensor> read_model(const std::string& dir,
                                         const CheckpointReadOptions& options = {});
// The earlier formats' optimizer state or a rank's stream state (Error
// naming a missing file). Not sharded: optimizer.safetensors, or every part
// file merged. Sharded: the rank's optimizer.rank<r>.safetensors, the
// checkpoint's shard files checked against its world as
// read_sharded_optimizer_whole does.
std::vector<NamedTensor> read_optimizer(const std::string& dir, bool sharded, int rank,
                                        const CheckpointReadOptions& options = {});
std::map<std::string, Tensor> read_stream_state(const std::string& dir, int rank);

class CheckpointDir {
 public:
  CheckpointDir(std::string root, int64_t keep_last);
  // Waits for the deletion of pruned checkpoints.
  ~CheckpointDir();
  CheckpointDir(const CheckpointDir&) = delete;
  CheckpointDir& operator=(const CheckpointDir&) = delete;

  // Creates an empty step_N.tmp directory (removing a stale one) and returns
  // its path. A commit of another step may run meanwhile on another thread:
  // its pruning leaves this directory alone.
  std::string begin(int64_t step);
  // Publishes step_N: fsync, rename, update `latest` (and `best`), prune old ones.
  std::string commit(int64_t step, bool is_best);

  // The newest complete checkpoint: `latest` if it is valid, else the highest
  // step_N holding a trainer_state.json. Empty when there is none.
  std::optional<std::string> latest_complete() const { return latest_in(root_); }
  // Complete checkpoints, oldest first.
  std::vector<std::string> complete() const { return complete_in(root_); }
  // The same of any checkpoints folder, read only; and the complete
  // checkpoint a pointer file (latest, best) in it names.
  static std::optional<std::string> latest_in(const std::string& root);
  static std::vector<std::string> complete_in(const std::string& root);
  static std::optional<std::string> pointer_in(const std::string& root, const std::string& pointer);

  static std::string step_name(int64_t step);
  static bool is_complete(const std::string& dir);
  const std::string& root() const { return root_; }

 private:
  void prune();

  std::string root_;
  int64_t keep_last_;
  std::thread pruner_;  // deleting the checkpoints the last commit pruned
  // The step whose .tmp directory begin() made last (-1: none).
  std::atomic<int64_t> writing_step_{-1};
};

// fsyncs every regular file in dir, then dir itself.
void fsync_tree(const std::string& dir);

}  // namespace trainer
