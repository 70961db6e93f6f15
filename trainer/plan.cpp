#include "trainer/plan.h"

#include <yaml-cpp/yaml.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "data/files.h"
#include "data/token_shards.h"
#include "models/llama.h"
#include "parallel/pipeline_sim.h"
#include "parallel/schedule.h"
#include "trainer/cluster_file.h"
#include "trainer/model_setup.h"
#include "trainer/numbers.h"
#include "trainer/plan_parts.h"
#include "trainer/recipe.h"
#include "trainer/safetensors.h"

namespace trainer {

std::string plan_number(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", value);
  return text;
}

namespace {

// Widest swimlane before its cells grow: one terminal screen or two.
constexpr int kMaxSwimlaneCells = 160;

// The bounds of the options, those of the recipe keys they stand for
// (parallel.pp, parallel.micro_batches, parallel.virtual_stages; the
// schedule's size is bounded by make_schedule), the cluster file's per_node,
// and a stage time of a day.
constexpr int kMaxStages = 4096;
constexpr int kMaxMicroBatches = 65536;
constexpr int kMaxChunks = 1024;
constexpr double kMaxStageMs = 86400e3;
constexpr int kMaxPlanNodes = 65536;
constexpr int kMaxPerNode = 1024;
// The largest cluster planned: every layout of it is scored in well under a
// second (bench_planner); the biggest training clusters have about 1e5 GPUs.
constexpr int64_t kMaxPlanWorld = 1 << 17;

// An output file the user named: refused early when it is a directory or
// its directory does not exist, so that nothing is left behind.
void check_output_file(const std::string& path, const char* option) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (fs::is_directory(path, error))
    throw Error(cat(option, " ", path, " is a directory; give a file name, e.g. ",
                    (fs::path(path) / "plan.json").string()));
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty() && !fs::is_directory(parent, error))
    throw Error(cat(option, " ", path, ": the directory ", parent.string(), " does not exist"));
}

std::string percent(double fraction) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f%%", 100.0 * fraction);
  return text;
}

std::string joined(const std::vector<double>& values) {
  std::string out;
  for (double v : values) {
    if (!out.empty()) out += ',';
    out += plan_number(v);
  }
  return out;
}

// A flag's times per stage: one value (every stage) or one per stage, each >= 0.
std::vector<double> stage_times(const std::vector<double>& given, double fallback, int stages,
                                const char* flag) {
  if (given.empty()) return {fallback};
  if (given.size() != 1 && int(given.size()) != stages)
    throw Error(cat(flag, " has ", given.size(), " values for ", stages,
                    " stages; give 1 (every stage) or ", stages, ", separated by commas"));
  for (double v : given)
    if (!(v >= 0) || !std::isfinite(v))
      throw Error(cat(flag, ": ", v, " is not a time in milliseconds >= 0"));
  return given;
}

// The smallest compute action's time, so each shows as at least one cell.
double swimlane_unit(const parallel::Schedule& schedule, const parallel::SimResult& result) {
  double unit = result.step_time;
  for (size_t stage = 0; stage < schedule.stages.size(); ++stage)
    for (const parallel::ActionTime& t : result.times[stage])
      if (t.end > t.start) unit = std::min(unit, t.end - t.start);
  if (unit <= 0) return 1.0;
  return std::max(unit, result.step_time / kMaxSwimlaneCells);
}

}  // namespace

