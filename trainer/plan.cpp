#include "trainer/plan.h"

#include <yaml-cpp/yaml.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <sched.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include "comm/bootstrap.h"
#include "comm/collectives.h"
#include "core/check.h"
#include "core/cpu/threads.h"
#include "data/files.h"
#include "parallel/pipeline_sim.h"
#include "parallel/schedule.h"
#include "parallel/tensor_parallel.h"
#include "trainer/pipeline_split.h"
#include "trainer/recipe.h"
#include "trainer/safetensors.h"
#include "trainer/session.h"

namespace trainer {

namespace {

// Widest swimlane before its cells grow: one terminal screen or two.
constexpr int kMaxSwimlaneCells = 160;

std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", value);
  return text;
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
    out += number(v);
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
      ->check(CLI::PositiveNumber);
  cmd->add_option("--micro-batches", args.micro_batches,
                  "micro-batches M per step (default: parallel.micro_batches)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--schedule", args.schedule,
                  "gpipe, 1f1b, interleaved or zbh1 (default: parallel.schedule)");
  cmd->add_option("--chunks", args.chunks,
                  "model chunks V per stage, for interleaved (default: the recipe's "
                  "parallel.virtual_stages, at least 2)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--fwd-ms", args.fwd_ms,
                  "forward time of one micro-batch through a stage, ms: one value, or one per "
                  "stage separated by commas (default: 1)")
      ->delimiter(',');
  cmd->add_option("--bwd-ms", args.bwd_ms,
                  "backward time of one micro-batch through a stage, ms: one value, or one per "
                  "stage separated by commas (default: 2)")
      ->delimiter(',');
  cmd->add_option("--trace", args.trace, "write the simulated timeline as a Chrome trace here");
  cmd->add_option("--nodes", args.nodes,
                  "plan the whole cluster: nodes N (ranks every dp x pp x tp layout)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--per-node", args.per_node, "GPUs per node G (default: the device's, 8)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--device", args.device,
                  "a100-40gb, a100-80gb (default) or h100-80gb (with --nodes)");
  cmd->add_option("--cluster", args.cluster,
                  "YAML file describing the device and links (docs/planner.md)");
  cmd->add_option("--top", args.top, "rows of the ranked plan table (default 10)")
      ->check(CLI::PositiveNumber);
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

std::string plan_report(const PlanArgs& args) {
  if (args.nodes > 0) return cluster_plan_report(args);
  if (args.per_node > 0 || !args.device.empty() || !args.cluster.empty())
    throw Error("--per-node, --device and --cluster plan a cluster: give --nodes N too");
  const Recipe recipe = load_recipe(args.recipe, args.overrides);
  const int stages = args.pp > 0 ? args.pp : int(recipe.parallel.pp);
  const int micro_batches =
      args.micro_batches > 0 ? args.micro_batches : int(recipe.parallel.micro_batches);
  const std::string name = args.schedule.empty() ? recipe.parallel.schedule : args.schedule;
  const int chunks = args.chunks > 0                      ? args.chunks
                     : name != "interleaved"              ? 1
                     : recipe.parallel.virtual_stages > 1 ? int(recipe.parallel.virtual_stages)
                                                          : 2;
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
  out += cat("one cell = ", number(unit), " ms\n");
  out += parallel::swimlane_text(schedule, result, unit);
  out += cat("\nstep time ", number(result.step_time), " ms (without bubble ",
             number(result.ideal_time), " ms)\n");
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
  if (recipe.data.vocab == "byte" || recipe.data.vocab == "char") {
    vocab = 256;
    why = recipe.data.vocab == "byte" ? "one id per byte" : "at most one id per distinct byte";
  }
  notes->push_back(cat("vocabulary from the data: planned with V=", vocab, " (", why,
                       "; set model.vocab_size to plan another)"));
  return vocab;
}

}  // namespace

parallel::ModelDesc model_for_planning(const Recipe& recipe, std::vector<std::string>* notes) {
  const ModelRecipe& model = recipe.model;
  const std::string& name = model.name;
  const int64_t sequence = recipe.data.seq_len > 0 ? recipe.data.seq_len : model.context;
  if (name == "gpt")
    return parallel::gpt_model({.n_layer = model.n_layer,
                                .n_head = model.n_head,
                                .d_model = model.d_model,
                                .context = sequence,
                                .vocab = planning_vocab(recipe, notes),
                                .pad_vocab_to = 1,
                                .tie_weights = model.tie_weights});
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

double positive_number(const YAML::Node& value, const std::string& where, const std::string& key) {
  double number = 0;
  bool ok = value.IsScalar();
  if (ok) {
    try {
      number = value.as<double>();
    } catch (const YAML::Exception&) {
      ok = false;
    }
  }
  if (!ok || !(number > 0) || !std::isfinite(number))
    throw Error(cat(where, ": key '", key, "' expects a number > 0, got ",
                    value.IsScalar() ? "'" + value.Scalar() + "'" : "a map or list"));
  return number;
}

}  // namespace

parallel::ClusterSpec load_cluster_file(const std::string& path, parallel::ClusterSpec base) {
  // Refuses a FIFO, a device or a directory before reading (data/files.h).
  const std::string text = data::read_regular_file(path, "the cluster file (--cluster)", 1 << 24);
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw Error(cat(path, ":", e.mark.line + 1, ": YAML syntax error: ", e.msg));
  }
  if (root.IsNull()) return base;
  if (!root.IsMap()) throw Error(cat(path, ": a cluster file is a YAML map of keys"));
  const char* const kKeys =
      "device, peak_tflops, memory_gib, per_node, achievable, intra.alpha_us, intra.gbps, "
      "inter.alpha_us, inter.gbps, p2p.alpha_us, p2p.gbps";
  auto where = [&](const YAML::Node& node) {
    return node.Mark().line >= 0 ? cat(path, ":", node.Mark().line + 1) : path;
  };
  auto unknown = [&](const YAML::Node& node, const std::string& key) {
    return Error(cat(where(node), ": unknown key '", key, "'; the keys are ", kKeys));
  };
  // The device first: the other keys change its figures.
  if (const YAML::Node device = root["device"]) {
    if (!device.IsScalar())
      throw Error(cat(where(device), ": key 'device' expects a device name, e.g. h100-80gb"));
    const int nodes = base.nodes, per_node = base.per_node;
    // A CPU cluster's figures come from this machine (this_machine_cluster).
    if (device.Scalar() != parallel::kCpuDevice || base.device.name != parallel::kCpuDevice) {
      base = parallel::cluster_for(device.Scalar(), nodes);
      base.per_node = per_node;
    }
  }
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string key = it->first.as<std::string>();
    const YAML::Node& value = it->second;
    const std::string at = where(it->first);
    if (key == "device") continue;
    if (key == "peak_tflops") {
      base.device.peak_tflops = positive_number(value, at, key);
    } else if (key == "memory_gib") {
      base.device.memory_gib = positive_number(value, at, key);
    } else if (key == "per_node") {
      const double per_node = positive_number(value, at, key);
      if (per_node != std::floor(per_node) || per_node > 1024)
        throw Error(cat(at, ": key 'per_node' expects a whole number of GPUs, got ", per_node));
      base.per_node = int(per_node);
    } else if (key == "achievable") {
      base.device.achievable = std::min(1.0, positive_number(value, at, key));
    } else if (key == "intra" || key == "inter" || key == "p2p") {
      parallel::LinkSpec& link = key == "intra"   ? base.intra
                                 : key == "inter" ? base.inter
                                                  : base.intra_p2p;
      if (!value.IsMap()) throw Error(cat(at, ": key '", key, "' expects a map {alpha_us, gbps}"));
      for (auto field = value.begin(); field != value.end(); ++field) {
        const std::string name = field->first.as<std::string>();
        const std::string full = key + "." + name;
        const std::string field_at = where(field->first);
        if (name == "alpha_us")
          link.alpha_us = positive_number(field->second, field_at, full);
        else if (name == "gbps")
          link.gbps = positive_number(field->second, field_at, full);
        else
          throw unknown(field->first, full);
      }
    } else {
      throw unknown(it->first, key);
    }
  }
  base.device.name = root["device"] ? base.device.name : base.device.name + " (cluster file)";
  return base;
}

