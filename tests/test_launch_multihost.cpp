// Multi-host launches, tested on one machine: the launch scripts of
// scripts/ and real launchers start the trainer, and each run is compared
// with one process training the same global batch.
//   [netns]   two "hosts" are network namespaces joined by a veth pair
//             (tests/netns_hosts.sh, removed at exit); one `trainer launch
//             --nnodes 2` per host, then scripts/launch_hosts.sh over a
//             stand-in for ssh into them: training as one process, bit for
//             bit the same ranks on one host with the same allreduce, a
//             killed rank named with its host, a restart that ends bit for
//             bit as an uninterrupted run. Which UCX transport each pair of
//             ranks uses is read from the ranks' debug log: TCP across the
//             veth, shared memory inside a host.
//   [mpirun]  scripts/mpirun.sh on Debian's OpenMPI, 2 and 4 ranks; its
//             --max-restarts loop (a stand-in trainer that fails twice).
//   [scripts] the scripts' refusals of a missing recipe, hostfile or allocation.
//   [slurm]   a real Slurm (munged, slurmctld, slurmd started here with a
//             configuration of this test, tests/slurm_cluster.sh) running
//             scripts/slurm/train.sbatch on one node and on the two
//             namespace hosts, and the script's --max-restarts loop.
// A case that cannot run here (not root, no `ip netns`, no mpirun, daemons
// that do not start) prints "SKIPPED: <what is missing>" and exits 77, which
// ctest reports as skipped.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "bench/programs.h"
#include "tests/runs.h"
#include "trainer/checkpoint.h"

using namespace trainer;
using trainer::testing::ProcessResult;
namespace fs = std::filesystem;

