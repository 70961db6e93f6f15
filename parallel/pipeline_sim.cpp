#include "parallel/pipeline_sim.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/check.h"

namespace trainer::parallel {

namespace {

bool is_compute(ActionKind kind) {
  return kind == ActionKind::forward || kind == ActionKind::backward ||
         kind == ActionKind::backward_input || kind == ActionKind::backward_weight;
}

// One value per stage from a list of 1 (every stage) or `stages` values.
std::vector<double> per_stage(const std::vector<double>& values, int stages, const char* what) {
  if (values.size() != 1 && int(values.size()) != stages)
    throw Error(cat(what, ": ", values.size(), " values for ", stages,
                    " stages; give 1 (every stage) or ", stages));
  for (double v : values)
    if (!(v >= 0) || !std::isfinite(v)) throw Error(cat(what, ": ", v, " is not a time >= 0"));
  return values.size() == 1 ? std::vector<double>(size_t(stages), values[0]) : values;
}

double cost_of(const Action& a, double forward, double backward, const PipelineCosts& costs) {
  switch (a.kind) {
    case ActionKind::forward:
      return forward;
    case ActionKind::backward:
      return backward;
    case ActionKind::backward_input:
      return backward * costs.backward_input_fraction;
    case ActionKind::backward_weight:
      return backward * costs.backward_weight_fraction;
    case ActionKind::grad_sync:
      return costs.grad_sync;
    case ActionKind::optimizer_step:
      return costs.optimizer_step;
    default:
      return 0;  // messages: sends are free, receives wait (simulate() times them)
  }
}

// "F3", "B1", chunk c > 0 as "F3.1": the swimlane's short form.
std::string cell_label(const Action& a) {
  std::string label = to_string(Action{a.kind, a.micro_batch, 0});
  if (a.chunk != 0) label += cat(".", a.chunk);
  return label;
}

}  // namespace

double SimResult::bubble_fraction() const {
  if (step_time <= 0 || compute_time.empty()) return 0;
  double total = 0;
  for (double t : compute_time) total += t;
  return 1.0 - total / (double(compute_time.size()) * step_time);
}

double SimResult::bubble_over_ideal() const {
  return ideal_time > 0 ? (step_time - ideal_time) / ideal_time : 0;
}

SimResult simulate(const Schedule& schedule, const PipelineCosts& costs) {
  const int stages = int(schedule.stages.size());
  const std::vector<double> forward = per_stage(costs.forward, stages, "forward costs");
  const std::vector<double> backward = per_stage(costs.backward, stages, "backward costs");
  for (double v : {costs.backward_input_fraction, costs.backward_weight_fraction, costs.latency,
                   costs.grad_sync, costs.optimizer_step})
    if (!(v >= 0) || !std::isfinite(v))
      throw Error(cat("pipeline costs: ", v, " is not a fraction or time >= 0"));
  check_schedule(schedule);

  SimResult result;
  result.compute_time.assign(size_t(stages), 0.0);
  result.times.resize(size_t(stages));
  for (int stage = 0; stage < stages; ++stage)
    result.times[size_t(stage)].resize(schedule.stages[size_t(stage)].size());
  // When each message is usable (-1: not sent yet), by MessageIndex.
  const MessageIndex message{schedule.micro_batches, stages * schedule.chunks};
  std::vector<double> arrival(message.count(), -1.0);
  std::vector<size_t> next(size_t(stages), 0);
  std::vector<double> clock(size_t(stages), 0.0);
  // Rounds over the stages, each running until a receive whose send is not
  // yet posted; the table is deadlock-free, so every list reaches its end.
  for (bool progress = true; progress;) {
    progress = false;
    for (int stage = 0; stage < stages; ++stage) {
      const std::vector<Action>& actions = schedule.stages[size_t(stage)];
      double& now = clock[size_t(stage)];
      for (size_t& i = next[size_t(stage)]; i < actions.size(); ++i, progress = true) {
        const Action& a = actions[i];
        const int v = a.chunk * stages + stage;
        ActionTime& time = result.times[size_t(stage)][i];
        time.start = now;
        if (a.kind == ActionKind::recv_activation || a.kind == ActionKind::recv_gradient) {
          const double at = arrival[message(a.kind == ActionKind::recv_gradient, a.micro_batch, v)];
          if (at < 0) break;
          now = std::max(now, at);
        } else if (a.kind == ActionKind::send_activation) {
          arrival[message(false, a.micro_batch, v + 1)] = now + costs.latency;
        } else if (a.kind == ActionKind::send_gradient) {
          arrival[message(true, a.micro_batch, v - 1)] = now + costs.latency;
        } else {
          const double cost = cost_of(a, forward[size_t(stage)], backward[size_t(stage)], costs);
          now += cost;
          result.compute_time[size_t(stage)] += cost;
        }
        time.end = now;
      }
    }
  }
  for (int stage = 0; stage < stages; ++stage)
    CHECK_EQ(next[size_t(stage)], schedule.stages[size_t(stage)].size())
        << "stage " << stage << " of a checked schedule did not finish";

  result.step_time = *std::max_element(clock.begin(), clock.end());
  result.ideal_time = *std::max_element(result.compute_time.begin(), result.compute_time.end());
  for (double t : result.compute_time)
    result.busy.push_back(result.step_time > 0 ? t / result.step_time : 0.0);
  result.peak_in_flight = peak_in_flight(schedule);
  return result;
}

std::string swimlane_text(const Schedule& schedule, const SimResult& result, double unit) {
  CHECK(unit > 0) << "swimlane cell of " << unit;
  // A little slack so that cells landing exactly on an action's end do not
  // grow an extra column from rounding.
  const int cells = int(std::ceil(result.step_time / unit - 1e-9));
  size_t width = 1;
  for (const std::vector<Action>& actions : schedule.stages)
    for (const Action& a : actions)
      if (is_compute(a.kind)) width = std::max(width, cell_label(a).size());
  std::string out;
  for (size_t stage = 0; stage < schedule.stages.size(); ++stage) {
    const std::vector<Action>& actions = schedule.stages[stage];
    // Per cell: the compute action overlapping it most, if by half a cell.
    std::vector<std::string> row(size_t(cells), ".");
    std::vector<double> overlap(size_t(cells), 0.5 * unit - 1e-9 * unit);
    for (size_t i = 0; i < actions.size(); ++i) {
      if (!is_compute(actions[i].kind)) continue;
      const ActionTime& t = result.times[stage][i];
      const int first = std::max(0, int(std::floor(t.start / unit)));
      for (int cell = first; cell < cells && cell * unit < t.end; ++cell) {
        const double covered = std::min(t.end, (cell + 1) * unit) - std::max(t.start, cell * unit);
        if (covered > overlap[size_t(cell)]) {
          overlap[size_t(cell)] = covered;
          row[size_t(cell)] = cell_label(actions[i]);
        }
      }
    }
    std::string line = cat("stage ", stage, " |");
    for (const std::string& cell : row) {
      line += ' ';
      line += cell;
      line.append(width - cell.size(), ' ');
    }
    char busy[32];
    std::snprintf(busy, sizeof busy, " | busy %.1f%%", 100.0 * result.busy[stage]);
    out += line + busy + "\n";
  }
  return out;
}

std::string chrome_trace_json(const Schedule& schedule, const SimResult& result) {
  using nlohmann::json;
  json events = json::array();
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", 0},
                    {"tid", 0},
                    {"args", {{"name", cat("pipeline schedule ", schedule.name)}}}});
  for (size_t stage = 0; stage < schedule.stages.size(); ++stage) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", stage},
                      {"args", {{"name", cat("stage ", stage)}}}});
    const std::vector<Action>& actions = schedule.stages[stage];
    for (size_t i = 0; i < actions.size(); ++i) {
      const Action& a = actions[i];
      const ActionTime& t = result.times[stage][i];
      const bool timed_step =
          (a.kind == ActionKind::grad_sync || a.kind == ActionKind::optimizer_step) &&
          t.end > t.start;
      if (!is_compute(a.kind) && !timed_step) continue;
      json event = {{"name", to_string(a)},
                    {"cat", is_compute(a.kind) ? "compute" : "step"},
                    {"ph", "X"},
                    {"pid", 0},
                    {"tid", stage},
                    {"ts", t.start * 1000.0},
                    {"dur", (t.end - t.start) * 1000.0}};
      if (is_compute(a.kind)) event["args"] = {{"micro_batch", a.micro_batch}, {"chunk", a.chunk}};
      events.push_back(std::move(event));
    }
  }
  return json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump();
}

}  // namespace trainer::parallel
