// The parallel layout a recipe asks for, the checkpoint schema
// (trainer/checkpoint.h: trainer_state.json with its layout, older files
// without one, model parts written by several ranks), and the step
// executor's one-stage schedule against the gradient-accumulation loop it
// replaced, bit for bit.
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/ops.h"
#include "tests/testing.h"
#include "trainer/checkpoint.h"
#include "trainer/distributed.h"
#include "trainer/precision.h"
#include "trainer/safetensors.h"
#include "trainer/session.h"
#include "trainer/step_executor.h"

using namespace trainer;
using namespace trainer::testing;
namespace fs = std::filesystem;

namespace {

Recipe recipe_with(const std::vector<std::string>& overrides) {
  return load_recipe(std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_mlp.yaml", overrides);
}

ParallelLayout layout_of(int dp, int pp, int tp, bool zero1) {
  return ParallelLayout{.mesh = parallel::MeshShape{{parallel::Dim::dp_replicate, dp},
                                                    {parallel::Dim::pp, pp},
                                                    {parallel::Dim::tp, tp}},
                        .zero1 = zero1,
                        .zero_stage = zero1 ? 1 : 0};
}

void require_same_bits(const std::vector<NamedTensor>& a, const std::vector<NamedTensor>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    INFO(a[k].name);
    REQUIRE(a[k].name == b[k].name);
    require_close(b[k].tensor, a[k].tensor, 0, 0, a[k].name);
  }
}

}  // namespace

TEST_CASE("layout: the recipe's dp x pp x tp against the world, with errors naming keys",
          "[checkpoint]") {
  ParallelLayout l = parallel_layout(recipe_with({}), 4);
  CHECK(l == layout_of(4, 1, 1, false));
  CHECK(parallel_layout(recipe_with({"parallel.dp=2"}), 2) == layout_of(2, 1, 1, false));
  // zero1 shards only over several dp ranks.
  CHECK(parallel_layout(recipe_with({"parallel.zero1=true"}), 1).zero1 == false);
  CHECK(parallel_layout(recipe_with({"parallel.zero1=true"}), 3).zero1 == true);

  CHECK_THAT(error_of([] { parallel_layout(recipe_with({"parallel.dp=2"}), 1); }),
             Catch::Contains("parallel.dp = 2 but the job has 1 rank") &&
                 Catch::Contains("set parallel.dp=1"));
  CHECK(parallel_layout(recipe_with({"parallel.pp=2"}), 4).mesh == layout_of(2, 2, 1, false).mesh);
  CHECK_THAT(error_of([] { parallel_layout(recipe_with({"parallel.pp=2"}), 3); }),
             Catch::Contains("launch dp x pp x tp ranks"));
  CHECK_THAT(error_of([] {
               parallel_layout(recipe_with({"parallel.pp=2", "parallel.virtual_stages=2"}), 2);
             }),
             Catch::Contains("needs parallel.schedule=interleaved"));
  CHECK_THAT(error_of([] {
               parallel_layout(recipe_with({"parallel.pp=2", "parallel.schedule=interleaved"}), 2);
             }),
             Catch::Contains("virtual_stages >= 2"));
  // fp16 on split models: the ranks agree on overflow (trainer/precision.h).
  CHECK_NOTHROW(parallel_layout(recipe_with({"parallel.pp=2", "precision=fp16"}), 2));
  CHECK_NOTHROW(parallel_layout(recipe_with({"parallel.tp=2", "precision=fp16"}), 2));
  CHECK(parallel_layout(recipe_with({"parallel.tp=2"}), 4).mesh == layout_of(2, 1, 2, false).mesh);
  // ZeRO-1 shards each tensor-parallel rank's part over its dp group.
  CHECK(parallel_layout(recipe_with({"parallel.tp=2", "parallel.zero1=true"}), 4).zero1);
  // Read by pipeline schedules only: refused, not ignored, with pp = 1.
  CHECK_THAT(error_of([] { parallel_layout(recipe_with({"parallel.micro_batches=4"}), 1); }),
             Catch::Contains("parallel.micro_batches = 4 is the number of micro-batches a "
                             "pipeline") &&
                 Catch::Contains("training.grad_accum"));
  CHECK_THAT(
      error_of([] { parallel_layout(recipe_with({"parallel.schedule=gpipe"}), 1); }),
      Catch::Contains("parallel.schedule = 'gpipe'") && Catch::Contains("orders a pipeline's"));
  // Their defaults, spelled out, are fine.
  CHECK_NOTHROW(
      parallel_layout(recipe_with({"parallel.micro_batches=1", "parallel.schedule=1f1b"}), 1));

  RankLayout r = rank_layout(layout_of(2, 1, 1, true), 1);
  CHECK(r.rank == 1);
  CHECK(r.dp_rank() == 1);
  CHECK(r.dp_size() == 2);
  CHECK(r.world_size() == 2);
  CHECK(r.shards_optimizer());
}

