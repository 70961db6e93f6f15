// Text corpora: vocabularies, the train/val split by position, random
// training windows keyed by (seed, epoch, index), sequential evaluation
// windows, data-parallel shards and the errors for bad corpora.
#include "tests/testing.h"

#include <filesystem>
#include <fstream>
#include <set>

#include "data/text.h"

using namespace trainer;
using namespace trainer::data;
namespace fs = std::filesystem;

namespace {

// "abcdefghij" repeated: position p holds 'a' + p % 10, so any window can be
// checked against its start.
std::string cycle_text(int64_t n) {
  std::string s(size_t(n), ' ');
  for (int64_t i = 0; i < n; ++i) s[size_t(i)] = char('a' + i % 10);
  return s;
}

// The window must be T + 1 consecutive corpus tokens starting at `start`.
void require_window(const TextCorpus& c, const TextBatch& b, int64_t row, int64_t start) {
  const int64_t T = b.inputs.size(1);
  std::vector<int64_t> in = b.inputs.select(0, row).contiguous().to_vector<int64_t>();
  std::vector<int64_t> out = b.targets.select(0, row).contiguous().to_vector<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    REQUIRE(in[size_t(t)] == c.tokens()[size_t(start + t)]);
    REQUIRE(out[size_t(t)] == c.tokens()[size_t(start + t + 1)]);
  }
}

}  // namespace

