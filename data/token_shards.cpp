// Token shards written and mapped; see token_shards.h.
#include "data/token_shards.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>

#include "core/check.h"

namespace trainer::data {

namespace fs = std::filesystem;

namespace {

void put_le(uint8_t* p, uint64_t v, int bytes) {
  for (int b = 0; b < bytes; ++b) p[b] = uint8_t(v >> (8 * b));
}

uint64_t get_le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int b = bytes - 1; b >= 0; --b) v = v << 8 | p[b];
  return v;
}

const char* kEncodeAgain =
    "encode the corpus again (`trainer tokenize --model M CORPUS --out DIR`)";

// The shard index of a file name "shard_<digits>.tok", -1 for any other name.
int64_t shard_index(const std::string& name) {
  const std::string prefix = "shard_", suffix = ".tok";
  if (name.size() < prefix.size() + 5 + suffix.size() || name.rfind(prefix, 0) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return -1;
  const std::string digits =
      name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() > 12 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(digits);
}

// Shard index -> path of a directory's shards (Error when it is not a directory).
std::map<int64_t, std::string> list_shards(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw Error(cat("the token directory ", dir, " ",
                    fs::exists(dir, ec) ? "is not a directory" : "does not exist",
                    "; data.path must name a directory written by `trainer tokenize --model M "
                    "CORPUS --out DIR`"));
  std::map<int64_t, std::string> shards;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const int64_t index = shard_index(entry.path().filename().string());
    if (index >= 0) shards[index] = entry.path().string();
  }
  if (ec) throw Error(cat("cannot list the token directory ", dir, ": ", ec.message()));
  return shards;
}

// A file mapped read-only for the life of the object.
class Mapping {
 public:
  Mapping(const std::string& path, const std::string& what) {
    RegularFile file(path, what);
    size_ = size_t(file.size());
    if (size_ == 0) return;
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, file.fd(), 0);
    if (p == MAP_FAILED)
      throw Error(cat("cannot map ", what, " ", path, ": ", std::strerror(errno)));
    data_ = static_cast<const uint8_t*>(p);
  }
  ~Mapping() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

using Mappings = std::vector<std::unique_ptr<Mapping>>;

// Maps and checks one shard against the directory's tokenizer.
TokenSource::Segment open_shard(const std::string& path, const SentencePieceTokenizer& tokenizer,
                                Mappings& mappings) {
  auto m = std::make_unique<Mapping>(path, "the token shard");
  const ShardHeader h = decode_shard_header(m->data(), m->size(), path);
  const uint64_t body = uint64_t(m->size()) - kShardHeaderBytes;
  const bool truncated = h.tokens > body / h.token_bytes;
  if (truncated || h.tokens * h.token_bytes != body)
    throw Error(cat(path, ": the header says ", h.tokens, " tokens of ", h.token_bytes,
                    " bytes, but the file holds ", body, " bytes after its header: it is ",
                    truncated ? "truncated" : "longer than written", "; ", kEncodeAgain));
  if (h.tokenizer_checksum != tokenizer.checksum())
    throw Error(cat(path, " was written with the tokenizer of checksum ",
                    checksum_hex(h.tokenizer_checksum), ", but ", tokenizer.name(),
                    " has checksum ", checksum_hex(tokenizer.checksum()),
                    ": shards of different tokenizers cannot be read together; ", kEncodeAgain,
                    " into an empty directory"));
  if (int64_t(h.vocab_size) != tokenizer.size() ||
      h.token_bytes != token_bytes_for(tokenizer.size()))
    throw Error(cat(path, ": a vocabulary of ", h.vocab_size, " in ", h.token_bytes,
                    "-byte tokens, but ", tokenizer.name(), " has ", tokenizer.size(),
                    " pieces; the file is damaged: ", kEncodeAgain));
  TokenSource::Segment s{.data = m->data() + kShardHeaderBytes,
                         .width = int(h.token_bytes),
                         .count = int64_t(h.tokens),
                         .name = path};
  mappings.push_back(std::move(m));
  return s;
}

}  // namespace

std::array<uint8_t, kShardHeaderBytes> encode_shard_header(const ShardHeader& h) {
  std::array<uint8_t, kShardHeaderBytes> b{};
  std::memcpy(b.data(), kShardMagic, 8);
  put_le(b.data() + 8, h.version, 4);
  put_le(b.data() + 12, h.token_bytes, 4);
  put_le(b.data() + 16, h.vocab_size, 8);
  put_le(b.data() + 24, h.tokens, 8);
  put_le(b.data() + 32, h.tokenizer_checksum, 8);
  put_le(b.data() + 40, fnv1a64({reinterpret_cast<const char*>(b.data()), 40}), 8);
  return b;
}