TEST_CASE(
    "checkpoint: ZeRO-1 shards of tensor-parallel parts join into whole tensors, or are named",
    "[checkpoint]") {
  // dp 2 x tp 2: w [4, 3] split on dim 0 (rows 0-1 on tp rank 0, 2-3 on
  // tp rank 1), b [3] whole on both; each dp rank holds half of each part's
  // flattened elements. Written as a run would: both tp ranks write b.
  fs::path dir = fresh_temp_dir("ckpt_zero_tp");
  const std::vector<float> w = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, b = {20, 21, 22};
  auto slice = [](const std::vector<float>& v, int64_t from, int64_t to) {
    return from_vector(std::vector<float>(v.begin() + from, v.begin() + to), {to - from});
  };
  const std::map<std::string, Shape> shapes = {{"w", {4, 3}}, {"b", {3}}};
  for (int tp = 0; tp < 2; ++tp)
    for (int dp = 0; dp < 2; ++dp) {
      const int64_t part = 6 * tp;  // the part's first element in w
      std::vector<NamedTensor> shard = {
          {cat("w.exp_avg[", 3 * dp, ":", 3 * dp + 3, "]"),
           slice(w, part + 3 * dp, part + 3 * dp + 3)},
          {dp == 0 ? "b.exp_avg[0:2]" : "b.exp_avg[2:3]",
           dp == 0 ? slice(b, 0, 2) : slice(b, 2, 3)},
          {cat("w.step[", 3 * dp, ":", 3 * dp + 3, "]"), scalar_tensor(7.0f)}};
      write_safetensors(cat(dir.string(), "/optimizer.rank", 2 * dp + tp, ".safetensors"), shard,
                        {{"tp", cat(tp, " 2")}, {"tp_split.w", "0 1"}});
    }
  std::map<std::string, Tensor> whole = read_sharded_optimizer_whole(dir.string(), shapes);
  CHECK(whole.at("w.exp_avg").shape() == Shape{4, 3});
  CHECK(whole.at("w.exp_avg").to_vector<float>() == w);
  CHECK(whole.at("b.exp_avg").to_vector<float>() == b);
  CHECK(whole.at("w.step").item<float>() == 7.0f);
  // A part's file missing: its elements are named as uncovered.
  fs::remove(dir / "optimizer.rank3.safetensors");
  CHECK_THAT(error_of([&] { read_sharded_optimizer_whole(dir.string(), shapes); }),
             Catch::Contains("the ZeRO-1 shards of 'w.exp_avg' (tensor-parallel part 1) cover 3 "
                             "of 6 elements"));
  // Metadata that is no layout.
  write_safetensors((dir / "optimizer.rank3.safetensors").string(),
                    {{"w.exp_avg[3:6]", slice(w, 9, 12)}}, {{"tp", "2 2"}});
  CHECK_THAT(error_of([&] { read_sharded_optimizer_whole(dir.string(), shapes); }),
             Catch::Contains("metadata 'tp' = '2 2' is not the tensor-parallel layout"));
}

