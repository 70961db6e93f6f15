// `trainer launch` as a supervisor: the watchdog's heartbeat and report, ranks
// that die with their launcher, and restarts that resume a killed job from
// its newest complete checkpoint and end bit for bit where an uninterrupted
// run ends.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/bootstrap.h"
#include "comm/watchdog.h"
#include "tests/runs.h"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"

using namespace trainer;
using testing::Child;
using testing::finish;
using testing::launched_rank;
using testing::output_of;
using testing::ProcessResult;
using testing::start;
using testing::wait_for_output;
namespace fs = std::filesystem;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<std::string> train_args(const fs::path& out, const std::vector<std::string>& extra) {
  return testing::mlp_sgd_args(out.string(), extra);
}

std::vector<std::string> launch(int nproc, std::vector<std::string> options,
                                const std::vector<std::string>& args) {
  std::vector<std::string> argv{TRAINER_BINARY,        "launch",          "--nproc-per-node",
                                std::to_string(nproc), "--grace-seconds", "5"};
  argv.insert(argv.end(), options.begin(), options.end());
  argv.push_back("--");
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

fs::path fresh(const std::string& name) { return testing::fresh_temp_dir("launch_" + name, false); }

// The model of a run's checkpoint at step (its parts merged by name).
std::map<std::string, Tensor> model_at(const fs::path& run, int64_t step) {
  return read_model((run / "checkpoints" / CheckpointDir::step_name(step)).string());
}

void check_bitwise(const std::map<std::string, Tensor>& a, const std::map<std::string, Tensor>& b) {
  REQUIRE(!a.empty());
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    INFO(name);
    REQUIRE(b.count(name) == 1);
    std::vector<float> x = t.to_vector<float>(), y = b.at(name).to_vector<float>();
    REQUIRE(x.size() == y.size());
    CHECK(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
  }
}

bool alive(pid_t pid) { return pid > 0 && ::kill(pid, 0) == 0; }

// The step number of the last "step K/N" progress line in text (0: none).
int64_t last_step(const std::string& text) {
  const size_t at = text.rfind(" step ");
  return at == std::string::npos ? 0 : std::atoll(text.c_str() + at + 6);
}

constexpr int64_t kSteps = 2400, kEvery = 400;

// One run of the fault-injection scenario: the job is killed (a random rank
// with SIGKILL, after a random delay) and must restart, resume and end with
// the reference's weights.
void killed_run_matches(const fs::path& reference, const std::vector<std::string>& layout,
                        int nproc, uint32_t seed) {
  std::mt19937 random(seed);
  const int victim = int(random() % uint32_t(nproc));
  const double delay_s = 0.3 + double(random() % 1000) / 1000.0 * 2.0;
  INFO("seed " << seed << ": SIGKILL rank " << victim << " " << delay_s << " s into training");
  const fs::path run = fresh("killed");
  std::vector<std::string> extra{cat("training.steps=", kSteps),
                                 cat("training.checkpoint_every=", kEvery),
                                 "training.log_every=50"};
  extra.insert(extra.end(), layout.begin(), layout.end());
  Child c = start(launch(nproc, {"--max-restarts", "2"}, train_args(run, extra)));
  REQUIRE(wait_for_output(c, " step ", 120));
  std::this_thread::sleep_for(std::chrono::duration<double>(delay_s));
  const pid_t pid = launched_rank(c.pid, victim);
  const int64_t killed_near = last_step(output_of(c));
  if (pid > 0) ::kill(pid, SIGKILL);
  ProcessResult r = finish(c, 300);
  INFO(r.output);
  REQUIRE(r.code == 0);
  if (pid > 0 && killed_near < kSteps) {  // else the run had ended before the kill
    CHECK(contains(r.output, cat("rank ", victim, " exited with code 137")));
    CHECK(contains(r.output, "restart 1 of 2"));
    CHECK(contains(r.output, "restart 1: resuming from the newest complete checkpoint"));
  }
  check_bitwise(model_at(reference, kSteps), model_at(run, kSteps));
}

fs::path reference_run(const std::vector<std::string>& layout, int nproc) {
  const fs::path ref = fresh("reference");
  std::vector<std::string> extra{cat("training.steps=", kSteps),
                                 cat("training.checkpoint_every=", kEvery),
                                 "training.log_every=400"};
  extra.insert(extra.end(), layout.begin(), layout.end());
  ProcessResult r = finish(start(launch(nproc, {}, train_args(ref, extra))), 300);
  INFO(r.output);
  REQUIRE(r.code == 0);
  return ref;
}

// The hidden case below that writes a status record as fast as it can: run
// by the stop tests as a process of its own (this binary, by name).
constexpr const char* kStatusWriterCase = "watchdog: status writer for the stop tests";

// The state letter of /proc/pid/stat ('T': stopped), '?' when unreadable.
char process_state(pid_t pid) {
  std::ifstream stat(cat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  return paren != std::string::npos && paren + 2 < text.size() ? text[paren + 2] : '?';
}

// SIGSTOP to pid, then waits until it is stopped (false after 10 s).
bool stop(pid_t pid) {
  if (::kill(pid, SIGSTOP) != 0) return false;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (process_state(pid) != 'T')
    if (std::chrono::steady_clock::now() > give_up) return false;
  return true;
}

// Kills a child's process group when the test ends, however it ends.
struct KillAtExit {
  pid_t pid;  // 0 once reaped
  ~KillAtExit() {
    if (pid <= 0) return;
    ::kill(-pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
};

}  // namespace

TEST_CASE("launch: a stopped rank is named within the heartbeat timeout", "[launch][mp]") {
  const fs::path out = fresh("stopped");
  Child c = start(launch(2, {"--heartbeat-timeout", "2"},
                         train_args(out, {"training.steps=1000000", "training.log_every=200"})));
  REQUIRE(wait_for_output(c, " step ", 120));
  const pid_t victim = launched_rank(c.pid, 1);
  REQUIRE(victim > 0);
  ::kill(victim, SIGSTOP);
  const auto stopped = std::chrono::steady_clock::now();
  ProcessResult r = finish(c, 60);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
  INFO(r.output);
  CHECK(r.code == 128 + SIGKILL);
  CHECK(seconds < 2 + 10);  // the timeout, the grace period, and slack for a loaded machine
  CHECK(contains(r.output, cat("rank 1 (pid ", victim, ") stopped making progress")));
  CHECK(contains(r.output, "process stopped by a signal"));
  // The report: rank 0 waits for rank 1, which is not running.
  CHECK(contains(r.output, "what the ranks of this host were doing"));
  CHECK(contains(r.output, "for rank 1"));
  CHECK(contains(r.output, cat("rank 1 on ")));
  CHECK(contains(r.output, "not running: no heartbeat for"));
  CHECK(contains(r.output, "never arrived: 1"));
  // Not the rank that saw its peer go.
  CHECK(!contains(r.output, "trainer launch: rank 0 exited"));
}

TEST_CASE("launch: the ranks waiting on a hung rank name it", "[launch][mp]") {
  // Rank 2 of 3 sleeps (its heartbeat goes on) while ranks 0 and 1 wait in
  // an allreduce until their 1.5 s timeout.
  Child c = start({TRAINER_BINARY, "launch", "--nproc-per-node", "3", "--grace-seconds", "2",
                   "--program", COMM_WORKER_BINARY, "--", "hang", "2", "1500", "ring"});
  ProcessResult r = finish(c, 60);
  INFO(r.output);
  CHECK(r.code == 3);
  CHECK(contains(r.output, "timed out after 1500 ms"));
  CHECK(contains(r.output, "last completed: allreduce(ring) #"));
  CHECK(contains(r.output, "what the ranks of this host were doing"));
  CHECK(contains(r.output, "in allreduce(ring) #"));
  CHECK(contains(r.output, "never arrived: 2"));
}

TEST_CASE("launch: ranks die with their launcher, even when it is killed", "[launch][mp]") {
  const fs::path out = fresh("orphans");
  Child c = start(launch(2, {}, train_args(out, {"training.steps=1000000"})));
  REQUIRE(wait_for_output(c, " step ", 120));
  const pid_t r0 = launched_rank(c.pid, 0), r1 = launched_rank(c.pid, 1);
  REQUIRE(alive(r0));
  REQUIRE(alive(r1));
  ::kill(c.pid, SIGKILL);  // the launcher alone: the ranks lead their own process groups
  ::waitpid(c.pid, nullptr, 0);
  const auto t0 = std::chrono::steady_clock::now();
  while ((alive(r0) || alive(r1)) &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(!alive(r0));
  CHECK(!alive(r1));
  ::kill(-r0, SIGKILL);  // never leave them behind, whatever happened
  ::kill(-r1, SIGKILL);
  ::unlink(c.output_path.c_str());
}

TEST_CASE("launch: --max-restarts resumes a killed dp=2 job, bit for bit", "[launch][mp]") {
  const fs::path ref = reference_run({}, 2);
  for (int i = 0; i < 2; ++i) killed_run_matches(ref, {}, 2, std::random_device()());
}

TEST_CASE("launch: --max-restarts resumes a killed ZeRO-3 dp=2 job, bit for bit", "[launch][mp]") {
  // Each rank's checkpoint holds its slices of the parameters and their state.
  const std::vector<std::string> layout{"parallel.shard=parameters"};
  const fs::path ref = reference_run(layout, 2);
  for (int i = 0; i < 2; ++i) killed_run_matches(ref, layout, 2, std::random_device()());
}

TEST_CASE("launch: 10 random kills of dp=2 and pp=2 jobs, each resumed bit for bit",
          "[launch][mp][slow]") {
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{}, std::vector<std::string>{"parallel.pp=2"}}) {
    const fs::path ref = reference_run(layout, 2);
    for (int i = 0; i < 10; ++i) killed_run_matches(ref, layout, 2, std::random_device()());
  }
}

TEST_CASE("launch: a rank killed while writing a checkpoint resumes from the one before",
          "[launch][mp]") {
  const fs::path ref = reference_run({}, 2), run = fresh("torn");
  fs::create_directories(run / "checkpoints");
  // Rank 0 writes the checkpoints: it dies as the second one's temporary
  // directory appears (inotify), before that checkpoint is complete.
  const int watch = ::inotify_init1(IN_CLOEXEC);
  REQUIRE(watch >= 0);
  REQUIRE(::inotify_add_watch(watch, (run / "checkpoints").c_str(), IN_CREATE) >= 0);
  Child c = start(launch(
      2, {"--max-restarts", "1"},
      train_args(run, {cat("training.steps=", kSteps), cat("training.checkpoint_every=", kEvery),
                       "training.log_every=400"})));
  const std::string torn = CheckpointDir::step_name(2 * kEvery) + ".tmp";
  bool killed = false;
  alignas(inotify_event) char buffer[4096];
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!killed && std::chrono::steady_clock::now() < give_up) {
    pollfd ready{watch, POLLIN, 0};
    if (::poll(&ready, 1, 100) <= 0) continue;
    const ssize_t n = ::read(watch, buffer, sizeof buffer);
    REQUIRE(n > 0);
    for (char* p = buffer; p < buffer + n;) {
      const auto* event = reinterpret_cast<const inotify_event*>(p);
      if (event->len && torn == event->name) {
        ::kill(launched_rank(c.pid, 0), SIGKILL);
        killed = true;
      }
      p += sizeof(inotify_event) + event->len;
    }
  }
  ::close(watch);
  ProcessResult r = finish(c, 300);
  INFO(r.output);
  REQUIRE(killed);
  REQUIRE(r.code == 0);
  CHECK(contains(r.output, "rank 0 exited with code 137"));
  const std::string previous = CheckpointDir::step_name(kEvery);
  CHECK(contains(r.output, "resumed from " + (run / "checkpoints" / previous).string()));
  check_bitwise(model_at(ref, kSteps), model_at(run, kSteps));
}

TEST_CASE("launch: --nnodes 1:2 goes on with the node that is left, resharded", "[launch][mp]") {
  // Two launchers on this host play two nodes of one rank each; node 1's
  // launcher is killed (its rank dies with it), and node 0 restarts alone.
  const fs::path run = fresh("elastic");
  const int port =
      testing::free_port(2);  // the ranks' store, and the nodes' rendezvous on port + 1
  auto node = [&](int rank) {
    return start(launch(
        1,
        {"--nnodes", "1:2", "--node-rank", std::to_string(rank), "--master-addr", "127.0.0.1",
         "--master-port", std::to_string(port), "--max-restarts", "1", "--settle-seconds", "1"},
        train_args(run, {cat("training.steps=", kSteps), cat("training.checkpoint_every=", kEvery),
                         "training.log_every=100"})));
  };
  Child n0 = node(0), n1 = node(1);
  const bool checkpointed = wait_for_output(n0, "checkpoint: /", 120);  // not *_checkpoint: keys
  ::kill(n1.pid, SIGKILL);
  if (!checkpointed) ::kill(-n0.pid, SIGKILL);
  INFO("node 1:\n" << output_of(n1));
  ProcessResult r1 = finish(n1, 10), r0 = finish(n0, 300);
  INFO("node 0:\n" << r0.output);
  REQUIRE(checkpointed);
  CHECK(r1.code == 128 + SIGKILL);
  REQUIRE(r0.code == 0);
  CHECK(contains(r0.output, "round 0: 2 of 2 nodes (node ranks 0, 1), 2 ranks"));
  CHECK(contains(r0.output, "round 1: 1 of 2 nodes (node ranks 0), 1 ranks"));
  CHECK(contains(r0.output, "never arrived: 1 (of another node)"));
  CHECK(contains(r0.output, "resharded: dp 2 -> 1"));
  CHECK(contains(r0.output, cat("step ", kSteps, "/", kSteps)));
  CHECK(!model_at(run, kSteps).empty());
}

TEST_CASE("launch: bad --nnodes values are refused", "[launch]") {
  for (const char* bad : {"0", "2:1", "x", "1:", ":2", "1:2:3"}) {
    INFO(bad);
    ProcessResult r = testing::run_process(
        {TRAINER_BINARY, "launch", "--nproc-per-node", "1", "--nnodes", bad, "--", "info"},
        {.timeout_s = 30});
    CHECK(r.code != 0);
    CHECK(contains(r.output, "--nnodes"));
  }
}

TEST_CASE("watchdog: the status file a launcher reads, and its report", "[launch]") {
  namespace wd = comm::watchdog;
  const fs::path dir = fresh("status");
  fs::create_directories(dir);
  comm::Bootstrap boot;
  boot.rank = 3;
  boot.status_dir = dir.string();
  boot.heartbeat_ms = 10;
  wd::start(boot);
  {
    wd::Wait first("allreduce(ring)", 0, 41, 2);
    first.done();
  }
  wd::Wait pending("send", 2, 7, 5);  // never done: the rank "died" waiting
  std::optional<wd::Status> s = wd::read_status(wd::status_path(dir.string(), 3));
  REQUIRE(s);
  CHECK(s->rank == 3);
  CHECK(s->pid == ::getpid());
  CHECK(s->last.name == "allreduce(ring)");
  CHECK(s->last.seq == 41);
  CHECK(s->waiting.name == "send");
  CHECK(s->waiting.comm == 2);
  CHECK(s->waiting.peer == 5);
  CHECK(wd::describe() == "last completed: allreduce(ring) #41 of communicator 0");
  // The heartbeat goes on.
  const int64_t beat = s->heartbeat_ns;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(wd::read_status(wd::status_path(dir.string(), 3))->heartbeat_ns > beat);

  // Rank 4 waits on 3 (which waits on 5, of another node); 6 is not running.
  wd::Status r4, r6;
  r4.rank = 4;
  r4.host = "h";
  r4.heartbeat_ns = s->heartbeat_ns;
  r4.waiting = {"allreduce(ring)", 0, 42, 3, s->heartbeat_ns};
  r6.rank = 6;
  r6.host = "h";
  r6.heartbeat_ns = s->heartbeat_ns - int64_t(5e9);
  r6.waiting = {"allreduce(ring)", 0, 42, 7, s->heartbeat_ns};
  std::vector<std::string> lines = wd::report({*s, r4, r6}, s->heartbeat_ns, int64_t(1e9));
  REQUIRE(lines.size() == 4);
  CHECK(contains(lines[0], "rank 3 on "));
  CHECK(contains(lines[0], "last completed allreduce(ring) #41 of communicator 0"));
  CHECK(contains(lines[0], "in send #7 of communicator 2 for rank 5"));
  CHECK(contains(lines[1], "for rank 3"));
  CHECK(contains(lines[2], "not running: no heartbeat for 5.0 s"));
  CHECK(lines[3] ==
        "never arrived: 5 (of another node), 7 (of another node) (waited on by the "
        "ranks above, and waiting on nothing)");
  // Rank 8, killed by a signal while it waited on 4, which waits on it:
  // where the job stopped is 8, not 4.
  wd::Status r8 = r4;
  r8.rank = 8;
  r8.killed = true;
  r8.waiting.peer = 4;
  r4.waiting.peer = 8;
  lines = wd::report({r4, r8}, s->heartbeat_ns, int64_t(1e9));
  REQUIRE(lines.size() == 3);
  CHECK(contains(lines[1],
                 "rank 8 on h (pid 0): killed by a signal; no operation completed; was "
                 "waiting in allreduce(ring) #42 of communicator 0 for rank 4"));
  CHECK(lines[2] == "never arrived: 8 (waited on by the ranks above, and waiting on nothing)");
  // Not a status file: nothing.
  CHECK(!wd::read_status((dir / "missing").string()));
  CHECK(!wd::read_status(dir.string()));
}

TEST_CASE("watchdog: a record left in the middle of an update still gives the heartbeat",
          "[launch]") {
  namespace wd = comm::watchdog;
  const fs::path dir = fresh("torn_record");
  fs::create_directories(dir);
  const std::string path = wd::status_path(dir.string(), 1);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, sizeof(wd::StatusRecord)) == 0);
  void* mapped =
      ::mmap(nullptr, sizeof(wd::StatusRecord), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  REQUIRE(mapped != MAP_FAILED);
  // What a rank stopped inside an update leaves: generation odd for good,
  // names half written (no NUL anywhere).
  auto* record = new (mapped) wd::StatusRecord{};
  record->magic = wd::StatusRecord::kMagic;
  record->version = wd::StatusRecord::kVersion;
  record->rank = 1;
  record->pid = 4242;
  std::memset(record->host, 'h', sizeof record->host);
  record->heartbeat_ns.store(int64_t(7e9));
  record->completed = 9;
  std::memset(record->last.name, 'x', sizeof record->last.name);
  std::memset(record->waiting.name, 'y', sizeof record->waiting.name);
  record->waiting.peer = 0;
  record->generation.store(5);

  std::optional<wd::Status> s = wd::read_status(path);
  REQUIRE(s);
  CHECK(s->rank == 1);
  CHECK(s->pid == 4242);
  CHECK(s->host == std::string(sizeof record->host, 'h'));
  CHECK(s->heartbeat_ns == int64_t(7e9));
  CHECK(!s->ops_consistent);
  CHECK(s->completed == 0);
  CHECK(s->last.name.empty());
  CHECK(s->waiting.name.empty());
  // Stopped there: the report says so, and names it as where the job stopped.
  wd::Status r0;
  r0.rank = 0;
  r0.host = "h";
  r0.heartbeat_ns = int64_t(12e9);
  r0.waiting = {"allreduce(ring)", 0, 3, 1, int64_t(11e9)};
  std::vector<std::string> lines = wd::report({r0, *s}, int64_t(12e9), int64_t(1e9));
  REQUIRE(lines.size() == 3);
  CHECK(contains(lines[1],
                 "not running: no heartbeat for 5.0 s; stopped in the middle of updating its "
                 "operation record: last completed and waited-on operations unknown"));
  CHECK(contains(lines[2], "never arrived: 1 "));
  // Running (only descheduled inside the update): not said to have stopped.
  lines = wd::report({r0, *s}, int64_t(7.5e9), int64_t(1e9));
  REQUIRE(lines.size() == 2);
  CHECK(contains(lines[1], "its operation record was being updated at every read"));
  CHECK(!contains(lines[1], "not running"));

  // The update done: the operations read, names bounded by their fields.
  record->generation.store(6);
  s = wd::read_status(path);
  REQUIRE(s);
  CHECK(s->ops_consistent);
  CHECK(s->completed == 9);
  CHECK(s->last.name == std::string(sizeof record->last.name, 'x'));
  CHECK(s->waiting.name == std::string(sizeof record->waiting.name, 'y'));
  ::munmap(mapped, sizeof(wd::StatusRecord));
}

