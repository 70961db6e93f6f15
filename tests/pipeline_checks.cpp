// The pipeline runtime checks of one rank (tests/pipeline_checks.h), run by
// tests/pipeline_worker.cpp as processes of `trainer launch` (or started by
// the test with torchrun-style variables) and, for equiv, by
// tests/test_parallel_pipeline_runtime.cpp as threads of one process. Every rank is one pipeline
// stage (pp = world size) of a small model with a long skip connection and
// drives trainer::parallel::PipelineRuntime itself, action by action, through a stage
// list of parallel::make_schedule, as the trainer's step executor does.
//
//   equiv SCHEDULE...
//       pp = 3, M = 4 micro-batches, two steps per schedule: every rank
//       compares its stage's parameter gradients bit for bit with the same
//       model run whole in this process (gradient accumulation of loss / M),
//       the last stage also its outputs; after the steps, an evaluation of
//       4 batches (forward only) gives the whole model's outputs bit for
//       bit; every rank checks that the plan sends the skip from piece 0
//       straight to piece 2, past stage 1.
//       Prints mismatches (rank, what, index, expected, actual) and last
//       "rank R: N checks, F failed"; exit 0 only without failures.
//   mismatch
//       pp = 2: the probe runs at micro-batch size 4, the step at 3, so
//       stage 0's first sendA is an Error naming both stages.
//   kill VICTIM
//       pp = 2: VICTIM SIGKILLs itself before its first backward; the others
//       must get an Error naming their stage and the receive they waited on.
//   kill-evaluation VICTIM
//       pp = world size: an evaluation of 4 batches (forward only); VICTIM
//       SIGKILLs itself before its batch 2.
//   In mismatch and kill, a rank that catches an Error prints
//   "rank R: error: ..." and exits 3; one that finishes the step prints
//   "rank R: finished the step" and exits 1 (kill-evaluation: "finished
//   the evaluation").
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/bootstrap.h"
#include "comm/collectives.h"
#include "comm/communicator.h"
#include "core/ops.h"
#include "layers/block_list.h"
#include "layers/linear.h"
#include "parallel/mesh.h"
#include "parallel/pipeline.h"
#include "parallel/pipeline_runtime.h"
#include "parallel/schedule.h"
#include "tests/pipeline_checks.h"
#include "tests/worker_checks.h"

using namespace trainer;
using namespace trainer::testing;
using namespace trainer::parallel;

namespace {

// actual and expected hold the same bits; the first differing element is reported.
void expect_same_bits(const std::string& what, const Tensor& actual, const Tensor& expected) {
  ++g_checks;
  if (!actual.defined() || !expected.defined() || actual.shape() != expected.shape()) {
    std::printf("rank %d: %s: mismatch: %s, expected %s\n", g_rank, what.c_str(),
                actual.defined() ? actual.shape_str().c_str() : "undefined",
                expected.defined() ? expected.shape_str().c_str() : "undefined");
    ++g_failures;
    return;
  }
  std::vector<float> a = actual.to_vector<float>(), e = expected.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &e[i], sizeof(float)) != 0) {
      std::printf("rank %d: %s: mismatch at index %zu: expected %.9g, actual %.9g\n", g_rank,
                  what.c_str(), i, double(e[i]), double(a[i]));
      ++g_failures;
      return;
    }
}

// ---- the model ----

constexpr int64_t kWidth = 8;
constexpr int64_t kRows = 4;  // rows of a micro-batch
constexpr int kMicroBatches = 4;

// Six blocks of Linear layers; block 1 ("save") publishes "skip", block 5
// ("use") reads it. Split into three stages of two blocks, the skip crosses
// two stage boundaries: piece 0 sends it straight to piece 2.
//   x -> tanh(l0) -> h = l1(.) -> x = tanh(h), skip = h -> tanh(l2) -> tanh(l3)
//     -> tanh(l4) -> out = l5(x + skip)
struct SkipModel {
  std::vector<std::shared_ptr<Linear>> layers;
  BlockList blocks;
  void zero_grad() {
    for (const auto& l : layers) l->zero_grad();
  }
};