TEST_CASE("checkpoint: ZeRO-1 shard files must be those of the ranks that wrote them",
          "[checkpoint]") {
  // dp 2: w [4] as w.exp_avg[0:2] on rank 0, w.exp_avg[2:4] on rank 1.
  fs::path dir = fresh_temp_dir("ckpt_zero_files");
  const std::map<std::string, Shape> shapes = {{"w", {4}}};
  const std::string dir_name = dir.string();
  auto shard = [&](int rank) { return optimizer_file(dir_name, true, rank); };
  auto write_shard = [&](int rank, int64_t begin, int64_t end) {
    std::vector<float> v;
    for (int64_t i = begin; i < end; ++i) v.push_back(float(i));
    write_safetensors(shard(rank), {{cat("w.exp_avg[", begin, ":", end, "]"), from_vector(v)}});
  };
  write_shard(0, 0, 2);
  write_shard(1, 2, 4);
  CHECK(read_sharded_optimizer_whole(dir_name, shapes).at("w.exp_avg").to_vector<float>() ==
        std::vector<float>{0, 1, 2, 3});

  // Two shards holding the same elements: both files and the range named,
  // not taken for a missing file (the hint it used to get).
  write_shard(2, 1, 3);
  std::string overlap = error_of([&] { read_sharded_optimizer_whole(dir_name, shapes); });
  CHECK_THAT(overlap, Catch::Contains(shard(2) +
                                      ": entry 'w.exp_avg[1:3]' holds elements [1, 2) "
                                      "of 'w.exp_avg', which entry 'w.exp_avg[0:2]' "
                                      "of " +
                                      shard(0) + " holds too") &&
                          Catch::Contains("a shard file is extra"));
  CHECK(overlap.find("missing") == std::string::npos);
  fs::remove(shard(2));
  // A hole: the range no shard holds.
  write_shard(1, 3, 4);
  CHECK_THAT(error_of([&] { read_sharded_optimizer_whole(dir_name, shapes); }),
             Catch::Contains(dir_name + ": the ZeRO-1 shards of 'w.exp_avg' cover 3 of 4 "
                                        "elements: [2, 3) is in none; is a rank's optimizer file "
                                        "missing?"));
  write_shard(1, 2, 4);

  // With the trainer state of 2 ranks: a third rank's file, even one that
  // fits (it used to be ignored on the same layout), and a missing one.
  TrainerStateFile state;
  state.state.layout = layout_of(2, 1, 1, true);
  write_trainer_state(dir_name, state);
  CHECK_NOTHROW(read_sharded_optimizer_whole(dir_name, shapes));
  CHECK(read_optimizer(dir_name, true, 1).size() == 1);
  write_safetensors(shard(2), {});
  const std::string extra = shard(2) +
                            ": a ZeRO-1 shard of rank 2, but the checkpoint was written by 2 "
                            "ranks (" +
                            trainer_state_file(dir_name) +
                            "): the file is not part of it; remove it, or use an earlier "
                            "checkpoint";
  CHECK_THAT(error_of([&] { read_sharded_optimizer_whole(dir_name, shapes); }),
             Catch::Contains(extra));
  CHECK_THAT(error_of([&] { read_optimizer(dir_name, true, 0); }), Catch::Contains(extra));
  fs::remove(shard(2));
  fs::rename(shard(1), dir / "elsewhere");
  const std::string missing = shard(1) + ": missing: each of the 2 ranks that wrote the checkpoint";
  CHECK_THAT(error_of([&] { read_sharded_optimizer_whole(dir_name, shapes); }),
             Catch::Contains(missing));
  CHECK_THAT(error_of([&] { read_optimizer(dir_name, true, 0); }), Catch::Contains(missing));
  fs::rename(dir / "elsewhere", shard(1));
  // A shard file's name without a rank number is not taken for one.
  write_shard(0, 0, 2);
  fs::copy_file(shard(0), dir / "optimizer.rank01.safetensors");
  CHECK_THAT(error_of([&] { read_sharded_optimizer_whole(dir_name, shapes); }),
             Catch::Contains("optimizer.rank01.safetensors: not the name of a rank's ZeRO-1 "
                             "shard"));
}

TEST_CASE("checkpoint: readers name the part holding a non-finite tensor when asked",
          "[checkpoint]") {
  fs::path dir = fresh_temp_dir("ckpt_nonfinite_parts");
  Tensor good = from_vector<float>({1, 2, 3, 4}), bad = from_vector<float>({1, 2, 3, INFINITY});
  // Pipeline stages' parts: "a" and its state in the first, "b" in the second.
  for (int stage = 0; stage < 2; ++stage) {
    const std::string name = stage == 0 ? "a" : "b";
    const Tensor& value = stage == 0 ? good : bad;
    write_safetensors(model_part_file(dir.string(), stage, 2), {{name, value}});
    write_safetensors(optimizer_part_file(dir.string(), stage, 2),
                      {{name + ".momentum_buffer", value}});
  }
  CHECK(read_model(dir.string()).size() == 2);  // the default: loaded as it is
  CHECK_THAT(error_of([&] { read_model(dir.string(), {.refuse_non_finite = true}); }),
             Catch::Contains(model_part_file(dir.string(), 1, 2) +
                             ": tensor 'b' holds inf at element 3 (a non-finite value)"));
  CHECK_THAT(error_of([&] { read_optimizer(dir.string(), false, 0, {.refuse_non_finite = true}); }),
             Catch::Contains(optimizer_part_file(dir.string(), 1, 2) +
                             ": tensor 'b.momentum_buffer' holds inf"));
}

