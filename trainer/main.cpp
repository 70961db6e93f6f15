// The trainer binary. Subcommands arrive with their issues (train, eval,
// plan, launch, sample); until then `trainer info` is the smoke run: it
// builds a tiny graph, runs backward and reports the build.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "core/cpu/cpu_backend.h"
#include "core/ops.h"

using namespace trainer;

namespace {

int run_info() {
  std::printf("trainer %s\n", "0.1.0");
#ifdef TRAINER_HAVE_CUDA
  std::printf("CUDA backend: compiled\n");
#else
  std::printf("CUDA backend: not compiled\n");
#endif
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainer: a from-scratch deep-learning trainer"};
  app.require_subcommand(1);
  CLI::App* info = app.add_subcommand("info", "print the build and run a smoke test");
  CLI11_PARSE(app, argc, argv);
  try {
    if (*info) return run_info();
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