// The same parameters on every rank and every call (fixed seed).
std::unique_ptr<SkipModel> make_skip_model() {
  auto model = std::make_unique<SkipModel>();
  Generator gen(2024, 5);
  for (int i = 0; i < 6; ++i)
    model->layers.push_back(std::make_shared<Linear>(kWidth, kWidth, gen));
  const std::vector<std::shared_ptr<Linear>>& l = model->layers;
  auto dense = [](std::shared_ptr<Linear> layer) {
    return [layer](const TensorList& in) { return TensorList{tanh((*layer)(in[0]))}; };
  };
  std::vector<BlockSpec> specs;
  specs.push_back({.name = "b0", .members = {{"l0", l[0]}}, .fn = dense(l[0])});
  specs.push_back({.name = "save",
                   .members = {{"l1", l[1]}},
                   .outputs = {"x", "skip"},
                   .fn = [layer = l[1]](const TensorList& in) {
                     Tensor h = (*layer)(in[0]);
                     return TensorList{tanh(h), h};
                   }});
  specs.push_back({.name = "b2", .members = {{"l2", l[2]}}, .fn = dense(l[2])});
  specs.push_back({.name = "b3", .members = {{"l3", l[3]}}, .fn = dense(l[3])});
  specs.push_back({.name = "b4", .members = {{"l4", l[4]}}, .fn = dense(l[4])});
  specs.push_back(
      {.name = "use",
       .members = {{"l5", l[5]}},
       .inputs = {"x", "skip"},
       .outputs = {"out"},
       .fn = [layer = l[5]](const TensorList& in) { return TensorList{(*layer)(in[0] + in[1])}; }});
  model->blocks = BlockList({"x"}, {"out"}, std::move(specs));
  return model;
}

struct MicroBatch {
  Tensor input, target;
};

std::vector<MicroBatch> micro_batches(int64_t step, int64_t rows) {
  std::vector<MicroBatch> batches;
  for (int m = 0; m < kMicroBatches; ++m) {
    Generator gen(uint64_t(900 + step), uint64_t(m));
    MicroBatch b;
    b.input = uniform({rows, kWidth}, -1.0, 1.0, gen);
    b.target = uniform({rows, kWidth}, -1.0, 1.0, gen);
    batches.push_back(b);
  }
  return batches;
}

// The mean-squared error, scaled by 1 / M as the trainer scales a micro-batch's loss.
Tensor scaled_loss(const Tensor& out, const Tensor& target) {
  Tensor d = out - target;
  return mean(d * d) * (1.0 / double(kMicroBatches));
}

// Hooks into the action loop: called before each action (the kill scenario).
using BeforeAction = std::function<void(const Action&)>;

// One optimizer step's actions of this stage, run as the step executor runs
// them (without the optimizer). Returns the last piece's outputs per micro-batch.
std::vector<Tensor> run_step(PipelineRuntime& rt, const std::vector<Action>& actions,
                             const std::vector<MicroBatch>& batches,
                             const BeforeAction& before = {}) {
  std::vector<Tensor> outputs(batches.size());
  rt.begin_step(actions);
  for (const Action& a : actions) {
    if (before) before(a);
    const int m = a.micro_batch, c = a.chunk;
    switch (a.kind) {
      case ActionKind::forward: {
        TensorList kept = rt.forward(m, c, {batches[size_t(m)].input});
        if (rt.is_last_piece(c)) {
          outputs[size_t(m)] = kept.at(0);
          rt.set_loss(m, scaled_loss(kept.at(0), batches[size_t(m)].target));
        }
        break;
      }
      case ActionKind::grad_sync:
        rt.finish_step();
        break;
      case ActionKind::optimizer_step:
        break;
      default:
        rt.run(a);
    }
  }
  return outputs;
}

// ---- equiv ----

// The skip's transfer goes from piece 0 straight to piece 2; the middle
// piece neither receives nor sends it, and it is absent at its input.
void check_plan(const BlockList& blocks, const PipelinePlan& plan) {
  int skip = -1, found = 0;
  for (size_t t = 0; t < plan.transfers().size(); ++t)
    if (plan.transfers()[t].name == "skip") {
      skip = int(t);
      ++found;
    }
  expect(found == 1, cat("the plan has ", found, " transfers of 'skip', expected 1"));
  if (skip < 0) return;
  const Transfer& tr = plan.transfers()[size_t(skip)];
  expect(tr.from == 0 && tr.to == 2,
         cat("'skip' travels from piece ", tr.from, " to piece ", tr.to, ", expected 0 to 2"));
  auto has = [](const std::vector<int>& v, int t) {
    return std::find(v.begin(), v.end(), t) != v.end();
  };
  const Piece& middle = plan.piece(1);
  expect(!has(middle.receives, skip), "piece 1 receives 'skip'");
  expect(!has(middle.sends, skip), "piece 1 sends 'skip'");
  expect(has(plan.piece(0).sends, skip), "piece 0 does not send 'skip'");
  expect(has(plan.piece(2).receives, skip), "piece 2 does not receive 'skip'");
  const std::vector<std::string>& at_middle = blocks.boundary(middle.first);
  for (size_t k = 0; k < at_middle.size(); ++k)
    if (at_middle[k] == "skip")
      expect(middle.input_source[k] == Piece::kAbsent,
             cat("piece 1's input 'skip' has source ", middle.input_source[k], ", not absent"));
  // Only "x" flows through the middle.
  expect(middle.receives.size() == 1 && middle.sends.size() == 1,
         cat("piece 1 has ", middle.receives.size(), " receives and ", middle.sends.size(),
             " sends, expected 1 and 1 ('x')"));
}