TEST_CASE("checkpoint: trainer_state.json round-trips the state and the full layout",
          "[checkpoint]") {
  fs::path dir = fresh_temp_dir("ckpt_state");
  TrainerStateFile file;
  file.state = {.step = 12,
                .epoch = 1,
                .position = 96,
                .best_metric = 81.5,
                .nonfinite_skipped = 2,
                .layout = layout_of(2, 1, 1, true),
                .link_models = {}};
  // Exact: alpha, beta and gamma as measured (not round numbers).
  file.state.link_models[{0, 1}] = {.alpha = 1.0 / 3e5, .beta = 1e-9 / 0.7, .gamma = 1e-9 / 13.1};
  file.lr = 0.05;
  file.seed = 7;
  file.vocab = {10, 65, 66};
  file.recipe_yaml = "seed: 7\n";
  write_trainer_state(dir.string(), file);
  nlohmann::json j = nlohmann::json::parse(read_file(trainer_state_file(dir.string())));
  CHECK(j["parallel"] ==
        nlohmann::json({{"world_size", 2}, {"dp", 2}, {"pp", 1}, {"tp", 1}, {"zero1", true}}));
  TrainerStateFile back = read_trainer_state(dir.string());
  CHECK(back.state.step == 12);
  CHECK(back.state.epoch == 1);
  CHECK(back.state.position == 96);
  CHECK(back.state.best_metric == 81.5);
  CHECK(back.state.nonfinite_skipped == 2);
  CHECK(back.state.layout == file.state.layout);
  REQUIRE(back.state.link_models.size() == 1);
  const comm::LinkModel& link = back.state.link_models.at({0, 1});
  const comm::LinkModel& wrote = file.state.link_models.at({0, 1});
  CHECK((link.alpha == wrote.alpha && link.beta == wrote.beta && link.gamma == wrote.gamma));
  CHECK(back.lr == 0.05);
  CHECK(back.vocab == file.vocab);
  CHECK(back.recipe_yaml == file.recipe_yaml);
  // Sharded parameters (ZeRO-3) are recorded as parallel.shard.
  file.state.layout.zero_stage = 3;
  write_trainer_state(dir.string(), file);
  j = nlohmann::json::parse(read_file(trainer_state_file(dir.string())));
  CHECK(j["parallel"]["shard"] == "parameters");
  CHECK(read_trainer_state(dir.string()).state.layout.zero_stage == 3);

  // Older files: no dp/pp/tp (all data-parallel), or no parallel record (one process).
  j["parallel"] = {{"world_size", 3}, {"zero1", false}};
  write_file_atomic(trainer_state_file(dir.string()), j.dump());
  CHECK(read_trainer_state(dir.string()).state.layout == layout_of(3, 1, 1, false));
  j.erase("parallel");
  j.erase("link_models");  // written with the layout
  write_file_atomic(trainer_state_file(dir.string()), j.dump());
  CHECK(read_trainer_state(dir.string()).state.layout == layout_of(1, 1, 1, false));
  // A layout that does not multiply out to its world.
  j["parallel"] = {{"world_size", 4}, {"dp", 3}, {"pp", 1}, {"tp", 1}};
  write_file_atomic(trainer_state_file(dir.string()), j.dump());
  CHECK_THAT(error_of([&] { read_trainer_state(dir.string()); }),
             Catch::Contains("parallel.world_size 4 is not dp x pp x tp"));
  j.erase("step");
  write_file_atomic(trainer_state_file(dir.string()), j.dump());
  CHECK_THAT(error_of([&] { read_trainer_state(dir.string()); }),
             Catch::Contains("trainer_state.json: missing or wrong field"));
}