namespace {

const std::string kSource = TRAINER_SOURCE_DIR;
const std::string kNetnsHosts = kSource + "/tests/netns_hosts.sh";

[[noreturn]] void skip(const std::string& why) {
  std::printf("SKIPPED: %s\n", why.c_str());
  std::fflush(stdout);
  std::exit(77);
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_file(const fs::path& path, const std::string& text, bool executable = false) {
  std::ofstream(path) << text;
  if (executable) fs::permissions(path, fs::perms::owner_all, fs::perm_options::add);
}

bool on_path(const std::string& program) {
  return testing::run_process({"/bin/sh", "-c", "command -v " + program}).code == 0;
}

// Fake Fashion-MNIST (random pixels) shared by the cases: loads in no time.
std::string fake_data() {
  static const std::string dir = [] {
    fs::path d = testing::fresh_temp_dir("mh_data");
    bench::write_fake_fashion_mnist(d.string(), 512, 64);
    return d.string();
  }();
  return dir;
}

// `trainer train` of the MLP recipe with SGD (its update is linear in the
// gradient, so any number of ranks agrees with one process to rounding),
// 32 samples per step over every rank, a loss logged every step.
std::vector<std::string> train_args(const fs::path& out, int steps = 6) {
  return {"train",
          kSource + "/recipes/fmnist_mlp.yaml",
          "output_dir=" + out.string(),
          "data.root=" + fake_data(),
          "training.threads=1",
          "data.workers=1",
          "training.global_batch=32",
          cat("training.steps=", steps),
          "training.log_every=1",
          "optimizer.name=sgd",
          "optimizer.lr=0.05"};
}

// One process's run of train_args, computed once.
fs::path reference_run() {
  static const fs::path dir = [] {
    fs::path d = testing::fresh_temp_dir("mh_reference", false);
    ProcessResult r = testing::run_trainer(train_args(d), {.timeout_s = 120});
    INFO(r.output);
    REQUIRE(r.code == 0);
    return d;
  }();
  return dir;
}

// The run in dir ended where the one-process run did: the same losses step
// by step and the same weights, within float rounding (the ranks' gradients
// are summed in another order).
void check_matches_reference(const fs::path& dir) {
  const fs::path one = reference_run();
  testing::check_close(testing::step_log(one).loss, testing::step_log(dir).loss, 1e-5, "loss");
  testing::check_models(testing::model_at(one, 6), testing::model_at(dir, 6), 1e-5);
}

// The "transport: rank P on ... over ..." lines of the ranks' debug logs
// (comm/transport.cpp), by (rank, peer): where the peer is and the transports.
struct Route {
  std::string where;                    // "this host" or "another host"
  std::vector<std::string> transports;  // "tcp/mhveth", "posix/memory", ...
};
std::map<std::pair<int, int>, Route> routes(const std::string& log) {
  std::map<std::pair<int, int>, Route> out;
  const std::regex line(
      R"(\[rank (\d+)\] comm debug: transport: rank (\d+) on (this host|another host) over ([^\n]*))");
  for (std::sregex_iterator it(log.begin(), log.end(), line), end; it != end; ++it) {
    Route route{(*it)[3], {}};
    std::istringstream list((*it)[4].str());
    for (std::string t; std::getline(list >> std::ws, t, ',');) route.transports.push_back(t);
    out[{std::stoi((*it)[1]), std::stoi((*it)[2])}] = route;
  }
  return out;
}

bool is_shared_memory(const std::string& transport) {
  const std::string tl = transport.substr(0, transport.find('/'));
  return tl == "posix" || tl == "sysv" || tl == "cma" || tl == "xpmem" || tl == "knem";
}

// Ranks 2h and 2h + 1 run on host h: pairs on one host use shared memory
// only, pairs across hosts TCP over the veth only.
void check_routes(const std::string& log, int world) {
  auto found = routes(log);
  INFO("the ranks' transport lines:\n" << log);
  for (int r = 0; r < world; ++r) {
    for (int p = 0; p < world; ++p) {
      if (p == r) continue;
      INFO("rank " << r << " to rank " << p);
      REQUIRE(found.count({r, p}) == 1);
      const Route& route = found[{r, p}];
      REQUIRE(!route.transports.empty());
      if (r / 2 == p / 2) {
        CHECK(route.where == "this host");
        for (const std::string& t : route.transports) CHECK(is_shared_memory(t));
      } else {
        CHECK(route.where == "another host");
        for (const std::string& t : route.transports) CHECK(t == "tcp/mhveth");
      }
    }
  }
}

// A helper script that sets something up, prints "ready ...", and undoes it
// when its stdin ends (tests/netns_hosts.sh guard, tests/slurm_cluster.sh):
// it runs while this object lives, and cleans up also when this process
// dies, since its stdin is a pipe only this process writes. A script that
// exits 77 ("SKIPPED: <why>") skips the test.
class Guard {
 public:
  explicit Guard(const std::vector<std::string>& argv) {
    int in[2], out[2];
    REQUIRE(::pipe2(in, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      ::dup2(out[1], 2);
      std::vector<char*> args;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    keep_ = in[1];
    std::string output;
    char buf[512];
    size_t ready = std::string::npos;
    for (ssize_t n; ready == std::string::npos && (n = ::read(out[0], buf, sizeof buf)) > 0;) {
      output.append(buf, size_t(n));
      ready = output.find("ready");
      if (ready != std::string::npos && output.find('\n', ready) == std::string::npos)
        ready = std::string::npos;  // the line is not complete yet
    }
    ::close(out[0]);
    if (ready != std::string::npos) {
      ready_ = output.substr(ready, output.find('\n', ready) - ready);
      return;
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
      const size_t at = output.find("SKIPPED: ");
      skip(at == std::string::npos ? output : output.substr(at + 9));
    }
    FAIL(argv[1] << " failed:\n" << output);
  }
  ~Guard() {
    if (keep_ >= 0) ::close(keep_);
    if (pid_ > 0) ::waitpid(pid_, nullptr, 0);
  }
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;
  // The "ready ..." line.
  const std::string& ready() const { return ready_; }

 private:
  pid_t pid_ = -1;
  int keep_ = -1;
  std::string ready_;
};

// The two namespaces of tests/netns_hosts.sh, alive while this object is.
class NetnsHosts {
 public:
  NetnsHosts()
      : prefix_(cat("trnmh", ::getpid())), guard_({"/bin/bash", kNetnsHosts, "guard", prefix_}) {}

  // argv run on host h (0: 10.201.0.1, 1: 10.201.0.2).
  std::vector<std::string> on_host(int h, const std::vector<std::string>& argv) const {
    std::vector<std::string> out{"/bin/bash", kNetnsHosts, "run", prefix_, std::to_string(h)};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }
  // launch_hosts.sh --ssh: "ssh" into the hosts by address.
  std::string ssh() const { return cat("/bin/bash ", kNetnsHosts, " ssh ", prefix_); }
  const std::string& prefix() const { return prefix_; }

 private:
  std::string prefix_;
  Guard guard_;
};

// The pid of a process whose environment holds every one of vars ("RANK=3"), or -1.
pid_t process_with_environment(const std::vector<std::string>& vars) {
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string env = read_file(entry.path() / "environ");
    std::set<std::string> have;
    for (size_t at = 0; at < env.size();) {
      const size_t end = env.find('\0', at);
      have.insert(env.substr(at, end - at));
      at = end == std::string::npos ? env.size() : end + 1;
    }
    bool all = !have.empty();
    for (const std::string& v : vars) all = all && have.count(v) == 1;
    if (all) return pid_t(std::stol(name));
  }
  return -1;
}

}  // namespace

namespace {

// `trainer launch --nnodes 2` of host h (rendezvous at host 0, port), then args.
std::vector<std::string> launch_on_host(int h, int port, int nproc, const std::string& grace,
                                        const std::vector<std::string>& args) {
  std::vector<std::string> argv{TRAINER_BINARY,
                                "launch",
                                "--nnodes",
                                "2",
                                "--node-rank",
                                cat(h),
                                "--master-addr",
                                "10.201.0.1",
                                "--master-port",
                                cat(port),
                                "--nproc-per-node",
                                cat(nproc),
                                "--grace-seconds",
                                grace,
                                "--"};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

// One `trainer launch --nnodes 2 --nproc-per-node 2` on each host of hosts,
// training train_args(dir) plus extra; the launchers' outcomes.
std::vector<ProcessResult> train_on_two_hosts(const NetnsHosts& hosts, const fs::path& dir,
                                              const std::vector<std::string>& extra = {}) {
  std::vector<testing::Child> launchers;
  for (int h = 0; h < 2; ++h) {
    std::vector<std::string> args = train_args(dir);
    args.insert(args.end(), extra.begin(), extra.end());
    launchers.push_back(testing::start(hosts.on_host(h, launch_on_host(h, 29500, 2, "5", args)),
                                       {{"TRAINER_LOG_LEVEL", "debug"}}));
  }
  std::vector<ProcessResult> outcomes;
  for (const testing::Child& launcher : launchers)
    outcomes.push_back(testing::finish(launcher, 180));
  return outcomes;
}

}  // namespace

TEST_CASE("multihost: two namespaces with 2 ranks each train like one process, TCP between them",
          "[netns]") {
  NetnsHosts hosts;
  const fs::path dir = testing::fresh_temp_dir("mh_netns", false);
  std::vector<ProcessResult> host = train_on_two_hosts(hosts, dir);
  INFO("host 0:\n" << host[0].output << "\nhost 1:\n" << host[1].output);
  REQUIRE(host[0].code == 0);
  REQUIRE(host[1].code == 0);
  CHECK(host[0].output.find("parallel layout: world 4 (dp=4") != std::string::npos);
  // Every rank found its rendezvous at host 0's address.
  for (int r = 0; r < 4; ++r)
    CHECK(host[r / 2].output.find(cat("launcher torchrun: rank ", r, " of 4, local rank ", r % 2,
                                      " of 2, store at 10.201.0.1:29500")) != std::string::npos);
  check_routes(host[0].output + host[1].output, 4);
  check_matches_reference(dir);
}

TEST_CASE("multihost: with the ring allreduce two hosts are bit for bit 4 ranks on one host",
          "[netns]") {
  // The same algorithm adds the gradients in the same order whichever
  // transport carries them.
  NetnsHosts hosts;
  const fs::path apart = testing::fresh_temp_dir("mh_ring_hosts", false);
  const fs::path together = testing::fresh_temp_dir("mh_ring_one_host", false);
  std::vector<ProcessResult> host = train_on_two_hosts(hosts, apart, {"parallel.allreduce=ring"});
  INFO("host 0:\n" << host[0].output << "\nhost 1:\n" << host[1].output);
  REQUIRE(host[0].code == 0);
  REQUIRE(host[1].code == 0);
  std::vector<std::string> args = train_args(together);
  args.push_back("parallel.allreduce=ring");
  ProcessResult one_host = testing::run_ranks(4, args, {.timeout_s = 180});
  INFO("one host:\n" << one_host.output);
  REQUIRE(one_host.code == 0);
  testing::check_close(testing::step_log(together).loss, testing::step_log(apart).loss, 0, "loss");
  testing::check_models(testing::model_at(together, 6), testing::model_at(apart, 6), 0);
}

namespace {

// scripts/launch_hosts.sh over the two namespaces (a hostfile of their
// addresses in work), 2 ranks per host; options go to the script,
// rank_args to every rank.
std::vector<std::string> launch_hosts(const NetnsHosts& hosts, const fs::path& work,
                                      const std::vector<std::string>& options,
                                      const std::vector<std::string>& rank_args) {
  write_file(work / "hosts", "# the two namespaces\n10.201.0.1\n10.201.0.2  # second\n");
  std::vector<std::string> argv{"/bin/bash",
                                kSource + "/scripts/launch_hosts.sh",
                                "--hostfile",
                                (work / "hosts").string(),
                                "--nproc-per-node",
                                "2",
                                "--grace-seconds",
                                "5",
                                "--trainer",
                                TRAINER_BINARY,
                                "--ssh",
                                hosts.ssh()};
  argv.insert(argv.end(), options.begin(), options.end());
  argv.push_back("--");
  argv.insert(argv.end(), rank_args.begin(), rank_args.end());
  return argv;
}

// Once job's output shows text, SIGKILLs the rank of the job on port of
// the namespaces (found by its environment); false when that never happens.
bool kill_rank_after(const testing::Child& job, const std::string& text, int rank,
                     const std::string& port) {
  for (int i = 0; i < 3000; ++i) {
    if (testing::output_of(job).find(text) != std::string::npos) {
      const pid_t victim = process_with_environment(
          {cat("RANK=", rank), "MASTER_ADDR=10.201.0.1", "MASTER_PORT=" + port});
      if (victim > 0) return ::kill(victim, SIGKILL) == 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

}  // namespace

TEST_CASE("multihost: launch_hosts.sh trains on two hosts and stops both when a rank dies",
          "[netns]") {
  NetnsHosts hosts;
  const fs::path work = testing::fresh_temp_dir("mh_hosts");
  const fs::path dir = work / "run";
  ProcessResult ok =
      testing::run_process(launch_hosts(hosts, work, {"--master-port", "29501"}, train_args(dir)),
                           {.env = {{"TRAINER_LOG_LEVEL", "debug"}}, .timeout_s = 180});
  INFO(ok.output);
  REQUIRE(ok.code == 0);
  // Each host's lines carry its node rank and address.
  CHECK(ok.output.find("node 0 (10.201.0.1): [rank 1] comm info: launcher torchrun: rank 1 of 4") !=
        std::string::npos);
  CHECK(ok.output.find("node 1 (10.201.0.2): [rank 3] comm info: launcher torchrun: rank 3 of 4") !=
        std::string::npos);
  check_routes(ok.output, 4);
  check_matches_reference(dir);

  // A long run; rank 3 (host 1) is killed once it trains.
  const std::string port = cat(30000 + ::getpid() % 20000);
  testing::Child job = testing::start(
      launch_hosts(hosts, work, {"--master-port", port}, train_args(work / "killed", 100000)));
  const bool killed = kill_rank_after(job, "step 3/", 3, port);
  const auto killed_at = std::chrono::steady_clock::now();
  ProcessResult failed = testing::finish(job, killed ? 60 : 0);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  INFO(failed.output);
  REQUIRE(killed);
  CHECK(failed.code != 0);
  // The launcher of host 1 names the rank; the script names the host.
  CHECK(failed.output.find("node 1 (10.201.0.2): trainer launch: rank 3 exited with code 137") !=
        std::string::npos);
  CHECK(std::regex_search(
      failed.output,
      std::regex(R"(launch_hosts.sh: node [01] \(10\.201\.0\.[12]\) exited with code [1-9])")));
  CHECK(seconds < 30);
  // Nothing of the job is left on either host.
  CHECK(process_with_environment({"MASTER_ADDR=10.201.0.1", "MASTER_PORT=" + port}) == -1);
}

TEST_CASE(
    "multihost: launch_hosts.sh --max-restarts resumes both hosts after a rank dies, "
    "bit for bit",
    "[netns]") {
  NetnsHosts hosts;
  const fs::path work = testing::fresh_temp_dir("mh_restart");
  // 300 steps (about 10 s), a checkpoint every 25.
  auto args = [&](const fs::path& out) {
    std::vector<std::string> a = train_args(out, 300);
    a.push_back("training.checkpoint_every=25");
    return a;
  };
  // The allreduce algorithms across hosts come from a cost model. Given one
  // (a second per message: recursive doubling for every bucket), not
  // measured, the uninterrupted run and the restarted one choose alike
  // however loaded the machine is.
  const std::vector<std::pair<std::string, std::string>> slow_links{
      {"TRAINER_LINK_MODEL", "1000000,1,10"}};
  ProcessResult whole = testing::run_process(
      launch_hosts(hosts, work, {"--master-port", "29502"}, args(work / "whole")),
      {.env = slow_links, .timeout_s = 240});
  INFO(whole.output);
  REQUIRE(whole.code == 0);

  const std::string port = cat(30000 + ::getpid() % 20000);
  testing::Child job =
      testing::start(launch_hosts(hosts, work, {"--master-port", port, "--max-restarts", "1"},
                                  args(work / "restarted")),
                     slow_links);
  const bool killed = kill_rank_after(job, "step 100/", 3, port);
  ProcessResult restarted = testing::finish(job, killed ? 240 : 0);
  INFO(restarted.output);
  REQUIRE(killed);
  REQUIRE(restarted.code == 0);
  CHECK(restarted.output.find("node 1 (10.201.0.2): trainer launch: rank 3 exited with code 137") !=
        std::string::npos);
  // Both hosts' launchers started their ranks again: rank 0, on host 0, resumed.
  CHECK(restarted.output.find("node 0 (10.201.0.1): resumed from " +
                              (work / "restarted" / "checkpoints" / "step_").string()) !=
        std::string::npos);
  testing::check_models(testing::model_at(work / "whole", 300),
                        testing::model_at(work / "restarted", 300), 0);

  // Resumed where another model would choose the ring for the buckets (1 us
  // a message, 1 GB/s): the checkpoint's model is kept, and the run ends on
  // the same bits.
  const std::vector<std::string> kept =
      CheckpointDir((work / "restarted" / "checkpoints").string(), 100).complete();
  REQUIRE(kept.size() >= 2);
  std::vector<std::string> again = args(work / "again");
  again.insert(again.begin() + 2, {"--resume", kept.front()});
  ProcessResult resumed =
      testing::run_process(launch_hosts(hosts, work, {"--master-port", "29503"}, again),
                           {.env = {{"TRAINER_LINK_MODEL", "1,1,10"}}, .timeout_s = 240});
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  CHECK(
      resumed.output.find("node 0 (10.201.0.1): allreduce cost model of ranks 0 1 2 3 kept from "
                          "the checkpoint: alpha 1000000.0 us, beta 1.00 GB/s, gamma 10.00 GB/s") !=
      std::string::npos);
  testing::check_models(testing::model_at(work / "whole", 300),
                        testing::model_at(work / "again", 300), 0);
}

TEST_CASE("multihost: mpirun.sh starts 2 ranks on each of two hosts and trains like one process",
          "[netns]") {
  if (!on_path("mpirun")) skip("mpirun is not installed (apt-get install openmpi-bin)");
  // mpirun runs on host 0 and reaches host 1 through its rsh agent: the
  // namespaces' stand-in for ssh.
  NetnsHosts hosts;
  const fs::path work = testing::fresh_temp_dir("mh_mpirun_hosts");
  write_file(work / "hosts", "10.201.0.1 slots=2\n10.201.0.2 slots=2\n");
  const fs::path dir = work / "run";
  std::vector<std::string> argv{"/bin/bash",
                                kSource + "/scripts/mpirun.sh",
                                "--hostfile",
                                (work / "hosts").string(),
                                "-np",
                                "4",
                                "--trainer",
                                TRAINER_BINARY,
                                "--oversubscribe",
                                "--mca",
                                "plm_rsh_agent",
                                hosts.ssh()};
  if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
  argv.push_back("--");
  std::vector<std::string> train = train_args(dir);
  argv.insert(argv.end(), train.begin() + 1, train.end());  // without "train"
  ProcessResult r = testing::run_process(
      hosts.on_host(0, argv), {.env = {{"TRAINER_LOG_LEVEL", "debug"}}, .timeout_s = 180});
  INFO(r.output);
  REQUIRE(r.code == 0);
  for (int rank = 0; rank < 4; ++rank)
    CHECK(r.output.find(cat("launcher openmpi: rank ", rank, " of 4, local rank ", rank % 2,
                            " of 2, store at 10.201.0.1:")) != std::string::npos);
  check_routes(r.output, 4);
  check_matches_reference(dir);
}

TEST_CASE("mpirun: scripts/mpirun.sh trains on 2 and 4 ranks like one process", "[mpirun]") {
  if (!on_path("mpirun")) skip("mpirun is not installed (apt-get install openmpi-bin)");
  const fs::path work = testing::fresh_temp_dir("mh_mpirun");
  write_file(work / "hosts", "localhost slots=4\n");
  for (int np : {2, 4}) {
    INFO(np << " ranks");
    const fs::path dir = work / cat("np", np);
    std::vector<std::string> argv{"/bin/bash",
                                  kSource + "/scripts/mpirun.sh",
                                  "--hostfile",
                                  (work / "hosts").string(),
                                  "-np",
                                  cat(np),
                                  "--trainer",
                                  TRAINER_BINARY,
                                  "--oversubscribe"};
    if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
    argv.push_back("--");
    std::vector<std::string> train = train_args(dir);
    argv.insert(argv.end(), train.begin() + 1, train.end());  // without "train"
    ProcessResult r = testing::run_process(argv, {.timeout_s = 180});
    INFO(r.output);
    REQUIRE(r.code == 0);
    for (int rank = 0; rank < np; ++rank)
      CHECK(r.output.find(cat("launcher openmpi: rank ", rank, " of ", np)) != std::string::npos);
    CHECK(r.output.find(cat("parallel layout: world ", np, " (dp=", np)) != std::string::npos);
    check_matches_reference(dir);
  }
}

TEST_CASE("scripts: the launch scripts refuse a missing recipe, hostfile or allocation",
          "[scripts]") {
  const fs::path work = testing::fresh_temp_dir("mh_refuse");
  write_file(work / "hosts", "localhost slots=2\n");
  const std::string recipe = kSource + "/recipes/fmnist_mlp.yaml";
  const std::string hosts = (work / "hosts").string(), missing = (work / "missing.yaml").string();
  const std::string sbatch = kSource + "/scripts/slurm/train.sbatch";
  const std::string mpirun = kSource + "/scripts/mpirun.sh";
  const std::string launch_hosts = kSource + "/scripts/launch_hosts.sh";
  struct Refusal {
    std::vector<std::string> argv;
    std::vector<std::pair<std::string, std::string>> env;
    std::string message;
  };
  const std::vector<Refusal> refusals{
      {{sbatch, recipe}, {}, "error: no Slurm allocation"},
      {{sbatch}, {{"SLURM_JOB_ID", "7"}}, "error: no recipe"},
      {{sbatch, missing}, {{"SLURM_JOB_ID", "7"}}, "error: recipe " + missing + " not found"},
      {{mpirun, recipe}, {}, "error: no hostfile"},
      {{mpirun, "--hostfile", missing, recipe}, {}, "error: hostfile " + missing + " not found"},
      {{mpirun, "--hostfile", hosts}, {}, "error: no recipe"},
      {{mpirun, "--hostfile", hosts, missing}, {}, "error: recipe " + missing + " not found"},
      {{launch_hosts, "--", "train", recipe}, {}, "error: no hostfile"},
      {{launch_hosts, "--hostfile", missing, "--", "train", recipe}, {}, "error: hostfile"},
      {{launch_hosts, "--hostfile", hosts, "--", "train"}, {}, "error: no recipe"},
      {{launch_hosts, "--hostfile", hosts, "--", "train", missing}, {}, "error: recipe"},
  };
  for (const Refusal& refusal : refusals) {
    std::vector<std::string> argv{"/bin/bash"};
    argv.insert(argv.end(), refusal.argv.begin(), refusal.argv.end());
    ProcessResult r = testing::run_process(argv, {.env = refusal.env, .timeout_s = 30});
    INFO(argv[1] << " " << (argv.size() > 2 ? argv[2] : "") << ":\n" << r.output);
    CHECK(r.code == 1);
    CHECK(r.output.find(refusal.message) != std::string::npos);
    CHECK(r.output.find("error: ") == r.output.rfind("error: "));  // one line
  }
}

TEST_CASE("scripts: mpirun.sh --max-restarts runs a failed job again with --resume auto",
          "[mpirun]") {
  if (!on_path("mpirun")) skip("mpirun is not installed (apt-get install openmpi-bin)");
  const fs::path work = testing::fresh_temp_dir("mh_restarts");
  write_file(work / "hosts", "localhost slots=1\n");
  const std::string calls = (work / "calls").string();
  const std::string recipe = kSource + "/recipes/fmnist_mlp.yaml";
  // A trainer that records its arguments and fails its first two runs.
  write_file(work / "trainer",
             "#!/bin/sh\n"
             "echo \"run: $*\" >> " +
                 calls +
                 "\n"
                 "[ \"$(grep -c '^run:' " +
                 calls + ")\" -ge 3 ] || exit 3\n",
             true);
  auto run = [&](const std::string& restarts) {
    fs::remove(calls);
    std::vector<std::string> argv{"/bin/bash",      kSource + "/scripts/mpirun.sh",
                                  "--hostfile",     (work / "hosts").string(),
                                  "--max-restarts", restarts,
                                  "--trainer",      (work / "trainer").string()};
    if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
    for (const std::string& a : {std::string("--"), recipe, std::string("optimizer.lr=0.1"),
                                 std::string("--resume"), std::string("old")})
      argv.push_back(a);
    return testing::run_process(argv, {.timeout_s = 120});
  };
  auto count = [](const std::string& text, const std::string& line) {
    size_t n = 0;
    for (size_t at = 0; (at = text.find(line, at)) != std::string::npos; at += line.size()) ++n;
    return n;
  };
  ProcessResult too_few = run("1");
  INFO(too_few.output);
  CHECK(too_few.code == 3);
  CHECK(too_few.output.find("giving up") != std::string::npos);
  CHECK(count(read_file(calls), "run: ") == 2);

  ProcessResult enough = run("2");
  INFO(enough.output);
  CHECK(enough.code == 0);
  const std::string called = read_file(calls);
  INFO(called);
  // The first run as given; the restarts resume from the newest checkpoint instead.
  CHECK(count(called, "run: train " + recipe + " optimizer.lr=0.1 --resume old\n") == 1);
  CHECK(count(called, "run: train " + recipe + " optimizer.lr=0.1 --resume auto\n") == 2);
}

namespace {

// Submits scripts/slurm/train.sbatch with sbatch_args and script_args, waits
// for the job to end (at most timeout_s) and returns its final state
// ("COMPLETED", "FAILED", ...) and its output file.
struct SlurmJob {
  std::string state, output;
};
// Slurm's commands run as given, or through on_host (a command on a namespace host).
SlurmJob run_sbatch(
    const std::vector<std::pair<std::string, std::string>>& env, const fs::path& work,
    const std::vector<std::string>& sbatch_args, const std::vector<std::string>& script_args,
    double timeout_s,
    const std::function<std::vector<std::string>(const std::vector<std::string>&)>& on_host = {}) {
  auto command = [&](const std::vector<std::string>& argv) {
    return on_host ? on_host(argv) : argv;
  };
  std::vector<std::string> argv{"/usr/bin/env", "sbatch", "--parsable", "--chdir=" + work.string(),
                                "--output=" + (work / "job-%j.out").string()};
  argv.insert(argv.end(), sbatch_args.begin(), sbatch_args.end());
  argv.push_back(kSource + "/scripts/slurm/train.sbatch");
  argv.insert(argv.end(), script_args.begin(), script_args.end());
  ProcessResult submitted = testing::run_process(command(argv), {.env = env, .timeout_s = 60});
  INFO(submitted.output);
  REQUIRE(submitted.code == 0);
  const std::string id = submitted.output.substr(0, submitted.output.find_first_of(";\n"));
  const std::regex state(R"(JobState=([A-Z_]+))");
  const auto start = std::chrono::steady_clock::now();
  SlurmJob job;
  for (;;) {
    ProcessResult shown = testing::run_process(
        command({"/usr/bin/env", "scontrol", "-o", "show", "job", id}), {.env = env});
    std::smatch m;
    if (std::regex_search(shown.output, m, state)) job.state = m[1];
    if (job.state != "PENDING" && job.state != "RUNNING" && job.state != "CONFIGURING" &&
        job.state != "COMPLETING" && !job.state.empty())
      break;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >
        timeout_s) {
      testing::run_process(command({"/usr/bin/env", "scancel", id}), {.env = env});
      job.state = "still " + job.state + " after the test's timeout";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  job.output = read_file(work / ("job-" + id + ".out"));
  return job;
}

}  // namespace

TEST_CASE("slurm: train.sbatch trains on a real Slurm like one process, and restarts a failed step",
          "[slurm][slow]") {
  const fs::path work = testing::fresh_temp_dir("mh_slurm");
  Guard cluster({"/bin/bash", kSource + "/tests/slurm_cluster.sh", (work / "cluster").string()});
  const std::string conf = cluster.ready().substr(cluster.ready().find('=') + 1);
  INFO("cluster: " << conf);

  // 4 tasks on the one node, one rank each.
  const fs::path dir = work / "run";
  std::vector<std::string> train = train_args(dir);
  train.erase(train.begin());  // the script runs `trainer train`
  SlurmJob job = run_sbatch({{"SLURM_CONF", conf}, {"TRAINER", TRAINER_BINARY}}, work,
                            {"--nodes=1", "--ntasks-per-node=4"}, train, 300);
  INFO(job.output);
  REQUIRE(job.state == "COMPLETED");
  CHECK(job.output.find("train.sbatch: job ") != std::string::npos);
  for (int r = 0; r < 4; ++r)
    CHECK(job.output.find(cat("launcher slurm: rank ", r, " of 4, local rank ", r, " of 4")) !=
          std::string::npos);
  CHECK(job.output.find("parallel layout: world 4 (dp=4") != std::string::npos);
  check_matches_reference(dir);

  // A trainer that fails its first run: the script runs the step again, resuming.
  const std::string calls = (work / "calls").string();
  write_file(work / "fake_trainer",
             "#!/bin/sh\n"
             "echo \"run: $*\" >> " +
                 calls +
                 "\n"
                 "[ \"$(grep -c '^run:' " +
                 calls + ")\" -ge 2 ] || exit 5\n",
             true);
  const std::string recipe = kSource + "/recipes/fmnist_mlp.yaml";
  SlurmJob restarted = run_sbatch(
      {{"SLURM_CONF", conf}, {"TRAINER", (work / "fake_trainer").string()}}, work,
      {"--nodes=1", "--ntasks-per-node=1"}, {recipe, "seed=3", "--max-restarts", "1"}, 120);
  INFO(restarted.output);
  CHECK(restarted.state == "COMPLETED");
  CHECK(restarted.output.find("the job step failed with code 5; restart 1 of 1") !=
        std::string::npos);
  CHECK(read_file(calls) ==
        "run: train " + recipe + " seed=3\nrun: train " + recipe + " seed=3 --resume auto\n");
}

TEST_CASE("scripts: launch_hosts.sh stops every host when one fails, or on SIGTERM", "[scripts]") {
  // Three "hosts" reached by a stand-in for ssh that runs the command line
  // here, and a stand-in trainer: node FAIL_NODE exits 7, the others run
  // until SIGTERM, as `trainer launch` does.
  const fs::path work = testing::fresh_temp_dir("mh_stop");
  write_file(work / "hosts", "a\nb\nc\n");
  write_file(work / "ssh", "#!/bin/sh\nshift\nexec /bin/sh -c \"$*\"\n", true);
  // Node FAIL_NODE fails once every node has set its trap and started.
  write_file(work / "trainer",
             "#!/bin/bash\n"
             "while [ \"$1\" != -- ]; do [ \"$1\" = --node-rank ] && node=$2; shift; done\n"
             "trap 'echo \"node-rank $node stopped\"; kill $sleeper 2>/dev/null; exit 143' TERM\n"
             "echo \"node-rank $node started\"\n"
             "touch " +
                 (work / "started.").string() +
                 "$node\n"
                 "if [ \"$node\" = \"$FAIL_NODE\" ]; then\n"
                 "  while [ $(ls " +
                 work.string() +
                 " | grep -c started) -lt 3 ]; do sleep 0.05; done\n"
                 "  exit 7\n"
                 "fi\n"
                 "sleep 60 & sleeper=$!\n"
                 "wait\n",
             true);
  const std::vector<std::string> argv{"/bin/bash",
                                      kSource + "/scripts/launch_hosts.sh",
                                      "--hostfile",
                                      (work / "hosts").string(),
                                      "--ssh",
                                      (work / "ssh").string(),
                                      "--trainer",
                                      (work / "trainer").string(),
                                      "--grace-seconds",
                                      "20",
                                      "--",
                                      "train",
                                      kSource + "/recipes/fmnist_mlp.yaml"};

  ProcessResult failed = testing::run_process(argv, {.env = {{"FAIL_NODE", "1"}}, .timeout_s = 60});
  INFO(failed.output);
  CHECK(failed.code == 7);
  CHECK(failed.output.find("launch_hosts.sh: node 1 (b) exited with code 7; stopping the other "
                           "hosts") != std::string::npos);
  CHECK(failed.output.find("node 0 (a): node-rank 0 stopped") != std::string::npos);
  CHECK(failed.output.find("node 2 (c): node-rank 2 stopped") != std::string::npos);
  CHECK(failed.seconds < 15);  // stopped, not killed after the grace period

  testing::Child job = testing::start(argv, {{"FAIL_NODE", "none"}});
  for (int i = 0; i < 500; ++i) {
    const std::string out = testing::output_of(job);
    if (out.find("node-rank 0 started") != std::string::npos &&
        out.find("node-rank 1 started") != std::string::npos &&
        out.find("node-rank 2 started") != std::string::npos)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(::kill(job.pid, SIGTERM) == 0);
  ProcessResult stopped = testing::finish(job, 30);
  INFO(stopped.output);
  CHECK(stopped.code == 130);
  for (int node = 0; node < 3; ++node)
    CHECK(stopped.output.find(cat("node-rank ", node, " stopped")) != std::string::npos);
  CHECK(stopped.output.find("launch_hosts.sh: interrupted; every host stopped") !=
        std::string::npos);
}

TEST_CASE("slurm: train.sbatch on two Slurm nodes trains like one process, TCP between them",
          "[slurm][slow]") {
  // The nodes are the namespaces' hosts: slurmctld and a slurmd on host0,
  // a slurmd on host1; Slurm's commands run on host0.
  NetnsHosts hosts;
  const fs::path work = testing::fresh_temp_dir("mh_slurm_hosts");
  Guard cluster({"/bin/bash", kSource + "/tests/slurm_cluster.sh", (work / "cluster").string(),
                 hosts.prefix()});
  const std::string conf = cluster.ready().substr(cluster.ready().find('=') + 1);
  const fs::path dir = work / "run";
  std::vector<std::string> train = train_args(dir);
  train.erase(train.begin());  // the script runs `trainer train`
  SlurmJob job = run_sbatch(
      {{"SLURM_CONF", conf}, {"TRAINER", TRAINER_BINARY}, {"TRAINER_LOG_LEVEL", "debug"}}, work,
      {"--nodes=2", "--ntasks-per-node=2"}, train, 300,
      [&](const std::vector<std::string>& argv) { return hosts.on_host(0, argv); });
  INFO(job.output);
  REQUIRE(job.state == "COMPLETED");
  CHECK(job.output.find("4 tasks on 2 node(s) (host[0-1]), rendezvous on host0") !=
        std::string::npos);
  for (int r = 0; r < 4; ++r)
    CHECK(job.output.find(cat("launcher slurm: rank ", r, " of 4, local rank ", r % 2,
                              " of 2, store at host0:")) != std::string::npos);
  check_routes(job.output, 4);
  check_matches_reference(dir);
}

TEST_CASE("multihost: a cut link is named as such by the ranks waiting across it", "[netns]") {
  // One rank per host; host 0's end of the veth goes down mid-training. Each
  // rank's wait on the other times out (TRAINER_COMM_TIMEOUT_MS), probes the
  // other's host and finds it silent: a link down, not a hung rank.
  NetnsHosts hosts;
  const fs::path dir = testing::fresh_temp_dir("mh_cut", false);
  std::vector<testing::Child> launchers;
  for (int h = 0; h < 2; ++h)
    launchers.push_back(
        testing::start(hosts.on_host(h, launch_on_host(h, 29503, 1, "2", train_args(dir, 1000000))),
                       {{"TRAINER_COMM_TIMEOUT_MS", "4000"}}));
  REQUIRE(testing::wait_for_output(launchers[0], "step 20/", 120));
  const ProcessResult down =
      testing::run_process({"/usr/sbin/ip", "netns", "exec", hosts.prefix() + "-0", "/usr/sbin/ip",
                            "link", "set", "mhveth", "down"},
                           {.timeout_s = 30});
  REQUIRE(down.code == 0);
  const auto cut = std::chrono::steady_clock::now();
  std::vector<ProcessResult> host;
  for (const testing::Child& launcher : launchers) host.push_back(testing::finish(launcher, 120));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - cut).count();
  INFO("host 0:\n" << host[0].output << "\nhost 1:\n" << host[1].output);
  CHECK(host[0].code != 0);
  CHECK(host[1].code != 0);
  CHECK(seconds < 60);
  CHECK(
      host[0].output.find("its host 10.201.0.2 does not answer: the network link to it is down") !=
      std::string::npos);
  CHECK(
      host[1].output.find("its host 10.201.0.1 does not answer: the network link to it is down") !=
      std::string::npos);
  // The launcher's report: rank 0 waits on rank 1, of the other node.
  CHECK(host[0].output.find("never arrived: 1 (of another node)") != std::string::npos);
}
