// SentencePiece training and the exact tokenizer over a model; see sentencepiece.h.
#include "data/sentencepiece.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <chrono>
#include <cstdio>
#include <unordered_map>

#include "core/check.h"
#include "data/files.h"

namespace trainer::data {

namespace {

// The largest tokenizer model read (SentencePiece's of a 256k vocabulary
// are a few MiB).
constexpr uint64_t kMaxModelBytes = uint64_t(1) << 30;

// U+2581, SentencePiece's mark for a space inside pieces.
constexpr std::string_view kSpaceMark = "\xE2\x96\x81";

// The length of the UTF-8 character at text[i], 0 when the bytes there are
// not one (a stray continuation byte, a truncated or overlong sequence, a
// surrogate, past U+10FFFF).
size_t utf8_length(std::string_view text, size_t i) {
  const auto b = [&](size_t k) { return uint8_t(text[i + k]); };
  const uint8_t c = b(0);
  if (c < 0x80) return 1;
  size_t n = c >= 0xC2 && c <= 0xDF   ? 2
             : c >= 0xE0 && c <= 0xEF ? 3
             : c >= 0xF0 && c <= 0xF4 ? 4
                                      : 0;
  if (n == 0 || i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if ((b(k) & 0xC0) != 0x80) return 0;
  if ((c == 0xE0 && b(1) < 0xA0) || (c == 0xED && b(1) >= 0xA0) || (c == 0xF0 && b(1) < 0x90) ||
      (c == 0xF4 && b(1) >= 0x90))
    return 0;
  return n;
}

// "<0x41>" -> 0x41; -1 for any other piece.
int byte_of_piece(const std::string& piece) {
  unsigned value = 0;
  int end = 0;
  if (piece.size() != 6 || std::sscanf(piece.c_str(), "<0x%2X>%n", &value, &end) != 1 || end != 6)
    return -1;
  return int(value);
}

std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
  std::string out;
  for (size_t at = text.find(from); at != std::string_view::npos; at = text.find(from)) {
    out.append(text.substr(0, at)).append(to);
    text.remove_prefix(at + from.size());
  }
  return out.append(text);
}

}  // namespace

uint64_t fnv1a64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : bytes) h = (h ^ uint8_t(c)) * 0x100000001b3ull;
  return h;
}

std::string checksum_hex(uint64_t checksum) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)checksum);
  return buf;
}

std::shared_ptr<const SentencePieceTokenizer> SentencePieceTokenizer::load(
    const std::string& path) {
  return from_bytes(read_regular_file(path, "the tokenizer model", kMaxModelBytes), path);
}

std::shared_ptr<const SentencePieceTokenizer> SentencePieceTokenizer::from_bytes(std::string model,
                                                                                 std::string name) {
  return std::shared_ptr<const SentencePieceTokenizer>(
      new SentencePieceTokenizer(std::move(model), std::move(name)));
}

SentencePieceTokenizer::SentencePieceTokenizer(std::string model, std::string name)
    : name_(std::move(name)),
      model_(std::move(model)),
      checksum_(fnv1a64(model_)),
      processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  const auto status = processor_->LoadFromSerializedProto(model_);
  if (!status.ok() || processor_->GetPieceSize() <= 0)
    throw Error(cat(name_, " is not a SentencePiece model (", status.ToString(),
                    "); train one with `trainer tokenize --train CORPUS --vocab-size N --out ",
                    name_, "`"));
  byte_id_.fill(-1);
  const int n = processor_->GetPieceSize();
  surface_.resize(size_t(n));
  int bytes = 0;
  for (int id = 0; id < n; ++id) {
    const std::string& piece = processor_->IdToPiece(id);
    if (processor_->IsByte(id) && byte_of_piece(piece) >= 0) {
      const int b = byte_of_piece(piece);
      surface_[size_t(id)] = std::string(1, char(b));
      if (byte_id_[size_t(b)] < 0) ++bytes;
      byte_id_[size_t(b)] = id;
    } else if (processor_->IsUnknown(id)) {
      surface_[size_t(id)] = " \xE2\x81\x87 ";  // SentencePiece's text for an unknown piece
    } else if (!processor_->IsControl(id) && !processor_->IsUnused(id)) {
      surface_[size_t(id)] = replace_all(piece, kSpaceMark, " ");
    }
  }
  byte_pieces_ = bytes == 256;
  eos_id_ = processor_->eos_id();
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

void SentencePieceTokenizer::encode_pieces(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  std::vector<int> ids;
  const auto status = processor_->Encode(text, &ids);
  CHECK(status.ok()) << name_ << ": SentencePiece cannot encode: " << status.ToString();
  out.insert(out.end(), ids.begin(), ids.end());
}

void SentencePieceTokenizer::encode_into(std::string_view text, std::vector<int32_t>& out) const {
  if (!byte_pieces_) return encode_pieces(text, out);
  // Runs SentencePiece gives back as they are go to it; the rest byte by byte.
  size_t run = 0, i = 0;
  while (i < text.size()) {
    const size_t n = utf8_length(text, i);
    if (n > 0 && text.substr(i, n) != kSpaceMark) {
      i += n;
      continue;
    }
    encode_pieces(text.substr(run, i - run), out);
    for (size_t k = 0; k < std::max<size_t>(n, 1); ++k)
      out.push_back(byte_id_[uint8_t(text[i + k])]);
    i += std::max<size_t>(n, 1);
    run = i;
  }
  encode_pieces(text.substr(run), out);
}