TEST_CASE(
    "checkpoint: trainer_state.json has a format version: the mesh of named dimensions "
    "round-trips, older versions load and newer ones are refused",
    "[checkpoint]") {
  fs::path dir = fresh_temp_dir("ckpt_format");
  TrainerStateFile file;
  file.state.layout.mesh = parallel::MeshShape{
      {parallel::Dim::dp_replicate, 2}, {parallel::Dim::dp_shard, 2}, {parallel::Dim::cp, 2}};
  write_trainer_state(dir.string(), file);
  nlohmann::json j = nlohmann::json::parse(read_file(trainer_state_file(dir.string())));
  CHECK(j["format"] == kTrainerStateFormat);
  CHECK(j["parallel"]["mesh"] ==
        nlohmann::json(
            {{"dp_replicate", 2}, {"dp_shard", 2}, {"ep", 1}, {"pp", 1}, {"cp", 2}, {"tp", 1}}));
  CHECK(j["parallel"]["dp"] == 4);  // what version 1 called dp
  CHECK(read_trainer_state(dir.string()).state.layout == file.state.layout);

  // Version 1: no format key, dp x pp x tp.
  j.erase("format");
  j["parallel"] = {{"world_size", 8}, {"dp", 2}, {"pp", 2}, {"tp", 2}, {"zero1", false}};
  write_file_atomic(trainer_state_file(dir.string()), j.dump());
  CHECK(read_trainer_state(dir.string()).state.layout == layout_of(2, 2, 2, false));
  // A newer version, a dimension this build does not know, a mesh that is not the world.
  j["format"] = kTrainerStateFormat + 1;
  write_file_atomic(trainer_state_file(dir.string()), j.dump());
  CHECK_THAT(
      error_of([&] { read_trainer_state(dir.string()); }),
      Catch::Contains(cat("format ", kTrainerStateFormat + 1, " was written by a newer trainer")));
  j["format"] = kTrainerStateFormat;
  j["parallel"]["mesh"] = {{"dp_replicate", 8}, {"xp", 1}};
  write_file_atomic(trainer_state_file(dir.string()), j.dump());
  CHECK_THAT(error_of([&] { read_trainer_state(dir.string()); }),
             Catch::Contains("parallel.mesh names a dimension 'xp'"));
  j["parallel"]["mesh"] = {{"dp_replicate", 2}, {"tp", 2}};
  write_file_atomic(trainer_state_file(dir.string()), j.dump());
  CHECK_THAT(error_of([&] { read_trainer_state(dir.string()); }),
             Catch::Contains("parallel.world_size 8 is not the product of parallel.mesh"));
  j["parallel"]["mesh"] = {{"dp_replicate", 8}, {"tp", 0}};
  write_file_atomic(trainer_state_file(dir.string()), j.dump());
  CHECK_THAT(error_of([&] { read_trainer_state(dir.string()); }),
             Catch::Contains("'parallel.mesh.tp': 0 is outside [1, "));
}

TEST_CASE("checkpoint: trainer_state.json with a key given twice is refused, naming it",
          "[checkpoint]") {
  // nlohmann::json keeps the last of two values: the file is damaged, and
  // which value was meant is not known.
  auto error_for = [](const std::string& text) {
    return error_of([&] { parse_trainer_state(text, "s/trainer_state.json"); });
  };
  const std::string fields =
      R"("epoch": 0, "position": 0, "best_metric": -1, "nonfinite_skipped": 0)";
  CHECK_NOTHROW(parse_trainer_state(cat(R"({"step": 3, )", fields, "}"), "x"));
  CHECK_THAT(error_for(cat(R"({"step": 3, "step": 5, )", fields, "}")),
             Catch::Contains("s/trainer_state.json: key 'step' is given twice; the file is "
                             "damaged: use an earlier checkpoint"));
  CHECK_THAT(error_for(cat(R"({"step": 3, )", fields,
                           R"(, "parallel": {"world_size": 1, "zero1": false, "zero1": true}})")),
             Catch::Contains("key 'zero1' is given twice in 'parallel'"));
  CHECK_THAT(error_for(cat(R"({"step": 3, )", fields,
                           R"(, "link_models": [{"ranks": [0]}, {"ranks": [0], "ranks": [1]}]})")),
             Catch::Contains("key 'ranks' is given twice in 'link_models[1]'"));
  // The same key in two objects is fine.
  CHECK_NOTHROW(parse_trainer_state(
      cat(R"({"step": 3, )", fields,
          R"(, "link_models": [{"ranks": [0], "alpha_s": 0, "beta_s_per_byte": 0,)"
          R"( "gamma_s_per_byte": 0}, {"ranks": [0], "alpha_s": 0, "beta_s_per_byte": 0,)"
          R"( "gamma_s_per_byte": 0}]})"),
      "x"));
  // What follows a NUL byte was never read.
  CHECK_THAT(error_for(cat(R"({"step": 3, )", fields, "}", std::string(1, '\0'), "{}")),
             Catch::Contains("s/trainer_state.json: 3 bytes after the JSON value"));
}

