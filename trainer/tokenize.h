// `trainer tokenize`: subword tokenizers for language models, in two forms.
//
//   trainer tokenize --train CORPUS... --vocab-size N --out tok.model
//                    [--type bpe|unigram] [--character-coverage X] [--threads N]
//     trains a SentencePiece model on the corpora (data/sentencepiece.h: byte
//     fallback, no normalisation, digits split, unk/bos/eos/pad ids 0..3) and
//     writes tok.model and tok.vocab;
//   trainer tokenize --model tok.model CORPUS... --out DIR [--shard-tokens N] [--threads N]
//     encodes the corpora into the token shards of DIR (data/token_shards.h,
//     data/token_encoder.h) plus DIR/tokenizer.model, which a recipe reads
//     with data.name: tokens and data.path: DIR.
//
// Each prints a one-line summary on stdout; encoding shows its progress on
// stderr (a bar redrawn in place on a terminal, else a line every 10 s).
//
//   TokenizeArgs args;
//   CLI::App* tokenize = add_tokenize_command(app, args);
//   if (*tokenize) return tokenize_command(args);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace trainer {

struct TokenizeArgs {
  std::vector<std::string> train;    // --train: the corpora to train on
  std::string model;                 // --model: the tokenizer to encode with
  std::vector<std::string> corpora;  // positional: corpora (to encode, or to train on too)
  std::string out;                   // the model file (--train) or the token directory (--model)
  // 0 or "": not given (the defaults below apply).
  int64_t vocab_size = 0;         // --train: required
  std::string type;               // --train: bpe (default) | unigram
  double character_coverage = 0;  // --train: 0.9995 by default
  int64_t shard_tokens = 0;       // --model: 2^24 by default
  int threads = 0;                // 0: the cores this process may run on
};

CLI::App* add_tokenize_command(CLI::App& app, TokenizeArgs& args);

// Runs either form; Error for a bad combination of options (naming them),
// a missing corpus or what SentencePiece refuses.
int tokenize_command(const TokenizeArgs& args);

}  // namespace trainer
