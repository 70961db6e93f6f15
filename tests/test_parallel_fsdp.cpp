// Sharded data parallelism (parallel.shard: gradients = ZeRO-2, parameters
// = ZeRO-3) in the trainer: each mode on 2 and 4 ranks against one process
// (MLP, GPT with its tied head and recomputation, ResNet-18, the LSTM LM),
// composed with tensor parallelism, gradient accumulation and clipping; its
// checkpoints resuming bit for bit and on other layouts; the memory it
// saves, measured; and the recipes it refuses.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <tuple>
#include <vector>

#include "core/autocast.h"
#include "core/ops.h"
#include "models/small.h"
#include "optim/optimizer.h"
#include "parallel/fsdp.h"
#include "tests/runs.h"
#include "tests/thread_world.h"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"

using namespace trainer;
using trainer::testing::check_close;
using trainer::testing::check_models;
using trainer::testing::model_at;
using trainer::testing::ProcessResult;
using trainer::testing::run_ranks;
using trainer::testing::step_log;
namespace fs = std::filesystem;

namespace {

const std::string kRecipes = std::string(TRAINER_SOURCE_DIR) + "/recipes/";

std::string run_dir(const std::string& name) {
  return testing::fresh_temp_dir("fsdp_" + name, false).string();
}

// The MLP recipe (testing::mlp_sgd_args) with momentum, two micro-steps
// per step and clipping: the sharded gradient norm and accumulation in the shard.
std::vector<std::string> mlp_args(const std::string& out, std::vector<std::string> extra) {
  extra.insert(extra.begin(), {"training.steps=6", "training.grad_accum=2",
                               "optimizer.momentum=0.9", "parallel.shard_unit_mb=0",
                               "optimizer.clip_grad_norm=0.5", "training.log_every=1"});
  return testing::mlp_sgd_args(out, extra);
}

// recipes/gpt_kjv.yaml made tiny (tied head), AdamW at a constant rate.
std::vector<std::string> gpt_args(const std::string& out, std::vector<std::string> extra) {
  std::vector<std::string> a{"train",
                             kRecipes + "gpt_kjv.yaml",
                             "output_dir=" + out,
                             "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
                             "training.threads=1",
                             "data.workers=1",
                             "training.steps=4",
                             "training.log_every=1",
                             "training.eval_every=0",
                             "model.n_layer=3",
                             "model.d_model=32",
                             "model.n_head=2",
                             "model.context=32",
                             "model.dropout=0",
                             "data.seq_len=32",
                             "data.val_windows=8",
                             "schedule.name=constant",
                             "schedule.warmup_steps=0",
                             "optimizer.clip_grad_norm=0.5",
                             "parallel.shard_unit_mb=0"};  // a unit per block
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

ProcessResult trained(int ranks, const std::vector<std::string>& args) {
  ProcessResult r = run_ranks(ranks, args);
  INFO("exit " << r.code << " after " << r.seconds << " s; why:\n" << r.failure_lines());
  INFO(r.output);
  REQUIRE(r.code == 0);
  return r;
}

// check_models, a tensor-parallel run's vocabulary padding left out (its
// embedding and head rows past the vocabulary: models/gpt.h).
void check_models_unpadded(const std::map<std::string, Tensor>& one,
                           std::map<std::string, Tensor> padded, double tolerance) {
  for (auto& [name, t] : padded)
    if (one.count(name) && t.dim() == 2 && t.size(0) > one.at(name).size(0))
      t = t.narrow(0, 0, one.at(name).size(0)).contiguous();
  check_models(one, padded, tolerance);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// "memory: peak 12.3 MiB of tensors" from a run's summary.
double peak_tensor_mib(const std::string& output) {
  std::smatch m;
  const std::regex peak("memory: peak ([0-9.]+) MiB of tensors");
  REQUIRE(std::regex_search(output, m, peak));
  return std::stod(m[1]);
}

// One rank's run of a small MLP (three linear blocks) for two SGD steps on
// its own batch, under ZeRO-1 (stage 1) or ZeRO-3 (stage 3): the gathers and
// prefetches it made, whether each block's weight had memory right after
// the first forward, and the final weights (gathered).
struct UnitRun {
  int64_t gathers = 0, prefetches = 0;
  std::vector<bool> held_after_forward;
  std::vector<DType> dtype_after_forward;  // of each weight
  std::vector<float> weights;
  // ZeroOptions::gather_in_place: whether the units were read where they lie,
  // and whether the weight kept after forward pointed into the ranks' blocks.
  bool in_place = false, weight_in_view = false;
};

// Mixed precision: forward under autocast bf16, ZeRO-3's gathers and
// ZeRO-2/3's reduction in these dtypes (unset: f32); gather_in_place as
// ZeroOptions's.
struct UnitPrecision {
  bool autocast = false;
  std::optional<DType> param, reduce;
  bool gather_in_place = false;
};

UnitRun run_units(comm::Communicator& world, int stage, bool diverge = false,
                  UnitPrecision precision = {}) {
  auto comm = std::shared_ptr<comm::Communicator>(&world, [](comm::Communicator*) {});
  auto model =
      std::make_shared<MLP>(MLPOptions{.in_features = 8, .hidden = {16, 16}, .num_classes = 4});
  const std::vector<std::vector<size_t>> units = parallel::sharding_units(model->blocks());
  std::unique_ptr<parallel::ShardedParameters> sharded;
  std::shared_ptr<parallel::ZeroOptimizer> zero;
  parallel::DataParallelOptions o;
  o.reduce = parallel::zero_bucket_reduce(&zero);
  if (stage > 1) {
    o.transient_buckets = true;
    o.bucket_numel_multiple =
        world.size() *
        (precision.gather_in_place ? parallel::gather_in_place_align(DType::f32) : 1);
    o.units = parallel::unit_parameters(model->blocks(), units);
    o.transient_buffer = [&](int64_t numel, DType dtype) {  // in the reduce dtype
      return zero->transient_buffer(numel, dtype);
    };
  }
  if (stage == 3) o.on_bucket_started = [&](int b) { sharded->bucket_started(b); };
  parallel::DataParallel dp(model, comm, o);
  parallel::ZeroOptions zero_options;
  zero_options.stage = stage;
  zero_options.buckets = &dp.buckets();
  zero_options.param_dtype = precision.param;
  zero_options.reduce_dtype = precision.reduce;
  zero_options.gather_in_place = precision.gather_in_place;
  zero = std::make_shared<parallel::ZeroOptimizer>(
      comm, std::vector<optim::ParamGroup>{{model->named_parameters()}},
      [](std::vector<optim::ParamGroup> g) {
        return std::make_unique<optim::SGD>(std::move(g),
                                            optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
      },
      zero_options);
  if (stage == 3) sharded = std::make_unique<parallel::ShardedParameters>(*model, units, dp, &zero);
  UnitRun run;
  for (int step = 0; step < 2; ++step) {
    Generator gen(uint64_t(100 + 10 * world.rank() + step), 0);
    Tensor x = randn({2, 8}, gen);
    Tensor loss;
    {
      AutocastGuard autocast(precision.autocast ? DType::bf16 : DType::f32);
      Tensor out = diverge && world.rank() == 1
                       ? model->blocks().run(1, 3, {randn({2, 16}, gen)})[0]
                       : model->forward(x);
      loss = mean(out * out);
    }
    if (step == 0)
      for (const NamedTensor& p : model->named_parameters())
        if (p.name.ends_with(".weight")) {
          run.held_after_forward.push_back(p.tensor.storage()->data != nullptr);
          run.dtype_after_forward.push_back(p.tensor.dtype());
          for (size_t k = 0; stage == 3 && p.tensor.storage()->data && k < zero->segments().size();
               ++k)
            if (Tensor view = zero->gathered_in_place(int(k)); view.defined()) {
              const char* at = static_cast<const char*>(p.tensor.data_ptr());
              const char* begin = static_cast<const char*>(view.data_ptr());
              run.weight_in_view = run.weight_in_view ||
                                   (at >= begin && at + p.tensor.nbytes() <= begin + view.nbytes());
            }
        }
    loss.backward();
    dp.end_backward();
    dp.finish();
    zero->step();
    zero->zero_grad();
    dp.zero_grad();
    if (sharded) sharded->end_step();
  }
  std::map<const TensorImpl*, Tensor> gathered;
  if (sharded) {
    gathered = sharded->gathered_copies();
    run.gathers = sharded->gathers();
    run.prefetches = sharded->prefetches();
    run.in_place = zero->gathered_in_place(0).defined();
  }
  for (const NamedTensor& p : model->named_parameters()) {
    const Tensor& t = gathered.count(p.tensor.impl()) ? gathered.at(p.tensor.impl()) : p.tensor;
    for (float v : t.contiguous().to_vector<float>()) run.weights.push_back(v);
  }
  return run;
}

}  // namespace

TEST_CASE("fsdp: units gathered per use, prefetched after the first step, freed after use",
          "[parallel][fsdp][threads]") {
  const std::vector<UnitRun> zero3 = testing::run_thread_ranks<UnitRun>(
      2, [](comm::Communicator& world) { return run_units(world, 3); });
  const std::vector<UnitRun> zero1 = testing::run_thread_ranks<UnitRun>(
      2, [](comm::Communicator& world) { return run_units(world, 1); });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    const UnitRun& run = zero3[size_t(r)];
    // After forward the last block keeps its weight for backward; the others are freed.
    CHECK(run.held_after_forward == std::vector<bool>{false, false, true});
    // Step 1, checked and unprefetched: 3 gathers in forward, 2 in backward
    // (the last block's kept). Step 2: the first block's gather, then the
    // next two prefetched in forward and two in backward.
    CHECK(run.gathers == 6);
    CHECK(run.prefetches == 4);
    REQUIRE(run.weights.size() == zero1[size_t(r)].weights.size());
    float worst = 0;
    for (size_t i = 0; i < run.weights.size(); ++i)
      worst = std::max(worst, std::fabs(run.weights[i] - zero1[size_t(r)].weights[i]));
    CHECK(worst < 1e-6f);
    CHECK(run.weights == zero3[0].weights);
  }
}

TEST_CASE("fsdp: on one host the units are read where the ranks' blocks lie, as gathered copies",
          "[parallel][fsdp][threads]") {
  for (int n : {2, 3}) {
    const std::vector<UnitRun> copied = testing::run_thread_ranks<UnitRun>(
        n, [](comm::Communicator& world) { return run_units(world, 3); });
    const std::vector<UnitRun> in_place =
        testing::run_thread_ranks<UnitRun>(n, [](comm::Communicator& world) {
          UnitPrecision precision;
          precision.gather_in_place = true;
          return run_units(world, 3, false, precision);
        });
    for (int r = 0; r < n; ++r) {
      INFO(n << " ranks, rank " << r);
      CHECK_FALSE(copied[size_t(r)].in_place);
      CHECK(in_place[size_t(r)].in_place);
      // The weight kept after forward is a view of the ranks' blocks, not a copy.
      CHECK(in_place[size_t(r)].weight_in_view);
      CHECK_FALSE(copied[size_t(r)].weight_in_view);
      CHECK(in_place[size_t(r)].held_after_forward == copied[size_t(r)].held_after_forward);
      CHECK(in_place[size_t(r)].gathers == copied[size_t(r)].gathers);
      // The same values: bit for bit (the sums run in the same order).
      CHECK(in_place[size_t(r)].weights == copied[size_t(r)].weights);
    }
  }
}

TEST_CASE("fsdp: parameters gathered in bf16 and gradients reduced in bf16 (mixed precision)",
          "[parallel][fsdp][threads]") {
  UnitPrecision autocast, gather, both, reduce;
  autocast.autocast = gather.autocast = both.autocast = reduce.autocast = true;
  gather.param = both.param = DType::bf16;
  both.reduce = reduce.reduce = DType::bf16;
  const std::vector<UnitRun> zero1 = testing::run_thread_ranks<UnitRun>(
      2, [&](comm::Communicator& world) { return run_units(world, 1, false, autocast); });
  // Under autocast bf16 the linear layers round their f32 weights to bf16
  // and the bf16 gradients come back as f32 ones of the same values: ZeRO-3
  // gathering bf16 weights computes the same numbers.
  const std::vector<UnitRun> bf16_gather = testing::run_thread_ranks<UnitRun>(
      2, [&](comm::Communicator& world) { return run_units(world, 3, false, gather); });
  // Gradients reduce-scattered in bf16: within bf16's rounding of them.
  const std::vector<UnitRun> bf16_reduce = testing::run_thread_ranks<UnitRun>(
      2, [&](comm::Communicator& world) { return run_units(world, 3, false, both); });
  const std::vector<UnitRun> zero2_reduce = testing::run_thread_ranks<UnitRun>(
      2, [&](comm::Communicator& world) { return run_units(world, 2, false, reduce); });
  auto worst = [](const UnitRun& a, const UnitRun& b) {
    REQUIRE(a.weights.size() == b.weights.size());
    float w = 0;
    for (size_t i = 0; i < a.weights.size(); ++i)
      w = std::max(w, std::fabs(a.weights[i] - b.weights[i]));
    return w;
  };
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    // The last block, kept gathered after forward, is a bf16 tensor until freed.
    CHECK(bf16_gather[size_t(r)].dtype_after_forward ==
          std::vector<DType>{DType::f32, DType::f32, DType::bf16});
    CHECK(worst(bf16_gather[size_t(r)], zero1[size_t(r)]) < 1e-6f);
    const float reduced = worst(bf16_reduce[size_t(r)], zero1[size_t(r)]);
    CHECK(reduced > 0);
    CHECK(reduced < 2e-3f);
    CHECK(worst(zero2_reduce[size_t(r)], zero1[size_t(r)]) < 2e-3f);
    // The master weights stay f32: what the ranks hold after the steps is alike.
    CHECK(bf16_reduce[size_t(r)].weights == bf16_reduce[0].weights);
  }
}

TEST_CASE("fsdp: ranks that gather units in different orders fail naming both, not hang",
          "[parallel][fsdp][threads]") {
  try {
    testing::run_thread_ranks<UnitRun>(
        2, [](comm::Communicator& world) { return run_units(world, 3, /*diverge=*/true); });
    FAIL("the divergent ranks trained");
  } catch (const Error& e) {
    CHECK(contains(e.what(),
                   "ZeRO-3: rank 1 of the data-parallel group gathers the parameters of "
                   "fc2 where rank 0 gathers those of fc1"));
  }
}

TEST_CASE("fsdp: ZeRO-2 and ZeRO-3 train the MLP as one process, on 2 and 4 ranks",
          "[parallel][mp][fsdp]") {
  const std::string ref = run_dir("mlp_one");
  trained(1, mlp_args(ref, {}));
  for (const char* shard : {"gradients", "parameters"}) {
    for (int ranks : {2, 4}) {
      INFO(shard << " on " << ranks << " ranks");
      const std::string out = run_dir(cat("mlp_", shard, ranks));
      ProcessResult r = trained(ranks, mlp_args(out, {cat("parallel.shard=", shard)}));
      CHECK(contains(r.output, cat("tp=1, zero", shard == std::string("gradients") ? 2 : 3, ")")));
      check_close(step_log(ref).loss, step_log(out).loss, 1e-5, "loss");
      check_close(step_log(ref).grad_norm, step_log(out).grad_norm, 1e-5, "gradient norm");
      check_models(model_at(ref, 6), model_at(out, 6), 1e-6);
    }
  }
}

TEST_CASE("fsdp: ZeRO-3 trains GPT (tied head) as one process, with recomputation, tp, pp, hybrid",
          "[parallel][mp][fsdp]") {
  const std::string ref = run_dir("gpt_one");
  trained(1, gpt_args(ref, {}));
  struct Layout {
    const char* name;
    int ranks;
    std::vector<std::string> extra;
  };
  for (const Layout& l :
       {Layout{"dp2", 2, {"parallel.shard=parameters"}},
        Layout{"dp2_recompute_keep",
               2,
               {"parallel.shard=parameters", "parallel.recompute=blocks",
                "parallel.reshard_after_forward=false"}},
        Layout{"dp4_zero2", 4, {"parallel.shard=gradients"}},
        Layout{"hybrid_2x2", 4, {"parallel.shard=parameters", "parallel.dp_replicate=2"}},
        Layout{"hybrid_2x2_tp2",
               8,
               {"parallel.shard=parameters", "parallel.dp_replicate=2", "parallel.tp=2"}},
        Layout{"hybrid_2x2_pp2_zero1",
               8,
               {"parallel.shard=optimizer", "parallel.dp_replicate=2", "parallel.pp=2"}},
        // Pipelines: each stage shards its own blocks (the tied embedding
        // and head in a bucket of their own on both stages).
        Layout{"dp2_pp2", 4, {"parallel.shard=parameters", "parallel.pp=2"}},
        Layout{"dp2_pp2_zero2_zbh1",
               4,
               {"parallel.shard=gradients", "parallel.pp=2", "parallel.schedule=zbh1",
                "parallel.micro_batches=4"}},
        Layout{"dp2_pp2_zbh1",
               4,
               {"parallel.shard=parameters", "parallel.pp=2", "parallel.schedule=zbh1",
                "parallel.micro_batches=4"}},
        Layout{"dp2_pp2_interleaved_kept",
               4,
               {"parallel.shard=parameters", "parallel.pp=2", "parallel.schedule=interleaved",
                "parallel.virtual_stages=2", "parallel.micro_batches=4",
                "parallel.reshard_after_forward=false"}},
        Layout{"dp2_pp2_tp2", 8, {"parallel.shard=parameters", "parallel.pp=2", "parallel.tp=2"}},
        Layout{"hybrid_2x2_pp2",
               8,
               {"parallel.shard=parameters", "parallel.dp_replicate=2", "parallel.pp=2"}},
        Layout{"dp2_tp2", 4, {"parallel.shard=parameters", "parallel.tp=2"}},
        // Units of two blocks (0.05 MiB); the tied embedding and head alone.
        Layout{"dp2_merged", 2, {"parallel.shard=parameters", "parallel.shard_unit_mb=0.05"}}}) {
    INFO(l.name);
    const std::string out = run_dir(cat("gpt_", l.name));
    trained(l.ranks, gpt_args(out, l.extra));
    check_close(step_log(ref).loss, step_log(out).loss, 1e-5, "loss");
    check_models_unpadded(model_at(ref, 4), model_at(out, 4), 1e-5);
  }
}

TEST_CASE("fsdp: GPT under precision bf16 gathers bf16 parameters and trains as plain dp",
          "[parallel][mp][fsdp]") {
  const std::string ref = run_dir("gpt_bf16_dp");
  trained(2, gpt_args(ref, {"precision=bf16", "training.steps=6"}));
  // Parameters gathered in bf16 (auto under precision bf16), gradients
  // reduced in f32 and then in bf16; ZeRO-2 reduced in bf16. The residual
  // stream starts from bf16 embeddings here, so the loss differs from plain
  // dp's at bf16's rounding, not more.
  for (const auto& [name, extra, line] :
       {std::tuple{"zero3", "parallel.reduce_dtype=f32", "zero3, gathers bf16"},
        std::tuple{"zero3_reduce_bf16", "parallel.reduce_dtype=bf16",
                   "zero3, gathers bf16, reduces bf16"},
        std::tuple{"zero2_reduce_bf16", "parallel.reduce_dtype=bf16", "zero2, reduces bf16"}}) {
    INFO(name);
    const std::string out = run_dir(cat("gpt_bf16_", name));
    const std::string shard = std::string(name).starts_with("zero3") ? "parameters" : "gradients";
    ProcessResult r = trained(
        2, gpt_args(out, {"precision=bf16", "training.steps=6", "parallel.shard=" + shard, extra}));
    CHECK(contains(r.output, line));
    check_close(step_log(ref).loss, step_log(out).loss, 3e-3, "loss");
    check_models(model_at(ref, 6), model_at(out, 6), 2e-2);
  }
}

TEST_CASE("fsdp: ZeRO-3 trains ResNet-18 and the LSTM LM as one process", "[parallel][mp][fsdp]") {
  SECTION("resnet18_small") {
    const std::vector<std::string> common = {"model.name=resnet18_small", "model.in_channels=1",
                                             "training.global_batch=8",   "optimizer.lr=0.05",
                                             "data.val_samples=64",       "training.steps=3",
                                             "training.log_every=1"};
    auto args = [&](const std::string& out, std::vector<std::string> extra) {
      std::vector<std::string> a{"train", kRecipes + "fmnist_cnn.yaml", "output_dir=" + out,
                                 "training.threads=1", "data.workers=1"};
      a.insert(a.end(), common.begin(), common.end());
      a.insert(a.end(), extra.begin(), extra.end());
      return a;
    };
    // Against plain data parallelism: batch norm's statistics are each rank's own.
    const std::string ref = run_dir("resnet_dp2"), out = run_dir("resnet_zero3");
    trained(2, args(ref, {}));
    trained(2, args(out, {"parallel.shard=parameters"}));
    check_close(step_log(ref).loss, step_log(out).loss, 1e-5, "loss");
    check_models(model_at(ref, 3), model_at(out, 3), 1e-5);
    // And each of 2 pipeline stages sharding its blocks, against the same
    // pipeline (batch norm sees micro-batches of one image), for one step:
    // the sharded gradients are reduced per micro-batch and round
    // differently, and batch norm over one image amplifies rounding in the
    // steps after it (one thread against two differ by 1e-5 in the loss).
    const std::string piped = run_dir("resnet_pp2"), staged = run_dir("resnet_zero3_pp2");
    trained(4, args(piped, {"parallel.pp=2", "training.steps=1"}));
    trained(4, args(staged, {"parallel.shard=parameters", "parallel.pp=2", "training.steps=1"}));
    check_close(step_log(piped).loss, step_log(staged).loss, 1e-6, "loss");
    check_models(model_at(piped, 1), model_at(staged, 1), 1e-5);
  }
  SECTION("lstm") {
    auto args = [&](const std::string& out, std::vector<std::string> extra) {
      std::vector<std::string> a{
          "train",
          kRecipes + "lstm_kjv.yaml",
          "output_dir=" + out,
          "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
          "training.threads=1",
          "data.workers=1",
          "training.steps=3",
          "training.log_every=1",
          "training.eval_every=0",
          "model.hidden=32",
          "model.d_model=32",
          "model.dropout=0",
          "data.seq_len=16",
          "data.val_windows=8"};
      a.insert(a.end(), extra.begin(), extra.end());
      return a;
    };
    const std::string ref = run_dir("lstm_one"), out = run_dir("lstm_zero3");
    trained(1, args(ref, {}));
    trained(2, args(out, {"parallel.shard=parameters"}));
    check_close(step_log(ref).loss, step_log(out).loss, 1e-5, "loss");
    check_models(model_at(ref, 3), model_at(out, 3), 1e-5);
    // The wavefront pipeline: one layer per stage, time chunks as micro-batches.
    const std::string staged = run_dir("lstm_zero3_pp2");
    trained(4, args(staged,
                    {"parallel.shard=parameters", "parallel.pp=2", "parallel.schedule=wavefront",
                     "parallel.time_chunks=2", "parallel.micro_batches=1"}));
    check_close(step_log(ref).loss, step_log(staged).loss, 1e-5, "loss");
    check_models(model_at(ref, 3), model_at(staged, 3), 1e-5);
  }
}

TEST_CASE("fsdp: ZeRO-3 evaluates unit by unit when the ranks' shares take different passes",
          "[parallel][mp][fsdp]") {
  // 33 validation images in batches of 16: one rank's share takes two
  // forward passes, the other's one.
  const std::vector<std::string> extra = {"training.steps=4", "training.eval_every=2",
                                          "data.val_samples=33", "training.log_every=1"};
  const std::string ref = run_dir("eval_one");
  trained(1, testing::mlp_sgd_args(ref, extra));
  const std::string out = run_dir("eval_zero3");
  std::vector<std::string> sharded = extra;
  sharded.push_back("parallel.shard=parameters");
  trained(2, testing::mlp_sgd_args(out, sharded));
  REQUIRE(step_log(ref).val_loss.size() == 2);
  check_close(step_log(ref).val_loss, step_log(out).val_loss, 1e-5, "validation loss");
  check_close(step_log(ref).val_top1, step_log(out).val_top1, 0, "validation top-1");
}

TEST_CASE("fsdp: a ZeRO-3 run resumes bit for bit, and on other shard modes and sizes",
          "[parallel][mp][fsdp]") {
  const std::vector<std::string> every = {"training.steps=12", "training.checkpoint_every=6",
                                          "optimizer.name=adamw", "optimizer.lr=0.002"};
  auto args = [&](const std::string& out, const std::vector<std::string>& extra) {
    std::vector<std::string> a = every;
    a.insert(a.end(), extra.begin(), extra.end());
    return testing::mlp_sgd_args(out, a);
  };
  const std::string straight = run_dir("resume_straight");
  ProcessResult a = trained(2, args(straight, {"parallel.shard=parameters"}));
  nlohmann::json state = nlohmann::json::parse(
      read_file(straight + "/checkpoints/" + CheckpointDir::step_name(12) + "/trainer_state.json"));
  CHECK(state.at("parallel").at("shard") == "parameters");
  // Each rank wrote its own elements of every parameter, no rank a whole one
  // (nothing was gathered to write them).
  for (int rank : {0, 1}) {
    const SafetensorsHeader header = read_safetensors_header(
        pieces_file(straight + "/checkpoints/" + CheckpointDir::step_name(12), "model", rank));
    int64_t elements = 0;
    for (const SafetensorsEntry& e : header.entries) {
      INFO(e.name);
      CHECK(e.name.find('#') != std::string::npos);
      elements += shape_numel(e.shape);
    }
    CHECK(elements > 0);
    for (const auto& [key, value] : header.metadata)
      if (key.find('#') != std::string::npos) CHECK(!contains(value, "elements=0:-1"));
  }
  struct Continue {
    const char* name;
    int ranks;
    const char* shard;
    const char* resharded;  // "" for the same layout: bit for bit
  };
  for (const Continue& c : {Continue{"same", 2, "parameters", ""},
                            Continue{"one", 1, "none", "resharded: dp 2 -> 1, zero1 on -> off"},
                            Continue{"zero1", 2, "optimizer", "shard parameters -> optimizer"},
                            Continue{"zero2_dp4", 4, "gradients", "dp 2 -> 4"}}) {
    INFO(c.name);
    const std::string run = run_dir(cat("resume_", c.name));
    const std::string mid = CheckpointDir::step_name(6);
    fs::create_directories(run + "/checkpoints");
    fs::copy(straight + "/checkpoints/" + mid, run + "/checkpoints/" + mid);
    std::vector<std::string> resume = args(run, {cat("parallel.shard=", c.shard)});
    resume.insert(resume.end(), {"--resume", "auto"});
    ProcessResult b = trained(c.ranks, resume);
    CHECK(contains(b.output, "resumed from"));
    CHECK(contains(b.output, c.resharded));
    check_models(model_at(straight, 12), model_at(run, 12), *c.resharded ? 1e-5 : 0);
  }
  // One process evaluates it.
  ProcessResult e = run_ranks(
      1, {"eval", kRecipes + "fmnist_mlp.yaml", "--checkpoint", straight + "/checkpoints"});
  INFO(e.output);
  CHECK(e.code == 0);
  CHECK(contains(e.output, "top1"));
}

TEST_CASE("fsdp: hybrid sharding (2 replica groups of 2 shards) trains as one process",
          "[parallel][mp][fsdp]") {
  const std::string ref = run_dir("hybrid_one");
  trained(1, mlp_args(ref, {"training.checkpoint_every=3"}));
  for (const char* shard : {"optimizer", "gradients", "parameters"}) {
    INFO(shard);
    const std::string out = run_dir(cat("hybrid_", shard));
    ProcessResult r =
        trained(4, mlp_args(out, {cat("parallel.shard=", shard), "parallel.dp_replicate=2",
                                  "training.checkpoint_every=3"}));
    CHECK(contains(r.output, "dp_replicate=2, dp_shard=2"));
    check_close(step_log(ref).loss, step_log(out).loss, 1e-5, "loss");
    check_close(step_log(ref).grad_norm, step_log(out).grad_norm, 1e-5, "gradient norm");
    check_models(model_at(ref, 6), model_at(out, 6), 1e-6);
    // The first replica group writes the optimizer's shards; the second holds copies.
    const std::string mid = out + "/checkpoints/" + CheckpointDir::step_name(3);
    CHECK(fs::exists(mid + "/optimizer-rank00001.safetensors"));
    CHECK_FALSE(fs::exists(mid + "/optimizer-rank00002.safetensors"));
    CHECK_FALSE(fs::exists(mid + "/optimizer-rank00003.safetensors"));
    if (shard != std::string("parameters")) continue;
    // Its checkpoint resumes on the same layout bit for bit, and on plain
    // ZeRO-3 over 2 ranks (resharded).
    for (const auto& [ranks, extra, resharded] :
         {std::tuple{4, "parallel.dp_replicate=2", ""},
          std::tuple{2, "parallel.dp_replicate=1", "dp 4 -> 2, dp_replicate 2 -> 1"}}) {
      INFO(ranks << " ranks");
      const std::string run = run_dir(cat("hybrid_resume_", ranks));
      fs::create_directories(run + "/checkpoints");
      fs::copy(mid, run + "/checkpoints/" + CheckpointDir::step_name(3));
      std::vector<std::string> resume =
          mlp_args(run, {"parallel.shard=parameters", extra, "--resume", "auto"});
      ProcessResult b = trained(ranks, resume);
      CHECK(contains(b.output, "resumed from"));
      CHECK(contains(b.output, resharded));
      check_models(model_at(out, 6), model_at(run, 6), *resharded ? 1e-5 : 0);
    }
  }
}

TEST_CASE("fsdp: a rank's peak tensor memory falls with each shard mode", "[parallel][mp][fsdp]") {
  // A GPT whose weights (W bytes; with AdamW's two moments and the
  // gradients 4 W) outweigh its activations, on 4 ranks: sharding what
  // takes k W saves 3/4 k W in an ideal world; at least half must be saved.
  std::map<std::string, double> peak;
  double weights_mib = 0;
  for (const char* shard : {"none", "optimizer", "gradients", "parameters"}) {
    const std::string out = run_dir(cat("memory_", shard));
    ProcessResult r =
        trained(4, gpt_args(out, {"model.d_model=256", "model.n_layer=4", "model.n_head=4",
                                  "training.global_batch=4", "training.steps=2",
                                  "optimizer.name=adamw", cat("parallel.shard=", shard)}));
    peak[shard] = peak_tensor_mib(r.output);
    weights_mib = 0;
    for (const auto& [name, t] : model_at(out, 2))
      if (name != "lm_head.weight") weights_mib += double(t.nbytes()) / (1 << 20);  // tied
  }
  INFO("weights " << weights_mib << " MiB; peak: none " << peak["none"] << ", optimizer "
                  << peak["optimizer"] << ", gradients " << peak["gradients"] << ", parameters "
                  << peak["parameters"] << " MiB");
  // ZeRO-1 reduce-scatters in the gradient buckets themselves, so it saves
  // 3/4 of AdamW's two moments (2 W).
  const double quarter = 0.75 * weights_mib;
  CHECK(peak["optimizer"] < peak["none"] - 0.5 * 2 * quarter);
  // ZeRO-2 trades the whole gradients for their slice plus two
  // reduce-scatter slots of the largest block (here a fifth of the model each).
  CHECK(peak["gradients"] < peak["optimizer"]);
  CHECK(peak["parameters"] < peak["gradients"] - 0.5 * quarter);
  CHECK(peak["parameters"] < peak["none"] - 0.5 * 4 * quarter);
}

TEST_CASE("fsdp: a GPT over a rank's memory limit trains under ZeRO-3 on 4 ranks",
          "[parallel][mp][fsdp]") {
  // GPT 6 x 512 with AdamW (72 MiB of weights): unsharded, a rank's tensors
  // take 270 MiB of the allocator's (and 72 MiB of shared buckets); under
  // ZeRO-3 on 4 ranks about 160 MiB.
  auto args = [](const std::string& out, const char* shard) {
    return gpt_args(out, {"model.d_model=512", "model.n_layer=6", "model.n_head=8",
                          "training.global_batch=4", "training.steps=2", "optimizer.name=adamw",
                          "training.memory_limit_mb=220", cat("parallel.shard=", shard)});
  };
  ProcessResult whole = run_ranks(4, args(run_dir("limit_none"), "none"));
  INFO(whole.output);
  CHECK(whole.code != 0);
  CHECK(contains(whole.output, "passes this rank's limit of 220.0 MiB (training.memory_limit_mb)"));
  // Evaluates and checkpoints every step, the checkpoints written
  // synchronously (an asynchronous one stages a copy of the shards): the
  // evaluation gathers unit by unit, each rank writes its shards where they
  // lie; a gathered copy of the model, 72 MiB more, would pass the limit.
  std::vector<std::string> sharded_args = args(run_dir("limit_zero3"), "parameters");
  sharded_args.insert(sharded_args.end(),
                      {"training.checkpoint_every=1", "training.async_checkpoint=false",
                       "training.eval_every=1", "data.val_windows=8"});
  ProcessResult sharded = trained(4, sharded_args);
  CHECK(contains(sharded.output, "checkpoint"));
  CHECK(peak_tensor_mib(sharded.output) < 220);
}

TEST_CASE("fsdp: what the shard modes refuse, by key", "[parallel][fsdp]") {
  struct Refusal {
    std::vector<std::string> keys;
    const char* says;
  };
  for (const Refusal& r :
       {Refusal{{"parallel.dp=4", "parallel.dp_replicate=2"},
                "parallel.dp_replicate = 2 with parallel.shard = none: replica groups"},
        Refusal{{"parallel.dp=4", "parallel.dp_replicate=3", "parallel.shard=parameters"},
                "parallel.dp_replicate = 3 with dp = 4: hybrid sharding needs groups of at "
                "least 2 ranks that divide the dp ranks"},
        Refusal{{"parallel.dp=2", "parallel.shard=parameters", "parallel.param_dtype=bf16"},
                "parallel.param_dtype = bf16 with parallel.shard = parameters and precision "
                "fp32"},
        Refusal{{"parallel.dp=2", "parallel.shard=optimizer", "parallel.reduce_dtype=bf16"},
                "parallel.reduce_dtype = bf16 with parallel.shard = optimizer: gradients are "
                "reduced in bf16 when they are sharded"},
        Refusal{{"parallel.shard=all"},
                "'parallel.shard' = 'all' is not one of: none, optimizer, gradients, "
                "parameters"}}) {
    std::vector<std::string> args{"train", kRecipes + "gpt_kjv.yaml"};
    args.insert(args.end(), r.keys.begin(), r.keys.end());
    args.push_back("--dry-run");
    ProcessResult p = run_ranks(1, args);
    INFO(p.output);
    CHECK(p.code != 0);
    CHECK(contains(p.output, r.says));
  }
}