TEST_CASE("checkpoint: resharding says what a resume changes of the layout", "[checkpoint]") {
  const ParallelLayout dp2 = layout_of(2, 1, 1, false);
  CHECK(resharding(dp2, dp2).empty());
  CHECK(resharding(dp2, layout_of(1, 1, 1, false)) == "dp 2 -> 1");
  CHECK(resharding(layout_of(2, 2, 1, true), layout_of(2, 1, 1, true)) == "pp 2 -> 1");
  CHECK(resharding(layout_of(2, 1, 2, false), layout_of(4, 1, 1, true)) ==
        "dp 2 -> 4, tp 2 -> 1, zero1 off -> on");
}

TEST_CASE("checkpoint: the earlier formats' model files are read back merged", "[checkpoint]") {
  fs::path dir = fresh_temp_dir("ckpt_parts");
  Generator gen(3);
  Tensor a = rand_tensor({4, 3}, gen), b = rand_tensor({5}, gen), c = rand_tensor({2, 2}, gen);
  // One writer: model.safetensors.
  write_safetensors(model_file(dir.string()), {{"a", a}, {"b", b}});
  std::map<std::string, Tensor> whole = read_model(dir.string());
  REQUIRE(whole.size() == 2);
  require_close(whole.at("a"), a, 0, 0, "a");
  fs::remove(model_file(dir.string()));

  // Two writers (pipeline stages), each with its tensors, plus a ZeRO-1 shard.
  write_safetensors(model_part_file(dir.string(), 0, 2), {{"a", a}, {"b", b}});
  write_safetensors(model_part_file(dir.string(), 1, 2), {{"c", c}});
  write_safetensors(optimizer_file(dir.string(), true, 0), {{"a.step", zeros({}, DType::i64)}});
  write_safetensors(optimizer_file(dir.string(), true, 1), {{"c.step", zeros({}, DType::i64)}});
  std::map<std::string, Tensor> merged = read_model(dir.string());
  REQUIRE(merged.size() == 3);
  require_close(merged.at("c"), c, 0, 0, "c");
  CHECK(read_optimizer(dir.string(), true, 1).at(0).name == "c.step");

  // A tensor in two parts, or a part missing, is refused by name.
  write_safetensors(model_part_file(dir.string(), 1, 2), {{"c", c}, {"a", a}});
  CHECK_THAT(error_of([&] { read_model(dir.string()); }),
             Catch::Contains("model-00002-of-00002.safetensors: tensor 'a' is also in another"));
  fs::remove(dir / "model-00001-of-00002.safetensors");
  CHECK_THAT(error_of([&] { read_model(dir.string()); }),
             Catch::Contains("model-00001-of-00002.safetensors: missing part of the model"));
  fs::remove(dir / "model-00002-of-00002.safetensors");
  CHECK_THAT(error_of([&] { read_model(dir.string()); }), Catch::Contains("no model file"));
}

namespace {

// The pieces rank `coord` of `mesh` writes of a logical tensor under
// placement p: its local part, whole or cut into `ranges` element ranges.
std::vector<TensorPiece> pieces_at(const std::string& name, const Tensor& logical,
                                   const parallel::TensorPlacement& p,
                                   const parallel::MeshShape& mesh,
                                   const parallel::MeshCoord& coord, int ranges = 1) {
  // The local tensor: its boxes of the logical tensor, concatenated.
  std::vector<parallel::Box> boxes = parallel::local_boxes(p, mesh, coord);
  TensorList parts;
  int dim = 0;
  for (parallel::Dim d : parallel::kAllDims)
    if (p[d].kind == parallel::Placement::Kind::shard) dim = p[d].dim;
  for (const parallel::Box& b : boxes) {
    Tensor part = logical;
    for (size_t i = 0; i < b.offset.size(); ++i)
      part = part.narrow(int(i), b.offset[i], b.extent[i]);
    parts.push_back(part.contiguous());
  }
  Tensor local = concat(parts, dim);
  TensorPiece whole = piece_of(name, local, p, mesh, coord);
  if (ranges == 1) return {whole};
  std::vector<TensorPiece> out;
  const int64_t n = local.numel();
  for (int k = 0; k < ranges; ++k) {
    TensorPiece piece = whole;
    piece.begin = n * k / ranges, piece.end = n * (k + 1) / ranges;
    piece.values = local.reshape({n}).narrow(0, piece.begin, piece.end - piece.begin).contiguous();
    out.push_back(piece);
  }
  return out;
}

}  // namespace

