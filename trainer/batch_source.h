// Where a session's training batches come from, what its loss is, and how
// it evaluates: one interface over the two kinds of data, so the loop and
// the session never ask which kind they train on.
//
//   ImageBatches (image_batches.cpp): classifiers reading images through the
//     data::Loader (Fashion-MNIST IDX files or an ImageFolder); the loss is
//     the mean cross-entropy of the labels; evaluation reports top-1/top-5.
//   TextBatches (text_batches.cpp): language models (gpt, lstm_lm) reading
//     token windows of a corpus (data/text.h): a text file (data.name: text,
//     a byte or character vocabulary) or a directory of token shards written
//     by `trainer tokenize` (data.name: tokens, its SentencePiece tokenizer;
//     data/token_shards.h); the loss is the mean cross-entropy over every
//     token; evaluation reports it and bits per token (loss / ln 2, "bits
//     per character" for byte and character vocabularies) over sequential
//     validation windows. Under
//     data.sampling: contiguous the LSTM LM carries its recurrent state from
//     one micro-batch to the next (the stream state, saved per rank with
//     each checkpoint).
//
//   std::unique_ptr<BatchSource> source = make_batch_source(recipe, layout, micro_batch);
//   model = build_model(recipe, source->vocab_size());
//   source->bind(model);
//   source->start_epoch(epoch, position);
//   while (source->next(batch)) source->loss(batch).backward();
//
// Data-parallel ranks read disjoint shares (the layout's dp rank and size).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/text.h"
#include "layers/context_parallel.h"
#include "layers/module.h"
#include "trainer/distributed.h"
#include "trainer/metrics.h"
#include "trainer/recipe.h"

namespace trainer {

struct TrainerStateFile;

// One micro-batch of training data: images [N, H, W, C] and labels [N] for
// a classifier; token windows i64 [N, T] and their next tokens [N, T] for
// a language model.
struct StepBatch {
  Tensor inputs, targets;
  int64_t position = 0;  // this rank's samples (or windows) of the epoch consumed after it
  int64_t items = 0;     // images or tokens, for throughput
};

// Sums over a share of the validation set. Data-parallel ranks each evaluate
// a disjoint share and add the shares up in rank order (identical bits on
// every rank) before eval_metrics() divides.
struct EvalSums {
  double loss = 0;  // summed cross-entropy
  int64_t top1 = 0, top5 = 0;
  int64_t samples = 0;  // images, or tokens
  int64_t skipped = 0;  // bad files left out (data.bad_files: skip)
};

struct EvalMetrics {
  bool language_model = false;
  double loss = 0;
  double top1 = 0;           // percent (classifiers)
  double top5 = 0;           // percent (classifiers)
  double bits_per_char = 0;  // loss / ln 2 (language models)
  // What one of the language model's tokens is: "char" (char and byte
  // vocabularies) or "token" (subwords), for the texts.
  std::string token_unit = "char";
  int64_t samples = 0;  // images, or tokens
  int64_t skipped = 0;  // bad files left out

  // The metric the best checkpoint is chosen by: top-1 for classifiers
  // (higher is better), the loss for language models (lower is better).
  double best_metric() const { return language_model ? loss : top1; }
  // Whether these metrics beat best (-1: none yet); an evaluation of no
  // samples (every file bad) beats nothing.
  bool improves_on(double best) const;
  // "loss 0.41 | top1 85.2% | top5 99.1%" or "loss 1.52 | 2.19 bits/char",
  // with "| 3 bad files skipped" when some were; "nothing evaluated: ..."
  // when every file was bad.
  std::string text() const;
  // "final eval top1 85.2%, best 86.0%" or "final eval loss 1.52, 2.19
  // bits/char, best loss 1.50", for the end of training.
  std::string final_text(double best) const;
  // {"loss", ...} and {"top1", "top5"} or {"bits_per_char"}, for the metrics
  // log; none when nothing was evaluated.
  Scalars scalars() const;
};
EvalMetrics eval_metrics(const EvalSums& sums, bool language_model,
                         const std::string& token_unit = "char");

class BatchSource {
 public:
  virtual ~BatchSource() = default;

  // The model the batches feed, once built (a language model's size comes
  // from vocab_size()); before any other call below.
  virtual void bind(std::shared_ptr<Module> model) { model_ = std::move(model); }

  virtual bool is_language_model() const = 0;
  // "samples" or "tokens": what items and throughput count.
  virtual const char* item_name() const = 0;
  // The corpus's vocabulary size (language models), else 0.
  virtual int64_t vocab_size() const { return 0; }
  // The vocabulary: a byte or character Vocab, or a SentencePiece tokenizer
  // (language models only).
  virtual const data::Tokenizer& vocab() const;
  // This rank's micro-batches in one epoch, its samples (images, or text
  // windows: what a data position counts), and what an epoch holds in
  // words ("60000 training samples") for messages.
  virtual int64_t batches_per_epoch() const = 0;
  virtual int64_t samples_per_epoch() const = 0;
  virtual std::string epoch_text() const = 0;
  // The lines the summary prints about the data ("" when nothing to add).
  virtual std::string summary() const { return ""; }

  // The training batches of an epoch from a resume position: start_epoch,
  // then next until it returns false. Batches arrive on the model's device.
  virtual void start_epoch(int64_t epoch, int64_t position) = 0;
  virtual bool next(StepBatch& batch) = 0;
  // Mean cross-entropy of a micro-batch, over its images or every token.
  virtual Tensor loss(const StepBatch& batch) = 0;
  // The loss of n all-zero samples, changing no training state (the memory
  // estimate's probe).
  virtual Tensor probe_loss(int64_t n) = 0;