int run_equiv(comm::Communicator& world, const std::shared_ptr<comm::Communicator>& pp,
              const std::vector<std::string>& schedules) {
  const int stage = pp->rank(), stages = pp->size();
  std::unique_ptr<SkipModel> piped = make_skip_model(), whole = make_skip_model();
  PipelinePlan plan(piped->blocks, even_split(piped->blocks.size(), stages, 1));
  if (stages == 3) check_plan(piped->blocks, plan);
  const std::vector<std::pair<size_t, size_t>> mine = plan.blocks_of_stage(stage);
  std::vector<NamedTensor> params, ref_params;
  for (const auto& [first, last] : mine) {
    for (const NamedTensor& p : piped->blocks.named_parameters(first, last)) params.push_back(p);
    for (const NamedTensor& p : whole->blocks.named_parameters(first, last))
      ref_params.push_back(p);
  }
  expect(!params.empty(), cat("stage ", stage, " holds no parameters"));
  StageModule stage_module(piped->blocks, mine);
  expect(stage_module.named_parameters().size() == params.size(),
         cat("the stage module has ", stage_module.named_parameters().size(), " parameters, not ",
             params.size()));

  for (const std::string& name : schedules) {
    Schedule schedule = make_schedule(name, stages, kMicroBatches);
    check_schedule(schedule);
    PipelineRuntime rt(plan, stage, pp, piped->blocks, nullptr);
    rt.probe({micro_batches(0, kRows)[0].input}, DType::f32);
    if (stages == 3)
      for (const Transfer& t : rt.plan().transfers())
        if (t.name == "skip")
          expect(t.shape == Shape{kRows, kWidth} && t.has_gradient,
                 cat("the probe gives 'skip' the shape ", shape_str(t.shape)));
    const std::vector<Action>& actions = schedule.stages[size_t(stage)];
    int splits = 0;
    for (const Action& a : actions) splits += a.kind == ActionKind::backward_input;
    expect(name != "zbh1" || splits == kMicroBatches,
           cat(name, ": ", splits, " backward_input actions on stage ", stage));
    for (int64_t step = 0; step < 2; ++step) {
      const std::string what = cat(name, " step ", step, " stage ", stage);
      std::vector<MicroBatch> batches = micro_batches(step, kRows);
      piped->zero_grad();
      whole->zero_grad();
      std::vector<Tensor> outputs = run_step(rt, actions, batches);
      // The reference: the whole model, gradient accumulation over the same micro-batches.
      for (int m = 0; m < kMicroBatches; ++m) {
        Tensor out = whole->blocks.run({batches[size_t(m)].input})[0];
        scaled_loss(out, batches[size_t(m)].target).backward();
        if (rt.is_last_piece(0))
          expect_same_bits(cat(what, ": output of micro-batch ", m), outputs[size_t(m)], out);
      }
      for (size_t i = 0; i < params.size(); ++i) {
        expect(params[i].name == ref_params[i].name,
               cat(what, ": parameter ", params[i].name, " against ", ref_params[i].name));
        expect_same_bits(cat(what, ": gradient of ", params[i].name), params[i].tensor.grad(),
                         ref_params[i].tensor.grad());
      }
    }
    {
      // Evaluation between steps: forward only, batch after batch (the
      // sends of batch m - 2 completed before batch m); the last stage's
      // outputs are the whole model's.
      autograd::NoGradGuard no_grad;
      const std::vector<MicroBatch> batches = micro_batches(7, kRows);
      std::vector<TensorList> kept;
      for (int m = 0; m < kMicroBatches; ++m)
        kept.push_back(rt.evaluate(m, {batches[size_t(m)].input}));
      rt.finish_step();
      for (int m = 0; m < kMicroBatches; ++m) {
        const std::string what = cat(name, " evaluation of batch ", m, " on stage ", stage);
        if (rt.is_last_piece(0))
          expect_same_bits(what, kept[size_t(m)].at(0),
                           whole->blocks.run({batches[size_t(m)].input})[0]);
        else
          expect(!kept[size_t(m)].at(0).defined(), cat(what, ": an output before the last stage"));
      }
    }
    report_compared(cat(name, ": stage ", stage, " gradients of ", params.size(), " parameters"));
    // The next schedule's messages reuse the tags: start it together.
    comm::barrier(world);
  }
  return report_checks();
}

