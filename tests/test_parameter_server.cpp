// Parameter servers (parallel/parameter_server.h) through the trainer:
// bsp against allreduce data parallelism, exact resume, asp and ssp
// training with their staleness, shard assignment, the recipe's errors, and
// what the others say when a server or a worker dies.
#include <regex>
#include <string>
#include <vector>

#include "parallel/parameter_server.h"
#include "tests/runs.h"
#include "trainer/safetensors.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string run_dir(const std::string& name) {
  return fresh_temp_dir("ps_" + name, false).string();
}

// The MLP recipe with SGD and momentum.
std::vector<std::string> args(const std::string& out, std::vector<std::string> extra,
                              int batch = 32) {
  extra.insert(extra.begin(), {"training.log_every=5", "optimizer.momentum=0.9"});
  return mlp_sgd_args(out, extra, batch);
}

std::vector<std::string> ps(const std::string& sync, int servers) {
  return {"parallel.mode=parameter_server", cat("parallel.servers=", servers),
          "parallel.sync=" + sync};
}

// The largest staleness a server reported ("... max 3 (...").
int64_t max_staleness(const std::string& output) {
  static const std::regex pattern(R"(max (\d+) \()");
  int64_t most = -1;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), pattern);
       it != std::sregex_iterator(); ++it)
    most = std::max<int64_t>(most, std::stoll((*it)[1]));
  return most;
}

}  // namespace

TEST_CASE("parameter server: shards are whole tensors balanced by bytes", "[parallel]") {
  std::vector<optim::ParamGroup> groups(2);
  for (auto [name, n] : {std::pair{"a", 100}, {"b", 60}, {"c", 50}, {"d", 10}})
    groups[0].params.push_back({name, zeros({n})});
  groups[1].params.push_back({"e", zeros({5})});
  groups[1].weight_decay = 0.0;
  const parallel::ShardMap m = parallel::assign_shards(groups, 2);
  CHECK(m.owner.at("a") == 0);
  CHECK(m.owner.at("b") == 1);
  CHECK(m.owner.at("c") == 1);
  CHECK(m.elements == std::vector<int64_t>{115, 110});
  // Each server's groups keep their options and the model's order.
  std::vector<optim::ParamGroup> mine = parallel::shard_groups(groups, m, 0);
  REQUIRE(mine.size() == 2);
  CHECK(mine[0].params.size() == 2);
  CHECK(mine[0].params[0].name == "a");
  CHECK(mine[0].params[1].name == "d");
  CHECK(mine[1].weight_decay == 0.0);
  CHECK(parallel::assign_shards(groups, 5).elements == std::vector<int64_t>{100, 60, 50, 10, 5});
  CHECK_THROWS_WITH(parallel::parse_sync("bulk"), Catch::Contains("use bsp, asp or ssp"));
}

TEST_CASE("parameter server: bsp trains as allreduce data parallelism does, 1 and 2 servers",
          "[parallel][mp]") {
  const std::vector<std::string> common{"training.steps=30"};
  const std::string ref = run_dir("allreduce");
  ProcessResult r = run_ranks(2, args(ref, common));
  INFO(r.output);
  REQUIRE(r.code == 0);
  for (int servers : {1, 2}) {
    INFO(servers << " servers");
    const std::string out = run_dir(cat("bsp", servers));
    std::vector<std::string> extra = common;
    for (const std::string& a : ps("bsp", servers)) extra.push_back(a);
    ProcessResult p = run_ranks(2 + servers, args(out, extra));
    INFO(p.output);
    REQUIRE(p.code == 0);
    CHECK(contains(p.output, "parallel layout: world 2 (dp=2"));
    CHECK(
        contains(p.output, cat("parameter server ", servers - 1, ": 60 gradients in 30 updates")));
    check_close(step_log(ref).loss, step_log(out).loss, 1e-5, "loss");
    check_models(model_at(ref, 30), model_at(out, 30), 1e-5);
  }
}

TEST_CASE("parameter server: a bsp run stopped and resumed ends bit for bit", "[parallel][mp]") {
  std::vector<std::string> extra{"training.steps=30", "training.checkpoint_every=10"};
  for (const std::string& a : ps("bsp", 2)) extra.push_back(a);
  const std::string a = run_dir("whole"), b = run_dir("resumed");
  ProcessResult ra = run_ranks(4, args(a, extra));
  INFO(ra.output);
  REQUIRE(ra.code == 0);
  ProcessResult rb1 = run_ranks(4, args(b, extra), {.stop_after = "step 15/30", .timeout_s = 300});
  INFO(rb1.output);
  std::vector<std::string> resumed = args(b, extra);
  resumed.push_back("--resume=auto");
  ProcessResult rb2 = run_ranks(4, resumed);
  INFO(rb2.output);
  REQUIRE(rb2.code == 0);
  CHECK(contains(rb2.output, "resumed from"));
  check_models(model_at(a, 30), model_at(b, 30));
  // The optimizer state the servers held, saved as a local optimizer's.
  const std::map<std::string, Tensor> state =
      read_pieces(a + "/checkpoints/" + CheckpointDir::step_name(30), "optimizer");
  bool momentum = false;
  for (const auto& [name, t] : state)
    if (name.ends_with(".momentum_buffer")) {
      double sum = 0;
      for (float v : t.to_vector<float>()) sum += std::fabs(v);
      momentum = momentum || sum > 0;
    }
  CHECK(momentum);
}

