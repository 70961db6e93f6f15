// Comparing whole training runs: the trainer started as one process or as
// `trainer launch` ranks, and what two runs left behind (their metrics and
// checkpoints) compared step by step and tensor by tensor. For the parallel
// layouts' tests: a layout against the one process it must equal.
//
//   ProcessResult r = run_ranks(2, {"train", recipe, "output_dir=" + dir, "parallel.tp=2"});
//   check_close(step_log(ref).loss, step_log(dir).loss, 1e-5, "loss");
//   check_models(model_at(ref, 50), model_at(dir, 50), 1e-5);   // 0: bit for bit
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/process.h"  // last: it brings Catch's CHECK
#include "trainer/checkpoint.h"

namespace trainer::testing {

// The trainer with args, alone (nproc 1) or as `trainer launch` of nproc ranks.
inline ProcessResult run_ranks(int nproc, const std::vector<std::string>& args,
                               const ProcessOptions& options = {.timeout_s = 300}) {
  std::vector<std::string> argv{TRAINER_BINARY};
  if (nproc > 1) {
    for (const char* a : {"launch", "--nproc-per-node"}) argv.push_back(a);
    argv.push_back(std::to_string(nproc));
    argv.push_back("--");
  }
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, options);
}

#ifdef TRAINER_SOURCE_DIR
// `train` of the Fashion-MNIST MLP with SGD (lr 0.05; its update is linear
// in the gradient, so layouts agree to rounding), one thread and one loader
// worker per rank, `batch` samples per step, then extra.
inline std::vector<std::string> mlp_sgd_args(const std::string& out,
                                             const std::vector<std::string>& extra,
                                             int batch = 32) {
  std::vector<std::string> a{"train",
                             std::string(TRAINER_SOURCE_DIR) + "/recipes/fmnist_mlp.yaml",
                             "output_dir=" + out,
                             "training.threads=1",
                             "data.workers=1",
                             "training.global_batch=" + std::to_string(batch),
                             "optimizer.name=sgd",
                             "optimizer.lr=0.05"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}
#endif

// A run's training losses and gradient norms, and its evaluations' losses
// (and top-1 for classifiers), by step, from its metrics.jsonl.
struct StepLog {
  std::map<int64_t, double> loss, grad_norm, val_loss, val_top1;
};
inline StepLog step_log(const std::string& run) {
  StepLog log;
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    const std::string split = j.value("split", "");
    if (split == "val") {
      log.val_loss[j["step"].get<int64_t>()] = j["loss"].get<double>();
      if (j.contains("top1")) log.val_top1[j["step"].get<int64_t>()] = j["top1"].get<double>();
    }
    if (split != "train") continue;
    log.loss[j["step"].get<int64_t>()] = j["loss"].get<double>();
    if (j.contains("grad_norm")) log.grad_norm[j["step"].get<int64_t>()] = j["grad_norm"];
  }
  return log;
}

// The same steps in a and b, each value within `relative` of a's.
inline void check_close(const std::map<int64_t, double>& a, const std::map<int64_t, double>& b,
                        double relative, const char* what) {
  REQUIRE(!a.empty());
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (const auto& [step, v] : a) {
    REQUIRE(b.count(step) == 1);
    worst = std::max(worst, std::fabs(v - b.at(step)) / std::max(std::fabs(v), 1e-12));
  }
  INFO(what << ": worst relative difference " << worst);
  CHECK(worst <= relative);
}

// The model of a run's checkpoint at step (its parts merged by name).
inline std::map<std::string, Tensor> model_at(const std::string& run, int64_t step) {
  return read_model(run + "/checkpoints/" + CheckpointDir::step_name(step));
}

// Every tensor of a equal to b's: bitwise (tolerance 0), or within
// tolerance of the tensor's largest magnitude (at least 1).
inline void check_models(const std::map<std::string, Tensor>& a,
                         const std::map<std::string, Tensor>& b, double tolerance = 0) {
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    INFO(name);
    REQUIRE(b.count(name) == 1);
    const Tensor& u = b.at(name);
    REQUIRE(t.shape() == u.shape());
    if (t.dtype() != DType::f32) continue;
    std::vector<float> x = t.to_vector<float>(), y = u.to_vector<float>();
    if (tolerance == 0) {
      CHECK(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
      continue;
    }
    double worst = 0, scale = 1;
    for (size_t i = 0; i < x.size(); ++i) {
      worst = std::max(worst, double(std::fabs(x[i] - y[i])));
      scale = std::max(scale, double(std::fabs(x[i])));
    }
    CHECK(worst <= tolerance * scale);
  }
}

}  // namespace trainer::testing
