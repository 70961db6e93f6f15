// The command lines and cluster files of `trainer plan` and `trainer
// launch`, and the numbers of every command line, under hostile values:
// each is refused with exit 1 and one `error:` line naming the option or
// key, the value and the range (never a crash, a hang, a 309-digit range or
// CLI11's own exit codes), or gives a correct result in bounded time.
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "parallel/schedule.h"
#include "tests/hardening.h"
#include "tests/process.h"
#include "tests/testing.h"
#include "trainer/cluster_file.h"
#include "trainer/numbers.h"

using namespace trainer;
using namespace trainer::testing;
using namespace trainer::testing::hardening;
namespace fs = std::filesystem;

namespace {

const std::string kGpt = kRecipes + "gpt_kjv.yaml";

// Runs the trainer with a deadline; the answer is a clean error or success,
// never a crash, an uncaught exception or a hang.
ProcessResult run_bounded(const std::vector<std::string>& args, double seconds = 60) {
  ProcessResult r = run_trainer(args, {.timeout_s = seconds});
  INFO(r.output);
  CHECK((r.code == 0 || r.code == 1));
  CHECK(r.output.find("please report it") == std::string::npos);
  CHECK(r.output.find("terminate called") == std::string::npos);
  CHECK(r.output.find("the test stopped it after the timeout") == std::string::npos);
  return r;
}

// A refusal that names every piece of `texts` and prints no number longer
// than 20 digits (a range printed as the largest double).
void require_refused(const std::vector<std::string>& args, const std::vector<std::string>& texts) {
  ProcessResult r = run_bounded(args);
  INFO(r.output);
  require_error(r, texts);
  int digits = 0, longest = 0;
  for (char c : r.output) longest = std::max(longest, digits = std::isdigit(c) ? digits + 1 : 0);
  CHECK(longest <= 20);
}

std::string write_cluster(const std::string& name, const std::string& text) {
  const fs::path path = fresh_temp_dir("hardening_cli_cluster") / (name + ".yaml");
  write_text(path, text);
  return path.string();
}

}  // namespace

TEST_CASE("numbers: whole-text parsing, ranges and overflow-safe products", "[hardening]") {
  CHECK(parse_finite("2.5") == 2.5);
  CHECK(parse_finite("-1e3") == -1000);
  for (const char* bad : {"", " 1", "1 ", "nan", "NaN", "inf", "-inf", "1e999", "3x", "0x", ","})
    CHECK_FALSE(parse_finite(bad).has_value());
  CHECK(parse_integer("42") == 42);
  CHECK(parse_integer("-7") == -7);
  for (const char* bad : {"", "1.5", "99999999999999999999", " 3", "3 ", "1e3", "abc"})
    CHECK_FALSE(parse_integer(bad).has_value());
  CHECK(number_problem(5, 0, 10).empty());
  CHECK(number_problem(std::nan(""), 0, 10) == "nan is not a finite number");
  CHECK(number_problem(-5, 0, 3600) == "-5 is out of range [0, 3600]");
  CHECK(range_text(0, 1.7976931348623157e308) == "[0, 1.79769e+308]");
  CHECK(checked_product(1 << 20, 1 << 10, int64_t(1) << 30, "x") == int64_t(1) << 30);
  CHECK_THROWS_WITH(
      checked_product(int64_t(1) << 40, int64_t(1) << 40, int64_t(1) << 62, "--nodes x --per-node"),
      Catch::Contains("--nodes x --per-node = 1099511627776 x 1099511627776 is more "
                      "than"));
  CHECK_THROWS(checked_product(3, 5, 14, "x"));
}

TEST_CASE("trainer CLI: option errors exit 1 with one error line, --help exits 0", "[hardening]") {
  require_refused({"plan", kGpt, "--per-node", "99999999999999999999"},
                  {"--per-node", "is not a whole number in [1, 1024]"});
  require_refused({"plan", kGpt, "--bogus"}, {"--bogus", "`trainer plan --help`"});
  require_refused({"launch"}, {"--nproc-per-node"});
  require_refused({"sample", kGpt, "--checkpoint", "x", "--temperature", "nan"},
                  {"--temperature", "'nan' is not a finite number in [0, 1e+06]"});
  require_refused({"sample", kGpt, "--checkpoint", "x", "--tokens", "-1"}, {"--tokens"});
  require_refused({}, {"subcommand"});
  ProcessResult help = run_bounded({"plan", "--help"});
  CHECK(help.code == 0);
  CHECK(help.output.find("--pp") != std::string::npos);
}

