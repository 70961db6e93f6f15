// Activation checkpointing (parallel.recompute): a checkpointed block list
// gives the gradients of the plain one bit for bit (dropout masks redrawn
// from the restored generators, batch norm's running statistics moved once),
// the trainer trains the same bits with recompute blocks as without, alone
// and as pipeline stages, and the dry run's activation figure shrinks.
#include <cstring>
#include <filesystem>
#include <regex>

#include "core/autograd.h"
#include "core/ops.h"
#include "layers/linear.h"
#include "models/registry.h"
#include "tests/runs.h"  // last: it brings Catch's CHECK

namespace fs = std::filesystem;
using namespace trainer;
using namespace trainer::testing;

namespace {

// [3, 16] token indices below 40, different for each (k, salt).
Tensor symbols(int k, int salt) {
  std::vector<int64_t> v(48);
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = int64_t((i * 7 + size_t(k) * 13 + size_t(salt) * 5) % 40);
  return from_vector<int64_t>(v, {3, 16});
}

struct Pass {
  std::vector<float> loss;
  std::map<std::string, Tensor> grads, buffers;
  std::vector<uint64_t> offsets;  // every dropout generator's, after the pass
};

// Two forward + backward passes of model (built from seed 0 each time) on
// inputs, gradients accumulating over both, with recompute on or off.
template <class Loss>
Pass two_passes(const std::string& name, const ModelOptions& options, bool recompute,
                const Loss& loss_of) {
  std::shared_ptr<Model> model = make_model(name, options);
  model->set_recompute(recompute);
  model->apply([](Module& m) {
    if (auto* d = dynamic_cast<Dropout*>(&m)) d->generator() = Generator(7, kStreamDropout);
  });
  Pass p;
  for (int k = 0; k < 2; ++k) {
    Tensor loss = loss_of(*model, k);
    p.loss.push_back(loss.item<float>());
    loss.backward();
  }
  for (const NamedTensor& t : model->named_parameters()) p.grads[t.name] = t.tensor.grad().clone();
  for (const NamedTensor& t : model->named_buffers()) p.buffers[t.name] = t.tensor.clone();
  model->apply([&](Module& m) {
    if (auto* d = dynamic_cast<Dropout*>(&m)) p.offsets.push_back(d->generator().offset());
  });
  return p;
}

void check_same(const Pass& plain, const Pass& recomputed) {
  CHECK(plain.loss == recomputed.loss);
  CHECK(plain.offsets == recomputed.offsets);
  REQUIRE(plain.grads.size() == recomputed.grads.size());
  for (const auto& [name, g] : plain.grads) {
    INFO(name);
    CHECK(same_bits(g, recomputed.grads.at(name)));
  }
  for (const auto& [name, b] : plain.buffers) {
    INFO(name);
    if (b.dtype() == DType::f32) CHECK(same_bits(b, recomputed.buffers.at(name)));
    if (b.dtype() == DType::i64)
      CHECK(b.to_vector<int64_t>() == recomputed.buffers.at(name).to_vector<int64_t>());
  }
}

std::string run_dir(const std::string& name) {
  return fresh_temp_dir("recompute_" + name, false).string();
}

std::vector<std::string> trainer_args(const std::string& recipe, const std::string& out,
                                      std::vector<std::string> extra) {
  std::vector<std::string> a{"train",
                             std::string(TRAINER_SOURCE_DIR) + "/recipes/" + recipe,
                             "output_dir=" + out,
                             "training.threads=1",
                             "data.workers=1",
                             "training.log_every=1",
                             "training.eval_every=0"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// recompute none against blocks, both on nproc ranks with args: the same
// losses and the same weights, bit for bit.
void check_recompute_matches(const std::string& recipe, std::vector<std::string> args, int nproc,
                             int steps, const std::string& tag) {
  args.push_back(cat("training.steps=", steps));
  args.push_back(cat("training.checkpoint_every=", steps));
  std::vector<std::string> recomputed = args;
  recomputed.push_back("parallel.recompute=blocks");
  const std::string a = run_dir(tag + "_none"), b = run_dir(tag + "_blocks");
  ProcessResult ra = run_ranks(nproc, trainer_args(recipe, a, args));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  ProcessResult rb = run_ranks(nproc, trainer_args(recipe, b, recomputed));
  INFO(rb.output);
  REQUIRE(rb.code == 0);
  const StepLog expected = step_log(a), got = step_log(b);
  REQUIRE(expected.loss.size() == size_t(steps));
  CHECK(expected.loss == got.loss);
  CHECK(expected.grad_norm == got.grad_norm);
  check_models(model_at(a, steps), model_at(b, steps), 0);
}

std::vector<std::string> gpt_args() {
  return {"data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
          "training.global_batch=8",
          "model.n_layer=2",
          "model.d_model=32",
          "model.n_head=2",
          "model.context=32",
          "data.seq_len=32",
          "model.dropout=0.1"};
}

const std::vector<std::string> kResnetArgs = {"model.name=resnet18_small", "model.in_channels=1",
                                              "training.global_batch=8", "optimizer.lr=0.05",
                                              "data.val_samples=64"};

// The "activations X MiB" figure of a dry run's memory estimate.
double dry_run_activations(const std::vector<std::string>& args, const std::string& tag) {
  ProcessResult r = run_ranks(1, trainer_args("gpt_kjv.yaml", run_dir(tag), args));
  INFO(r.output);
  REQUIRE(r.code == 0);
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, std::regex("activations ([0-9.]+) MiB")));
  return std::stod(m[1]);
}

}  // namespace