CLI::App* add_plan_command(CLI::App& app, PlanArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "draw and time a pipeline schedule: swimlane, step time, bubble, memory; with --nodes, "
      "rank the dp x pp x tp plans of a cluster");
  cmd->add_option("recipe", args.recipe, "recipe YAML file (its parallel section gives defaults)");
  cmd->add_option("overrides", args.overrides, "key=value overrides of recipe keys");
  cmd->add_option("--pp", args.pp, "pipeline stages P (default: parallel.pp)")
      ->check(integer_in(1, kMaxStages));
  cmd->add_option("--micro-batches", args.micro_batches,
                  "micro-batches M per step (default: parallel.micro_batches)")
      ->check(integer_in(1, kMaxMicroBatches));
  cmd->add_option("--schedule", args.schedule,
                  "gpipe, 1f1b, interleaved or zbh1 (default: parallel.schedule)");
  cmd->add_option("--chunks", args.chunks,
                  "model chunks V per stage, for interleaved (default: the recipe's "
                  "parallel.virtual_stages, at least 2)")
      ->check(integer_in(1, kMaxChunks));
  cmd->add_option("--fwd-ms", args.fwd_ms,
                  "forward time of one micro-batch through a stage, ms: one value, or one per "
                  "stage separated by commas (default: 1)")
      ->delimiter(',')
      ->check(number_in(0, kMaxStageMs));
  cmd->add_option("--bwd-ms", args.bwd_ms,
                  "backward time of one micro-batch through a stage, ms: one value, or one per "
                  "stage separated by commas (default: 2)")
      ->delimiter(',')
      ->check(number_in(0, kMaxStageMs));
  cmd->add_option("--trace", args.trace, "write the simulated timeline as a Chrome trace here");
  cmd->add_option("--nodes", args.nodes,
                  "plan the whole cluster: nodes N (ranks every dp x pp x tp layout)")
      ->check(integer_in(1, kMaxPlanNodes));
  cmd->add_option("--per-node", args.per_node, "GPUs per node G (default: the device's, 8)")
      ->check(integer_in(1, kMaxPerNode));
  cmd->add_option("--device", args.device,
                  "a100-40gb, a100-80gb (default) or h100-80gb (with --nodes)");
  cmd->add_option("--cluster", args.cluster,
                  "YAML file describing the device and links (docs/planner.md)");
  cmd->add_option("--top", args.top, "rows of the ranked plan table (default 10)")
      ->check(integer_in(1, 1000000));
  cmd->add_option("--format", args.format,
                  "table (default) or tsv: every ranked plan, one tab-separated line each")
      ->check(CLI::IsMember({"table", "tsv"}));
  cmd->add_flag("--calibrate", args.calibrate,
                "measure p2p and allreduce between 2 local ranks and print them as a cluster "
                "file (--device cpu)");
  cmd->add_option("--out", args.out, "with --calibrate: write the cluster file here");
  cmd->add_flag("--calibrate-rank", args.calibrate_rank)->group("");  // a rank of --calibrate
  return cmd;
}