// Not a test of its own: the rank the stop tests stop. Alone (ctest lists
// it) it has no status directory and nothing to do.
TEST_CASE("watchdog: status writer for the stop tests", "[.][launch]") {
  namespace wd = comm::watchdog;
  const comm::Bootstrap boot = comm::detect_bootstrap();
  if (boot.status_dir.empty()) return;
  wd::start(boot);
  std::printf("writing %s\n", wd::status_path(boot.status_dir, boot.rank).c_str());
  std::fflush(stdout);
  // Two minutes at most, should the test that started it be gone.
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (uint32_t i = 1; i % 4096 || std::chrono::steady_clock::now() < end; ++i) {
    wd::Wait wait("allreduce(ring)", 0, i, 1);
    wait.done();
    wd::completed("broadcast", 1, i);
  }
}

TEST_CASE("watchdog: a rank stopped at 200 random moments shows its heartbeat each time",
          "[launch]") {
  namespace wd = comm::watchdog;
  const fs::path dir = fresh("random_stops");
  fs::create_directories(dir);
  Child writer = start({fs::read_symlink("/proc/self/exe").string(), kStatusWriterCase},
                       {{"TRAINER_STATUS_DIR", dir.string()}, {"TRAINER_HEARTBEAT_MS", "10"}});
  KillAtExit guard{writer.pid};
  REQUIRE(wait_for_output(writer, "writing ", 60));
  const std::string path = wd::status_path(dir.string(), 0);
  std::mt19937 random(std::random_device{}());
  int torn = 0;
  for (int i = 0; i < 200; ++i) {
    INFO("stop " << i);
    std::this_thread::sleep_for(std::chrono::microseconds(random() % 2000));
    REQUIRE(stop(writer.pid));
    std::optional<wd::Status> s = wd::read_status(path);
    REQUIRE(s);
    CHECK(s->rank == 0);
    CHECK(s->pid == writer.pid);
    CHECK(s->heartbeat_ns > 0);
    CHECK(!s->host.empty());
    if (s->ops_consistent) {
      // Never a mix of two updates.
      CHECK(s->last.name == (s->last.comm == 0 ? "allreduce(ring)" : "broadcast"));
      CHECK((s->waiting.name.empty() || s->waiting.name == "allreduce(ring)"));
    } else {
      ++torn;
      CHECK(s->last.name.empty());
    }
    REQUIRE(::kill(writer.pid, SIGCONT) == 0);
  }
  // The case this test is for came up (a stop inside an update).
  INFO(torn << " of 200 stops came inside an update");
  CHECK(torn > 0);
  ::unlink(writer.output_path.c_str());
}