TEST_CASE("parameter server: asp and ssp train, with their staleness measured and bounded",
          "[parallel][mp]") {
  for (const std::string sync : {"asp", "ssp"}) {
    INFO(sync);
    const std::string out = run_dir(sync);
    std::vector<std::string> extra{"training.steps=300", "training.log_every=50",
                                   "parallel.staleness=1"};
    for (const std::string& a : ps(sync, 1)) extra.push_back(a);
    ProcessResult r = run_ranks(4, args(out, extra, 48));  // 3 workers, 1 server
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(contains(r.output, "parameter server 0: 900 gradients in 900 updates"));
    // Every worker's gradient lands on parameters others have moved since.
    const int64_t most = max_staleness(r.output);
    CHECK(most >= 1);
    // ssp: no worker more than s = 1 pushes ahead of the slowest, so at
    // most (W - 1)(2s + 2) updates between a pull and its gradient.
    if (sync == "ssp") CHECK(most <= 2 * 4);
    const StepLog log = step_log(out);
    REQUIRE(log.loss.size() == 6);
    CHECK(log.loss.rbegin()->second < 0.8);  // from 2.3 at the start
    // The staleness of worker 0's last gradient, in its metrics, and the
    // server's histogram of all it applied.
    std::ifstream metrics(out + "/metrics.jsonl");
    std::string first;
    std::getline(metrics, first);
    CHECK(contains(first, "\"staleness\""));
    int64_t histogram = 0;
    for (std::string line; std::getline(metrics, line);) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j["split"] != "staleness") continue;
      CHECK(j["gradients"] == 900);
      for (const auto& [key, value] : j.items())
        if (key.starts_with("staleness_")) histogram += value.get<int64_t>();
    }
    CHECK(histogram == 900);
    // ... and in TensorBoard, in the server's own event file.
    bool events = false;
    for (const auto& f : std::filesystem::directory_iterator(out + "/tb"))
      events = events || f.path().string().ends_with(".server0");
    CHECK(events);
  }
}

TEST_CASE("parameter server: recipes it cannot train are refused with the key to change",
          "[parallel]") {
  const std::string out = run_dir("errors");
  struct Case {
    std::vector<std::string> extra;
    int ranks;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {{"parallel.servers=2"}, 2, "leaves no worker among the 2 ranks"},
           {{"parallel.pp=2"}, 3, "need parallel.mode = allreduce"},
           {{"parallel.zero1=true"}, 3, "set parallel.shard=none (and parallel.zero1=false)"},
           {{"optimizer.clip_grad_norm=1"}, 3, "set optimizer.clip_grad_norm=0"},
           {{"parallel.sync=bulk"}, 3, "parallel.sync"}}) {
    std::vector<std::string> extra{"parallel.mode=parameter_server"};
    extra.insert(extra.end(), c.extra.begin(), c.extra.end());
    ProcessResult r = run_ranks(c.ranks, args(out, extra), {.timeout_s = 120});
    INFO(r.output);
    CHECK(r.code != 0);
    CHECK(contains(r.output, c.message));
  }
}

TEST_CASE("parameter server: a dead server or worker is an error naming its role and rank",
          "[parallel][mp]") {
  for (int victim : {2, 1}) {  // the server, then a worker
    INFO("rank " << victim << " killed");
    const std::string out = run_dir(cat("dead", victim));
    std::vector<std::string> argv{TRAINER_BINARY, "launch", "--nproc-per-node", "3", "--"};
    for (const std::string& a :
         args(out, {"training.steps=1000000", "parallel.mode=parameter_server"}))
      argv.push_back(a);
    Child c = start(argv);
    REQUIRE(wait_for_output(c, " step ", 120));
    const pid_t pid = launched_rank(c.pid, victim);
    REQUIRE(pid > 0);
    ::kill(pid, SIGKILL);
    ProcessResult r = finish(c, 120);
    INFO(r.output);
    CHECK(r.code == 128 + SIGKILL);
    CHECK(contains(r.output, cat("rank ", victim, " exited with code 137")));
    // The launcher's report names it as where the job stopped, not a rank
    // that was waiting on it.
    CHECK(contains(r.output, cat("never arrived: ", victim, " ")));
    // The survivors' errors name it by its role, as dead (its exit or UCX's
    // lost connection, whichever they saw first), and say what the message
    // they were exchanging with it is.
    const std::string died = cat(" (rank ", victim, ") died: ");
    std::string error;  // the first survivor's error naming it
    for (size_t at = r.output.find("error: "); at != std::string::npos && error.empty();
         at = r.output.find("error: ", at + 1)) {
      const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
      if (contains(line, died)) error = line;
    }
    REQUIRE(!error.empty());
    if (victim == 2) {
      CHECK(error.starts_with("error: worker "));
      CHECK(contains(error, cat(": parameter server 0", died)));
    } else {
      CHECK(error.starts_with(cat("error: parameter server 0 (rank 2): worker 1", died)));
      CHECK(contains(error, "gradient push"));
    }
    CHECK(contains(error, "restart the job"));
    CHECK(!contains(r.output, "activation micro-batch"));
  }
}
