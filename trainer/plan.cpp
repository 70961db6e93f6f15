#include "trainer/plan.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/check.h"
#include "parallel/pipeline_sim.h"
#include "parallel/schedule.h"
#include "trainer/recipe.h"
#include "trainer/safetensors.h"

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
      "plan", "draw and time a pipeline schedule: swimlane, step time, bubble, memory");
  cmd->add_option("recipe", args.recipe, "recipe YAML file (its parallel section gives defaults)")
      ->required();
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
  return cmd;
}

std::string plan_report(const PlanArgs& args) {
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

int plan_command(const PlanArgs& args) {
  std::fputs(plan_report(args).c_str(), stdout);
  return 0;
}

}  // namespace trainer