std::vector<int64_t> SentencePieceTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  encode_into(text, ids);
  return std::vector<int64_t>(ids.begin(), ids.end());
}

void SentencePieceTokenizer::decode_into(const int32_t* ids, int64_t n, std::string& out) const {
  for (int64_t i = 0; i < n; ++i) {
    CHECK(ids[i] >= 0 && ids[i] < size()) << "token id " << ids[i] << ", vocabulary " << size();
    out += surface_[size_t(ids[i])];
  }
}

std::string SentencePieceTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string text;
  for (int64_t id : ids) {
    CHECK(id >= 0 && id < size()) << "token id " << id << ", vocabulary " << size();
    text += surface_[size_t(id)];
  }
  return text;
}

std::string SentencePieceTokenizer::description() const {
  return cat("SentencePiece vocabulary of ", size(), " (", name_, ", checksum ",
             checksum_hex(checksum_), byte_pieces_ ? "" : ", no byte fallback", ")");
}

std::string vocab_path_of(const std::string& model_path) {
  const std::string suffix = ".model";
  if (model_path.size() > suffix.size() &&
      model_path.compare(model_path.size() - suffix.size(), suffix.size(), suffix) == 0)
    return model_path.substr(0, model_path.size() - suffix.size()) + ".vocab";
  return model_path + ".vocab";
}

namespace {

// The corpora's lines (without line breaks) for SentencePiece's trainer.
class CorpusLines final : public sentencepiece::SentenceIterator {
 public:
  explicit CorpusLines(const std::vector<std::string>& files) : files_(files) { Next(); }
  bool done() const override { return done_; }
  void Next() override {
    while (true) {
      if (pos_ < chunk_.size()) {
        size_t end = chunk_.find('\n', pos_);
        if (end == std::string::npos) end = chunk_.size();
        line_.assign(chunk_, pos_, end - pos_);
        pos_ = end + 1;
        ++lines_;
        return;
      }
      pos_ = 0;
      if (reader_ && reader_->next(chunk_)) continue;
      if (next_file_ == files_.size()) {
        done_ = true;
        return;
      }
      reader_ = std::make_unique<LineChunks>(files_[next_file_++], "the text corpus");
      bytes_ += int64_t(reader_->size());
    }
  }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }
  int64_t lines() const { return lines_; }
  int64_t bytes() const { return bytes_; }

 private:
  const std::vector<std::string>& files_;
  size_t next_file_ = 0;
  std::unique_ptr<LineChunks> reader_;
  std::string chunk_, line_;
  size_t pos_ = 0;
  bool done_ = false;
  int64_t lines_ = 0, bytes_ = 0;
};

std::unordered_map<std::string, std::string> trainer_arguments(const SentencePieceTrainOptions& o) {
  return {{"model_type", o.type},
          {"vocab_size", std::to_string(o.vocab_size)},
          {"character_coverage", cat(o.character_coverage)},
          {"num_threads", std::to_string(std::max(1, o.threads))},
          {"input_sentence_size", std::to_string(o.max_sentences)},
          {"shuffle_input_sentence", "true"},
          {"byte_fallback", "true"},
          {"normalization_rule_name", "identity"},
          {"remove_extra_whitespaces", "false"},
          {"add_dummy_prefix", "false"},
          {"split_digits", "true"},
          {"allow_whitespace_only_pieces", "true"},
          {"unk_id", "0"},
          {"bos_id", "1"},
          {"eos_id", "2"},
          {"pad_id", "3"},
          {"minloglevel", "2"}};
}

}  // namespace

SentencePieceSummary train_sentencepiece(const SentencePieceTrainOptions& o) {
  if (o.corpora.empty()) throw Error("tokenizer training needs at least one corpus file");
  if (o.type != "bpe" && o.type != "unigram")
    throw Error(cat("tokenizer type '", o.type, "' is not one of: bpe, unigram"));
  if (o.out.empty()) throw Error("tokenizer training needs the model file to write (--out)");
  for (const std::string& file : o.corpora) RegularFile(file, "the text corpus");
  const auto start = std::chrono::steady_clock::now();
  CorpusLines lines(o.corpora);
  std::string model;
  const auto status =
      sentencepiece::SentencePieceTrainer::Train(trainer_arguments(o), &lines, &model);
  if (!status.ok())
    throw Error(cat("SentencePiece could not train a ", o.type, " tokenizer of ", o.vocab_size,
                    " pieces on ", o.corpora.front(), o.corpora.size() > 1 ? " and the rest" : "",
                    ": ", status.ToString(),
                    "; a vocabulary must hold at least the 256 byte pieces, the 4 special ones "
                    "and the corpus's characters, and at most what the corpus can fill"));
  auto tokenizer = SentencePieceTokenizer::from_bytes(model, o.out);
  std::string vocab;
  sentencepiece::SentencePieceProcessor processor;
  CHECK(processor.LoadFromSerializedProto(model).ok()) << "the model just trained";
  for (int id = 0; id < processor.GetPieceSize(); ++id)
    vocab += cat(processor.IdToPiece(id), "\t", processor.GetScore(id), "\n");
  const std::string vocab_path = vocab_path_of(o.out);
  write_file_atomically(vocab_path, vocab);
  write_file_atomically(o.out, model);
  return {
      .model_path = o.out,
      .vocab_path = vocab_path,
      .vocab_size = tokenizer->size(),
      .checksum = tokenizer->checksum(),
      .lines = lines.lines(),
      .bytes = lines.bytes(),
      .seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

}  // namespace trainer::data