ShardHeader decode_shard_header(const uint8_t* b, size_t n, const std::string& name) {
  if (n < kShardHeaderBytes)
    throw Error(cat(name, " is ", n, " bytes, shorter than the ", kShardHeaderBytes,
                    "-byte header of a token shard: it is truncated or not a shard; ",
                    kEncodeAgain));
  if (std::memcmp(b, kShardMagic, 8) != 0)
    throw Error(cat(name, " does not start with \"", kShardMagic, "\": it is not a token shard; ",
                    kEncodeAgain));
  ShardHeader h;
  h.version = uint32_t(get_le(b + 8, 4));
  if (h.version != kShardVersion)
    throw Error(cat(name, ": token shard version ", h.version, ", but this trainer reads version ",
                    kShardVersion, "; ", kEncodeAgain));
  if (get_le(b + 40, 8) != fnv1a64({reinterpret_cast<const char*>(b), 40}))
    throw Error(cat(name, ": the header's checksum does not match its bytes: the file is damaged; ",
                    kEncodeAgain));
  h.token_bytes = uint32_t(get_le(b + 12, 4));
  h.vocab_size = get_le(b + 16, 8);
  h.tokens = get_le(b + 24, 8);
  h.tokenizer_checksum = get_le(b + 32, 8);
  if ((h.token_bytes != 2 && h.token_bytes != 4) || h.vocab_size == 0 ||
      h.token_bytes != token_bytes_for(int64_t(std::min<uint64_t>(h.vocab_size, 1ull << 40))))
    throw Error(cat(name, ": ", h.token_bytes, " bytes per token for a vocabulary of ",
                    h.vocab_size, " is not a token shard's (2 up to 65536 ids, else 4); ",
                    kEncodeAgain));
  return h;
}

uint32_t token_bytes_for(int64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

std::string shard_file_name(int64_t index) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "shard_%05lld.tok", (long long)index);
  return buf;
}

ShardWriter::ShardWriter(std::string dir, const ShardWriterOptions& options)
    : dir_(std::move(dir)), options_(options), token_bytes_(token_bytes_for(options.vocab_size)) {
  CHECK(options.vocab_size > 0 && options.shard_tokens > 0)
      << "vocabulary " << options.vocab_size << ", shard tokens " << options.shard_tokens;
  make_directories(dir_, "the token directory");
  const std::map<int64_t, std::string> existing = list_shards(dir_);
  std::error_code ec;
  if (!existing.empty() || fs::exists(fs::path(dir_) / kTokenizerFile, ec))
    throw Error(cat("the token directory ", dir_, " already holds ",
                    existing.empty() ? std::string(kTokenizerFile) : existing.begin()->second,
                    "; write into an empty directory, or delete its shards and tokenizer.model "
                    "first (shards of two encodings must never mix)"));
}

ShardWriter::~ShardWriter() = default;

void ShardWriter::append(const int32_t* ids, int64_t n) {
  while (n > 0) {
    if (!file_) {
      file_ = std::make_unique<AtomicFile>((fs::path(dir_) / shard_file_name(shards_)).string());
      // The header's place: its token count and checksum are known, and
      // written, when the shard closes.
      const std::array<uint8_t, kShardHeaderBytes> header_space{};
      file_->write(header_space.data(), header_space.size());
    }
    const int64_t take = std::min(n, options_.shard_tokens - in_shard_);
    buffer_.resize(size_t(take) * token_bytes_);
    for (int64_t i = 0; i < take; ++i) {
      CHECK(ids[i] >= 0 && ids[i] < options_.vocab_size)
          << "token id " << ids[i] << ", vocabulary " << options_.vocab_size;
      put_le(buffer_.data() + i * token_bytes_, uint64_t(ids[i]), int(token_bytes_));
    }
    file_->write(buffer_.data(), buffer_.size());
    in_shard_ += take, tokens_ += take, ids += take, n -= take;
    if (in_shard_ == options_.shard_tokens) close_shard();
  }
}

void ShardWriter::close_shard() {
  const auto header = encode_shard_header({.token_bytes = token_bytes_,
                                           .vocab_size = uint64_t(options_.vocab_size),
                                           .tokens = uint64_t(in_shard_),
                                           .tokenizer_checksum = options_.tokenizer_checksum});
  file_->write_at(0, header.data(), header.size());
  file_->commit();
  file_.reset();
  in_shard_ = 0;
  ++shards_;
}

void ShardWriter::finish() {
  if (file_) close_shard();
}

TokenDirectory open_token_directory(const std::string& dir) {
  const std::map<int64_t, std::string> shards = list_shards(dir);
  if (shards.empty())
    throw Error(cat("the token directory ", dir, " holds no token shards (", shard_file_name(0),
                    ", ...); ", kEncodeAgain));
  int64_t expected = 0;
  for (const auto& [index, path] : shards) {
    if (index != expected)
      throw Error(cat("the token directory ", dir, " holds ", fs::path(path).filename().string(),
                      " but not ", shard_file_name(expected),
                      ": a shard is missing; restore it or ", kEncodeAgain));
    ++expected;
  }
  const std::string model = (fs::path(dir) / kTokenizerFile).string();
  if (!not_a_regular_file(model).empty())
    throw Error(cat("the token directory ", dir, " has no ", kTokenizerFile,
                    " (the tokenizer its shards were written with; it is written last, so the "
                    "encoding may have stopped part way); ",
                    kEncodeAgain));
  TokenDirectory d;
  d.dir = dir;
  d.tokenizer = SentencePieceTokenizer::load(model);
  auto mappings = std::make_shared<Mappings>();
  std::vector<TokenSource::Segment> segments;
  for (const auto& [index, path] : shards)
    segments.push_back(open_shard(path, *d.tokenizer, *mappings));
  d.shards = int64_t(segments.size());
  d.token_bytes = token_bytes_for(d.tokenizer->size());
  d.tokens = TokenSource(std::move(segments), mappings, d.tokenizer->size());
  return d;
}

TextCorpus load_token_corpus(const std::string& dir, double val_fraction) {
  TokenDirectory d = open_token_directory(dir);
  return TextCorpus(std::move(d.tokens), std::move(d.tokenizer), val_fraction, dir);
}

}  // namespace trainer::data