std::string plan_report(const PlanArgs& args, bool* found) {
  if (found) *found = true;
  if (args.nodes > 0) return cluster_plan_report(args, found);
  if (args.per_node > 0 || !args.device.empty() || !args.cluster.empty())
    throw Error("--per-node, --device and --cluster plan a cluster: give --nodes N too");
  const Recipe recipe = load_recipe(args.recipe, args.overrides);
  const int stages = args.pp > 0 ? args.pp : int(recipe.parallel.pp);
  const std::string name = args.schedule.empty() ? recipe.parallel.schedule : args.schedule;
  const int chunks = args.chunks > 0                      ? args.chunks
                     : name != "interleaved"              ? 1
                     : recipe.parallel.virtual_stages > 1 ? int(recipe.parallel.virtual_stages)
                                                          : 2;
  // The recipe's count, or what a run of this pipeline would choose (auto).
  Recipe pipeline = recipe;
  pipeline.parallel.pp = stages;
  pipeline.parallel.schedule = name;
  pipeline.parallel.virtual_stages = chunks;
  const int micro_batches =
      args.micro_batches > 0
          ? args.micro_batches
          : int(resolved_micro_batches(pipeline, std::max<int64_t>(1, recipe.parallel.dp)));
  const parallel::Schedule schedule = parallel::make_schedule(name, stages, micro_batches, chunks);

  const std::vector<double> fwd = stage_times(args.fwd_ms, 1.0, stages, "--fwd-ms");
  const std::vector<double> bwd = stage_times(args.bwd_ms, 2.0, stages, "--bwd-ms");
  parallel::PipelineCosts costs;
  costs.forward.clear();
  costs.backward.clear();
  for (double t : fwd) costs.forward.push_back(t / schedule.chunks);
  for (double t : bwd) costs.backward.push_back(t / schedule.chunks);
  const parallel::SimResult result = parallel::simulate(schedule, costs);

  bool split = false;
  for (const std::vector<parallel::Action>& actions : schedule.stages)
    for (const parallel::Action& a : actions)
      split = split || a.kind == parallel::ActionKind::backward_input;

  std::string out = cat("schedule ", schedule.name, ": P=", stages, " stages, M=", micro_batches,
                        " micro-batches, V=", schedule.chunks, " chunks per stage\n");
  out += cat("forward ", joined(fwd), " ms, backward ", joined(bwd), " ms per micro-batch",
             fwd.size() == 1 && bwd.size() == 1 ? " on every stage" : " by stage");
  if (schedule.chunks > 1) out += cat(" (1/", schedule.chunks, " per chunk)");
  if (split) out += "; backward split in halves: input (I) and weight (W)";
  out += "\n\n";
  const double unit = swimlane_unit(schedule, result);
  out += cat("one cell = ", plan_number(unit), " ms\n");
  out += parallel::swimlane_text(schedule, result, unit);
  out += cat("\nstep time ", plan_number(result.step_time), " ms (without bubble ",
             plan_number(result.ideal_time), " ms)\n");
  out += cat("bubble ", percent(result.bubble_fraction()), " of the stages' time (",
             percent(result.bubble_over_ideal()), " over the time without bubble)\n");
  const std::vector<int> until_weight =
      parallel::peak_in_flight(schedule, parallel::InFlightUntil::backward_weight);
  out += cat("stage  busy    peak in flight", split ? "  (until W)" : "", "\n");
  for (int stage = 0; stage < stages; ++stage) {
    char line[96];
    std::snprintf(line, sizeof line, "%-6d %-7s %-15d", stage,
                  percent(result.busy[size_t(stage)]).c_str(),
                  result.peak_in_flight[size_t(stage)]);
    std::string row = line;
    if (split) row += cat(" (", until_weight[size_t(stage)], ")");
    out += row.erase(row.find_last_not_of(' ') + 1) + "\n";
  }
  if (!args.trace.empty()) {
    check_output_file(args.trace, "--trace");
    write_file_atomic(args.trace, parallel::chrome_trace_json(schedule, result));
    out += cat("trace written to ", args.trace, " (ui.perfetto.dev opens it)\n");
  }
  return out;
}

namespace {

// The cluster planner's device when neither --device nor a cluster file names one.
constexpr const char* kDefaultDevice = "a100-80gb";

// Planning a text recipe whose vocabulary the data would give.
constexpr int64_t kDefaultPlanningVocab = 50257;  // GPT-2's BPE

int64_t planning_vocab(const Recipe& recipe, std::vector<std::string>* notes) {
  if (recipe.model.vocab_size > 0) return recipe.model.vocab_size;
  int64_t vocab = kDefaultPlanningVocab;
  std::string why = "the data's tokenizer";
  // data.vocab is text's; a token directory's tokenizer gives its own size.
  const bool text = recipe.data.name != "tokens";
  if (text && (recipe.data.vocab == "byte" || recipe.data.vocab == "char")) {
    vocab = 256;
    why = recipe.data.vocab == "byte" ? "one id per byte" : "at most one id per distinct byte";
  } else if (!text) {
    try {
      vocab = data::open_token_directory(recipe.data.path).tokenizer->size();
      why = cat("the tokenizer of ", recipe.data.path);
    } catch (const Error& e) {
      why = cat("GPT-2's BPE: ", recipe.data.path, " could not be read: ", e.what());
    }
  }
  notes->push_back(cat("vocabulary from the data: planned with V=", vocab, " (", why,
                       "; set model.vocab_size to plan another)"));
  return vocab;
}

}  // namespace

