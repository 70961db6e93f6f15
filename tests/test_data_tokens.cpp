// SentencePiece tokenizers and token shards: exact round trips of any bytes,
// the shard header byte by byte, shards read back and concatenated (windows
// crossing a shard boundary), windows over mapped shards equal to the text
// path's, encoding independent of the thread count, and damaged, truncated
// or foreign shards refused naming the file.
#include "tests/testing.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "data/files.h"
#include "data/sentencepiece.h"
#include "data/text.h"
#include "data/token_encoder.h"
#include "data/token_shards.h"

using namespace trainer;
using namespace trainer::data;
namespace fs = std::filesystem;

namespace {

// Lines of words made of syllables picked by a fixed linear congruential
// sequence, with some UTF-8 beyond ASCII, tabs, digits and runs of spaces.
std::string generated_text(size_t bytes, uint32_t seed) {
  const char* syllables[] = {"the", "lo",  "rd", "sa",          "id",       "un", "to",  "mo",
                             "ses", "an",  "d",  "caf\xc3\xa9", "\xce\xbb", "  ", "\t",  "42",
                             "ea",  "rth", "he", "av",          "en",       "li", "ght", "ki"};
  std::string text;
  uint32_t x = seed;
  auto next = [&] { return (x = x * 1664525u + 1013904223u) >> 16; };
  while (text.size() < bytes) {
    for (int w = 0; w < 9; ++w) {
      for (uint32_t k = 0, n = 1 + next() % 3; k < n; ++k) text += syllables[next() % 24];
      text += w == 8 ? ".\n" : " ";
    }
  }
  return text;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// A tokenizer trained once on generated text (vocab_size pieces).
std::shared_ptr<const SentencePieceTokenizer> trained(int64_t vocab_size) {
  static std::map<int64_t, std::shared_ptr<const SentencePieceTokenizer>> made;
  auto& t = made[vocab_size];
  if (t) return t;
  const fs::path dir = testing::fresh_temp_dir("tokens_model_" + std::to_string(vocab_size));
  write_text(dir / "corpus.txt", generated_text(60000, 7));
  train_sentencepiece({.corpora = {(dir / "corpus.txt").string()},
                       .vocab_size = vocab_size,
                       .out = (dir / "tok.model").string()});
  t = SentencePieceTokenizer::load((dir / "tok.model").string());
  return t;
}

// A token directory of `ids` in shards of shard_tokens, with the tokenizer's model.
void write_token_dir(const fs::path& dir, const SentencePieceTokenizer& tok,
                     const std::vector<int32_t>& ids, int64_t shard_tokens) {
  ShardWriter w(dir.string(), {.vocab_size = tok.size(),
                               .tokenizer_checksum = tok.checksum(),
                               .shard_tokens = shard_tokens});
  w.append(ids.data(), int64_t(ids.size()));
  w.finish();
  write_file_atomically((dir / kTokenizerFile).string(), tok.model_bytes());
}

std::vector<int64_t> all_tokens(const TokenSource& s) {
  std::vector<int64_t> ids(size_t(s.size()));
  s.read(0, s.size(), ids.data());
  return ids;
}

void require_same_batch(const TextBatch& a, const TextBatch& b) {
  REQUIRE(a.inputs.shape() == b.inputs.shape());
  REQUIRE(a.inputs.to_vector<int64_t>() == b.inputs.to_vector<int64_t>());
  REQUIRE(a.targets.to_vector<int64_t>() == b.targets.to_vector<int64_t>());
}

}  // namespace

TEST_CASE("tokens: a SentencePiece tokenizer gives every byte back", "[data][tokens]") {
  auto tok = trained(400);
  REQUIRE(tok->size() == 400);
  REQUIRE(tok->has_byte_pieces());
  REQUIRE(tok->eos_id() == 2);
  const fs::path dir = testing::temp_path("tokens_model_400");
  REQUIRE(tok->checksum() == fnv1a64(read_regular_file((dir / "tok.model").string(), "the file")));
  REQUIRE(fs::exists(dir / "tok.vocab"));
  REQUIRE(tok->description().find("SentencePiece vocabulary of 400") != std::string::npos);
  // Subwords: fewer tokens than bytes on text like the training text.
  const std::string text = generated_text(5000, 99);
  REQUIRE(tok->encode(text).size() < text.size() / 2);

  std::vector<std::string> cases = {"the lord said unto moses.\n",
                                    "  leading and trailing  \n",
                                    "caf\xc3\xa9 \xce\xbb\n",
                                    "tab\there\r\n",
                                    "\xe2\x96\x81 a space mark \xe2\x96\x81\xe2\x96\x81",
                                    "bad \xff\xfe utf-8 \xc3 \xed\xa0\x80 \xf4\x90\x80\x80",
                                    std::string("nul \0 in", 8),
                                    "digits 1234567890",
                                    "unseen \xe6\xbc\xa2\xe5\xad\x97 \xf0\x9f\x98\x80",
                                    ""};
  for (int b = 0; b < 256; ++b) cases.push_back(std::string(1, char(b)));
  uint32_t x = 5;
  for (int k = 0; k < 200; ++k) {  // random bytes
    std::string s;
    for (int i = 0; i < 40; ++i) s += char((x = x * 1664525u + 1013904223u) >> 24);
    cases.push_back(s);
  }
  for (const std::string& s : cases) {
    INFO("text of " << s.size() << " bytes: " << s);
    const std::vector<int64_t> ids = tok->encode(s);
    for (int64_t id : ids) REQUIRE((id >= 0 && id < tok->size()));
    REQUIRE(tok->decode(ids) == s);
  }
  // The special ids decode to nothing.
  REQUIRE(tok->decode({1, 2, 3}).empty());

  REQUIRE_THROWS_WITH(SentencePieceTokenizer::from_bytes("not a model", "bad.model"),
                      Catch::Contains("bad.model is not a SentencePiece model"));
  REQUIRE_THROWS_WITH(SentencePieceTokenizer::load((dir / "missing.model").string()),
                      Catch::Contains("missing.model"));
  REQUIRE(vocab_path_of("a/tok.model") == "a/tok.vocab");
  REQUIRE(vocab_path_of("tok") == "tok.vocab");
}

TEST_CASE("tokens: training refuses what SentencePiece cannot do, naming it", "[data][tokens]") {
  const fs::path dir = testing::fresh_temp_dir("tokens_bad_training");
  write_text(dir / "small.txt", "a b c\n");
  REQUIRE_THROWS_WITH(train_sentencepiece({.corpora = {(dir / "small.txt").string()},
                                           .vocab_size = 100000,
                                           .out = (dir / "t.model").string()}),
                      Catch::Contains("could not train a bpe tokenizer of 100000 pieces on") &&
                          Catch::Contains("small.txt"));
  REQUIRE_THROWS_WITH(
      train_sentencepiece({.corpora = {(dir / "missing.txt").string()},
                           .vocab_size = 300,
                           .out = (dir / "t.model").string()}),
      Catch::Contains("cannot open the text corpus") && Catch::Contains("missing.txt"));
  REQUIRE_FALSE(fs::exists(dir / "t.model"));
}

TEST_CASE("tokens: a shard is a fixed little-endian header and its tokens", "[data][tokens]") {
  // The header of 3 tokens of a 1000-piece vocabulary, tokenizer checksum
  // 0x0123456789abcdef, byte by byte.
  const auto header = encode_shard_header({.token_bytes = 2,
                                           .vocab_size = 1000,
                                           .tokens = 3,
                                           .tokenizer_checksum = 0x0123456789abcdefull});
  std::vector<uint8_t> expected = {
      'T',  'R',  'T',  'O',  'K',  'E',  'N',  'S',    // magic
      1,    0,    0,    0,                              // version
      2,    0,    0,    0,                              // bytes per token
      0xe8, 0x03, 0,    0,    0,    0,    0,    0,      // vocabulary size 1000
      3,    0,    0,    0,    0,    0,    0,    0,      // tokens
      0xef, 0xcd, 0xab, 0x89, 0x67, 0x45, 0x23, 0x01};  // tokenizer checksum
  const uint64_t sum = fnv1a64({reinterpret_cast<const char*>(expected.data()), 40});
  for (int b = 0; b < 8; ++b) expected.push_back(uint8_t(sum >> (8 * b)));
  REQUIRE(std::vector<uint8_t>(header.begin(), header.end()) == expected);
  const ShardHeader back = decode_shard_header(header.data(), header.size(), "h");
  REQUIRE(back.vocab_size == 1000);
  REQUIRE(back.tokens == 3);
  REQUIRE(back.tokenizer_checksum == 0x0123456789abcdefull);

  // A written shard: that header (the real checksum), then uint16 tokens.
  auto tok = trained(400);
  const fs::path dir = testing::fresh_temp_dir("tokens_bytes");
  write_token_dir(dir, *tok, {1, 2, 258}, 1 << 20);
  const std::string file = read_regular_file((dir / "shard_00000.tok").string(), "the file");
  REQUIRE(file.size() == 48 + 3 * 2);
  const auto want = encode_shard_header(
      {.token_bytes = 2, .vocab_size = 400, .tokens = 3, .tokenizer_checksum = tok->checksum()});
  REQUIRE(file.substr(0, 48) == std::string(want.begin(), want.end()));
  REQUIRE(file.substr(48) == std::string("\x01\x00\x02\x00\x02\x01", 6));
  REQUIRE(fs::exists(dir / "tokenizer.model"));
  REQUIRE_FALSE(fs::exists(dir / "shard_00000.tok.tmp"));

  // Vocabularies past 65536 ids take 4 bytes per token.
  REQUIRE(token_bytes_for(65536) == 2);
  REQUIRE(token_bytes_for(65537) == 4);
  const fs::path wide = testing::fresh_temp_dir("tokens_wide");
  ShardWriter w(wide.string(), {.vocab_size = 100000, .tokenizer_checksum = 9, .shard_tokens = 8});
  const std::vector<int32_t> ids = {70000, 1};
  w.append(ids.data(), 2);
  w.finish();
  const std::string wide_file = read_regular_file((wide / "shard_00000.tok").string(), "the file");
  REQUIRE(wide_file.size() == 48 + 2 * 4);
  REQUIRE(wide_file.substr(12, 4) == std::string("\x04\x00\x00\x00", 4));
  REQUIRE(wide_file.substr(48) == std::string("\x70\x11\x01\x00\x01\x00\x00\x00", 8));
}

TEST_CASE("tokens: shards read back as one sequence, windows crossing their boundaries",
          "[data][tokens]") {
  auto tok = trained(400);
  const fs::path dir = testing::fresh_temp_dir("tokens_read");
  std::vector<int32_t> ids;
  for (int i = 0; i < 1000; ++i) ids.push_back((i * 7) % 400);
  write_token_dir(dir, *tok, ids, 97);  // 11 shards, the last of 30
  TokenDirectory d = open_token_directory(dir.string());
  REQUIRE(d.shards == 11);
  REQUIRE(d.token_bytes == 2);
  REQUIRE(d.tokens.size() == 1000);
  REQUIRE(d.tokens.segments().back().count == 30);
  REQUIRE(all_tokens(d.tokens) == std::vector<int64_t>(ids.begin(), ids.end()));
  for (int64_t i : {0, 96, 97, 98, 999}) REQUIRE(d.tokens[i] == ids[size_t(i)]);
  // A window across shards 0, 1 and 2.
  std::vector<int64_t> w(150);
  d.tokens.read(90, 150, w.data());
  REQUIRE(w == std::vector<int64_t>(ids.begin() + 90, ids.begin() + 240));

  TextCorpus c = load_token_corpus(dir.string(), 0.1);
  REQUIRE(c.size() == 1000);
  REQUIRE(c.train_tokens() == 900);
  REQUIRE(c.tokenizer().size() == 400);
}

TEST_CASE("tokens: windows over mapped shards are the text path's windows", "[data][tokens]") {
  // The same ids as a byte corpus in memory and as shards of 2-byte tokens.
  std::string text(5003, ' ');
  for (size_t i = 0; i < text.size(); ++i) text[i] = char((i * 31 + i / 7) % 251);
  TextCorpus bytes(text, {.vocab = VocabKind::bytes, .val_fraction = 0.2}, "mem");
  auto tok = trained(400);
  const fs::path dir = testing::fresh_temp_dir("tokens_windows");
  std::vector<int32_t> ids;
  for (char ch : text) ids.push_back(uint8_t(ch));
  write_token_dir(dir, *tok, ids, 333);
  TextCorpus shards = load_token_corpus(dir.string(), 0.2);
  REQUIRE(shards.size() == bytes.size());
  REQUIRE(shards.train_tokens() == bytes.train_tokens());
  REQUIRE(all_tokens(shards.tokens()) == all_tokens(bytes.tokens()));

  const int64_t T = 13;
  for (int world : {1, 2, 3}) {
    for (int rank = 0; rank < world; ++rank) {
      INFO("rank " << rank << " of " << world);
      for (int64_t streams : {int64_t(0), int64_t(2)}) {
        const WindowOptions o{
            .seq_len = T, .seed = 4, .rank = rank, .world_size = world, .streams = streams};
        TextWindows a(bytes, o), b(shards, o);
        REQUIRE(a.windows_per_epoch() == b.windows_per_epoch());
        for (int64_t epoch : {0, 3}) {
          if (streams == 0) {
            require_same_batch(a.batch(epoch, 0, a.windows_per_epoch()),
                               b.batch(epoch, 0, b.windows_per_epoch()));
          } else {
            for (int64_t k = 0; k < a.windows_per_epoch(); k += streams)
              require_same_batch(a.batch(epoch, k, streams), b.batch(epoch, k, streams));
          }
        }
      }
    }
  }
  for (int64_t streams : {int64_t(0), int64_t(4)}) {
    EvalWindows a(bytes, {.seq_len = T, .streams = streams}),
        b(shards, {.seq_len = T, .streams = streams});
    REQUIRE(a.size() == b.size());
    require_same_batch(a.batch(0, a.size()), b.batch(0, b.size()));
  }
}

TEST_CASE("tokens: encoding is exact, in order, and the same on any number of threads",
          "[data][tokens]") {
  auto tok = trained(400);
  const fs::path dir = testing::fresh_temp_dir("tokens_encode");
  const std::string a = generated_text(20000, 1) + "no line break at the end",
                    b = "bad \xff bytes \xe2\x96\x81 and \xce\xbb\n" + std::string(1000, 'x') +
                        "\n" + generated_text(9000, 2);  // a line longer than a chunk
  write_text(dir / "a.txt", a);
  write_text(dir / "b.txt", b);
  std::map<int, std::vector<std::string>> shard_bytes;
  for (int threads : {1, 3}) {
    const fs::path out = dir / ("out" + std::to_string(threads));
    std::vector<EncodeProgress> seen;
    EncodeSummary s =
        encode_corpora(*tok,
                       {.corpora = {(dir / "a.txt").string(), (dir / "b.txt").string()},
                        .out = out.string(),
                        .shard_tokens = 1000,
                        .threads = threads,
                        .chunk_bytes = 300},
                       [&](const EncodeProgress& p) { seen.push_back(p); });
    REQUIRE(s.files == 2);
    REQUIRE(s.bytes == int64_t(a.size() + b.size()));
    REQUIRE(s.mismatched_lines == 0);
    REQUIRE(s.shards == (s.tokens + 999) / 1000);
    REQUIRE(seen.size() > 2);
    REQUIRE(seen.back().bytes == seen.back().total_bytes);
    REQUIRE(seen.back().tokens == s.tokens);
    TokenDirectory d = open_token_directory(out.string());
    std::vector<int64_t> ids = all_tokens(d.tokens);
    REQUIRE(int64_t(ids.size()) == s.tokens);
    // Each file's tokens, then eos; decoding gives the files back.
    const size_t na = tok->encode(a).size();
    REQUIRE(ids[na] == tok->eos_id());
    REQUIRE(ids.back() == tok->eos_id());
    REQUIRE(tok->decode(ids) == a + b);
    // Each shard decoded on its own: the same text, concatenated.
    std::string pieces;
    for (const TokenSource::Segment& seg : d.tokens.segments()) {
      shard_bytes[threads].push_back(read_regular_file(seg.name, "the shard"));
      TokenSource one({seg}, nullptr);
      pieces += tok->decode(all_tokens(one));
    }
    REQUIRE(pieces == a + b);
  }
  REQUIRE(shard_bytes[1] == shard_bytes[3]);

  // A directory that holds shards already is refused; so are empty corpora.
  REQUIRE_THROWS_WITH(
      encode_corpora(*tok, {.corpora = {(dir / "a.txt").string()}, .out = (dir / "out1").string()}),
      Catch::Contains("out1 already holds") && Catch::Contains("shard_00000.tok"));
  write_text(dir / "empty.txt", "");
  REQUIRE_THROWS_WITH(encode_corpora(*tok, {.corpora = {(dir / "empty.txt").string()},
                                            .out = (dir / "out_empty").string()}),
                      Catch::Contains("hold no text") && Catch::Contains("empty.txt"));
}

TEST_CASE("tokens: damaged, truncated and foreign shards are refused naming the file",
          "[data][tokens]") {
  auto tok = trained(400);
  std::vector<int32_t> ids;
  for (int i = 0; i < 300; ++i) ids.push_back(i % 400);
  const fs::path root = testing::fresh_temp_dir("tokens_bad");
  // A fresh directory of 3 shards of 100, damaged by `damage`.
  auto fails_with = [&](const std::string& name, const std::function<void(const fs::path&)>& damage,
                        const std::string& message) {
    INFO(name);
    const fs::path dir = root / name;
    write_token_dir(dir, *tok, ids, 100);
    damage(dir);
    REQUIRE_THROWS_WITH(
        [&] {
          TextCorpus c = load_token_corpus(dir.string(), 0.1);
          std::vector<int64_t> all(size_t(c.size()));
          c.tokens().read(0, c.size(), all.data());
        }(),
        Catch::Contains(message));
  };
  auto patch = [](const fs::path& file, size_t offset, const std::string& bytes) {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(offset));
    f.write(bytes.data(), std::streamsize(bytes.size()));
  };
  const std::string shard1 = "shard_00001.tok";
  fails_with(
      "truncated", [&](const fs::path& d) { fs::resize_file(d / shard1, 48 + 150); },
      shard1 +
          ": the header says 100 tokens of 2 bytes, but the file holds 150 bytes "
          "after its header: it is truncated");
  fails_with(
      "longer", [&](const fs::path& d) { fs::resize_file(d / shard1, 48 + 202); },
      "it is longer than written");
  fails_with(
      "no header", [&](const fs::path& d) { fs::resize_file(d / shard1, 20); },
      shard1 + " is 20 bytes, shorter than the 48-byte header");
  fails_with(
      "magic", [&](const fs::path& d) { patch(d / shard1, 0, "XX"); },
      shard1 + " does not start with \"TRTOKENS\"");
  fails_with(
      "version", [&](const fs::path& d) { patch(d / shard1, 8, "\x02"); },
      shard1 + ": token shard version 2");
  fails_with(
      "header checksum", [&](const fs::path& d) { patch(d / shard1, 24, "\x63"); },
      shard1 + ": the header's checksum does not match its bytes");
  fails_with(
      "token past the vocabulary", [&](const fs::path& d) { patch(d / shard1, 48, "\xff\xff"); },
      shard1 + ": token 0 of the file is 65535, not below the vocabulary size 400");
  fails_with(
      "gap", [&](const fs::path& d) { fs::remove(d / shard1); },
      "holds shard_00002.tok but not shard_00001.tok");
  fails_with(
      "no tokenizer", [&](const fs::path& d) { fs::remove(d / kTokenizerFile); },
      "has no tokenizer.model");
  fails_with(
      "empty",
      [&](const fs::path& d) {
        for (const char* f : {"shard_00000.tok", "shard_00001.tok", "shard_00002.tok"})
          fs::remove(d / f);
      },
      "holds no token shards");
  fails_with(
      "missing", [&](const fs::path& d) { fs::remove_all(d); }, "does not exist");
  // A shard of another tokenizer among them.
  auto other = trained(300);
  fails_with(
      "foreign",
      [&](const fs::path& d) {
        const fs::path elsewhere = root / "foreign_source";
        write_token_dir(elsewhere, *other, ids, 1000);
        fs::copy_file(elsewhere / "shard_00000.tok", d / "shard_00003.tok");
      },
      "shard_00003.tok was written with the tokenizer of checksum " +
          checksum_hex(other->checksum()));
}
