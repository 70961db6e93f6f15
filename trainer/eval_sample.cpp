// `trainer eval` and `trainer sample` (trainer/train.h): a checkpoint's
// model evaluated on the validation data, or continuing a prompt. The
// prompt is encoded and the text decoded by the data's vocabulary: the
// corpus's characters or bytes, or the SentencePiece tokenizer of a token
// directory (checked against the one the checkpoint records).
#include <cstdio>
#include <filesystem>

#include "core/autocast.h"
#include "models/registry.h"
#include "models/sample.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_tool.h"
#include "trainer/precision.h"
#include "trainer/session.h"
#include "trainer/train.h"
#include "trainer/train_parts.h"

namespace trainer {

int eval_command(const EvalArgs& args) {
  Recipe r = load_recipe(args.recipe, args.overrides);
  apply_threads(r);
  Session s(r);
  std::string dir = find_checkpoint(args.checkpoint, "--checkpoint");
  TrainState state = s.load_model(dir);
  EvalMetrics m;
  {
    AutocastGuard autocast(Precision(r, false).autocast_dtype());
    m = s.evaluate();
  }
  if (s.is_language_model())
    std::printf("eval %s (step %lld): loss %.4f | %.4f bits/%s | %lld tokens\n", dir.c_str(),
                (long long)state.step, m.loss, m.bits_per_char, m.token_unit.c_str(),
                (long long)m.samples);
  else
    std::printf("eval %s (step %lld): loss %.4f | top1 %.2f%% | top5 %.2f%% | %lld samples\n",
                dir.c_str(), (long long)state.step, m.loss, m.top1, m.top5, (long long)m.samples);
  return 0;
}

int sample_command(const SampleArgs& args) {
  Recipe r = load_recipe(args.recipe, args.overrides);
  if (!model_traits(r.model.name).language_model)
    throw Error(cat(r.source, ": model.name '", r.model.name,
                    "' is not a language model; `trainer sample` needs gpt or lstm_lm"));
  apply_threads(r);
  Session s(r);
  std::string dir = find_checkpoint(args.checkpoint, "--checkpoint");
  TrainState state = s.load_model(dir);
  // An empty prompt starts the text at a line break.
  const std::string prompt = args.prompt.empty() ? "\n" : args.prompt;
  std::vector<int64_t> ids;
  try {
    ids = s.vocab().encode(prompt);
  } catch (const Error& e) {
    throw Error(cat("--prompt: ", e.what()));
  }
  std::fprintf(stderr,
               "sampling %lld tokens from %s (step %lld): temperature %g, top-k %lld, "
               "seed %llu\n",
               (long long)args.tokens, dir.c_str(), (long long)state.step, args.temperature,
               (long long)args.top_k, (unsigned long long)args.seed);
  // Rows past the vocabulary (a larger model.vocab_size) are never picked.
  ids = sample(s.model(), ids,
               {.max_new_tokens = args.tokens,
                .temperature = args.temperature,
                .top_k = args.top_k,
                .seed = args.seed,
                .vocab_size = s.vocab().size()});
  std::string text = s.vocab().decode(ids).substr(args.prompt.empty() ? 1 : 0);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fputc('\n', stdout);
  return 0;
}

}  // namespace trainer
