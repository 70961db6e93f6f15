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
//
// With --nodes it is the cluster planner instead (parallel/planner.h,
// docs/planner.md): every dp x pp x tp layout of N x G GPUs, micro-batch
// count, schedule, ZeRO-1 and recomputation scored by a cost model, ranked,
// the rejected ones grouped by reason, the best as recipe overrides. The
// data set need not be on disk.
//
//   trainer plan recipes/gpt_kjv.yaml --nodes 2 --per-node 8
//   trainer plan big.yaml --nodes 128 --device h100-80gb --top 20
//   trainer plan big.yaml --nodes 16 --cluster my_cluster.yaml
#pragma once

#include <string>
#include <vector>

#include "parallel/planner.h"

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
  // The cluster planner (nodes > 0).
  int nodes = 0;
  int per_node = 0;     // 0: the device's (8)
  std::string device;   // a row of parallel::device_table(); "": a100-80gb
  std::string cluster;  // "": no cluster file
  int top = 10;         // rows of the ranked table
};

struct Recipe;

// A cluster file (YAML) applied over `base`: device, peak_tflops,
// memory_gib, per_node, achievable, intra {alpha_us, gbps}, inter
// {alpha_us, gbps}. An unknown key or a bad value throws Error naming the
// file, the line and the key.
parallel::ClusterSpec load_cluster_file(const std::string& path, parallel::ClusterSpec base);

// The planner's description of the recipe's model; what was assumed (a
// vocabulary the data would give) is appended to `notes`.
parallel::ModelDesc model_for_planning(const Recipe& recipe, std::vector<std::string>* notes);

// The cluster planner's report (args.nodes > 0).
std::string cluster_plan_report(const PlanArgs& args);

// Registers the subcommand; its options fill `args`.
CLI::App* add_plan_command(CLI::App& app, PlanArgs& args);

// The report `trainer plan` prints (throws trainer::Error on a bad schedule,
// count or time), and writes the Chrome trace when args.trace is set.
std::string plan_report(const PlanArgs& args);

// Prints plan_report(); returns the exit code.
int plan_command(const PlanArgs& args);

}  // namespace trainer
