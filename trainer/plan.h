// `trainer plan`: a pipeline schedule drawn and timed before anything runs.
// It builds the schedule's per-stage action tables (parallel/schedule.h),
// simulates them with per-stage forward and backward times
// (parallel/pipeline_sim.h), and prints the swimlane, the step time, the
// bubble, and each stage's busy share and peak micro-batches in flight.
//
//   trainer plan recipes/gpt_kjv.yaml --pp 4 --micro-batches 8 --schedule 1f1b
//   trainer plan recipes/gpt_kjv.yaml parallel.pp=4 parallel.micro_batches=8
//       --schedule interleaved --chunks 2 --fwd-ms 3,3,3,4 --bwd-ms 6,6,6,8 --trace plan.json
//
// P, M and the schedule default to the recipe's parallel.pp,
// parallel.micro_batches and parallel.schedule; flags override them and
// accept every schedule make_schedule() knows. --fwd-ms and --bwd-ms are one
// micro-batch's forward and backward through a whole stage (one value: every
// stage; default 1 and 2 ms); with V chunks each chunk takes 1/V of it.
// Split backwards (zbh1) take half of it for each of I and W.
#pragma once

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace trainer {

struct PlanArgs {
  std::string recipe;
  std::vector<std::string> overrides;  // key=value
  int pp = 0;                          // 0: the recipe's parallel.pp
  int micro_batches = 0;               // 0: the recipe's parallel.micro_batches
  std::string schedule;                // "": the recipe's parallel.schedule
  int chunks = 0;                      // 0: 2 for interleaved, else 1
  std::vector<double> fwd_ms;          // per stage, or one for all; empty: 1
  std::vector<double> bwd_ms;          // per stage, or one for all; empty: 2
  std::string trace;                   // "": no Chrome trace file
};

// Registers the subcommand; its options fill `args`.
CLI::App* add_plan_command(CLI::App& app, PlanArgs& args);

// The report `trainer plan` prints (throws trainer::Error on a bad schedule,
// count or time), and writes the Chrome trace when args.trace is set.
std::string plan_report(const PlanArgs& args);

// Prints plan_report(); returns the exit code.
int plan_command(const PlanArgs& args);

}  // namespace trainer
