#include "trainer/batch_source.h"

#include <cmath>

#include "core/ops.h"
#include "models/registry.h"
#include "trainer/checkpoint.h"

namespace trainer {

EvalMetrics eval_metrics(const EvalSums& sums, bool language_model, const std::string& token_unit) {
  EvalMetrics m;
  m.language_model = language_model;
  m.token_unit = token_unit;
  m.samples = sums.samples;
  m.skipped = sums.skipped;
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

bool EvalMetrics::improves_on(double best) const {
  if (samples == 0) return false;
  return language_model ? best < 0 || loss < best : top1 > best;
}

std::string EvalMetrics::text() const {
  if (samples == 0 && skipped > 0)
    return cat("nothing evaluated: all ", skipped,
               " validation files read were bad and skipped (fix or replace them)");
  const std::string skips = skipped > 0 ? cat(" | ", skipped, " bad files skipped") : "";
  if (language_model) return cat("loss ", loss, " | ", bits_per_char, " bits/", token_unit, skips);
  return cat("loss ", loss, " | top1 ", top1, "% | top5 ", top5, "%", skips);
}

std::string EvalMetrics::final_text(double best) const {
  if (samples == 0 && skipped > 0) {
    std::string text = cat("final eval: nothing evaluated (", skipped, " bad files skipped)");
    if (best < 0) return text;  // no evaluation ever read a file
    return language_model ? cat(text, ", best loss ", best) : cat(text, ", best ", best, "%");
  }
  if (language_model)
    return cat("final eval loss ", loss, ", ", bits_per_char, " bits/", token_unit, ", best loss ",
               best);
  return cat("final eval top1 ", top1, "%, best ", best, "%");
}

Scalars EvalMetrics::scalars() const {
  if (samples == 0) return {};
  // bits_per_char, or bits_per_token for a subword vocabulary.
  if (language_model) return {{"loss", loss}, {"bits_per_" + token_unit, bits_per_char}};
  return {{"loss", loss}, {"top1", top1}, {"top5", top5}};
}

StepBatch time_chunk(const StepBatch& batch, int m, int K) {
  if (K == 1) return batch;
  const int64_t T = batch.inputs.size(1), width = T / K;
  CHECK_EQ(width * K, T) << "time chunks of a window";
  StepBatch chunk = batch;
  chunk.inputs = batch.inputs.narrow(1, m * width, width).contiguous();
  chunk.targets = batch.targets.narrow(1, m * width, width).contiguous();
  return chunk;
}

Tensor pad_samples(const Tensor& t, int64_t rows) {
  if (t.size(0) >= rows) return t;
  Shape padding = t.shape();
  padding[0] = rows - t.size(0);
  return concat({t, zeros(padding, t.dtype(), t.device())}, 0);
}

void BatchSource::load_stream_state(const std::string& dir, int64_t position) {
  const int64_t epoch = samples_per_epoch();
  if (position < 0 || position > epoch)
    throw Error(cat(trainer_state_file(dir), ": \"position\" is ", position,
                    " (this data-parallel rank's ",
                    is_language_model() ? "text windows" : "samples",
                    " of the epoch consumed), but an epoch of the recipe's data holds ", epoch,
                    " per rank, so it must be in [0, ", epoch,
                    "]: the file was edited, or the checkpoint belongs to a larger dataset. "
                    "Resume from a checkpoint of this dataset, or start without --resume"));
  restore_stream_state(dir, position);
}

void BatchSource::set_context_parallel(std::shared_ptr<ContextParallelGroup>) {
  throw Error("context parallelism splits token windows; this data has none (use parallel.cp=1)");
}

const data::Tokenizer& BatchSource::vocab() const {
  CHECK(false) << "vocab() of a model that is not a language model";
  std::abort();
}

std::unique_ptr<BatchSource> make_batch_source(const Recipe& r, const RankLayout& layout,
                                               int64_t micro_batch, DataAccess access) {
  const bool text = r.data.name == "text" || r.data.name == "tokens";
  if (is_language_model(r.model.name) != text)
    throw Error(cat(r.source, ": model.name '", r.model.name, "' cannot read data.name '",
                    r.data.name,
                    "': language models (gpt, llama, lstm_lm) read text or tokens, the others "
                    "images"));
  if (r.data.sampling != "random" && !text)
    throw Error(cat(r.source, ": data.sampling '", r.data.sampling,
                    "' is for text; images are read by the shuffling sampler"));
  if (text) return make_text_batches(r, layout, micro_batch);
  return make_image_batches(r, layout, micro_batch, access);
}

}  // namespace trainer