parallel::ModelDesc model_for_planning(const Recipe& recipe, std::vector<std::string>* notes) {
  const ModelRecipe& model = recipe.model;
  const std::string& name = model.name;
  const int64_t sequence = window_tokens(recipe);
  if (name == "gpt")
    return parallel::gpt_model({.n_layer = model.n_layer,
                                .n_head = model.n_head,
                                .d_model = model.d_model,
                                .context = sequence,
                                .vocab = planning_vocab(recipe, notes),
                                .pad_vocab_to = 1,
                                .tie_weights = model.tie_weights,
                                .experts = model.moe.experts,
                                .top_k = model.moe.top_k,
                                .moe_hidden = model.moe.hidden,
                                .moe_every = model.moe.every_n_layers});
  if (name == "llama") {
    const int64_t kv = model.num_key_value_heads > 0 ? model.num_key_value_heads : model.n_head;
    return parallel::llama_model({.n_layer = model.n_layer,
                                  .n_head = model.n_head,
                                  .n_kv_head = kv,
                                  .d_model = model.d_model,
                                  .intermediate = model.intermediate_size > 0
                                                      ? model.intermediate_size
                                                      : llama_intermediate_size(model.d_model),
                                  .context = sequence,
                                  .vocab = planning_vocab(recipe, notes),
                                  .tie_weights = model.tie_weights});
  }
  if (name == "lstm_lm")
    return parallel::lstm_lm_model(planning_vocab(recipe, notes), model.d_model, model.hidden,
                                   model.n_layer, sequence, model.tie_weights);
  if (name == "mlp")
    return parallel::mlp_model(recipe.data.image_size * recipe.data.image_size * model.in_channels,
                               {256, 128}, model.num_classes);
  if (name == "small_cnn")
    return parallel::small_cnn_model(model.in_channels, recipe.data.image_size, model.num_classes);
  if (name.rfind("resnet", 0) == 0) {
    const bool small = name.size() > 6 && name.find("_small") != std::string::npos;
    return parallel::resnet_model({.depth = std::stoi(name.substr(6)),
                                   .num_classes = model.num_classes,
                                   .in_channels = model.in_channels,
                                   .image_size = recipe.data.image_size,
                                   .small = small});
  }
  throw Error(cat("model.name '", name, "': the planner has no cost model for it"));
}

namespace {

// One line per ranked plan, tab-separated, times in seconds: what a
// benchmark reads to run the same layouts.
std::string plan_tsv(const parallel::PlanResult& result) {
  std::string out =
      "# dp\tpp\ttp\tM\tb\tschedule\tchunks\tzero\trecompute\tstep_s\tcompute_s\tbubble_s\ttp_s\t"
      "pp_s\t"
      "dp_s\toptimizer_s\tstage_starts\n";
  for (const parallel::Plan& plan : result.ranked) {
    const parallel::StepTerms& t = plan.terms;
    std::string starts;
    for (size_t s = 1; s < plan.stage_starts.size(); ++s)
      starts += cat(s > 1 ? "," : "", plan.stage_starts[s]);
    out += cat(plan.dp, "\t", plan.pp, "\t", plan.tp, "\t", plan.micro_batches, "\t",
               plan.micro_batch_size, "\t", plan.schedule, "\t", plan.chunks, "\t", plan.zero, "\t",
               parallel::to_string(plan.recompute), "\t", plan_number(t.total()), "\t",
               plan_number(t.compute), "\t", plan_number(t.bubble), "\t", plan_number(t.tp_comm),
               "\t", plan_number(t.pp_comm), "\t", plan_number(t.dp_exposed), "\t",
               plan_number(t.optimizer), "\t", starts.empty() ? "-" : starts, "\n");
  }
  return out;
}

}  // namespace