TEST_CASE("recompute: a checkpoint recomputes the same dropout masks, gradients bit for bit",
          "[autograd]") {
  Generator init(3);
  Linear fc(6, 6, init);
  Dropout drop(0.5, Generator(11, kStreamDropout));
  Tensor x = uniform({4, 6}, -1.0, 1.0, init).requires_grad_();
  auto fn = [&](const TensorList& in) { return TensorList{drop(fc(in[0])) * in[0]}; };
  auto save = [&] {
    Generator g = drop.generator();
    return std::function<void()>([&drop, g] { drop.generator() = g; });
  };
  // Plain, twice (gradients accumulating), then checkpointed, twice.
  auto run = [&](bool checkpointed) {
    drop.generator() = Generator(11, kStreamDropout);
    fc.zero_grad();
    x.set_grad(Tensor());
    std::vector<float> outs;
    for (int k = 0; k < 2; ++k) {
      Tensor y =
          checkpointed ? autograd::checkpoint({.fn = fn, .save_state = save}, {x})[0] : fn({x})[0];
      Tensor loss = sum(y * y);
      outs.push_back(loss.item<float>());
      loss.backward();
    }
    return std::make_tuple(outs, fc.weight.grad().clone(), fc.bias.grad().clone(), x.grad().clone(),
                           drop.generator().offset());
  };
  auto [loss_a, w_a, b_a, x_a, off_a] = run(false);
  auto [loss_b, w_b, b_b, x_b, off_b] = run(true);
  CHECK(loss_a == loss_b);
  CHECK(same_bits(w_a, w_b));
  CHECK(same_bits(b_a, b_b));
  CHECK(same_bits(x_a, x_b));
  CHECK(off_a == off_b);  // the recompute left the generator where the forward did

  // Hooks on a parameter fire as in a plain backward.
  int fired = 0;
  fc.weight.register_hook([&](const Tensor&) { ++fired; });
  sum(autograd::checkpoint({.fn = fn, .save_state = save}, {x})[0]).backward();
  CHECK(fired == 1);

  // Under no grad it is fn itself, recording nothing.
  autograd::NoGradGuard no_grad;
  CHECK(!autograd::checkpoint({.fn = fn}, {x})[0].requires_grad());
}

TEST_CASE(
    "recompute: GPT with dropout and ResNet-18 with batch norm, checkpointed per block, give "
    "the plain gradients, buffers and generator offsets bit for bit",
    "[autograd][layers]") {
  SECTION("gpt, tied head, dropout 0.2") {
    ModelOptions o{
        .dropout = 0.2, .vocab_size = 40, .context = 16, .n_layer = 2, .n_head = 2, .d_model = 32};
    auto loss = [](Model& model, int k) {
      Tensor tokens = symbols(k, 1), targets = symbols(k, 2);
      return model.output_loss(model.forward(tokens).reshape({48, 40}), targets.reshape({48}));
    };
    check_same(two_passes("gpt", o, false, loss), two_passes("gpt", o, true, loss));
  }
  SECTION("resnet18_small, batch norm") {
    ModelOptions o{.num_classes = 10, .in_channels = 1, .image_size = 16, .width = 8};
    auto loss = [](Model& model, int k) {
      Generator gen(200 + k);
      Tensor x = uniform({4, 1, 16, 16}, -1.0, 1.0, gen);
      Tensor targets = from_vector<int64_t>({3, 1, 4, 1}, {4});
      return model.output_loss(model.forward(x), targets);
    };
    check_same(two_passes("resnet18_small", o, false, loss),
               two_passes("resnet18_small", o, true, loss));
  }
}