TEST_CASE("trainer plan: hostile counts and times are refused before any work", "[hardening]") {
  require_refused({"plan", kGpt, "--nodes", "1", "--per-node", "2147483647"},
                  {"--per-node", "'2147483647'", "[1, 1024]"});
  require_refused({"plan", kGpt, "--pp", "100000"}, {"--pp", "[1, 4096]"});
  require_refused({"plan", kGpt, "--pp", "2", "--micro-batches", "2000000000"},
                  {"--micro-batches", "[1, 65536]"});
  require_refused(
      {"plan", kGpt, "--pp", "2", "--schedule", "interleaved", "--chunks", "2000000000"},
      {"--chunks", "[1, 1024]"});
  require_refused({"plan", kGpt, "--fwd-ms", "1e300"}, {"--fwd-ms", "'1e300'"});
  require_refused({"plan", kGpt, "--fwd-ms", ""}, {"--fwd-ms", "''"});
  require_refused({"plan", kGpt, "--bwd-ms", "1,nan"}, {"--bwd-ms", "'nan'"});
  require_refused({"plan", kGpt, "--nodes", "65536", "--per-node", "1024"},
                  {"--nodes x --per-node", "65536 x 1024", "131072"});
  // Within every option's range, a schedule too large to build is refused by
  // its size, as training refuses it.
  require_refused({"plan", kGpt, "--pp", "4096", "--micro-batches", "65536"},
                  {"4096 stages x 65536 micro-batches", "262144"});
  // Training builds its schedules with the same generator and bound.
  CHECK_THROWS_WITH(parallel::make_schedule("1f1b", 4096, 65536),
                    Catch::Contains("4096 stages x 65536 micro-batches x 1 chunks"));
  CHECK(parallel::make_schedule("gpipe", 2, 4).stages.size() == 2);
}

TEST_CASE("trainer plan: the largest accepted inputs answer within seconds", "[hardening]") {
  // The largest schedule (2^18 forward passes) and the largest cluster.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"plan", kGpt, "--pp", "64", "--micro-batches", "4096"},
        std::vector<std::string>{"plan", kGpt, "--pp", "16", "--micro-batches", "4096",
                                 "--schedule", "interleaved", "--chunks", "4"},
        std::vector<std::string>{"plan", kGpt, "--nodes", "128", "--per-node", "1024",
                                 "training.global_batch=1048576"},
        std::vector<std::string>{"plan", kGpt, "--nodes", "65536", "--per-node", "2",
                                 "training.global_batch=16777216"}}) {
    ProcessResult r = run_bounded(args, 60);
    INFO(r.output);
    CHECK(r.code == 0);
    CHECK(r.seconds < 10);  // under a second here; the margin is the noisy CI machine
  }
}

