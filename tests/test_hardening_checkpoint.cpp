// Damaged checkpoints are refused by name (issue 38): a safetensors header or
// trainer_state.json with a key given twice or bytes after its JSON, the
// ZeRO-1 shard files of a checkpoint that are not those of the ranks that
// wrote it (one extra, one missing, two shards holding the same elements),
// and a non-finite tensor in a pipeline checkpoint, named by the part file
// that holds it. Each is an `error: ...` naming the file and exit 1.
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <string>

#include "tests/hardening.h"
#include "tests/process.h"
#include "tests/testing.h"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"

using namespace trainer;
using namespace trainer::testing;
using namespace trainer::testing::hardening;
namespace fs = std::filesystem;

namespace {

// Rewrites a safetensors file's header text as edit() says, the data kept.
void edit_header(const fs::path& file, const std::function<std::string(std::string)>& edit) {
  const std::string bytes = read_file(file.string());
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
  const std::string header = edit(bytes.substr(8, n));
  std::string length;
  for (int i = 0; i < 8; ++i) length.push_back(char((uint64_t(header.size()) >> (8 * i)) & 0xff));
  write_file_atomic(file.string(), length + header + bytes.substr(8 + n));
}

// text with its first `from` replaced by `to`.
std::string replace_first(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.replace(at, from.size(), to);
}

// The MLP trained as `trainer launch` of 2 ranks (SGD with momentum, so
// the optimizer has state to shard), then extra; 2 steps with a checkpoint
// at step 2.
std::vector<std::string> launched_mlp(const fs::path& out, std::vector<std::string> extra) {
  std::vector<std::string> args = {"launch", "--nproc-per-node", "2", "--"};
  std::vector<std::string> train =
      mlp_args(out, {"training.steps=2", "training.checkpoint_every=2", "training.log_every=1",
                     "training.global_batch=32", "optimizer.name=sgd", "optimizer.momentum=0.9"});
  args.insert(args.end(), train.begin(), train.end());
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// The same run continued to step 3 from its checkpoint: as 2 ranks again
// (`ranks` 2) or as one process (1, which joins the shards).
std::vector<std::string> resumed_mlp(const fs::path& out, int ranks,
                                     std::vector<std::string> extra) {
  std::vector<std::string> args = launched_mlp(out, extra);
  if (ranks == 1) args.erase(args.begin(), args.begin() + 4);
  for (std::string& a : args)
    if (a == "training.steps=2") a = "training.steps=3";
  args.insert(args.end(), {"--resume", "auto"});
  return args;
}

// A run of 2 ranks under `extra` (made once per layout), copied to break.
fs::path copy_of_launched(const std::string& layout, const std::vector<std::string>& extra,
                          const std::string& name) {
  static std::map<std::string, fs::path> made;
  if (!made.count(layout)) {
    fs::path out = fresh_temp_dir("hardening_ckpt_" + layout, false);
    ProcessResult r = run_trainer(launched_mlp(out, extra), {.timeout_s = 300});
    INFO(r.output);
    REQUIRE(r.code == 0);
    made[layout] = out;
  }
  fs::path out = fresh_temp_dir("hardening_ckpt_" + name, false);
  fs::copy(made[layout], out, fs::copy_options::recursive);
  return out;
}

// A launched run that failed: a rank's `error: ...` with every text.
void require_rank_error(const ProcessResult& r, const std::vector<std::string>& texts) {
  INFO(r.output);
  REQUIRE(r.code != 0);
  REQUIRE(r.output.find("error: ") != std::string::npos);
  for (const std::string& t : texts) CHECK(r.output.find(t) != std::string::npos);
  CHECK(r.output.find("terminate called") == std::string::npos);
}

}  // namespace

TEST_CASE(
    "checkpoint hardening: a safetensors header with a key given twice or bytes after its "
    "JSON is refused by name",
    "[hardening][checkpoint]") {
  const fs::path run = copy_of_base("header_keys");
  const fs::path ckpt = step_dir(run, 4);
  const fs::path model = ckpt / "model-rank00000.safetensors";
  const std::string good = read_file(model.string());
  const std::string first = read_safetensors(model.string()).tensors.begin()->first;
  const std::vector<std::string> resume = mlp_args(run, {"training.steps=6", "--resume", "auto"});
  struct Case {
    const char* what;
    std::function<std::string(std::string)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      // Which of the two a reader takes is not known: nlohmann's the last.
      {"a field twice",
       [](std::string h) {
         return replace_first(h, R"("dtype":"F32")", R"("dtype":"F32","dtype":"F32")");
       },
       "header: key 'dtype' is given twice in '" + first + "'"},
      {"a tensor twice, both on the same bytes",
       [&](std::string h) {
         const size_t at = h.find("\"" + first + "\":{");
         const std::string entry = h.substr(at, h.find('}', at) + 1 - at);
         return replace_first(h, entry, entry + "," + entry);
       },
       "header: key '" + first + "' is given twice"},
      {"__metadata__ twice",
       [](std::string h) {
         return replace_first(h, R"("__metadata__":{"format":"pt",)",
                              R"("__metadata__":{"format":"pt"},"__metadata__":{"format":"np",)");
       },
       "header: key '__metadata__' is given twice"},
      {"a metadata key twice",
       [](std::string h) {
         return replace_first(h, R"("format":"pt")", R"("format":"pt","format":"pt")");
       },
       "header: key 'format' is given twice in '__metadata__'"},
      // nlohmann::json stops at a NUL byte: what follows it was never read.
      {"bytes after the JSON", [](std::string h) { return h + std::string(1, '\0') + "junk"; },
       "header: 5 bytes after the JSON value, from byte "},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    write_file_atomic(model.string(), good);
    edit_header(model, c.edit);
    CHECK_THAT(error_of([&] { read_safetensors(model.string()); }),
               Catch::Contains(model.string() + ": not a valid safetensors file: " + c.message) &&
                   Catch::Contains("use an earlier checkpoint"));
  }
  // The trainer says so and exits 1, for the model and the optimizer state.
  write_file_atomic(model.string(), good);
  edit_header(model, cases[0].edit);
  require_error(run_trainer(resume),
                {model.string() + ": not a valid safetensors file: " + cases[0].message});
  write_file_atomic(model.string(), good);
  const fs::path optim = ckpt / "optimizer-rank00000.safetensors";
  edit_header(optim, cases[4].edit);
  require_error(run_trainer(resume), {optim.string() + ": not a valid safetensors file: header: ",
                                      "bytes after the JSON value"});
  // Spaces after the JSON are the format's padding (the reference writer
  // pads the header to 8 bytes): still a good file.
  write_file_atomic(
      optim.string(),
      read_file((step_dir(base_run(), 4) / "optimizer-rank00000.safetensors").string()));
  edit_header(model, [](std::string h) { return h + "        "; });
  ProcessResult padded = run_trainer(resume);
  INFO(padded.output);
  CHECK(padded.code == 0);
}

TEST_CASE(
    "checkpoint hardening: trainer_state.json with a key given twice or bytes after its "
    "JSON is refused by name",
    "[hardening][checkpoint]") {
  const fs::path run = copy_of_base("state_keys");
  const fs::path ckpt = step_dir(run, 4);
  const std::string state = trainer_state_file(ckpt.string());
  const std::string good = read_file(state);
  struct Case {
    std::function<std::string(std::string)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](std::string t) { return replace_first(t, "\"step\": 4", "\"step\": 4,\n  \"step\": 1"); },
       "key 'step' is given twice"},
      {[](std::string t) { return replace_first(t, "\"dp\": 1", "\"dp\": 1,\n    \"dp\": 2"); },
       "key 'dp' is given twice in 'parallel'"},
      {[](std::string t) { return t + std::string(1, '\0') + "{\"step\": 1}"; },
       "12 bytes after the JSON value, from byte " + std::to_string(good.size())},
  };
  for (const Case& c : cases) {
    INFO(c.message);
    write_file_atomic(state, c.edit(good));
    CHECK_THAT(error_of([&] { read_trainer_state(ckpt.string()); }),
               Catch::Contains(state + ": " + c.message) &&
                   Catch::Contains("the file is damaged: use an earlier checkpoint"));
  }
  write_file_atomic(state, cases[0].edit(good));
  require_error(run_trainer(mlp_args(run, {"training.steps=6", "--resume", "auto"})),
                {state + ": key 'step' is given twice; the file is damaged"});
}

