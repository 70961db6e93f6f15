// The cluster planner at scale (parallel/planner.h): for GPT models of 1.3B
// to 1T parameters on A100 and H100 clusters of 32 to 3072 GPUs, the plan it
// chooses, the predicted throughput and model FLOP utilisation, the terms of
// the predicted step time, the memory per GPU, and how long planning took.
// Then one point against a published figure: Megatron-LM's 175B on 1024
// A100s (Narayanan et al. 2021, Table 1: 140 TFLOP/s per GPU, 45% of peak,
// counting the recomputed forward), with the planner's prediction for the
// same layout and for its own choice.
//
//   bench_planner                     # every model, cluster and device
//   bench_planner --quick             # 1.3B and 175B on A100 only
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/check.h"
#include "parallel/planner.h"

using namespace trainer;
using namespace trainer::parallel;

namespace {

struct GptCase {
  const char* name;
  GptShape shape;
  int64_t global_batch;  // sequences of 2048 tokens, as Narayanan et al. 2021 Table 1
};

// Standard shapes (GPT-3 and Megatron-LM / MT-NLG), vocabulary 50257 padded to 50304.
const std::vector<GptCase>& cases() {
  static const std::vector<GptCase> list = {
      {"1.3B", {.n_layer = 24, .n_head = 16, .d_model = 2048, .context = 2048}, 512},
      {"13B", {.n_layer = 40, .n_head = 40, .d_model = 5120, .context = 2048}, 1024},
      {"175B", {.n_layer = 96, .n_head = 96, .d_model = 12288, .context = 2048}, 1536},
      {"530B", {.n_layer = 105, .n_head = 128, .d_model = 20480, .context = 2048}, 2520},
      {"1T", {.n_layer = 128, .n_head = 160, .d_model = 25600, .context = 2048}, 3072},
  };
  return list;
}

std::string fixed(double value, int digits) {
  char text[48];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

void print_header() {
  std::printf(
      "%-5s %-9s %5s | %-12s %4s %2s %-14s %-9s %-3s | %8s %9s %5s %6s | %7s %6s %6s %6s "
      "%6s | %6s | %7s\n",
      "model", "device", "GPUs", "dp x pp x tp", "M", "b", "schedule", "recompute", "z1", "step s",
      "tokens/s", "MFU", "TFLOPs", "compute", "bubble", "tp", "pp", "dp", "GiB", "plan ms");
}

void print_plan(const GptCase& gpt, const std::string& device, int gpus, const PlanResult& result,
                double seconds) {
  if (result.ranked.empty()) {
    int64_t rejected = 0;
    for (const Rejection& r : result.rejected) rejected += r.count;
    std::printf("%-5s %-9s %5d | no plan fits (%lld rejected for memory or shape) %33s | %7.1f\n",
                gpt.name, device.c_str(), gpus, static_cast<long long>(rejected), "",
                seconds * 1e3);
    return;
  }
  const Plan& plan = result.ranked[0];
  const StepTerms& t = plan.terms;
  const std::string schedule =
      plan.chunks > 1 ? plan.schedule + " V=" + std::to_string(plan.chunks) : plan.schedule;
  std::printf(
      "%-5s %-9s %5d | %-12s %4d %2lld %-14s %-9s %-3s | %8.2f %9.3g %4.1f%% %6.1f | %7.2f "
      "%6.2f %6.2f %6.2f %6.2f | %6.1f | %7.1f\n",
      gpt.name, device.c_str(), gpus, plan.layout().c_str(), plan.micro_batches,
      static_cast<long long>(plan.micro_batch_size), schedule.c_str(),
      to_string(plan.recompute).c_str(), plan.zero1 ? "on" : "off", t.total(),
      plan.tokens_per_second, 100 * plan.model_flops_utilisation,
      plan.hardware_flops_per_gpu / 1e12, t.compute, t.bubble, t.tp_comm, t.pp_comm, t.dp_exposed,
      plan.memory / (1024.0 * 1024 * 1024), seconds * 1e3);
}

// Megatron-LM's published 175B point against the planner's model of it.
void compare_megatron() {
  const GptCase& gpt = cases()[2];
  const ModelDesc model = gpt_model(gpt.shape);
  PlanRequest request{.cluster = cluster_for("a100-80gb", 128), .global_batch = gpt.global_batch};
  const FlopBlockTimer timer(request.cluster.device);
  // The published layout: t = 8, p = 8, d = 16, micro-batch 1 (96 per
  // replica), with full recomputation; the schedule (interleaved, V = 2) is
  // our assumption.
  Plan published;
  published.dp = 16, published.pp = 8, published.tp = 8;
  published.micro_batches = 96;
  published.micro_batch_size = 1;
  published.schedule = "interleaved";
  published.chunks = 2;
  published.sequence_parallel = false;
  published.recompute = Recompute::blocks;
  std::string why;
  const Plan same = evaluate_plan(model, request, timer, published, &why);
  const PlanResult chosen = plan_cluster(model, request, timer);
  std::printf(
      "\n175B on 1024 A100 (global batch 1536): Narayanan et al. 2021 Table 1 measured "
      "140 TFLOP/s per GPU (45%% of 312), counting the recomputed forward\n");
  std::printf(
      "  predicted for the published layout %s M=96 b=1 (interleaved V=2 "
      "assumed), full recomputation, no SP: %.1f TFLOP/s per GPU (%.0f%% of peak), MFU %.1f%%, "
      "step "
      "%.2f s%s\n",
      same.layout().c_str(), same.hardware_flops_per_gpu / 1e12,
      100 * same.hardware_flops_per_gpu / 312e12, 100 * same.model_flops_utilisation,
      same.terms.total(), why.empty() ? "" : (" (" + why + ")").c_str());
  if (!chosen.ranked.empty()) {
    const Plan& best = chosen.ranked[0];
    std::printf(
        "  the planner's choice %s M=%d %s recompute=%s: %.1f TFLOP/s per GPU counting "
        "recomputation, MFU %.1f%%, step %.2f s\n",
        best.layout().c_str(), best.micro_batches, best.schedule.c_str(),
        to_string(best.recompute).c_str(), best.hardware_flops_per_gpu / 1e12,
        100 * best.model_flops_utilisation, best.terms.total());
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: bench_planner [--quick]\n");
      return 2;
    }
  }
  const std::vector<std::string> devices = quick
                                               ? std::vector<std::string>{"a100-80gb"}
                                               : std::vector<std::string>{"a100-80gb", "h100-80gb"};
  const std::vector<int> sizes = {32, 128, 512, 1024, 3072};
  std::printf(
      "the planner's choice per GPT model and cluster (times in seconds, T = 2048, "
      "vocabulary 50304; TFLOPs per GPU count recomputation)\n");
  print_header();
  double slowest = 0;
  for (const GptCase& gpt : cases()) {
    if (quick && std::string(gpt.name) != "1.3B" && std::string(gpt.name) != "175B") continue;
    const ModelDesc model = gpt_model(gpt.shape);
    for (const std::string& device : devices)
      for (int gpus : sizes) {
        PlanRequest request{.cluster = cluster_for(device, gpus / 8),
                            .global_batch = gpt.global_batch};
        const FlopBlockTimer timer(request.cluster.device);
        const auto start = std::chrono::steady_clock::now();
        const PlanResult result = plan_cluster(model, request, timer);
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        slowest = std::max(slowest, seconds);
        print_plan(gpt, device, gpus, result, seconds);
      }
  }
  std::printf("slowest plan: %s ms\n", fixed(slowest * 1e3, 1).c_str());
  compare_megatron();
  return 0;
}