TEST_CASE("launch: a rank stopped in the middle of updating its status record is named",
          "[launch][mp]") {
  namespace wd = comm::watchdog;
  Child c = start({TRAINER_BINARY, "launch", "--nproc-per-node", "1", "--grace-seconds", "2",
                   "--heartbeat-timeout", "1", "--program",
                   fs::read_symlink("/proc/self/exe").string(), "--", kStatusWriterCase});
  KillAtExit guard{c.pid};
  REQUIRE(wait_for_output(c, "writing ", 60));
  const std::string output = output_of(c);
  const size_t at = output.find("writing ") + 8;
  const std::string path = output.substr(at, output.find('\n', at) - at);
  const pid_t rank = launched_rank(c.pid, 0);
  REQUIRE(rank > 0);
  // Stopped (briefly) until a stop lands inside an update; left stopped there.
  std::mt19937 random(std::random_device{}());
  bool torn = false;
  for (int i = 0; i < 2000 && !torn; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(random() % 2000));
    REQUIRE(stop(rank));
    std::optional<wd::Status> s = wd::read_status(path);
    REQUIRE(s);
    torn = !s->ops_consistent;
    if (!torn) REQUIRE(::kill(rank, SIGCONT) == 0);
  }
  REQUIRE(torn);
  const auto stopped = std::chrono::steady_clock::now();
  ProcessResult r = finish(c, 30);
  guard.pid = 0;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
  INFO(r.output);
  CHECK(r.code == 128 + SIGKILL);
  CHECK(seconds < 1 + 10);  // the timeout, the grace period, and slack for a loaded machine
  CHECK(contains(r.output, cat("rank 0 (pid ", rank, ") stopped making progress")));
  CHECK(contains(r.output, "process stopped by a signal"));
  CHECK(contains(r.output, "stopped in the middle of updating its operation record"));
}