  // loss() in the pieces a pipeline stage runs (parallel/pipeline.h): the
  // model inputs of a micro-batch, in the order of the block list's
  // boundary(0) (carried state undefined when there is none yet); keeping
  // the carried state a stage's blocks wrote (model outputs in boundary(size)
  // order, undefined where another stage holds them); and the loss from the
  // model outputs, on the last stage. loss(batch) is
  //   keep_outputs(out = blocks.run(model_inputs(batch))), loss_from(batch, out).
  virtual TensorList model_inputs(const StepBatch& batch) = 0;
  virtual void keep_outputs(const TensorList& /*outputs*/) {}
  virtual Tensor loss_from(const StepBatch& batch, const TensorList& outputs) = 0;
  // n all-zero samples (the pipeline's shape probe and profile).
  virtual StepBatch probe_batch(int64_t n) = 0;
  // On a pipeline stage: whether this stage's blocks read the carried state
  // (false: this rank keeps and saves none).
  virtual void set_holds_carried_state(bool /*holds*/) {}
  // On a pipeline stage that reads neither the model inputs nor the targets:
  // next() may give batches without tensors (position and items only), read
  // from nothing; sources where reading is cheap keep reading.
  virtual void set_reads_batches(bool /*reads*/) {}
  // Context parallelism: batches (training, evaluation, probes) hold this
  // rank's tokens of each window (g's layout of dim 1). Error for sources
  // without token windows.
  virtual void set_context_parallel(std::shared_ptr<ContextParallelGroup> g);
  bool batches_have_tensors() const { return reads_batches_; }
  // Sums over this dp rank's share of the validation set.
  virtual EvalSums evaluate_shard() = 0;

  // Evaluation in the pieces a pipeline stage runs (DistributedRun::evaluate):
  // start_eval, then next_eval until it returns false, gives this dp rank's
  // evaluation batches in the order evaluate_shard() reads them, each padded
  // with all-zero samples to the micro-batch size, so that every tensor
  // passed between stages keeps its training shape (batch.items counts the
  // real samples, which are the targets; on a stage that reads no batches
  // the batches have no tensors). eval_inputs gives a batch's model inputs
  // in boundary(0) order: for the LSTM LM's evaluation streams, with the
  // state carried from the previous chunk. keep_eval_outputs keeps that
  // state from the model outputs this stage wrote. add_eval_sums adds a
  // batch's sums from the model outputs (on the stage with the last piece).
  virtual void start_eval() = 0;
  virtual bool next_eval(StepBatch& batch) = 0;
  virtual TensorList eval_inputs(const StepBatch& batch) = 0;
  virtual void keep_eval_outputs(const TensorList& /*outputs*/) {}
  virtual void add_eval_sums(const StepBatch& batch, const TensorList& outputs,
                             EvalSums& sums) const = 0;

  // Training state beside the model and optimizer (the carried LSTM state),
  // saved per rank with checkpoints; nullopt when the source carries none.
  virtual std::optional<std::vector<NamedTensor>> stream_state() const { return std::nullopt; }
  // Resuming from checkpoint dir at `position` (this rank's samples of the
  // epoch consumed): checks that the position lies within this data's epoch
  // (an Error naming trainer_state.json otherwise: an edited file, or a
  // checkpoint of a larger dataset), then restores the carried state.
  void load_stream_state(const std::string& dir, int64_t position);
  // Records the vocabulary in a checkpoint's trainer state (language
  // models): the symbols of a byte or character vocabulary, the checksum,
  // size and path of a SentencePiece model.
  virtual void save_vocab(TrainerStateFile& /*file*/) const {}
  // Checks a checkpoint's vocabulary against the data's (language models);
  // Error naming the file when they differ.
  virtual void check_vocab(const std::string& /*state_path*/,
                           const TrainerStateFile& /*file*/) const {}

 protected:
  // load_stream_state's restoring part (nothing when the source carries no
  // state); Error naming the file when the saved state does not fit.
  virtual void restore_stream_state(const std::string& /*dir*/, int64_t /*position*/) {}

  std::shared_ptr<Module> model_;
  bool reads_batches_ = true;  // false: next() gives positions only
};

// Time chunk m of K of a batch of token windows [N, T]: its columns
// [m T/K, (m + 1) T/K) (the LSTM LM's wavefront); the batch itself for K = 1.
StepBatch time_chunk(const StepBatch& batch, int m, int K);

// t [n, ...] with all-zero samples appended up to `rows` (t itself when it
// has as many already): an evaluation batch at the shape of a micro-batch.
Tensor pad_samples(const Tensor& t, int64_t rows);

// What a source may do when the recipe's dataset is not on disk. read:
// an Error naming it. assume_if_missing (dry runs and plans, which never
// read a batch): an image dataset stands in with the size the recipe
// implies (Fashion-MNIST's, ImageNet-1k's for 1000 classes), and the
// source's summary says which figures the real data may change.
enum class DataAccess { read, assume_if_missing };

// The source of the recipe's data (throws Error naming the recipe key for
// data the model cannot read).
std::unique_ptr<BatchSource> make_batch_source(const Recipe& recipe, const RankLayout& layout,
                                               int64_t micro_batch,
                                               DataAccess access = DataAccess::read);
std::unique_ptr<BatchSource> make_image_batches(const Recipe& recipe, const RankLayout& layout,
                                                int64_t micro_batch, DataAccess access);
std::unique_ptr<BatchSource> make_text_batches(const Recipe& recipe, const RankLayout& layout,
                                               int64_t micro_batch);

}  // namespace trainer