std::string cluster_plan_report(const PlanArgs& args, bool* found) {
  const bool cpu = args.device == parallel::kCpuDevice;
  const Recipe recipe = cpu ? with_data_vocabulary(load_recipe(args.recipe, args.overrides))
                            : load_recipe(args.recipe, args.overrides);
  std::vector<std::string> notes;
  const parallel::ModelDesc model = model_for_planning(recipe, &notes);
  parallel::ClusterSpec cluster =
      cpu ? this_machine_cluster(args.nodes, args.per_node)
          : parallel::cluster_for(args.device.empty() ? kDefaultDevice : args.device, args.nodes,
                                  args.per_node);
  if (!args.cluster.empty()) {
    cluster = load_cluster_file(args.cluster, cluster);
    if (args.per_node > 0) cluster.per_node = args.per_node;
  }
  checked_product(cluster.nodes, cluster.per_node, kMaxPlanWorld,
                  "the cluster's GPUs (--nodes x --per-node)");
  std::unique_ptr<parallel::BlockTimer> timer;
  parallel::PlanRequest request;
  if (cpu) {
    request = cpu_plan_request(recipe, model, cluster, &timer, &notes);
  } else {
    request = {.cluster = cluster, .global_batch = recipe.training.global_batch};
    request.precision = recipe.precision;
    request.bucket_mb = double(recipe.parallel.bucket_mb);
    const double peak_scale = request.precision == "fp32" ? 0.5 : 1.0;
    timer = std::make_unique<parallel::FlopBlockTimer>(cluster.device, peak_scale);
  }
  const parallel::PlanResult result = parallel::plan_cluster(model, request, *timer);
  if (found) *found = !result.ranked.empty();
  if (args.format == "tsv") return plan_tsv(result);

  std::string out =
      cat("model ", model.name, ": ", plan_number(model.params() / 1e6), "M parameters, ",
          plan_number(model.forward_flops() / 1e9), " GFLOP forward per sample\n");
  for (const std::string& note : notes) out += note + "\n";
  const std::string device =
      cpu ? cat(" cpu ranks (one core each, ", plan_number(cluster.device.memory_gib), " GiB)")
          : cat(" ", cluster.device.name, " (", plan_number(cluster.device.peak_tflops),
                " TFLOP/s bf16, ", plan_number(cluster.device.memory_gib), " GiB)");
  const std::string p2p = cluster.intra_p2p.gbps > 0
                              ? cat(" (p2p ", plan_number(cluster.intra_p2p.gbps), " Gb/s + ",
                                    plan_number(cluster.intra_p2p.alpha_us), " us)")
                              : "";
  out += cat("cluster: ", cluster.nodes, " nodes x ", cluster.per_node, device, "; intra-node ",
             plan_number(cluster.intra.gbps), " Gb/s + ", plan_number(cluster.intra.alpha_us),
             " us", p2p, ", inter-node ", plan_number(cluster.inter.gbps), " Gb/s + ",
             plan_number(cluster.inter.alpha_us), " us\n");
  out += cat("compute: ", timer->describe(), "; global batch ", request.global_batch,
             model.language_model ? " sequences, " : " samples, ", "precision ", request.precision,
             "\n\n");
  out += parallel::plan_table(result, args.top, model);
  if (!result.ranked.empty())
    out += cat("\nbest plan as recipe overrides:\n  ", parallel::plan_overrides(result.ranked[0]),
               "\n");
  return out;
}

int plan_command(const PlanArgs& args) {
  if (args.calibrate_rank) return calibrate_rank(args);
  if (args.calibrate) return calibrate_command(args);
  if (args.recipe.empty()) throw Error("trainer plan: give a recipe (or --calibrate)");
  bool found = true;
  std::fputs(plan_report(args, &found).c_str(), stdout);
  if (!found)
    throw Error(cat("trainer plan: no layout of ", args.nodes,
                    " nodes fits the recipe (the reasons "
                    "are above); give more nodes or memory, or a smaller model or batch"));
  return 0;
}

}  // namespace trainer