TEST_CASE(
    "checkpoint hardening: ZeRO-1 shard files beyond, short of or overlapping the ranks "
    "that wrote them are named",
    "[hardening][checkpoint][mp]") {
  const std::vector<std::string> zero1 = {"parallel.zero1=true"};
  auto shard = [](const fs::path& run, int rank) {
    return fs::path(pieces_file(step_dir(run, 2).string(), "optimizer", rank));
  };
  SECTION("a shard file of a rank beyond the world that wrote the checkpoint") {
    // Written by 2 ranks; a third rank's file (here a copy of rank 1's)
    // would be joined in.
    const fs::path run = copy_of_launched("zero1", zero1, "zero_extra");
    fs::copy_file(shard(run, 1), shard(run, 2));
    const std::string message = shard(run, 2).string() +
                                ": the pieces of rank 2, but the checkpoint was written by 2 "
                                "ranks";
    require_rank_error(run_trainer(resumed_mlp(run, 2, zero1), {.timeout_s = 300}),
                       {message, "remove it, or use an earlier checkpoint"});
    require_error(run_trainer(resumed_mlp(run, 1, {}), {.timeout_s = 300}), {message});
  }
  SECTION("a rank's shard file missing") {
    const fs::path run = copy_of_launched("zero1", zero1, "zero_missing");
    fs::remove(shard(run, 1));
    require_error(run_trainer(resumed_mlp(run, 1, {}), {.timeout_s = 300}),
                  {step_dir(run, 2).string() + ": elements [",
                   "are in no file (missing? there is no optimizer-rank00001.safetensors)"});
  }
  SECTION("two shards holding the same elements") {
    // Rank 1's file also holds a piece of rank 0's.
    const fs::path run = copy_of_launched("zero1", zero1, "zero_overlap");
    SafetensorsFile mine = read_safetensors(shard(run, 1).string());
    SafetensorsFile other = read_safetensors(shard(run, 0).string());
    std::string entry;
    for (const auto& [name, t] : other.tensors)
      if (other.metadata.count(name) && t.numel() > 1) entry = name;
    REQUIRE(!entry.empty());
    const std::string copied = entry.substr(0, entry.find('#')) + "#9";
    mine.tensors.emplace(copied, other.tensors.at(entry));
    mine.metadata[copied] = other.metadata.at(entry);
    std::vector<NamedTensor> tensors;
    for (const auto& [name, t] : mine.tensors) tensors.push_back({name, t});
    write_safetensors(shard(run, 1).string(), tensors, mine.metadata);
    ProcessResult r = run_trainer(resumed_mlp(run, 1, {}), {.timeout_s = 300});
    require_error(
        r, {shard(run, 1).string() + ": elements [",
            "of '" + entry.substr(0, entry.find('#')) + "' are also in " + shard(run, 0).string(),
            "a file is extra"});
  }
}