TEST_CASE("checkpoint: the index names every piece, under any tensor name", "[checkpoint]") {
  fs::path dir = fresh_temp_dir("ckpt_index");
  Generator gen(6);
  const Tensor w = rand_tensor({6, 4}, gen), b = rand_tensor({3}, gen);
  const parallel::MeshShape mesh{{parallel::Dim::tp, 2}};
  const parallel::TensorPlacement split = parallel::TensorPlacement::replicated({6, 4}).with(
      parallel::Dim::tp, parallel::Placement::shard(0, 1));
  // A name JSON must escape: quotes, a backslash, a tab.
  const std::string odd = "odd \"name\"\\ with\ta tab";
  for (int rank = 0; rank < 2; ++rank) {
    const parallel::MeshCoord coord = parallel::mesh_coord(mesh, rank);
    CheckpointPart part;
    part.model.push_back(piece_of("w", w.narrow(0, 3 * rank, 3).contiguous(), split, mesh, coord));
    if (rank == 0)
      part.model.push_back(
          piece_of(odd, b, parallel::TensorPlacement::replicated({3}), mesh, coord));
    write_checkpoint_part(dir.string(), rank, part);
  }
  write_checkpoint_index(dir.string());
  CHECK_NOTHROW(verify_checkpoint_index(dir.string()));
  const nlohmann::json index =
      nlohmann::json::parse(read_file(checkpoint_index_file(dir.string())));
  CHECK(index["format"] == "trainer.checkpoint_index");
  const nlohmann::json& pieces = index["model"]["w"]["pieces"];
  CHECK(index["model"]["w"]["shape"] == nlohmann::json({6, 4}));
  REQUIRE(pieces.size() == 2);
  CHECK(pieces[1]["file"] == "model-rank00001.safetensors");
  CHECK(pieces[1]["boxes"][0]["offset"] == nlohmann::json({3, 0}));
  CHECK(pieces[1]["boxes"][0]["extent"] == nlohmann::json({3, 4}));
  CHECK(pieces[1]["elements"] == nlohmann::json({0, 12}));
  REQUIRE(index["model"].contains(odd));
  CHECK(index["model"][odd]["dtype"] == "F32");
  CHECK(index["files"]["model-rank00000.safetensors"] ==
        fs::file_size(pieces_file(dir.string(), "model", 0)));
  CHECK(read_model(dir.string()).count(odd) == 1);
}

