// The trainer binary:
//   trainer train RECIPE [key=value ...] [--resume auto|DIR] [--init-from FILE] [--dry-run]
//   trainer eval RECIPE [key=value ...] --checkpoint DIR
//   trainer sample RECIPE [key=value ...] --checkpoint DIR [--prompt S] [--tokens N]
//                  [--temperature T] [--top-k K] [--seed S]
//   trainer launch --nproc-per-node N -- <trainer args>
//   trainer plan RECIPE [key=value ...] [--pp P] [--micro-batches M] [--schedule S] ...
//   trainer tokenize --train CORPUS... --vocab-size N --out tok.model   (trainer/tokenize.h)
//   trainer tokenize --model tok.model CORPUS... --out DIR
//   trainer info          the build, and a smoke test of the engine
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>

#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "core/ops.h"
#include "parallel/device_staging.h"
#include "trainer/checkpoint_tool.h"
#include "trainer/device.h"
#include "trainer/last_net.h"
#include "trainer/launch.h"
#include "trainer/numbers.h"
#include "trainer/plan.h"
#include "trainer/recipe.h"
#include "trainer/tokenize.h"
#include "trainer/train.h"

using namespace trainer;

namespace {

// The longest text `trainer sample` generates in one call.
constexpr int64_t kMaxSampleTokens = 10000000;

// Parses the command line; an exit code when the process should end here:
// 0 after --help, 1 for a bad option (every user error exits 1, as
// docs/cli.md says; CLI11's own codes 105-115 are not used).
std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string command = "trainer";
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
      if (argc > 1 && sub->get_name() == argv[1]) command += cat(" ", argv[1]);
    std::fprintf(stderr, "error: %s (`%s --help` lists the options)\n", e.what(), command.c_str());
    return 1;
  }
  return std::nullopt;
}

int run_info() {
  std::printf("trainer %s\n", "0.1.0");
#ifdef TRAINER_HAVE_CUDA
  std::printf("CUDA backend: compiled, %d device(s) visible\n", device_availability().cuda_devices);
  std::printf("UCX CUDA memory: %s\n", parallel::ucx_supports_cuda_memory() ? "yes" : "no");
#else
  std::printf("CUDA backend: not compiled\n");
#endif
  const cpu::CpuFeatures& cpu = cpu::cpu_features();
  std::printf("CPU: %s\n", cpu::cpu_name(cpu).c_str());
  std::printf("CPU features: %s\n", cpu::feature_summary(cpu).c_str());
  std::printf("kernels: %s\n", cpu::describe_kernel_isas().c_str());
  std::printf("bf16: %s\n", cpu::describe_low_precision(false).c_str());
  std::printf("CPU threads: %d\n", num_threads());
  Generator gen(0);
  Tensor w = normal({4, 3}, 0.0, 1.0, gen).requires_grad_();
  Tensor x = uniform({8, 4}, -1.0, 1.0, gen);
  Tensor loss = mean(relu(matmul(x, w)));
  loss.backward();
  std::printf("smoke: loss %.6f, |grad| %.6f\n", loss.item<double>(),
              sum(w.grad() * w.grad()).item<double>());
  return 0;
}

// `trainer sample`'s options (trainer/train.h).
CLI::App* add_sample_command(CLI::App& app, SampleArgs& args) {
  CLI::App* sample =
      app.add_subcommand("sample", "generate text from a language model's checkpoint");
  sample->add_option("recipe", args.recipe, "the recipe the model was trained with")->required();
  sample->add_option("overrides", args.overrides, "key=value overrides of recipe keys");
  sample
      ->add_option("--checkpoint", args.checkpoint,
                   "a checkpoint directory, a checkpoints/ folder or a run's output directory "
                   "(their latest)")
      ->required();
  sample->add_option("--prompt", args.prompt,
                     "text to continue (with a character vocabulary, its characters must be in "
                     "it); default: start at a line break");
  sample->add_option("--tokens", args.tokens, "tokens to generate")
      ->capture_default_str()
      ->check(integer_in(0, kMaxSampleTokens));
  sample
      ->add_option("--temperature", args.temperature,
                   "divides the logits; 0: greedy (always the most likely token)")
      ->capture_default_str()
      ->check(number_in(0, 1e6));
  sample->add_option("--top-k", args.top_k, "sample among the k most likely tokens only; 0: all")
      ->capture_default_str()
      ->check(integer_in(0, 10000000));
  sample->add_option("--seed", args.seed, "the same seed gives the same text")
      ->capture_default_str();
  return sample;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainer: a from-scratch deep-learning trainer"};
  app.require_subcommand(1);
  CLI::App* info = app.add_subcommand("info", "print the build and run a smoke test");
  TrainArgs train_args;
  CLI::App* train = app.add_subcommand("train", "train from a recipe");
  train->add_option("recipe", train_args.recipe, "recipe YAML file")->required();
  train->add_option("overrides", train_args.overrides,
                    "key=value overrides of recipe keys (dotted paths, e.g. training.epochs=3)");
  train->add_option("--resume", train_args.resume,
                    "'auto': continue from the newest complete checkpoint of the run, if any; "
                    "or a checkpoint directory");
  train->add_option("--init-from", train_args.init_from,
                    "load weights by name from a safetensors file before training");
  train->add_flag("!--init-non-strict", train_args.init_strict,
                  "with --init-from: skip missing, unexpected and mis-shaped tensors");
  train->add_flag("--trace", train_args.trace,
                  "write a Chrome-trace timeline of compute and communication per rank to "
                  "<output_dir>/trace.json (ui.perfetto.dev opens it)");
  train->add_flag(
      "--dry-run", train_args.dry_run,
      "print the resolved recipe, model summary, memory estimate and layout, then exit");
  std::string keys = "Recipe keys (YAML sections, or key=value overrides):";
  for (const std::string& k : recipe_keys()) keys += "\n  " + k;
  train->footer(keys);
  EvalArgs eval_args;
  CLI::App* eval =
      app.add_subcommand("eval", "evaluate a checkpoint on the recipe's validation set");
  eval->add_option("recipe", eval_args.recipe, "recipe YAML file")->required();
  eval->add_option("overrides", eval_args.overrides, "key=value overrides of recipe keys");
  eval->add_option("--checkpoint", eval_args.checkpoint,
                   "a checkpoint directory, or a checkpoints/ folder (its latest)")
      ->required();
  SampleArgs sample_args;
  CLI::App* sample = add_sample_command(app, sample_args);
  LaunchOptions launch_options;
  CLI::App* launch = add_launch_command(app, launch_options);
  PlanArgs plan_args;
  CLI::App* plan = add_plan_command(app, plan_args);
  CheckpointArgs checkpoint_args;
  add_checkpoint_commands(app, checkpoint_args);
  TokenizeArgs tokenize_args;
  CLI::App* tokenize = add_tokenize_command(app, tokenize_args);
  if (const std::optional<int> code = parse_command_line(app, argc, argv)) return *code;
  return run_with_last_net([&] {
    if (*info) return run_info();
    if (*train) return train_command(train_args);
    if (*eval) return eval_command(eval_args);
    if (*sample) return sample_command(sample_args);
    if (*launch) return run_launch(launch_options);
    if (*plan) return plan_command(plan_args);
    if (*tokenize) return tokenize_command(tokenize_args);
    return std::max(0, run_checkpoint_commands(app, checkpoint_args));
  });
}