TEST_CASE("trainer plan: cluster files with hostile keys and figures are refused", "[hardening]") {
  auto refused = [&](const std::string& text, const std::vector<std::string>& texts) {
    const std::string path = write_cluster("c", text);
    std::vector<std::string> expected{path};
    expected.insert(expected.end(), texts.begin(), texts.end());
    require_refused({"plan", kGpt, "--nodes", "2", "--cluster", path}, expected);
  };
  refused("[a, b]: 3\n", {":1:", "a key of the cluster file is a list"});
  refused("{a: 1}: 3\n", {":1:", "is a map"});
  refused("peak_tflops: 300\npeak_tflops: 400\n", {":2:", "'peak_tflops' is given twice", ":1"});
  refused("intra: {gbps: 1, gbps: 2}\n", {"'intra.gbps' is given twice"});
  refused("peak_tflops: 1e308\n", {":1:", "'peak_tflops'", "[0.001, 1e+06]", "'1e308'"});
  refused("memory_gib: 1e-300\n", {"'memory_gib'", "'1e-300'"});
  refused("inter: {alpha_us: .nan}\n", {"'inter.alpha_us'", "'.nan'"});
  refused("intra: {gbps: .inf}\n", {"'intra.gbps'"});
  refused("achievable: 2\n", {"'achievable'", "[0.001, 1]"});
  refused("per_node: 100000\n", {"'per_node'", "[1, 1024]"});
  refused("per_node: 2.5\n", {"whole number"});
  refused("peak_tflops: ''\n", {"'peak_tflops'"});

  // The smallest memory accepted fits no plan: the table says why, and the
  // command fails.
  const std::string tiny = write_cluster("tiny", "memory_gib: 0.001\n");
  ProcessResult none = run_bounded({"plan", kGpt, "--nodes", "1", "--cluster", tiny});
  INFO(none.output);
  CHECK(none.code == 1);
  CHECK(none.output.find("(no plan fits)") != std::string::npos);
  CHECK(none.output.find("error: trainer plan: no layout of 1 nodes fits") != std::string::npos);

  // Figures at the edges of their ranges give finite, short step times.
  const std::string edges = write_cluster(
      "edges", "peak_tflops: 1e6\nmemory_gib: 1e6\nintra: {alpha_us: 0.001, gbps: 1e7}\n");
  ProcessResult ok = run_bounded({"plan", kGpt, "--nodes", "2", "--cluster", edges});
  INFO(ok.output);
  CHECK(ok.code == 0);
  CHECK(ok.output.find("inf") == std::string::npos);
  CHECK(ok.output.find("nan") == std::string::npos);
}

TEST_CASE("cluster file: parsed figures stay inside their ranges", "[hardening]") {
  const parallel::ClusterSpec base = parallel::cluster_for("a100-80gb", 2);
  const parallel::ClusterSpec c =
      parse_cluster_file("per_node: 4\np2p: {alpha_us: 5, gbps: 100}\n", "c.yaml", base);
  CHECK(c.per_node == 4);
  CHECK(c.intra_p2p.alpha_us == 5);
  CHECK(c.intra_p2p.gbps == 100);
  CHECK(c.device.name == "a100-80gb (cluster file)");
  CHECK_THROWS_WITH(parse_cluster_file("device: [a]\n", "c.yaml", base),
                    Catch::Contains("c.yaml:1: key 'device' expects a device name"));
  CHECK_THROWS_WITH(parse_cluster_file("intra: 5\n", "c.yaml", base),
                    Catch::Contains("key 'intra' expects a map"));
  CHECK_THROWS_WITH(parse_cluster_file("- 1\n", "c.yaml", base),
                    Catch::Contains("a cluster file is a YAML map"));
}

TEST_CASE("trainer plan --trace: a directory or a missing directory leaves nothing behind",
          "[hardening]") {
  const fs::path dir = fresh_temp_dir("hardening_cli_trace");
  require_refused({"plan", kGpt, "--pp", "2", "--trace", dir.string()},
                  {"--trace", "is a directory; give a file name"});
  CHECK_FALSE(fs::exists(dir.string() + ".tmp"));
  CHECK(fs::is_empty(dir));
  require_refused({"plan", kGpt, "--pp", "2", "--trace", (dir / "no" / "plan.json").string()},
                  {"--trace", "does not exist"});
  CHECK(fs::is_empty(dir));
  ProcessResult r = run_bounded({"plan", kGpt, "--pp", "2", "--trace", (dir / "p.json").string()});
  CHECK(r.code == 0);
  CHECK(fs::exists(dir / "p.json"));
}