// ---- failures ----

// A step of 1f1b at pp = world size on the skip model, probed at micro-batch
// size probe_rows and run at step_rows; before runs ahead of every action.
int run_failing_step(const std::shared_ptr<comm::Communicator>& pp, int64_t probe_rows,
                     int64_t step_rows, const BeforeAction& before) {
  std::unique_ptr<SkipModel> model = make_skip_model();
  PipelinePlan plan(model->blocks, even_split(model->blocks.size(), pp->size(), 1));
  PipelineRuntime rt(plan, pp->rank(), pp, model->blocks, nullptr);
  try {
    rt.probe({micro_batches(0, probe_rows)[0].input}, DType::f32);
    Schedule schedule = make_schedule("1f1b", pp->size(), kMicroBatches);
    run_step(rt, schedule.stages[size_t(pp->rank())], micro_batches(0, step_rows), before);
  } catch (const Error& e) {
    std::printf("rank %d: error: %s\n", g_rank, e.what());
    std::fflush(stdout);
    return 3;
  }
  std::printf("rank %d: finished the step\n", g_rank);
  return 1;
}

int run_kill(const std::shared_ptr<comm::Communicator>& pp, int victim) {
  return run_failing_step(pp, kRows, kRows, [&](const Action& a) {
    const bool backward = a.kind == ActionKind::backward || a.kind == ActionKind::backward_input;
    if (pp->rank() == victim && backward) {
      std::printf("rank %d: killing itself before %s\n", g_rank, to_string(a).c_str());
      std::fflush(stdout);
      ::raise(SIGKILL);
    }
  });
}

// pp = world size: an evaluation of 4 batches of the skip model; VICTIM
// SIGKILLs itself before its batch 2.
int run_kill_evaluation(const std::shared_ptr<comm::Communicator>& pp, int victim) {
  std::unique_ptr<SkipModel> model = make_skip_model();
  PipelinePlan plan(model->blocks, even_split(model->blocks.size(), pp->size(), 1));
  PipelineRuntime rt(plan, pp->rank(), pp, model->blocks, nullptr);
  try {
    rt.probe({micro_batches(0, kRows)[0].input}, DType::f32);
    autograd::NoGradGuard no_grad;
    const std::vector<MicroBatch> batches = micro_batches(7, kRows);
    for (int m = 0; m < kMicroBatches; ++m) {
      if (pp->rank() == victim && m == 2) {
        std::printf("rank %d: killing itself before evaluating batch 2\n", g_rank);
        std::fflush(stdout);
        ::raise(SIGKILL);
      }
      rt.evaluate(m, {batches[size_t(m)].input});
    }
    rt.finish_step();
  } catch (const Error& e) {
    std::printf("rank %d: error: %s\n", g_rank, e.what());
    std::fflush(stdout);
    return 3;
  }
  std::printf("rank %d: finished the evaluation\n", g_rank);
  return 1;
}

}  // namespace

int trainer::testing::run_pipeline_checks(const std::shared_ptr<comm::Communicator>& world,
                                          const std::vector<std::string>& args) {
  const std::string mode = args.empty() ? "" : args[0];
  Mesh mesh(MeshShape{{Dim::pp, world->size()}}, world);
  const std::shared_ptr<comm::Communicator> pp = mesh.comm(Dim::pp);
  if (mode == "equiv" && args.size() > 1)
    return run_equiv(*world, pp, std::vector<std::string>(args.begin() + 1, args.end()));
  if (mode == "mismatch" && args.size() == 1) return run_failing_step(pp, kRows, kRows - 1, {});
  if (mode == "kill" && args.size() == 2) return run_kill(pp, std::atoi(args[1].c_str()));
  if (mode == "kill-evaluation" && args.size() == 2)
    return run_kill_evaluation(pp, std::atoi(args[1].c_str()));
  std::fprintf(stderr,
               "usage: pipeline_worker equiv SCHEDULE... | mismatch | kill VICTIM | "
               "kill-evaluation VICTIM\n");
  return 64;
}
