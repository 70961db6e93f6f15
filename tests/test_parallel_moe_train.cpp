// Mixture-of-experts GPT in the trainer: on the KJV characters it trains
// as one process at tp 2 (top-1 with dropping, top-2 dropless) and at dp 2,
// pp 2, cp 2, dp 2 under ZeRO-3, ep 2 and 4, dp 2 x ep 2, ep 2 x tp 2,
// ep 2 x cp 2, ep 2 x pp 2 (zbh1), ep 2 under ZeRO-3 and dp 2 x ep 2 under
// ZeRO-1, -2 and -3; with dropping (top-1, top-2) ep 2, ep 4 and dp 2 x ep 2
// as dp 2 and dp 4
// (top-2 dropless; the
// expert loads summed over the ranks, the balancing bias the same on
// every rank); its checkpoints resume and evaluate alone; the expert load
// and the auxiliary loss are in metrics.jsonl; bad keys are refused.
#include <regex>

#include "tests/runs.h"  // last: it brings Catch's CHECK

using namespace trainer;
using namespace trainer::testing;

namespace {

std::vector<std::string> moe_args(const std::string& out, std::vector<std::string> extra) {
  std::vector<std::string> a{"train",
                             std::string(TRAINER_SOURCE_DIR) + "/recipes/gpt_kjv.yaml",
                             "output_dir=" + out,
                             "model.n_layer=2",
                             "model.d_model=64",
                             "model.context=64",
                             "model.vocab_size=76",
                             "model.moe.experts=4",
                             "model.moe.hidden=64",
                             "model.moe.z_loss_coef=0.001",
                             "data.seq_len=64",
                             "data.val_windows=16",
                             "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
                             "training.threads=1",
                             "training.log_every=1",
                             "training.eval_every=5",
                             "training.global_batch=8",
                             "training.steps=5",
                             "training.checkpoint_every=5",
                             "optimizer.name=sgd",
                             "optimizer.lr=0.3",
                             "optimizer.momentum=0.9",
                             "optimizer.clip_grad_norm=0.5",
                             "schedule.warmup_steps=0"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

}  // namespace

TEST_CASE("moe: an MoE GPT trains as one process under dp, tp, pp, cp and ZeRO-3",
          "[parallel][mp][moe]") {
  struct Routing {
    std::string name;
    std::vector<std::string> keys;
  };
  // Dropping and the Switch loss (a product of two means over a forward's
  // tokens) depend on which tokens a forward routes: the layouts that split
  // a micro-batch's tokens are compared dropless and without it (the
  // z-loss, a mean of per-token terms, and the bias, from the load summed
  // over the ranks, split exactly).
  for (const Routing& routing :
       {Routing{"top-2 dropless, balancing bias",
                {"model.moe.top_k=2", "model.moe.dropless=true", "model.moe.bias_update_rate=0.01",
                 "model.moe.aux_loss_coef=0"}},
        Routing{"top-1 with dropping", {"model.moe.top_k=1", "model.moe.capacity_factor=1.0"}}}) {
    INFO(routing.name);
    const bool dropless = routing.name.find("dropless") != std::string::npos;
    const std::string ref = fresh_temp_dir("moe_ref", false).string();
    ProcessResult r1 = run_ranks(1, moe_args(ref, routing.keys));
    INFO(r1.output);
    REQUIRE(r1.code == 0);
    const StepLog expected = step_log(ref);
    REQUIRE(expected.loss.size() == 5);
    struct Layout {
      std::string name;
      int ranks;
      std::vector<std::string> keys;
    };
    std::vector<Layout> layouts{{"tp 2", 2, {"parallel.tp=2"}}};
    if (dropless)
      for (Layout l :
           {Layout{"dp 2", 2, {}}, Layout{"pp 2", 2, {"parallel.pp=2", "parallel.micro_batches=2"}},
            Layout{"cp 2", 2, {"parallel.cp=2"}},
            Layout{"dp 2 ZeRO-3", 2, {"parallel.shard=parameters"}},
            Layout{"ep 2", 2, {"parallel.ep=2"}}, Layout{"ep 4", 4, {"parallel.ep=4"}},
            Layout{"dp 2 x ep 2", 4, {"parallel.dp=2", "parallel.ep=2"}},
            Layout{"ep 2 x tp 2", 4, {"parallel.ep=2", "parallel.tp=2"}},
            Layout{"ep 2 x cp 2", 4, {"parallel.ep=2", "parallel.cp=2"}},
            Layout{"ep 2 x pp 2 zbh1",
                   4,
                   {"parallel.ep=2", "parallel.pp=2", "parallel.micro_batches=4",
                    "parallel.schedule=zbh1"}},
            Layout{"ep 2 ZeRO-3", 2, {"parallel.ep=2", "parallel.shard=parameters"}},
            Layout{"dp 2 x ep 2 ZeRO-1",
                   4,
                   {"parallel.dp=2", "parallel.ep=2", "parallel.shard=optimizer"}},
            Layout{"dp 2 x ep 2 ZeRO-2",
                   4,
                   {"parallel.dp=2", "parallel.ep=2", "parallel.shard=gradients"}},
            Layout{"dp 2 x ep 2 ZeRO-3",
                   4,
                   {"parallel.dp=2", "parallel.ep=2", "parallel.shard=parameters"}}})
        layouts.push_back(l);
    for (const Layout& l : layouts) {
      INFO(l.name);
      const std::string run = fresh_temp_dir("moe_layout", false).string();
      std::vector<std::string> keys = routing.keys;
      keys.insert(keys.end(), l.keys.begin(), l.keys.end());
      ProcessResult r = run_ranks(l.ranks, moe_args(run, keys));
      INFO(r.output);
      REQUIRE(r.code == 0);
      const StepLog got = step_log(run);
      check_close(expected.loss, got.loss, 1e-5, "loss");
      check_close(expected.grad_norm, got.grad_norm, 1e-4, "gradient norm");
      check_models(model_at(ref, 5), model_at(run, 5), 1e-5);
    }
  }
}

TEST_CASE("moe: ep routes as data parallelism does, top-1 and top-2, with dropping and dropless",
          "[parallel][mp][moe]") {
  // Capacity, dropping and the Switch loss are per forward's tokens: an ep
  // rank routes its own share of the batch as a dp rank does, so ep 2 gives
  // dp 2's run and ep 4 and dp 2 x ep 2 give dp 4's (the experts computed
  // on other ranks change nothing).
  for (const std::vector<std::string>& routing :
       {std::vector<std::string>{"model.moe.top_k=1", "model.moe.capacity_factor=1.0"},
        std::vector<std::string>{"model.moe.top_k=2", "model.moe.capacity_factor=1.0"},
        std::vector<std::string>{"model.moe.top_k=1", "model.moe.dropless=true"}}) {
    INFO(routing[0] << " " << routing[1]);
    auto run = [&](int ranks, std::vector<std::string> keys) {
      const std::string dir = fresh_temp_dir("moe_ep_routing", false).string();
      keys.insert(keys.end(), routing.begin(), routing.end());
      ProcessResult r = run_ranks(ranks, moe_args(dir, keys));
      INFO(r.failure_lines());
      REQUIRE(r.code == 0);
      return dir;
    };
    const std::string dp2 = run(2, {}), dp4 = run(4, {});
    for (const auto& [ranks, keys, ref] :
         {std::tuple{2, std::vector<std::string>{"parallel.ep=2"}, dp2},
          std::tuple{4, std::vector<std::string>{"parallel.ep=4"}, dp4},
          std::tuple{4, std::vector<std::string>{"parallel.dp=2", "parallel.ep=2"}, dp4}}) {
      INFO(keys.back() << " on " << ranks << " ranks");
      const std::string got = run(ranks, keys);
      check_close(step_log(ref).loss, step_log(got).loss, 1e-5, "loss");
      check_close(step_log(ref).grad_norm, step_log(got).grad_norm, 1e-4, "gradient norm");
      check_models(model_at(ref, 5), model_at(got, 5), 1e-5);
    }
  }
}

TEST_CASE("moe: the logs hold the expert load and the auxiliary loss, and checkpoints resume",
          "[parallel][moe]") {
  const std::string run = fresh_temp_dir("moe_logs", false).string();
  ProcessResult r =
      run_ranks(1, moe_args(run, {"model.moe.top_k=2", "model.moe.every_n_layers=2"}));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("| aux ") != std::string::npos);
  std::ifstream in(run + "/metrics.jsonl");
  int train_lines = 0;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.value("split", "") != "train") continue;
    ++train_lines;
    // every_n_layers 2 of 2 blocks: one MoE layer (the second), index 0.
    REQUIRE(j.contains("moe_aux_loss"));
    CHECK(j["moe_aux_loss"].get<double>() >= 0.01 * 0.99);  // coef x E sum f P >= coef
    CHECK(j["moe_z_loss"].get<double>() > 0);
    CHECK(!j.contains("moe_imbalance.1"));
    double shares = 0;
    for (int e = 0; e < 4; ++e) shares += j[cat("moe_load.0.", e)].get<double>();
    CHECK(shares == Approx(1.0));
    CHECK(j["moe_dropped.0"].get<double>() >= 0);
  }
  CHECK(train_lines == 5);
  // The checkpoint holds every expert by name, and resumes.
  const std::map<std::string, Tensor> m = model_at(run, 5);
  CHECK(m.count("transformer.h.1.mlp.experts.3.c_fc.weight") == 1);
  CHECK(m.count("transformer.h.1.mlp.router.weight") == 1);
  CHECK(m.count("transformer.h.0.mlp.c_fc.weight") == 1);  // the dense block
  ProcessResult more = run_ranks(
      1, moe_args(run, {"model.moe.top_k=2", "model.moe.every_n_layers=2", "training.steps=7"}));
  INFO(more.output);
  CHECK(more.code == 0);
  CHECK(step_log(run).loss.size() == 7);
}