TEST_CASE("text: byte and character vocabularies", "[data][text]") {
  Vocab bytes = Vocab::bytes();
  REQUIRE(bytes.size() == 256);
  REQUIRE(bytes.encode("Az\n") == std::vector<int64_t>{65, 122, 10});

  Vocab chars = Vocab::from_text("hello, world\n");
  // Distinct bytes in increasing order: '\n' ' ' ',' 'd' 'e' 'h' 'l' 'o' 'r' 'w'.
  REQUIRE(chars.size() == 10);
  REQUIRE(chars.kind() == VocabKind::chars);
  REQUIRE(chars.encode("\n ,dehlorw") == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  REQUIRE(chars.decode(chars.encode("hello")) == "hello");
  REQUIRE(Vocab::from_text("world, hello\n") == chars);  // depends on the set of bytes only
  REQUIRE_THROWS_WITH(chars.encode("hex"), Catch::Contains("'x' (offset 2)"));

  // A saved list round-trips; a malformed one is refused.
  std::vector<int64_t> saved(chars.symbols().begin(), chars.symbols().end());
  REQUIRE(Vocab::from_symbols(saved) == chars);
  REQUIRE_THROWS_WITH(Vocab::from_symbols({10, 10}), Catch::Contains("not a byte above"));
  REQUIRE_THROWS_WITH(Vocab::from_symbols({300}), Catch::Contains("not a byte"));
}

TEST_CASE("text: the split is by position", "[data][text]") {
  std::string text = cycle_text(1000);
  TextCorpus c(text, {.vocab = VocabKind::chars, .val_fraction = 0.1}, "mem");
  REQUIRE(c.vocab().size() == 10);
  REQUIRE(c.size() == 1000);
  REQUIRE(c.train_tokens() == 900);
  REQUIRE(c.val_tokens() == 100);
  for (int64_t i = 0; i < c.size(); ++i) REQUIRE(c.tokens()[size_t(i)] == i % 10);

  TextCorpus b(text, {.vocab = VocabKind::bytes, .val_fraction = 0.25}, "mem");
  REQUIRE(b.train_tokens() == 750);
  REQUIRE(b.tokens()[0] == 'a');
}

TEST_CASE("text: training windows are keyed by (seed, epoch, index)", "[data][text]") {
  std::string text = cycle_text(5003);
  TextCorpus c(text, {.vocab = VocabKind::chars, .val_fraction = 0.2}, "mem");
  const int64_t T = 17, train = c.train_tokens();
  TextWindows w(c, {.seq_len = T, .seed = 3});
  REQUIRE(w.windows_per_epoch() == (train - 1) / T);

  TextBatch b = w.batch(/*epoch=*/2, /*position=*/5, /*n=*/7);
  REQUIRE(b.inputs.shape() == Shape{7, T});
  REQUIRE(b.targets.shape() == Shape{7, T});
  REQUIRE(b.inputs.dtype() == DType::i64);
  std::set<int64_t> starts;
  for (int64_t i = 0; i < w.windows_per_epoch(); ++i) {
    int64_t s = w.start(2, i);
    REQUIRE(s >= 0);
    REQUIRE(s + T + 1 <= train);  // never reads validation tokens
    starts.insert(s);
  }
  REQUIRE(starts.size() > size_t(w.windows_per_epoch()) * 3 / 4);  // not a few repeated starts
  for (int64_t row = 0; row < 7; ++row) require_window(c, b, row, w.start(2, 5 + row));

  // Pure function: the same windows from a fresh object, a resumed
  // position, or one window at a time; other epochs and seeds differ.
  TextWindows again(c, {.seq_len = T, .seed = 3});
  TextBatch whole = again.batch(2, 0, 12);
  TextBatch tail = again.batch(2, 5, 7);
  REQUIRE(tail.inputs.to_vector<int64_t>() == b.inputs.to_vector<int64_t>());
  REQUIRE(whole.inputs.slice(0, 5, 12).contiguous().to_vector<int64_t>() ==
          b.inputs.to_vector<int64_t>());
  TextWindows other_seed(c, {.seq_len = T, .seed = 4});
  int64_t same_epoch = 0, same_seed = 0;
  for (int64_t i = 0; i < 50; ++i) {
    same_epoch += w.start(2, i) == w.start(3, i);
    same_seed += w.start(2, i) == other_seed.start(2, i);
  }
  REQUIRE(same_epoch < 3);
  REQUIRE(same_seed < 3);

  REQUIRE_THROWS_WITH(w.batch(0, w.windows_per_epoch() - 1, 2),
                      Catch::Contains("outside this rank's epoch"));
}

TEST_CASE("text: data-parallel ranks take disjoint strided windows", "[data][text]") {
  std::string text = cycle_text(3001);
  TextCorpus c(text, {.vocab = VocabKind::bytes, .val_fraction = 0.0}, "mem");
  const int64_t T = 10;
  TextWindows single(c, {.seq_len = T, .seed = 9});
  for (int world : {1, 2, 3, 7}) {
    INFO("world " << world);
    for (int rank = 0; rank < world; ++rank) {
      TextWindows w(c, {.seq_len = T, .seed = 9, .rank = rank, .world_size = world});
      REQUIRE(w.windows_per_epoch() == single.windows_per_epoch() / world);
      TextBatch b = w.batch(1, 0, w.windows_per_epoch());
      for (int64_t p = 0; p < w.windows_per_epoch(); ++p)
        require_window(c, b, p, single.start(1, p * world + rank));
    }
  }
}

TEST_CASE("text: evaluation windows are sequential and non-overlapping", "[data][text]") {
  std::string text = cycle_text(1000);
  TextCorpus c(text, {.vocab = VocabKind::chars, .val_fraction = 0.3}, "mem");
  const int64_t T = 16;
  EvalWindows all(c, {.seq_len = T});
  REQUIRE(all.size() == (300 - 1) / T);
  TextBatch b = all.batch(0, all.size());
  REQUIRE(b.inputs.size(0) == all.size());
  for (int64_t k = 0; k < all.size(); ++k) {
    REQUIRE(all.start(k) == c.train_tokens() + k * T);
    require_window(c, b, k, all.start(k));
  }
  REQUIRE(all.start(all.size() - 1) + T + 1 <= c.size());
  REQUIRE(all.batch(all.size() - 2, 10).inputs.size(0) == 2);  // clipped at the end

  // max_windows spreads a subset over the whole validation part, in order.
  EvalWindows some(c, {.seq_len = T, .max_windows = 4});
  REQUIRE(some.size() == 4);
  REQUIRE(some.start(0) == c.train_tokens());
  for (int64_t k = 1; k < 4; ++k) {
    REQUIRE(some.start(k) >= some.start(k - 1) + T);
    REQUIRE((some.start(k) - c.train_tokens()) % T == 0);
  }
  REQUIRE(some.start(3) > c.train_tokens() + 300 / 2);
}

TEST_CASE("text: contiguous streams continue row by row across batches", "[data][text]") {
  // Byte i % 251: a window's first token gives its start modulo 251.
  std::string text(5003, ' ');
  for (size_t i = 0; i < text.size(); ++i) text[i] = char(i % 251);
  TextCorpus c(text, {.vocab = VocabKind::bytes, .val_fraction = 0.2}, "mem");
  const int64_t T = 13, B = 3, train = c.train_tokens();
  for (int world : {1, 2}) {
    INFO("world " << world);
    const int64_t L = (train - T) / (B * world);
    std::set<int64_t> first_starts;
    for (int rank = 0; rank < world; ++rank) {
      TextWindows w(c, {.seq_len = T, .seed = 5, .rank = rank, .world_size = world, .streams = B});
      REQUIRE(w.contiguous());
      REQUIRE(w.windows_per_epoch() == L / T * B);
      for (int64_t epoch : {0, 1}) {
        TextBatch prev = w.batch(epoch, 0, B);
        std::vector<int64_t> starts(static_cast<size_t>(B));
        for (int64_t i = 0; i < B; ++i) {
          // Stream j = rank B + i starts at j L plus an offset below T.
          const int64_t j = rank * B + i,
                        first = prev.inputs.select(0, i).select(0, 0).item<int64_t>();
          const int64_t offset = ((first - j * L) % 251 + 251) % 251;
          REQUIRE(offset < T);
          if (i > 0) REQUIRE(j * L + offset - starts[0] == i * L);  // one offset for all
          starts[size_t(i)] = j * L + offset;
          require_window(c, prev, i, starts[size_t(i)]);
          if (epoch == 0) first_starts.insert(starts[size_t(i)]);
        }
        for (int64_t k = 1; k < w.windows_per_epoch() / B; ++k) {
          TextBatch b = w.batch(epoch, k * B, B);
          for (int64_t i = 0; i < B; ++i) {
            // Row i's window k follows window k - 1 without a gap.
            require_window(c, b, i, starts[size_t(i)] + k * T);
            REQUIRE(starts[size_t(i)] + k * T + T + 1 <= train);
          }
        }
      }
      REQUIRE_THROWS_WITH(w.batch(0, 1, B), Catch::Contains("in chunks of 3"));
      REQUIRE_THROWS_WITH(w.batch(0, 0, B + 1), Catch::Contains("in chunks of 3"));
    }
    REQUIRE(int64_t(first_starts.size()) == B * world);  // every rank its own streams
  }
  // The offset moves with the epoch (same seed, same streams).
  TextWindows w(c, {.seq_len = T, .seed = 5, .streams = B});
  std::set<int64_t> firsts;
  for (int64_t epoch = 0; epoch < 8; ++epoch)
    firsts.insert(w.batch(epoch, 0, B).inputs.select(0, 0).select(0, 0).item<int64_t>());
  REQUIRE(firsts.size() > 1);

  // Evaluation streams: window k of stream j at index k S + j.
  EvalWindows val(c, {.seq_len = T, .streams = 4});
  const int64_t Lv = (c.val_tokens() - 1) / 4;
  REQUIRE(val.size() == Lv / T * 4);
  for (int64_t k = 0; k < val.size() / 4; ++k) {
    TextBatch b = val.batch(k * 4 + 1, 2);
    require_window(c, b, 0, train + 1 * Lv + k * T);
    require_window(c, b, 1, train + 2 * Lv + k * T);
  }
  REQUIRE(EvalWindows(c, {.seq_len = T, .max_windows = 5, .streams = 4}).size() == 8);
}

TEST_CASE("text: missing, empty and too-short corpora are clear errors", "[data][text]") {
  fs::path dir = testing::fresh_temp_dir("text_test");
  REQUIRE_THROWS_WITH(
      TextCorpus::load((dir / "missing.txt").string()),
      Catch::Contains("cannot open the text corpus") && Catch::Contains("missing.txt"));
  std::ofstream((dir / "empty.txt").string()).close();
  REQUIRE_THROWS_WITH(TextCorpus::load((dir / "empty.txt").string()),
                      Catch::Contains("empty.txt is empty"));
  std::ofstream((dir / "short.txt").string(), std::ios::binary) << cycle_text(100);
  TextCorpus c = TextCorpus::load((dir / "short.txt").string(), {.val_fraction = 0.1});
  REQUIRE(c.size() == 100);
  REQUIRE_THROWS_WITH(TextWindows(c, {.seq_len = 90}),
                      Catch::Contains("90 tokens, fewer than one window of T + 1 = 91"));
  REQUIRE_THROWS_WITH(EvalWindows(c, {.seq_len = 10}),
                      Catch::Contains("the validation part has 10 tokens"));
  REQUIRE_THROWS_WITH(TextWindows(c, {.seq_len = 8, .rank = 0, .world_size = 20}),
                      Catch::Contains("cannot give each of 20 ranks"));
  REQUIRE_THROWS_WITH(TextCorpus(std::string("abc"), {.val_fraction = 1.0}, "mem"),
                      Catch::Contains("outside [0, 1)"));
  fs::remove_all(dir);
}