TEST_CASE("trainer launch: hostile options are refused before any rank starts", "[hardening]") {
  const std::vector<std::string> tail{"--", "train", kRecipes + "fmnist_mlp.yaml"};
  auto launch = [&](std::vector<std::string> options) {
    std::vector<std::string> args{"launch"};
    args.insert(args.end(), options.begin(), options.end());
    args.insert(args.end(), tail.begin(), tail.end());
    return args;
  };
  require_refused({"launch", "--nproc-per-node", "2"}, {"give the ranks' command after --"});
  require_refused({"launch", "--nproc-per-node", "2", "--", "trian", "x.yaml"},
                  {"'trian' is not a trainer command"});
  require_refused(launch({"--nproc-per-node", "4000"}),
                  {"--nproc-per-node 4000", "ranks per core", "--oversubscribe"});
  require_refused(launch({"--nproc-per-node", "10000"}), {"--nproc-per-node", "[1, 4096]"});
  require_refused(launch({"--nproc-per-node", "2", "--grace-seconds", "-5"}),
                  {"--grace-seconds", "'-5'", "[0, 3600]"});
  require_refused(launch({"--nproc-per-node", "2", "--grace-seconds", "nan"}),
                  {"--grace-seconds", "'nan'"});
  require_refused(launch({"--nproc-per-node", "2", "--settle-seconds", "nan"}),
                  {"--settle-seconds", "'nan'"});
  require_refused(launch({"--nproc-per-node", "2", "--heartbeat-timeout", "nan"}),
                  {"--heartbeat-timeout", "'nan'"});
  require_refused(launch({"--nproc-per-node", "2", "--heartbeat-timeout", "1e300"}),
                  {"--heartbeat-timeout", "[0, 86400]"});
  require_refused(launch({"--nproc-per-node", "2", "--nnodes", "0"}), {"--nnodes", "'0'"});
  require_refused(launch({"--nproc-per-node", "2", "--nnodes", "3:2"}), {"MIN is above MAX"});
  require_refused(launch({"--nproc-per-node", "2", "--nnodes", "99999999999"}), {"--nnodes"});
  require_refused(launch({"--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2",
                          "--master-port", "29999"}),
                  {"--node-rank 2 is not below --nnodes 2"});
  require_refused(launch({"--nproc-per-node", "2", "--max-restarts", "-1"}), {"--max-restarts"});
  require_refused(launch({"--nproc-per-node", "1024", "--nnodes", "2048", "--oversubscribe",
                          "--master-port", "29999"}),
                  {"--nnodes x --nproc-per-node", "1048576"});
}

TEST_CASE("trainer plan and launch: a battery of numbers is answered cleanly", "[hardening]") {
  const std::vector<std::string> values{"0",
                                        "-1",
                                        "1",
                                        "3",
                                        "1e9",
                                        "-0",
                                        "0.5",
                                        "1e-9",
                                        "nan",
                                        "inf",
                                        "2147483648",
                                        "",
                                        "0x10",
                                        "1,2",
                                        " 2",
                                        "1e308",
                                        "9223372036854775808"};
  for (const char* option : {"--pp", "--micro-batches", "--chunks", "--fwd-ms", "--top"})
    for (const std::string& value : values) {
      std::vector<std::string> args{"plan", kGpt, option, value};
      if (std::string(option) == "--chunks") args.insert(args.end(), {"--schedule", "interleaved"});
      ProcessResult r = run_bounded(args, 30);
      INFO(option << " " << value << "\n" << r.output);
      CHECK(r.seconds < 10);
      if (r.code == 1) CHECK(r.output.find("error: ") != std::string::npos);
    }
  for (const char* option :
       {"--nproc-per-node", "--grace-seconds", "--settle-seconds", "--heartbeat-timeout",
        "--max-restarts", "--master-port", "--node-rank"})
    for (const std::string& value : values) {
      // With --program true a launch that is accepted runs `true` (and a
      // command is always given): nothing long-lived starts.
      std::vector<std::string> args{"launch", option, value, "--program", "/bin/true"};
      if (std::string(option) != "--nproc-per-node")
        args.insert(args.begin() + 1, {"--nproc-per-node", "1"});
      ProcessResult r = run_bounded(args, 30);
      INFO(option << " " << value << "\n" << r.output);
      if (r.code == 1) CHECK(r.output.find("error: ") != std::string::npos);
    }
}

TEST_CASE("recipes: non-finite numbers are refused by every float key", "[hardening]") {
  // (yaml-cpp reads "nan" as text, refused as not a number; .nan and .inf are YAML's.)
  for (const char* value : {".nan", ".NaN", ".inf", "-.inf"}) {
    ProcessResult r = run_bounded(
        {"train", kRecipes + "fmnist_mlp.yaml", cat("optimizer.lr=", value), "--dry-run"});
    INFO(r.output);
    require_error(r, {"optimizer.lr", "is not a finite number"});
  }
}
