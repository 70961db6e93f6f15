// libFuzzer target: the command lines of `trainer plan` and `trainer
// launch` (trainer/plan.h, trainer/launch.h). The input is the arguments
// after `trainer`, one per line. Every command line ends as a parse error, a
// trainer::Error, or (plan) a report made in under 5 s and (launch) options
// that validate_launch_options accepts; nothing is started and no file is
// written: --trace, --out, --cluster, --calibrate and CPU profiling are
// dropped, and the recipe is always a small GPT of the fuzzer's own.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "trainer/launch.h"
#include "trainer/plan.h"

namespace {

// A recipe the planner can plan without data on disk.
const std::string& recipe_path() {
  static const std::string path = [] {
    const std::string p = "/tmp/fuzz_command_line_recipe.yaml";
    std::ofstream(p) << "model: {name: gpt, n_layer: 4, n_head: 4, d_model: 64, context: 64, "
                        "vocab_size: 96}\ndata: {name: text}\ntraining: {global_batch: 16}\n";
    return p;
  }();
  return path;
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size() && out.size() < 24) {
    const size_t end = std::min(text.find('\n', start), text.size());
    out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<std::string> words =
      lines(std::string(reinterpret_cast<const char*>(data), size));
  if (words.empty() || (words[0] != "plan" && words[0] != "launch")) return 0;
  std::vector<std::string> strings{"trainer"};
  strings.insert(strings.end(), words.begin(), words.end());
  std::vector<char*> argv;
  for (std::string& s : strings) argv.push_back(s.data());

  CLI::App app{"fuzz"};
  app.require_subcommand(1);
  trainer::PlanArgs plan_args;
  CLI::App* plan = trainer::add_plan_command(app, plan_args);
  trainer::LaunchOptions launch_options;
  CLI::App* launch = trainer::add_launch_command(app, launch_options);
  try {
    app.parse(int(argv.size()), argv.data());
  } catch (const CLI::Error&) {
    return 0;
  }
  try {
    if (*launch) {
      trainer::validate_launch_options(launch_options);
      if (launch_options.nproc_per_node < 1 || launch_options.nnodes < 1) std::abort();
    }
    if (*plan) {
      if (plan_args.calibrate || plan_args.calibrate_rank || plan_args.device == "cpu") return 0;
      plan_args.recipe = recipe_path();
      plan_args.trace.clear();
      plan_args.out.clear();
      plan_args.cluster.clear();
      const auto start = std::chrono::steady_clock::now();
      trainer::plan_report(plan_args);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (seconds > 5) {
        std::fprintf(stderr, "trainer plan took %.1f s\n", seconds);
        std::abort();
      }
    }
  } catch (const trainer::Error&) {
  }
  return 0;
}