TEST_CASE("moe: an ep checkpoint evaluates and resumes in one process, and one process's at ep 2",
          "[parallel][mp][moe]") {
  const std::vector<std::string> keys{"model.moe.top_k=2", "model.moe.dropless=true"};
  const std::string run = fresh_temp_dir("moe_ep_ckpt", false).string();
  std::vector<std::string> at_ep = keys;
  at_ep.push_back("parallel.ep=2");
  ProcessResult r = run_ranks(2, moe_args(run, at_ep));
  INFO(r.output);
  REQUIRE(r.code == 0);
  // Every expert is in the checkpoint, each written by the rank holding it.
  const std::map<std::string, Tensor> m = model_at(run, 5);
  for (int e = 0; e < 4; ++e)
    CHECK(m.count(cat("transformer.h.0.mlp.experts.", e, ".c_proj.weight")) == 1);
  std::vector<std::string> eval = moe_args(run, keys);
  eval[0] = "eval";
  eval.insert(eval.end(), {"--checkpoint", run});
  ProcessResult e = run_ranks(1, eval);
  INFO(e.output);
  CHECK(e.code == 0);
  std::vector<std::string> more = keys;
  more.push_back("training.steps=7");
  ProcessResult one = run_ranks(1, moe_args(run, more));
  INFO(one.output);
  CHECK(one.code == 0);
  more.insert(more.end(), {"training.steps=9", "parallel.ep=2"});
  ProcessResult back = run_ranks(2, moe_args(run, more));
  INFO(back.output);
  CHECK(back.code == 0);
  CHECK(step_log(run).loss.size() == 9);
}