namespace {

// Process-private memory a CPU rank needs beyond the model: the binary,
// oneDNN's scratch pads, the data loader, the allocator's slack.
constexpr double kCpuWorkspaceGib = 0.25;
// The median of this many optimizer steps, after one that allocates
// AdamW's moments.
constexpr int kOptimizerRepeats = 3;

std::vector<int> divisors_of(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

// Every micro-batch size the plans of `world` ranks at this tp can take.
std::set<int64_t> micro_batch_sizes(int64_t global_batch, int world, int tp) {
  std::set<int64_t> sizes;
  for (int pp : divisors_of(world / tp)) {
    const int dp = world / tp / pp;
    if (global_batch % dp != 0) continue;
    const int64_t per_replica = global_batch / dp;
    for (int64_t m = 1; m <= per_replica; ++m)
      if (per_replica % m == 0) sizes.insert(per_replica / m);
  }
  return sizes;
}

// The sizes to profile: the smallest, the largest and one between
// (geometrically), interpolated between for the rest.
std::vector<int64_t> sizes_to_profile(const std::set<int64_t>& needed) {
  if (needed.size() <= 3) return {needed.begin(), needed.end()};
  const int64_t lo = *needed.begin(), hi = *needed.rbegin();
  const double mid = std::sqrt(double(lo) * double(hi));
  int64_t between = lo;
  for (int64_t b : needed)
    if (std::fabs(std::log(double(b) / mid)) < std::fabs(std::log(double(between) / mid)))
      between = b;
  std::vector<int64_t> out{lo};
  if (between != lo && between != hi) out.push_back(between);
  out.push_back(hi);
  return out;
}

// The recipe as one process training micro-batches of `samples`.
Recipe one_process_recipe(Recipe recipe, int64_t samples) {
  recipe.training.global_batch = samples;
  recipe.training.grad_accum = 1;
  recipe.parallel.dp = 1;
  recipe.parallel.pp = 1;
  recipe.parallel.tp = 1;
  recipe.parallel.micro_batches = 1;
  recipe.parallel.virtual_stages = 1;
  recipe.parallel.stages = "even";
  recipe.parallel.zero1 = false;
  return recipe;
}

// Each block's median over kProfileRepeats passes after a warm-up one (which
// builds oneDNN's primitives): a training run's step is a median too, and
// the best of a few passes is the one no other process disturbed.
constexpr int kProfileRepeats = 3;

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

parallel::MeasuredProfile profile_session(Session& session, const Recipe& recipe, int tp,
                                          int64_t samples) {
  const DType autocast = recipe.precision == "bf16" ? DType::bf16 : DType::f32;
  profile_blocks(session, autocast, 1);
  std::vector<BlockProfile> passes;
  for (int rep = 0; rep < kProfileRepeats; ++rep)
    passes.push_back(profile_blocks(session, autocast, 1));
  parallel::MeasuredProfile out{.tp = tp, .samples = samples, .blocks = {}};
  for (size_t i = 0; i < passes[0].forward_ms.size(); ++i) {
    std::vector<double> forward, backward;
    for (const BlockProfile& pass : passes) {
      forward.push_back(pass.forward_ms[i] * 1e-3);
      backward.push_back(pass.backward_ms[i] * 1e-3);
    }
    out.blocks.push_back({median_of(forward), median_of(backward)});
  }
  return out;
}

// The optimizer step over the whole model, per parameter.
double optimizer_seconds_per_param(Session& session) {
  for (const Tensor& p : session.model().parameters()) p.set_grad(zeros_like(p));
  session.optimizer().step();
  std::vector<double> seconds;
  for (int rep = 0; rep < kOptimizerRepeats; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    session.optimizer().step();
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return median_of(seconds) / double(std::max<int64_t>(1, session.model().num_parameters()));
}

}  // namespace

namespace {

// Binds this process to one core (as `trainer launch` binds a rank); false
// when the core is not ours to take.
bool bind_to_core(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  return sched_setaffinity(0, sizeof set, &set) == 0;
}

// The processes keeping the other ranks' cores busy while this one
// profiles: stopped, and this process's binding and thread count restored,
// however the profile ends. They die with this process too.
class Companions {
 public:
  Companions(const Recipe& recipe, int world, int per_node) {
    sched_getaffinity(0, sizeof affinity_, &affinity_);
    threads_ = num_threads();
    const std::vector<int> cores = allowed_cores();
    const int count = std::min<int>(std::min(world, per_node), int(cores.size())) - 1;
    for (int k = 1; k <= count; ++k) {
      std::fflush(nullptr);
      const pid_t pid = fork();
      if (pid == 0) run(recipe, world, cores[size_t(k)]);
      if (pid > 0) children_.push_back(pid);
    }
    if (count > 0) bind_to_core(cores[0]);
  }
  ~Companions() {
    for (pid_t pid : children_) {
      kill(pid, SIGTERM);
      waitpid(pid, nullptr, 0);
    }
    set_num_threads(threads_);
    sched_setaffinity(0, sizeof affinity_, &affinity_);
  }
  Companions(const Companions&) = delete;
  Companions& operator=(const Companions&) = delete;

 private:
  // A companion: the largest micro-batch's blocks and optimizer, over and over.
  [[noreturn]] static void run(const Recipe& recipe, int world, int core) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    bind_to_core(core);
    set_num_threads(recipe.training.threads > 0 ? int(recipe.training.threads) : 1);
    try {
      const int64_t samples = *micro_batch_sizes(recipe.training.global_batch, world, 1).rbegin();
      const Recipe one = one_process_recipe(recipe, samples);
      Session session(one, rank_layout(parallel_layout(one, 1), 0), DataAccess::assume_if_missing);
      for (;;) {
        profile_session(session, one, 1, samples);
        optimizer_seconds_per_param(session);
      }
    } catch (...) {
    }
    _exit(1);  // the profile itself reports the error
  }

  std::vector<pid_t> children_;
  cpu_set_t affinity_;
  int threads_ = 1;
};

}  // namespace

CpuProfile profile_for_cpu_plans(const Recipe& recipe, const parallel::ModelDesc& model, int world,
                                 int per_node) {
  const auto start = std::chrono::steady_clock::now();
  // The ranks of a plan share this host's memory bandwidth and caches (on a
  // VM perhaps one physical core's two threads): a rank alone runs its
  // blocks 25-45% faster than next to its peers (docs/planner.md). So the
  // other ranks' cores run the same kind of work meanwhile, in processes
  // forked before any thread pool exists, each bound to its core.
  const Companions companions(recipe, world, per_node);
  // The ranks of a CPU plan run one thread each (or the recipe's count).
  set_num_threads(recipe.training.threads > 0 ? int(recipe.training.threads) : 1);
  CpuProfile out;
  try {
    const bool splits = model.n_head > 0 || model.tp_channels > 0;
    for (int tp : divisors_of(std::min(world, per_node))) {
      if (tp > 1 && (!splits || per_node % tp != 0)) continue;
      for (int64_t samples :
           sizes_to_profile(micro_batch_sizes(recipe.training.global_batch, world, tp))) {
        Recipe one = one_process_recipe(recipe, samples);
        // As the planner's tp: with sequence parallelism for Transformers.
        const bool sequence_parallel = tp > 1 && model.n_head > 0;
        one.parallel.sequence_parallel = sequence_parallel;
        Session session(one, rank_layout(parallel_layout(one, 1), 0),
                        DataAccess::assume_if_missing);
        if (tp == 1 && out.optimizer_seconds_per_param == 0) {
          out.profiles.push_back(profile_session(session, one, tp, samples));
          out.optimizer_seconds_per_param = optimizer_seconds_per_param(session);
          continue;
        }
        if (tp > 1) {
          try {
            // Rank 0's part of the split model, its collectives moving nothing.
            session.set_tensor_parallel(parallel::shape_only_group(0, tp, sequence_parallel));
          } catch (const Error&) {
            break;  // the model does not split tp ways: plan_cluster says why
          }
        }
        out.profiles.push_back(profile_session(session, one, tp, samples));
      }
    }
  } catch (const Error& e) {
    throw Error(
        cat("--device cpu times the model's blocks on this machine, which needs the "
            "recipe's data: ",
            e.what()));
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

parallel::ClusterSpec this_machine_cluster(int nodes, int per_node) {
  if (per_node <= 0) per_node = std::max<int>(1, int(allowed_cores().size()));
  const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  return parallel::cpu_cluster(nodes, per_node, ram / (1024.0 * 1024.0 * 1024.0));
}

namespace {

// One line per ranked plan, tab-separated, times in seconds: what a
// benchmark reads to run the same layouts.
std::string plan_tsv(const parallel::PlanResult& result) {
  std::string out =
      "# dp\tpp\ttp\tM\tb\tschedule\tchunks\tzero1\tstep_s\tcompute_s\tbubble_s\ttp_s\tpp_s\t"
      "dp_s\toptimizer_s\tstage_starts\n";
  for (const parallel::Plan& plan : result.ranked) {
    const parallel::StepTerms& t = plan.terms;
    std::string starts;
    for (size_t s = 1; s < plan.stage_starts.size(); ++s)
      starts += cat(s > 1 ? "," : "", plan.stage_starts[s]);
    out +=
        cat(plan.dp, "\t", plan.pp, "\t", plan.tp, "\t", plan.micro_batches, "\t",
            plan.micro_batch_size, "\t", plan.schedule, "\t", plan.chunks, "\t", plan.zero1 ? 1 : 0,
            "\t", number(t.total()), "\t", number(t.compute), "\t", number(t.bubble), "\t",
            number(t.tp_comm), "\t", number(t.pp_comm), "\t", number(t.dp_exposed), "\t",
            number(t.optimizer), "\t", starts.empty() ? "-" : starts, "\n");
  }
  return out;
}

// CPU mode reads the data anyway: a language model's vocabulary is the
// data's (tp must divide it), not the planning default.
Recipe with_data_vocabulary(Recipe recipe) {
  const bool text = recipe.model.name == "gpt" || recipe.model.name == "lstm_lm";
  if (!text || recipe.model.vocab_size > 0) return recipe;
  try {
    const Recipe one = one_process_recipe(recipe, 1);
    Session session(one, rank_layout(parallel_layout(one, 1), 0), DataAccess::assume_if_missing);
    recipe.model.vocab_size = session.data().vocab_size();
  } catch (const Error& e) {
    throw Error(
        cat("--device cpu times the model's blocks on this machine, which needs the "
            "recipe's data: ",
            e.what()));
  }
  return recipe;
}

// CPU mode's request for the recipe on `cluster`, its timer from block
// times profiled here; what was measured is appended to notes.
parallel::PlanRequest cpu_plan_request(const Recipe& recipe, const parallel::ModelDesc& model,
                                       const parallel::ClusterSpec& cluster,
                                       std::unique_ptr<parallel::BlockTimer>* timer,
                                       std::vector<std::string>* notes) {
  parallel::PlanRequest request{.cluster = cluster, .global_batch = recipe.training.global_batch};
  request.precision = recipe.precision;
  request.bucket_mb = double(recipe.parallel.bucket_mb);
  request.workspace_gib = kCpuWorkspaceGib;
  // Recomputation is not profiled; ZeRO-1 trades the optimizer's time for
  // an all-gather, which the dominance pruning does not weigh.
  request.allow_recompute = false;
  request.allow_zero1 = false;
  request.overlap_dp = false;
  CpuProfile profile = profile_for_cpu_plans(recipe, model, cluster.world(), cluster.per_node);
  request.optimizer_seconds_per_param = profile.optimizer_seconds_per_param;
  notes->push_back(cat("profiled on this machine in ", number(profile.seconds), " s; optimizer ",
                       recipe.optimizer.name, " ",
                       number(profile.optimizer_seconds_per_param * 1e9), " ns per parameter"));
  *timer = std::make_unique<parallel::MeasuredBlockTimer>(
      std::move(profile.profiles),
      cat(recipe.training.threads > 0 ? recipe.training.threads : 1, " thread"));
  return request;
}

}  // namespace

std::string cluster_plan_report(const PlanArgs& args) {
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
  if (args.format == "tsv") return plan_tsv(result);

  std::string out = cat("model ", model.name, ": ", number(model.params() / 1e6), "M parameters, ",
                        number(model.forward_flops() / 1e9), " GFLOP forward per sample\n");
  for (const std::string& note : notes) out += note + "\n";
  const std::string device =
      cpu ? cat(" cpu ranks (one core each, ", number(cluster.device.memory_gib), " GiB)")
          : cat(" ", cluster.device.name, " (", number(cluster.device.peak_tflops),
                " TFLOP/s bf16, ", number(cluster.device.memory_gib), " GiB)");
  const std::string p2p = cluster.intra_p2p.gbps > 0
                              ? cat(" (p2p ", number(cluster.intra_p2p.gbps), " Gb/s + ",
                                    number(cluster.intra_p2p.alpha_us), " us)")
                              : "";
  out += cat("cluster: ", cluster.nodes, " nodes x ", cluster.per_node, device, "; intra-node ",
             number(cluster.intra.gbps), " Gb/s + ", number(cluster.intra.alpha_us), " us", p2p,
             ", inter-node ", number(cluster.inter.gbps), " Gb/s + ",
             number(cluster.inter.alpha_us), " us\n");
  out += cat("compute: ", timer->describe(), "; global batch ", request.global_batch,
             model.language_model ? " sequences, " : " samples, ", "precision ", request.precision,
             "\n\n");
  out += parallel::plan_table(result, args.top, model);
  if (!result.ranked.empty())
    out += cat("\nbest plan as recipe overrides:\n  ", parallel::plan_overrides(result.ranked[0]),
               "\n");
  return out;
}

// ---- parallel.auto ----

namespace {

// The plan rank 0 chose, as the integers it broadcasts: ok, dp, pp, tp, M,
// schedule, the stage count, then each stage's first block.
constexpr size_t kMaxAutoStages = 64;
const char* const kAutoSchedules[] = {"none", "gpipe", "1f1b", "zbh1"};

std::string plan_line(const parallel::Plan& plan) {
  std::string out = cat("dp=", plan.dp, " pp=", plan.pp, " tp=", plan.tp, " M=", plan.micro_batches,
                        " b=", plan.micro_batch_size);
  if (plan.pp > 1) out += " " + plan.schedule;
  return cat(out, ": ", number(plan.terms.total() * 1e3), " ms per step");
}

}  // namespace

namespace {

// The choice join_job_planned broadcasts, from the resolved recipe of a
// checkpoint written by `world` ranks; empty when it was not (another world
// size, or a layout the planner does not make: interleaved, an even split).
std::vector<int64_t> checkpoint_choice(const std::string& dir, int world, size_t size) {
  const TrainerStateFile saved = read_trainer_state(dir);
  if (saved.state.layout.world_size() != world || saved.recipe_yaml.empty()) return {};
  const Recipe was = parse_recipe(saved.recipe_yaml, trainer_state_file(dir));
  const ParallelRecipe& p = was.parallel;
  const auto schedule = std::find(std::begin(kAutoSchedules), std::end(kAutoSchedules), p.schedule);
  const bool listed = p.pp == 1 || (p.stages == "list" && p.stage_starts.size() < kMaxAutoStages);
  if (!listed || p.virtual_stages != 1 || (p.pp > 1 && schedule == std::end(kAutoSchedules)))
    return {};
  std::vector<int64_t> choice(size, 0);
  const int64_t head[] = {1,
                          saved.state.layout.mesh.dp,
                          p.pp,
                          p.tp,
                          p.pp > 1 ? p.micro_batches : was.training.grad_accum,
                          p.pp > 1 ? schedule - std::begin(kAutoSchedules) : 0,
                          p.pp > 1 ? int64_t(p.stage_starts.size()) + 1 : 0};
  std::copy(std::begin(head), std::end(head), choice.begin());
  // As the planner gives them: the first stage's start (0), then the recipe's list.
  for (size_t k = 0; p.pp > 1 && k < p.stage_starts.size(); ++k)
    choice[8 + k] = int64_t(p.stage_starts[k]);
  std::printf(
      "parallel.auto: keeping the layout of %s, written by the same %d ranks: dp=%lld "
      "pp=%lld tp=%lld %s=%lld\n",
      dir.c_str(), world, (long long)head[1], (long long)p.pp, (long long)p.tp,
      p.pp > 1 ? "micro_batches" : "grad_accum", (long long)head[4]);
  std::fflush(stdout);
  return choice;
}

}  // namespace

Distributed join_job_planned(Recipe& recipe, bool dry_run,
                             const std::function<std::optional<std::string>()>& resume_from) {
  const char* unsupported = dry_run                          ? "--dry-run"
                            : recipe.device != "cpu"         ? "device: cuda (it plans CPU ranks)"
                            : recipe.parallel.zero1          ? "parallel.zero1"
                            : recipe.model.name == "lstm_lm" ? "model lstm_lm (its wavefront)"
                                                             : nullptr;
  if (unsupported)
    throw Error(cat(recipe.source, ": parallel.auto is not supported with ", unsupported));
  // Join as pure data parallelism: the world communicator does not depend on the layout.
  Recipe provisional = recipe;
  provisional.parallel.dp = 0;
  provisional.parallel.pp = 1;
  provisional.parallel.tp = 1;
  provisional.parallel.micro_batches = 1;
  provisional.parallel.virtual_stages = 1;
  provisional.parallel.schedule = "1f1b";
  provisional.parallel.stages = "even";
  provisional.parallel.stage_starts.clear();
  provisional.parallel.sequence_parallel = false;
  Distributed joined = join_job(provisional);
  const int world = joined.world_size();
  const comm::Bootstrap boot = comm::detect_bootstrap();
  const int per_node = std::max(1, std::min(world, boot.local_world_size));
  std::vector<int64_t> choice(7 + kMaxAutoStages, 0);
  std::string error;
  if (joined.is_main() && resume_from) {
    try {
      const std::optional<std::string> dir = resume_from();
      std::vector<int64_t> kept =
          dir ? checkpoint_choice(*dir, world, choice.size()) : std::vector<int64_t>{};
      if (!kept.empty()) choice = kept;
    } catch (const Error& e) {
      error = e.what();
    }
  }
  if (joined.is_main() && choice[0] == 0 && error.empty()) {
    try {
      std::vector<std::string> notes;
      const parallel::ModelDesc model = model_for_planning(with_data_vocabulary(recipe), &notes);
      const parallel::ClusterSpec cluster = this_machine_cluster(world / per_node, per_node);
      std::unique_ptr<parallel::BlockTimer> timer;
      parallel::PlanRequest request = cpu_plan_request(recipe, model, cluster, &timer, &notes);
      request.max_chunks = 1;  // interleaved needs parallel.virtual_stages: not chosen here
      const parallel::PlanResult result = parallel::plan_cluster(model, request, *timer);
      std::vector<const parallel::Plan*> usable;
      for (const parallel::Plan& plan : result.ranked)
        if (plan.chunks == 1 && plan.stage_starts.size() <= kMaxAutoStages) usable.push_back(&plan);
      if (usable.empty())
        throw Error(cat("parallel.auto: no layout of ", world, " ranks fits (trainer plan ",
                        recipe.source, " --nodes ", world / per_node, " --per-node ", per_node,
                        " --device cpu says why)"));
      const parallel::Plan& best = *usable[0];
      std::printf("parallel.auto: %s predicted%s; %s\n", plan_line(best).c_str(),
                  usable.size() > 1 ? cat(" (runner-up ", plan_line(*usable[1]), ")").c_str() : "",
                  notes.back().c_str());
      std::fflush(stdout);
      const auto schedule =
          std::find(std::begin(kAutoSchedules), std::end(kAutoSchedules), best.schedule);
      const int64_t head[] = {1,
                              best.dp,
                              best.pp,
                              best.tp,
                              best.micro_batches,
                              schedule - std::begin(kAutoSchedules),
                              int64_t(best.stage_starts.size())};
      std::copy(std::begin(head), std::end(head), choice.begin());
      for (size_t k = 0; k < best.stage_starts.size(); ++k)
        choice[7 + k] = int64_t(best.stage_starts[k]);
    } catch (const Error& e) {
      error = e.what();
      choice.assign(choice.size(), 0);
    }
  }
  if (joined.active())
    comm::broadcast(*joined.world(), choice.data(), choice.size() * sizeof(int64_t), 0);
  if (choice[0] != 1)
    throw Error(joined.is_main() ? error : "parallel.auto failed on rank 0 (see its error)");
  ParallelRecipe& p = recipe.parallel;
  p.dp = choice[1], p.pp = choice[2], p.tp = choice[3];
  p.schedule = kAutoSchedules[choice[5]];
  if (p.pp > 1) {
    p.micro_batches = choice[4];
    recipe.training.grad_accum = 1;
    p.stages = "list";
    p.stage_starts.assign(choice.begin() + 8, choice.begin() + 7 + choice[6]);
  } else {
    p.micro_batches = 1;
    p.schedule = "1f1b";
    recipe.training.grad_accum = choice[4];
  }
  // As the planner times tp: with sequence parallelism for Transformers.
  p.sequence_parallel = p.tp > 1 && recipe.model.name == "gpt";
  Distributed planned;
  planned.layout = rank_layout(parallel_layout(recipe, world), joined.rank());
  if (joined.active()) planned.mesh = parallel::Mesh(planned.layout.job.mesh, joined.world());
  return planned;
}

// ---- --calibrate: the links between two local ranks ----

namespace {

using Seconds = std::chrono::duration<double>;

// Message sizes of the fit: 256 B (the latency) to 16 MiB (a GPT layer's
// activations to a small model's whole gradient), by factors of 4.
constexpr size_t kCalibrateMinBytes = 256;
constexpr size_t kCalibrateMaxBytes = size_t(16) << 20;
constexpr int kCalibrateRounds = 3;

// About 32 MB moved per size and round, 4 to 1000 repetitions.
int calibrate_repeats(size_t bytes) {
  return int(std::clamp<size_t>((size_t(32) << 20) / bytes, 4, 1000));
}

// Mean seconds of fn() over the repetitions, the slower rank's, best of the rounds.
template <class Fn>
double timed(comm::Communicator& world, size_t bytes, Fn&& fn) {
  fn();
  double best = 1e300;
  for (int round = 0; round < kCalibrateRounds; ++round) {
    comm::barrier(world);
    const int repeats = calibrate_repeats(bytes);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < repeats; ++i) fn();
    double mean = Seconds(std::chrono::steady_clock::now() - start).count() / repeats;
    comm::allreduce(world, &mean, 1, DType::f64, {.op = comm::ReduceOp::max});
    best = std::min(best, mean);
  }
  return best;
}

// t = intercept + slope x bytes, by least squares on the relative error
// (every size counts alike, from the latency-bound to the bandwidth-bound).
std::pair<double, double> fit_alpha_beta(const std::vector<double>& bytes,
                                         const std::vector<double>& seconds) {
  double s00 = 0, s01 = 0, s11 = 0, r0 = 0, r1 = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const double w = 1.0 / (seconds[i] * seconds[i]);
    s00 += w, s01 += w * bytes[i], s11 += w * bytes[i] * bytes[i];
    r0 += w * seconds[i], r1 += w * seconds[i] * bytes[i];
  }
  const double det = s00 * s11 - s01 * s01;
  double slope = (s00 * r1 - s01 * r0) / det, intercept = (r0 * s11 - s01 * r1) / det;
  if (!(slope > 0)) slope = seconds.back() / bytes.back();
  return {std::max(intercept, 1e-7), slope};
}

// The link of a fitted line: per message alpha; Gb/s from the slope.
std::string link_yaml(const char* key, double alpha_seconds, double seconds_per_byte) {
  return cat(key, ":\n  alpha_us: ", number(alpha_seconds * 1e6),
             "\n  gbps: ", number(8e-9 / seconds_per_byte), "\n");
}

// One rank of --calibrate (under `trainer launch --nproc-per-node 2`): p2p
// ping-pong and allreduce over sizes; rank 0 fits and writes the file.
int calibrate_rank(const PlanArgs& args) {
  auto world = comm::init_world(comm::detect_bootstrap());
  if (world->size() != 2) throw Error("trainer plan --calibrate measures 2 ranks");
  const int me = world->rank(), other = 1 - me;
  std::vector<double> sizes, p2p, allreduce;
  for (size_t bytes = kCalibrateMinBytes; bytes <= kCalibrateMaxBytes; bytes *= 4) {
    const int64_t count = int64_t(bytes / 4);
    Tensor mine = full({count}, double(me)), theirs = zeros({count});
    // One message each way per repetition: the one-way time is half.
    const double round_trip = timed(*world, bytes, [&] {
      for (int way = 0; way < 2; ++way) {
        if (way == me)
          world->send(mine, other, {.micro_batch = way}).wait();
        else
          world->recv(theirs, other, {.micro_batch = way}).wait();
      }
    });
    const double reduce = timed(*world, bytes, [&] { comm::allreduce(*world, mine); });
    sizes.push_back(double(bytes));
    p2p.push_back(round_trip / 2);
    allreduce.push_back(reduce);
  }
  if (me != 0) return 0;
  const auto [p2p_alpha, p2p_slope] = fit_alpha_beta(sizes, p2p);
  const auto [ar_intercept, ar_slope] = fit_alpha_beta(sizes, allreduce);
  // A ring over 2 ranks: 2 steps of alpha + (bytes / 2) / bandwidth.
  std::string text = cat("# trainer plan --calibrate: 2 ranks on this host, ", number(sizes[0]),
                         " B to ", number(sizes.back()), " B\n# bytes  p2p_us  allreduce_us\n");
  for (size_t i = 0; i < sizes.size(); ++i)
    text += cat("#  ", number(sizes[i]), "  ", number(p2p[i] * 1e6), "  ",
                number(allreduce[i] * 1e6), "\n");
  text += "device: cpu\n";
  text += link_yaml("intra", ar_intercept / 2, ar_slope);  // the collectives: tp, dp
  text += link_yaml("p2p", p2p_alpha, p2p_slope);          // pipeline messages
  if (!args.out.empty()) write_file_atomic(args.out, text);
  std::fputs(text.c_str(), stdout);
  if (!args.out.empty()) std::printf("written to %s\n", args.out.c_str());
  return 0;
}

// --calibrate: this binary again as 2 ranks of `trainer launch`.
int calibrate_command(const PlanArgs& args) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::string> argv{self, "launch", "--nproc-per-node", "2",
                                "--", "plan",   "--calibrate-rank"};
  if (!args.out.empty()) {
    argv.push_back("--out");
    argv.push_back(std::filesystem::absolute(args.out).string());
  }
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    std::vector<char*> raw;
    for (const std::string& a : argv) raw.push_back(const_cast<char*>(a.c_str()));
    raw.push_back(nullptr);
    execv(raw[0], raw.data());
    _exit(127);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) < 0)
    throw Error("trainer plan --calibrate: cannot start the ranks");
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

}  // namespace

int plan_command(const PlanArgs& args) {
  if (args.calibrate_rank) return calibrate_rank(args);
  if (args.calibrate) return calibrate_command(args);
  if (args.recipe.empty()) throw Error("trainer plan: give a recipe (or --calibrate)");
  std::fputs(plan_report(args).c_str(), stdout);
  return 0;
}

}  // namespace trainer
