// Corpora encoded into token shards on several threads; see token_encoder.h.
#include "data/token_encoder.h"

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>

#include "core/check.h"
#include "data/files.h"
#include "data/token_shards.h"

namespace trainer::data {

namespace {

// One chunk of whole lines and what encoding it gave.
struct Chunk {
  std::string text;
  std::vector<int32_t> ids;
  int64_t lines = 0;
  int64_t first_mismatch = -1;  // line index within the chunk, -1: none
  int64_t mismatches = 0;
};

// Encodes a chunk line by line, checking that each line decodes to itself.
void encode_chunk(const SentencePieceTokenizer& tokenizer, Chunk& c) {
  std::string decoded;
  size_t pos = 0;
  while (pos < c.text.size()) {
    size_t end = c.text.find('\n', pos);
    end = end == std::string::npos ? c.text.size() : end + 1;
    const std::string_view line(c.text.data() + pos, end - pos);
    const size_t before = c.ids.size();
    tokenizer.encode_into(line, c.ids);
    decoded.clear();
    tokenizer.decode_into(c.ids.data() + before, int64_t(c.ids.size() - before), decoded);
    if (decoded != line) {
      if (c.first_mismatch < 0) c.first_mismatch = c.lines;
      ++c.mismatches;
    }
    ++c.lines;
    pos = end;
  }
}

// Encodes the chunks on up to `threads` threads, each taking the next chunk.
void encode_batch(const SentencePieceTokenizer& tokenizer, std::vector<Chunk>& batch, int threads) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t k = next++; k < batch.size(); k = next++) encode_chunk(tokenizer, batch[k]);
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < std::min<int>(threads, int(batch.size())); ++t) helpers.emplace_back(work);
  work();
  for (std::thread& h : helpers) h.join();
}

}  // namespace

EncodeSummary encode_corpora(const SentencePieceTokenizer& tokenizer, const EncodeOptions& o,
                             const std::function<void(const EncodeProgress&)>& progress) {
  if (o.corpora.empty()) throw Error("encoding needs at least one corpus file");
  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  EncodeProgress p;
  for (const std::string& file : o.corpora)
    p.total_bytes += int64_t(RegularFile(file, "the text corpus").size());
  if (p.total_bytes == 0)
    throw Error(cat("the corpora hold no text (", o.corpora.front(),
                    o.corpora.size() > 1 ? " and the rest are" : " is", " empty)"));
  ShardWriter writer(o.out, {.vocab_size = tokenizer.size(),
                             .tokenizer_checksum = tokenizer.checksum(),
                             .shard_tokens = o.shard_tokens});
  EncodeSummary s;
  const size_t batch_chunks = size_t(std::max(1, o.threads)) * 4;
  for (const std::string& file : o.corpora) {
    LineChunks reader(file, "the text corpus", o.chunk_bytes);
    int64_t file_lines = 0;
    for (bool more = true; more;) {
      std::vector<Chunk> batch;
      std::string text;
      while (batch.size() < batch_chunks && (more = reader.next(text))) {
        batch.emplace_back();
        batch.back().text = std::move(text);
      }
      encode_batch(tokenizer, batch, o.threads);
      for (const Chunk& c : batch) {
        writer.append(c.ids.data(), int64_t(c.ids.size()));
        if (c.first_mismatch >= 0 && s.mismatched_lines == 0)
          s.first_mismatch = cat(file, ":", file_lines + c.first_mismatch + 1);
        s.mismatched_lines += c.mismatches;
        file_lines += c.lines;
        p.bytes += int64_t(c.text.size());
      }
      p.tokens = writer.tokens();
      p.seconds = seconds();
      if (progress && !batch.empty()) progress(p);
    }
    if (tokenizer.eos_id() >= 0) {
      const int32_t eos = int32_t(tokenizer.eos_id());
      writer.append(&eos, 1);
    }
    s.lines += file_lines;
    ++p.files;
  }
  writer.finish();
  write_file_atomically((std::filesystem::path(o.out) / kTokenizerFile).string(),
                        tokenizer.model_bytes());
  p.tokens = writer.tokens();
  p.seconds = seconds();
  if (progress) progress(p);
  s.files = p.files;
  s.bytes = p.bytes;
  s.tokens = writer.tokens();
  s.shards = writer.shards();
  s.token_bytes = writer.token_bytes();
  s.seconds = p.seconds;
  return s;
}

}  // namespace trainer::data