TEST_CASE("moe: a dp 2 x ep 2 ZeRO-3 checkpoint resumes as if uninterrupted and evaluates alone",
          "[parallel][mp][moe]") {
  // AdamW: the experts' moments, saved whole beside the dense shards, matter.
  std::vector<std::string> keys{"model.moe.top_k=2", "model.moe.dropless=true",
                                "optimizer.name=adamw", "optimizer.lr=0.003"};
  std::vector<std::string> sharded = keys;
  sharded.insert(sharded.end(), {"parallel.dp=2", "parallel.ep=2", "parallel.shard=parameters"});
  auto with = [](std::vector<std::string> a, const std::string& key) {
    a.push_back(key);
    return a;
  };
  const std::string whole = fresh_temp_dir("moe_zero_whole", false).string();
  ProcessResult w = run_ranks(4, moe_args(whole, with(sharded, "training.steps=8")));
  INFO(w.output);
  REQUIRE(w.code == 0);
  const std::string run = fresh_temp_dir("moe_zero_resumed", false).string();
  ProcessResult first = run_ranks(4, moe_args(run, sharded));
  INFO(first.output);
  REQUIRE(first.code == 0);
  // Every expert's moments are in the checkpoint, once (read_pieces refuses
  // elements held twice).
  const std::map<std::string, Tensor> state =
      read_pieces(run + "/checkpoints/" + CheckpointDir::step_name(5), "optimizer");
  for (int e = 0; e < 4; ++e)
    CHECK(state.count(cat("transformer.h.1.mlp.experts.", e, ".c_fc.weight.exp_avg")) == 1);
  ProcessResult more = run_ranks(4, moe_args(run, with(sharded, "training.steps=8")));
  INFO(more.output);
  REQUIRE(more.code == 0);
  check_close(step_log(whole).loss, step_log(run).loss, 0, "loss");
  check_models(model_at(whole, 8), model_at(run, 8), 0);
  // The same checkpoint evaluated in one process (the dense shards and the
  // experts joined by name) gives the loss the four ranks evaluated.
  std::vector<std::string> eval = moe_args(run, keys);
  eval[0] = "eval";
  eval.insert(eval.end(), {"--checkpoint", run + "/checkpoints/" + CheckpointDir::step_name(5)});
  ProcessResult alone = run_ranks(1, eval);
  INFO(alone.output);
  REQUIRE(alone.code == 0);
  std::smatch m;
  REQUIRE(std::regex_search(alone.output, m, std::regex("loss ([0-9.]+)")));
  CHECK(std::stod(m[1]) == Approx(step_log(run).val_loss.at(5)).epsilon(1e-5));
}

TEST_CASE("moe: bad mixture-of-experts keys are errors naming them", "[parallel][moe]") {
  auto refused = [](std::vector<std::string> keys, const std::string& expected) {
    const std::string out = fresh_temp_dir("moe_bad", false).string();
    ProcessResult r = run_ranks(1, moe_args(out, keys));
    INFO(r.output);
    CHECK(r.code != 0);
    CHECK(r.output.find(expected) != std::string::npos);
  };
  refused({"model.moe.top_k=5"}, "model.moe.top_k = 5 is more than the 4 experts");
  refused({"model.name=lstm_lm"}, "mixtures of experts are GPT blocks");
  refused({"model.moe.score=relu"}, "model.moe.score");
  refused({"model.moe.experts=0", "parallel.ep=2"}, "this model has none");
  refused({"model.moe.experts=3", "parallel.ep=2"}, "does not divide over 2 ranks");
  refused(
      {"parallel.ep=2", "parallel.dp=4", "parallel.shard=parameters", "parallel.dp_replicate=2"},
      "parallel.ep = 2 with hybrid sharding (parallel.dp_replicate): not supported together "
      "yet; set parallel.dp_replicate=1");
}