TEST_CASE(
    "recompute: the trainer trains GPT with dropout and ResNet-18 the same bits with "
    "recompute blocks",
    "[trainer]") {
  SECTION("gpt") { check_recompute_matches("gpt_kjv.yaml", gpt_args(), 1, 3, "gpt"); }
  SECTION("resnet18_small") {
    check_recompute_matches("fmnist_cnn.yaml", kResnetArgs, 1, 2, "resnet");
  }
  SECTION("gpt under bf16 autocast: the recompute runs under the first run's autocast") {
    std::vector<std::string> args = gpt_args();
    args.push_back("precision=bf16");
    check_recompute_matches("gpt_kjv.yaml", args, 1, 3, "gpt_bf16");
  }
  SECTION("lstm_lm: tied decoder, dropout between layers, gradient accumulation") {
    check_recompute_matches("lstm_kjv.yaml",
                            {"data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
                             "training.global_batch=8", "training.grad_accum=2", "model.hidden=32",
                             "model.d_model=32", "data.seq_len=16", "model.dropout=0.2"},
                            1, 3, "lstm");
  }
}

TEST_CASE("recompute: data-parallel hooks and tensor-parallel GPT train the same bits",
          "[parallel][mp]") {
  SECTION("dp 2, small buckets overlapped with backward") {
    std::vector<std::string> args = gpt_args();
    args.push_back("parallel.bucket_mb=1");
    check_recompute_matches("gpt_kjv.yaml", args, 2, 3, "gpt_dp");
  }
  SECTION("tp 2, sequence parallel") {
    std::vector<std::string> args = gpt_args();
    args.insert(args.end(),
                {"parallel.tp=2", "parallel.sequence_parallel=true", "model.vocab_size=74"});
    check_recompute_matches("gpt_kjv.yaml", args, 2, 3, "gpt_tp");
  }
}

TEST_CASE("recompute: pipeline stages (1f1b, zbh1) train the same bits with recompute blocks",
          "[parallel][mp]") {
  const std::vector<std::string> pipe = {"parallel.pp=2", "parallel.micro_batches=2",
                                         "training.grad_accum=1"};
  SECTION("gpt, 1f1b") {
    std::vector<std::string> args = gpt_args();
    args.insert(args.end(), pipe.begin(), pipe.end());
    args.push_back("parallel.schedule=1f1b");
    check_recompute_matches("gpt_kjv.yaml", args, 2, 3, "gpt_pp");
  }
  SECTION("resnet18_small, 1f1b") {
    std::vector<std::string> args = kResnetArgs;
    args.insert(args.end(), pipe.begin(), pipe.end());
    args.push_back("parallel.schedule=1f1b");
    check_recompute_matches("fmnist_cnn.yaml", args, 2, 2, "resnet_pp");
  }
  SECTION("lstm_lm wavefront: a layer per stage, state carried over time chunks") {
    check_recompute_matches("lstm_kjv.yaml",
                            {"data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
                             "training.global_batch=4", "model.n_layer=2", "model.hidden=32",
                             "model.d_model=32", "model.dropout=0.2", "model.tie_weights=false",
                             "data.seq_len=32", "data.sampling=contiguous", "parallel.pp=2",
                             "parallel.schedule=wavefront", "parallel.time_chunks=4"},
                            2, 3, "lstm_wave");
  }
  SECTION("gpt, zbh1") {
    std::vector<std::string> args = gpt_args();
    args.insert(args.end(), pipe.begin(), pipe.end());
    args.push_back("parallel.schedule=zbh1");
    check_recompute_matches("gpt_kjv.yaml", args, 2, 2, "gpt_zb");
  }
}

TEST_CASE("recompute: the dry run's activation figure counts what recompute keeps", "[trainer]") {
  std::vector<std::string> args = {
      "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
      "model.n_layer=6",
      "model.d_model=64",
      "model.n_head=2",
      "model.context=64",
      "data.seq_len=64",
      "training.global_batch=8",
      "--dry-run"};
  const double none = dry_run_activations(args, "dry_none");
  args.push_back("parallel.recompute=blocks");
  const double blocks = dry_run_activations(args, "dry_blocks");
  INFO("none " << none << " MiB, blocks " << blocks << " MiB");
  CHECK(blocks < 0.5 * none);
  args.back() = "parallel.recompute=selective";
  const double selective = dry_run_activations(args, "dry_selective");
  CHECK(selective == none);

  // A pipeline's per-stage figure: each stage's kept inputs plus its
  // largest block recomputed.
  std::vector<std::string> piped = args;
  piped.back() = "parallel.recompute=blocks";
  piped.insert(piped.end(), {"parallel.pp=2", "parallel.micro_batches=2"});
  ProcessResult r = run_ranks(1, trainer_args("gpt_kjv.yaml", run_dir("dry_pp"), piped));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("per micro-batch (recompute: block inputs + one block recomputed)") !=
        std::string::npos);
}
