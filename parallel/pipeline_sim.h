// Times a schedule's tables (parallel/schedule.h) the way the runtime runs
// them: each stage works through its list in order, a compute action takes
// its cost, a send costs nothing and never blocks, and a receive waits until
// its send was posted plus the link latency. The result is the step time,
// how busy each stage was, and when every action ran; the same tables and
// the same rules serve `trainer plan` and the planner's bubble term.
//
//   Schedule schedule = make_schedule("1f1b", 4, 8);
//   SimResult r = simulate(schedule, PipelineCosts{.forward = {1}, .backward = {2}});
//   r.step_time;                 // 33 = (M + P - 1) * (t_f + t_b)
//   r.busy;                      // {0.727, ...} = M / (M + P - 1) on every stage
//   swimlane_text(schedule, r, 1.0);   // "stage 0 | F0 F1 F2 F3 .  .  .  B0 B0 F4 ..."
//   chrome_trace_json(schedule, r);    // ui.perfetto.dev opens it
//
// Uniform stages reproduce the published figures: GPipe and 1F1B take
// (M + P - 1)(t_f + t_b); interleaved 1F1B with chunks costing t_f/V and
// t_b/V takes (M + (P - 1)/V)(t_f + t_b), a bubble of (P - 1)/(V M) of the
// ideal time (Narayanan et al. 2021); ZB-H1 takes M(t_f + t_i + t_w) +
// (P - 1)(t_f + t_i - t_w) (Qi et al. 2023, whose B is our I).
//
// Glossary (as parallel/schedule.h): P stages, M micro-batches, V chunks;
// t_f, t_b, t_i, t_w: the time of one F, B, I, W of one chunk. Times are in
// milliseconds wherever a unit matters (the Chrome trace).
#pragma once

#include <string>
#include <vector>

#include "parallel/schedule.h"

namespace trainer::parallel {

// What each action costs. forward and backward hold one value per stage, or
// one for every stage: the time of one micro-batch's F (or whole B) through
// one chunk of the stage.
struct PipelineCosts {
  std::vector<double> forward{1.0};
  std::vector<double> backward{2.0};
  // A split backward: I and W as fractions of that stage's B.
  double backward_input_fraction = 0.5;
  double backward_weight_fraction = 0.5;
  // From a send being posted to its data being usable by the receive.
  double latency = 0.0;
  double grad_sync = 0.0;
  double optimizer_step = 0.0;
};

struct ActionTime {
  double start = 0, end = 0;  // a receive's end is when its data arrived
};

struct SimResult {
  double step_time = 0;  // when the last stage finished its list
  // The largest per-stage compute time: the step time without any bubble.
  double ideal_time = 0;
  std::vector<double> compute_time;            // per stage: F, B, I, W, sync and step
  std::vector<double> busy;                    // per stage: compute_time / step_time
  std::vector<int> peak_in_flight;             // per stage, counted until I (see InFlightUntil)
  std::vector<std::vector<ActionTime>> times;  // [stage][action index], as schedule.stages
  // Idle share of all stages over the step: 1 - sum(compute) / (P * step_time).
  double bubble_fraction() const;
  // The step's excess over the ideal time, as a fraction of it: (P - 1)/M for 1F1B.
  double bubble_over_ideal() const;
};

// Simulates a runnable table (CHECK-fails on one schedule_problems() rejects;
// throws trainer::Error when the costs name neither 1 nor P stages or are negative).
SimResult simulate(const Schedule& schedule, const PipelineCosts& costs);

// The stages as rows of text, one cell per `unit` of time: the compute
// action covering most of the cell ("F3", "B1", "I2", "W2"; chunk c > 0 as
// "F3.1"), "." where the stage idles; each row ends with its busy share.
//   stage 0 | F0 F1 .  B0 B0 B1 B1 | busy 66.7%
std::string swimlane_text(const Schedule& schedule, const SimResult& result, double unit);

// Chrome trace events (ui.perfetto.dev, chrome://tracing): one process, one
// thread per stage, an "X" event per compute action named as to_string()
// ("F3", "I2.c1") with args micro_batch and chunk; ts and dur in microseconds
// (simulated times are read as milliseconds).
std::string chrome_trace_json(const Schedule& schedule, const SimResult& result);

}  // namespace trainer::parallel