TEST_CASE(
    "checkpoint hardening: a non-finite tensor of a pipeline checkpoint is blamed on the "
    "rank's file that holds it",
    "[hardening][checkpoint][mp]") {
  const std::vector<std::string> pipeline = {"parallel.pp=2", "parallel.micro_batches=2"};
  for (const std::string kind : {"model", "optimizer"}) {
    INFO(kind);
    const fs::path run = copy_of_launched("pp2", pipeline, "pp_nonfinite_" + kind);
    const fs::path ckpt = step_dir(run, 2);
    const fs::path part = pieces_file(ckpt.string(), kind, 1);  // the second stage's
    std::string entry;
    for (const auto& [name, t] : read_safetensors(part.string()).tensors)
      if (t.dtype() == DType::f32 && t.numel() > 3) entry = name;
    REQUIRE(!entry.empty());
    poison(part, entry, std::nanf(""));
    const std::string message = part.string() + ": tensor '" + entry + "' holds nan at element 3";
    // Through the reader, and resumed by one process (which joins the pieces).
    CHECK_THAT(error_of([&] { read_pieces(ckpt.string(), kind, {.refuse_non_finite = true}); }),
               Catch::Contains(message));
    require_error(run_trainer(resumed_mlp(run, 1, {}), {.timeout_s = 300}),
                  {message, "training.allow_non_finite=true"});
  }
}