TEST_CASE("checkpoint: every rank's pieces join into the logical tensors, on any layout",
          "[checkpoint]") {
  using parallel::Dim;
  using parallel::Placement;
  fs::path dir = fresh_temp_dir("ckpt_pieces");
  Generator gen(5);
  // c_attn-like: q, k and v rows, each cut over tp = 2; a bias whole; a step.
  const Tensor w = rand_tensor({12, 4}, gen), bias = rand_tensor({4}, gen);
  const Tensor step = full({}, 7, DType::i64);
  const parallel::MeshShape mesh{{Dim::dp_replicate, 2}, {Dim::tp, 2}};
  const parallel::TensorPlacement split =
      parallel::TensorPlacement::replicated({12, 4}).with(Dim::tp, Placement::shard(0, 3));
  const parallel::TensorPlacement replicated = parallel::TensorPlacement::replicated({4});
  for (int rank = 0; rank < mesh.size(); ++rank) {
    const parallel::MeshCoord coord = parallel::mesh_coord(mesh, rank);
    CheckpointPart part;
    // ZeRO-1-like: the split weight's part cut in two ranges over dp, the
    // bias written whole by the first rank.
    for (TensorPiece& p : pieces_at("w", w, split, mesh, coord, 2))
      if ((p.begin == 0) == (coord[Dim::dp_replicate] == 0)) part.optimizer.push_back(p);
    if (parallel::writes(split, coord)) part.model = pieces_at("w", w, split, mesh, coord);
    if (parallel::writes(replicated, coord)) {
      part.model.push_back(piece_of("b", bias, replicated, mesh, coord));
      part.optimizer.push_back(
          piece_of("w.step", step, parallel::TensorPlacement::replicated({}), mesh, coord));
    }
    write_checkpoint_part(dir.string(), rank, part);
  }
  // The first rank's file is a state dict where a tensor is whole.
  CHECK(read_safetensors(pieces_file(dir.string(), "model", 0)).tensors.count("b") == 1);
  std::map<std::string, Tensor> model = read_model(dir.string());
  REQUIRE(model.size() == 2);
  require_close(model.at("w"), w, 0, 0, "w");
  require_close(model.at("b"), bias, 0, 0, "b");
  std::map<std::string, Tensor> optim = read_pieces(dir.string(), "optimizer");
  REQUIRE(optim.size() == 2);
  require_close(optim.at("w"), w, 0, 0, "w from ranges");
  CHECK(optim.at("w.step").item<int64_t>() == 7);

  // A rank's file missing leaves elements in no file; one copied over
  // another rank's holds elements twice.
  const std::string last = pieces_file(dir.string(), "optimizer", 3);
  fs::rename(last, dir / "kept");
  CHECK_THAT(error_of([&] { read_pieces(dir.string(), "optimizer"); }),
             Catch::Contains("are in no file"));
  fs::copy_file(pieces_file(dir.string(), "optimizer", 1), last);
  CHECK_THAT(error_of([&] { read_pieces(dir.string(), "optimizer"); }),
             Catch::Contains(last + ": elements [") && Catch::Contains("are also in"));
  fs::rename(dir / "kept", last);
  CHECK_NOTHROW(read_pieces(dir.string(), "optimizer"));
  // A damaged description is refused naming the file and the key.
  const std::string model1 = pieces_file(dir.string(), "model", 1);
  SafetensorsFile f = read_safetensors(model1);
  std::vector<NamedTensor> tensors;
  for (auto& [k, t] : f.tensors) tensors.push_back({k, t});
  f.metadata["w#0"] = "global=12,4 dim=0 boxes=2+2,0+4;6+2,0+4;10+4,0+4 elements=0:-1";
  write_safetensors(model1, tensors, f.metadata);
  CHECK_THAT(error_of([&] { read_model(dir.string()); }),
             Catch::Contains(model1 + ": piece of 'w'") && Catch::Contains("a box outside"));
  f.metadata["w#0"] = "global=12,4 dim=0 boxes=2+2,0+4 elements=0:x";
  write_safetensors(model1, tensors, f.metadata);
  CHECK_THAT(error_of([&] { read_model(dir.string()); }),
             Catch::Contains(model1 + ": metadata 'w#0'") &&
                 Catch::Contains("is not a piece's description"));
}

TEST_CASE("executor: the one-stage schedule is the gradient-accumulation loop, bit for bit",
          "[train]") {
  // The CNN has batch norm and dropout (re-keyed per micro-step); 3 micro-batches per step.
  const Recipe recipe = load_recipe(
      std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_cnn.yaml",
      {"training.global_batch=12", "training.grad_accum=3", "training.steps=3", "data.workers=1",
       "optimizer.clip_grad_norm=1.0", "schedule.name=cosine", "schedule.warmup_epochs=0"});
  const int64_t M = recipe.training.grad_accum, steps = 3;

  // The executor's step.
  Session executed(recipe);
  Distributed single;
  DistributedRun run(single, executed, false);
  Precision precision(recipe, false);
  StepExecutor executor(executed, run, precision, training_schedule(recipe, executed.layout()));
  CHECK(parallel::to_string(executor.schedule()) == "stage 0: F0 B0 F1 B1 F2 B2 sync step");
  executed.start_epoch(0, 0);
  std::vector<double> losses;
  for (int64_t step = 0; step < steps; ++step) {
    StepResult r = executor.run(step, false);
    REQUIRE(!r.ran_out);
    REQUIRE(r.finite);
    CHECK(r.position == (step + 1) * M * executed.micro_batch());
    losses.push_back(r.loss);
  }

  // The loop it replaced, written out.
  Session looped(recipe);
  looped.start_epoch(0, 0);
  for (int64_t step = 0; step < steps; ++step) {
    double loss_sum = 0;
    for (int64_t m = 0; m < M; ++m) {
      StepBatch batch;
      REQUIRE(looped.next_batch(batch));
      looped.rekey_dropout(step * M + m);
      Tensor loss = looped.loss(batch);
      loss_sum += loss.item<double>();
      (loss * (1.0 / double(M))).backward();
    }
    CHECK(loss_sum / double(M) == losses[size_t(step)]);
    optim::Optimizer& opt = looped.optimizer();
    opt.clip_grad_norm(recipe.optimizer.clip_grad_norm);
    opt.set_lr(looped.schedule().lr(step));
    opt.step();
    opt.zero_grad();
  }
  require_same_bits(executed.model().state(), looped.model().state());
  require_same_bits(executed.optimizer().state(), looped.optimizer().state());
}
