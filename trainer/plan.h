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
//
// --device cpu plans CPU ranks (one core each) of this machine: block times
// are measured here by profile_blocks() (trainer/pipeline_split.h) at the
// plans' micro-batch sizes, one thread, on rank 0's part of each tp split,
// and the optimizer step is timed too; so the recipe's data must be on
// disk. --calibrate measures the links between 2 local ranks (p2p and
// allreduce over the shared-memory channel) and writes them as a cluster
// file that --cluster reads.
//
//   trainer plan recipes/gpt_kjv.yaml --nodes 1 --per-node 2 --device cpu
//   trainer plan recipes/gpt_kjv.yaml --calibrate --out cpu.yaml
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "parallel/planner.h"
#include "trainer/cluster_file.h"
#include "trainer/distributed.h"

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
  int per_node = 0;              // 0: the device's (8)
  std::string device;            // a row of parallel::device_table(); "": a100-80gb
  std::string cluster;           // "": no cluster file
  int top = 10;                  // rows of the ranked table
  std::string format = "table";  // table | tsv (one line per ranked plan, for benchmarks)
  // --calibrate: measure the local links, write them to `out` ("": stdout only).
  bool calibrate = false;
  std::string out;
  bool calibrate_rank = false;  // internal: this process is a rank of --calibrate
};

struct Recipe;

// The planner's description of the recipe's model; what was assumed (a
// vocabulary the data would give) is appended to `notes`.
parallel::ModelDesc model_for_planning(const Recipe& recipe, std::vector<std::string>* notes);

// The cluster planner's report (args.nodes > 0); *found (when given) says
// whether any plan fits.
std::string cluster_plan_report(const PlanArgs& args, bool* found = nullptr);

// CPU mode's measured figures for a recipe: block profiles at each needed
// micro-batch size and tp (one thread), and the optimizer step per parameter.
struct CpuProfile {
  std::vector<parallel::MeasuredProfile> profiles;
  double optimizer_seconds_per_param = 0;
  double seconds = 0;  // spent profiling
};
// Profiles `recipe` for plans of `world` ranks, `per_node` on a host, at
// the micro-batch sizes those plans need (at most three, interpolated between).
CpuProfile profile_for_cpu_plans(const Recipe& recipe, const parallel::ModelDesc& model, int world,
                                 int per_node);
// The CPU cluster of this machine: nodes x per_node ranks (0: one per core),
// the RAM shared among a node's ranks.
parallel::ClusterSpec this_machine_cluster(int nodes, int per_node);

// parallel.auto: joins the job as pure data parallelism, and on world
// rank 0 plans the recipe for the job's ranks in CPU mode (block times
// profiled there, ranks per node from the launcher), prints the choice and
// the runner-up, and broadcasts it; every rank then sets recipe.parallel
// (and training.grad_accum) to it and gets the job on that layout. Throws
// Error "parallel.auto is not supported with ..." for --dry-run, CUDA and
// the LSTM LM's wavefront. It chooses parallel.zero1 and recompute too. resume_from (called on rank
// 0 once every rank has joined): the checkpoint the run will resume from;
// when it was planned for as many ranks as there are now, its layout is
// kept (no new plan: a noisy profile must not turn a resume into a
// resharding one).
Distributed join_job_planned(
    Recipe& recipe, bool dry_run,
    const std::function<std::optional<std::string>()>& resume_from = nullptr);

// Registers the subcommand; its options fill `args`.
CLI::App* add_plan_command(CLI::App& app, PlanArgs& args);

// The report `trainer plan` prints (throws trainer::Error on a bad schedule,
// count or time), and writes the Chrome trace when args.trace is set.
std::string plan_report(const PlanArgs& args, bool* found = nullptr);

// Prints plan_report(); returns the exit code (an Error after the report
// when no cluster plan fits).
int plan_command(const PlanArgs& args);

}  // namespace trainer
