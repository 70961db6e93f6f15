#include "trainer/pipeline_split.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "core/allocator.h"
#include "core/autocast.h"
#include "core/ops.h"
#include "trainer/device.h"
#include "trainer/metrics.h"
#include "trainer/step_executor.h"

namespace trainer {

namespace {

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

// Parameters, their gradients and the optimizer's state per parameter byte.
double bytes_per_parameter_byte(const Recipe& r) {
  const bool momentum = r.optimizer.name == "sgd" && r.optimizer.momentum > 0;
  return 2.0 + (r.optimizer.name == "adamw" ? 2.0 : momentum ? 1.0 : 0.0);
}

// With parallel.stage_memory_mb: each stage's activation memory as the
// recipe's schedule runs it, checked on its action table. A stage holding
// parameters p (with gradients and optimizer state) and a of activations per
// micro-batch in flight can keep floor((limit - p) / a) micro-batches; the
// table's peak in flight on the stage must not exceed it.
void check_stage_memory(const Session& session, const parallel::StageSplit& split,
                        const BlockProfile& profile) {
  const Recipe& r = session.recipe();
  const double limit = r.parallel.stage_memory_mb * double(1 << 20);
  const double per_param = bytes_per_parameter_byte(r);
  parallel::ScheduleLimits limits;
  std::string budget;
  for (int s = 0; s < split.stages; ++s) {
    double fixed = 0, activations = 0;
    for (int c = 0; c < split.chunks; ++c) {
      const int piece = split.piece(s, c);
      double piece_activations = 0;
      for (size_t b = split.bounds[size_t(piece)]; b < split.bounds[size_t(piece) + 1]; ++b) {
        fixed += profile.parameter_bytes[b] * per_param + profile.recompute_bytes[b];
        piece_activations += profile.activation_bytes[b];
      }
      activations = std::max(activations, piece_activations);
    }
    const int fits =
        activations > 0 ? int(std::min(1e6, std::floor((limit - fixed) / activations))) : 1000000;
    if (fits < 1)
      throw Error(cat("stage ", s, " needs ", (fixed + activations) / double(1 << 20),
                      " MiB for its parameters and one micro-batch, above parallel.stage_memory_mb "
                      "= ",
                      r.parallel.stage_memory_mb, ": raise it or add stages"));
    limits.max_in_flight.push_back(fits);
    budget += cat(budget.empty() ? "" : ", ", "stage ", s, " ", fits);
  }
  const std::vector<std::string> problems =
      parallel::schedule_problems(training_schedule(r, session.layout()), limits);
  if (problems.empty()) return;
  std::string text;
  for (const std::string& p : problems) text += "\n  " + p;
  throw Error(cat("parallel.schedule ", r.parallel.schedule, " with ", r.parallel.micro_batches,
                  " micro-batches holds more activations than parallel.stage_memory_mb = ",
                  r.parallel.stage_memory_mb,
                  " MiB allows (micro-batches in flight that fit: ", budget, "):", text,
                  "\nuse parallel.schedule=1f1b (at most pp in flight), fewer micro-batches, more "
                  "stages or a larger limit"));
}

// parallel.stages: auto, by the profile: the split of least largest stage
// time whose stages keep the schedule's peak micro-batches in flight (1F1B:
// pp, on the first stage; GPipe: all of them) within stage_memory_mb.
parallel::StageSplit balanced_split(const Session& session, const BlockProfile& profile) {
  const Recipe& r = session.recipe();
  const ParallelRecipe& p = r.parallel;
  const size_t n = session.blocks().size();
  const std::vector<int> peaks = parallel::peak_in_flight(training_schedule(r, session.layout()));
  const int in_flight = *std::max_element(peaks.begin(), peaks.end());
  const double per_param = bytes_per_parameter_byte(r);
  std::vector<double> cost(n), memory(n);
  for (size_t b = 0; b < n; ++b) {
    cost[b] = profile.forward_ms[b] + profile.backward_ms[b];
    // With recompute, a block's whole graph while its backward recomputes it
    // (counted per block: an upper bound on the one alive at a time).
    memory[b] = profile.parameter_bytes[b] * per_param +
                profile.activation_bytes[b] * double(in_flight) + profile.recompute_bytes[b];
  }
  try {
    return parallel::balanced_split(cost, memory, p.stage_memory_mb * double(1 << 20),
                                    session.layout().job.mesh[parallel::Dim::pp],
                                    int(p.virtual_stages));
  } catch (const Error& e) {
    throw Error(cat(e.what(), " (parallel.schedule ", p.schedule, " keeps up to ", in_flight,
                    " micro-batches in flight on a stage",
                    p.schedule == "gpipe" ? "; 1f1b keeps at most pp" : "", ")"));
  }
}

// The blocks' profile before any runs: their parameter bytes, and times
// that the first run lowers (each run keeps the least).
BlockProfile unmeasured_profile(const BlockList& blocks) {
  BlockProfile p;
  const size_t n = blocks.size();
  p.forward_ms.assign(n, 1e300);
  p.backward_ms.assign(n, 1e300);
  p.activation_bytes.assign(n, 0);
  p.recompute_bytes.assign(n, 0);
  p.parameter_bytes.assign(n, 0);
  for (size_t b = 0; b < n; ++b)
    for (const NamedTensor& t : blocks.named_parameters(b, b + 1))
      p.parameter_bytes[b] += double(t.tensor.nbytes());
  return p;
}

// A block's inputs as leaves, so its backward stops at them.
TensorList input_leaves(const TensorList& slots) {
  TensorList in;
  for (const Tensor& t : slots) {
    Tensor leaf = t.defined() ? t.detach() : t;
    if (leaf.defined() && is_floating(leaf.dtype())) leaf.requires_grad_();
    in.push_back(leaf);
  }
  return in;
}

}  // namespace

BlockProfile profile_blocks(Session& session, DType autocast, int repeats) {
  const BlockList& blocks = session.blocks();
  Module& model = session.model();
  // BatchNorm's running statistics move in every training forward: keep
  // them. A deferred model (a pipeline stage's) is made one block at a time
  // and returned to its record after it (the record is its initial value).
  std::vector<NamedTensor> buffers;
  std::vector<Tensor> saved;
  for (const NamedTensor& b : model.named_buffers())
    if (!is_deferred(b.tensor)) {
      buffers.push_back(b);
      saved.push_back(b.tensor.clone());
    }
  BlockProfile p = unmeasured_profile(blocks);
  const size_t n = blocks.size();
  BatchSource& source = session.data();
  const StepBatch batch = source.probe_batch(session.micro_batch());
  Allocator& a = allocator(module_device(model));
  for (int rep = 0; rep < repeats; ++rep) {
    TensorList slots = source.model_inputs(batch);
    for (size_t b = 0; b < n; ++b) {
      TensorList made;
      for (const NamedTensor& t : blocks.state(b, b + 1))
        if (is_deferred(t.tensor)) {
          materialize(t.tensor);
          made.push_back(t.tensor);
        }
      const TensorList in = input_leaves(slots);
      const int64_t before = a.stats().current_bytes;
      a.reset_peak();
      auto t0 = std::chrono::steady_clock::now();
      TensorList out;
      {
        AutocastGuard guard(autocast);
        out = blocks.run(b, b + 1, in);
      }
      p.forward_ms[b] = std::min(p.forward_ms[b], ms_since(t0));
      p.activation_bytes[b] = double(std::max<int64_t>(0, a.stats().current_bytes - before));
      if (blocks.recompute() && rep == 0) {
        // What the recompute holds: the block's forward with its whole graph.
        AutocastGuard guard(autocast);
        const int64_t start = a.stats().current_bytes;
        TensorList whole = blocks[b].fn(in);
        p.recompute_bytes[b] = double(std::max<int64_t>(0, a.stats().current_bytes - start));
      }
      TensorList roots, grads;
      for (const Tensor& t : out)
        if (t.defined() && t.requires_grad()) {
          roots.push_back(t);
          grads.push_back(ones_like(t));
        }
      t0 = std::chrono::steady_clock::now();
      if (!roots.empty()) autograd::run_backward(roots, grads, false);
      p.backward_ms[b] = std::min(p.backward_ms[b], ms_since(t0));
      slots.clear();
      for (const Tensor& t : out) slots.push_back(t.defined() ? t.detach() : t);
      for (const Tensor& t : made) {
        t.set_grad(Tensor());
        unmaterialize(t);
      }
    }
  }
  model.zero_grad();
  autograd::NoGradGuard no_grad;
  for (size_t k = 0; k < buffers.size(); ++k) buffers[k].tensor.copy_(saved[k]);
  return p;
}

parallel::StageSplit choose_split(const Session& session, const BlockProfile* profile) {
  const Recipe& r = session.recipe();
  const ParallelRecipe& p = r.parallel;
  const size_t n = session.blocks().size();
  const int stages = session.layout().job.mesh[parallel::Dim::pp], chunks = int(p.virtual_stages);
  try {
    parallel::StageSplit split;
    if (p.stages == "list") {
      split = parallel::split_at(n, stages, chunks, p.stage_starts);
    } else if (p.stages == "even" || !profile) {
      split = parallel::even_split(n, stages, chunks);
    } else {
      split = balanced_split(session, *profile);
    }
    // Any split, given a profile: its stages' memory on the schedule's table.
    if (profile && p.stage_memory_mb > 0) check_stage_memory(session, split, *profile);
    return split;
  } catch (const Error& e) {
    throw Error(cat(r.source, ": ", e.what()));
  }
}

std::string describe_stages(const Session& session, const parallel::StageSplit& split,
                            const BlockProfile* profile) {
  const BlockList& blocks = session.blocks();
  std::string out = cat("pipeline: ", split.stages, " stages",
                        split.chunks > 1 ? cat(" x ", split.chunks, " chunks") : "", ", blocks ",
                        parallel::to_string(split),
                        " (parallel.stages: ", session.recipe().parallel.stages, ")\n");
  for (int s = 0; s < split.stages; ++s) {
    int64_t params = 0;
    double ms = 0, act = 0, recomputed = 0;
    std::string names;
    for (int c = 0; c < split.chunks; ++c) {
      const int v = split.piece(s, c);
      const size_t first = split.bounds[size_t(v)], last = split.bounds[size_t(v) + 1];
      names += cat(names.empty() ? "" : " | ", blocks[first].name,
                   last - first > 1 ? cat(" .. ", blocks[last - 1].name) : "");
      for (const NamedTensor& t : blocks.named_parameters(first, last)) params += t.tensor.numel();
      if (profile)
        for (size_t b = first; b < last; ++b) {
          ms += profile->forward_ms[b] + profile->backward_ms[b];
          act += profile->activation_bytes[b];
          recomputed = std::max(recomputed, profile->recompute_bytes[b]);
        }
    }
    char line[256] = "";
    if (profile)
      std::snprintf(line, sizeof line,
                    ", predicted %.2f ms forward+backward and %.1f MiB of "
                    "activations per micro-batch%s",
                    ms, (act + recomputed) / double(1 << 20),
                    blocks.recompute() ? " (recompute: block inputs + one block recomputed)" : "");
    out += cat("  stage ", s, ": ", names, ", ", with_commas(params), " parameters", line, "\n");
  }
  const ParallelRecipe& p = session.recipe().parallel;
  if (p.time_chunks > 1) {
    const int64_t T = session.recipe().data.seq_len > 0 ? session.recipe().data.seq_len
                                                        : session.recipe().model.context;
    out += cat("wavefront: each micro-batch's ", T, "-token windows cut into ", p.time_chunks,
               " time chunks of ", T / p.time_chunks,
               " tokens, the schedule's micro-batches; each stage carries its layers' state "
               "from chunk to chunk",
               profile ? " (the predictions above are for the whole window)" : "", "\n");
  }
  return out;
}

}  // namespace trainer
