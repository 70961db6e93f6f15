// Launcher detection and the Slurm host-list parser: pure functions of a fake
// environment, no processes.
#include <map>

#include "tests/testing.h"

#include "comm/bootstrap.h"

using namespace trainer;
using namespace trainer::comm;

namespace {

EnvLookup fake_env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

const std::map<std::string, std::string> kTorchrun = {
    {"RANK", "3"},          {"WORLD_SIZE", "8"},     {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
    {"MASTER_ADDR", "n01"}, {"MASTER_PORT", "29500"}};
const std::map<std::string, std::string> kSlurm = {{"SLURM_PROCID", "5"},
                                                   {"SLURM_NTASKS", "6"},
                                                   {"SLURM_LOCALID", "2"},
                                                   {"SLURM_TASKS_PER_NODE", "3(x2)"},
                                                   {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                                                   {"SLURM_JOB_ID", "4242"}};
const std::map<std::string, std::string> kOpenMpi = {{"OMPI_COMM_WORLD_RANK", "1"},
                                                     {"OMPI_COMM_WORLD_SIZE", "2"},
                                                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                                     {"OMPI_MCA_ess_base_jobid", "1455357953"}};

std::map<std::string, std::string> merge(
    std::initializer_list<std::map<std::string, std::string>> maps) {
  std::map<std::string, std::string> out;
  for (const auto& m : maps) out.insert(m.begin(), m.end());
  return out;
}

}  // namespace

TEST_CASE("slurm nodelist: plain, ranges, padding, lists and several groups", "[comm]") {
  using V = std::vector<std::string>;
  CHECK(expand_slurm_nodelist("node01") == V{"node01"});
  CHECK(expand_slurm_nodelist("node[01-04,07]") ==
        V{"node01", "node02", "node03", "node04", "node07"});
  CHECK(expand_slurm_nodelist("a[8-11],b,c[3]") == V{"a8", "a9", "a10", "a11", "b", "c3"});
  CHECK(expand_slurm_nodelist("r[1-2]-n[09-10]") == V{"r1-n09", "r1-n10", "r2-n09", "r2-n10"});
  CHECK(expand_slurm_nodelist("x[098-101]") == V{"x098", "x099", "x100", "x101"});
  CHECK_THROWS_WITH(expand_slurm_nodelist("node[01-"), Catch::Contains("unbalanced"));
  CHECK_THROWS_WITH(expand_slurm_nodelist("node[5-3]"), Catch::Contains("decreasing"));
  CHECK_THROWS_WITH(expand_slurm_nodelist("node[a-b]"), Catch::Contains("not an integer"));
  CHECK_THROWS(expand_slurm_nodelist(""));
}

TEST_CASE("bootstrap: no launcher is a single process", "[comm]") {
  Bootstrap b = detect_bootstrap(fake_env({}));
  CHECK(b.launcher == Launcher::none);
  CHECK(b.rank == 0);
  CHECK(b.world_size == 1);
}

TEST_CASE("bootstrap: torchrun-style variables", "[comm]") {
  Bootstrap b = detect_bootstrap(fake_env(kTorchrun));
  CHECK(b.launcher == Launcher::torchrun);
  CHECK(b.rank == 3);
  CHECK(b.world_size == 8);
  CHECK(b.local_rank == 1);
  CHECK(b.local_world_size == 2);
  CHECK(b.master_addr == "n01");
  CHECK(b.master_port == 29500);
  CHECK(b.job_token == "torchrun:n01:29500");
}

TEST_CASE("bootstrap: Slurm, the first host of the node list is the master", "[comm]") {
  Bootstrap b = detect_bootstrap(fake_env(kSlurm));
  CHECK(b.launcher == Launcher::slurm);
  CHECK(b.rank == 5);
  CHECK(b.world_size == 6);
  CHECK(b.local_rank == 2);
  CHECK(b.local_world_size == 3);
  CHECK(b.master_addr == "gpu07");
  CHECK(b.master_port >= 20000);
  CHECK(b.master_port < 40000);
  CHECK(b.job_token == "slurm:4242.0");
  // The port is a function of the job: every rank derives the same one.
  CHECK(detect_bootstrap(fake_env(kSlurm)).master_port == b.master_port);
}

TEST_CASE("bootstrap: OpenMPI on one node", "[comm]") {
  Bootstrap b = detect_bootstrap(fake_env(kOpenMpi));
  CHECK(b.launcher == Launcher::openmpi);
  CHECK(b.rank == 1);
  CHECK(b.world_size == 2);
  CHECK(b.master_addr == "127.0.0.1");
  CHECK(b.job_token == "ompi:1455357953");
  auto across_nodes =
      merge({{{"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}}, kOpenMpi});
  CHECK_THROWS_WITH(detect_bootstrap(fake_env(across_nodes)), Catch::Contains("MASTER_ADDR"));
}

TEST_CASE("bootstrap: detection order is torchrun, then Slurm, then OpenMPI", "[comm]") {
  CHECK(detect_bootstrap(fake_env(merge({kOpenMpi, kSlurm, kTorchrun}))).launcher ==
        Launcher::torchrun);
  CHECK(detect_bootstrap(fake_env(merge({kOpenMpi, kSlurm}))).launcher == Launcher::slurm);
  CHECK(detect_bootstrap(fake_env(merge({kOpenMpi}))).launcher == Launcher::openmpi);
}

TEST_CASE("bootstrap: TRAINER_JOB_TOKEN and TRAINER_LOG_LEVEL override", "[comm]") {
  Bootstrap b = detect_bootstrap(
      fake_env(merge({kSlurm, {{"TRAINER_JOB_TOKEN", "s3cret"}, {"TRAINER_LOG_LEVEL", "debug"}}})));
  CHECK(b.job_token == "s3cret");
  CHECK(b.log_level == LogLevel::debug);
  CHECK_THROWS_WITH(detect_bootstrap(fake_env({{"TRAINER_LOG_LEVEL", "loud"}})),
                    Catch::Contains("TRAINER_LOG_LEVEL"));
}

TEST_CASE("bootstrap: bad or missing values are errors naming the variable", "[comm]") {
  auto without = [](std::map<std::string, std::string> m, const std::string& key) {
    m.erase(key);
    return m;
  };
  auto with = [](std::map<std::string, std::string> m, const std::string& key,
                 const std::string& value) {
    m[key] = value;
    return m;
  };
  CHECK_THROWS_WITH(detect_bootstrap(fake_env(without(kTorchrun, "WORLD_SIZE"))),
                    Catch::Contains("WORLD_SIZE"));
  CHECK_THROWS_WITH(detect_bootstrap(fake_env(without(kTorchrun, "MASTER_PORT"))),
                    Catch::Contains("MASTER_PORT"));
  CHECK_THROWS_WITH(detect_bootstrap(fake_env(with(kTorchrun, "RANK", "three"))),
                    Catch::Contains("RANK=three"));
  CHECK_THROWS_WITH(detect_bootstrap(fake_env(with(kTorchrun, "RANK", "8"))),
                    Catch::Contains("RANK=8"));
  CHECK_THROWS_WITH(detect_bootstrap(fake_env(with(kTorchrun, "MASTER_PORT", "70000"))),
                    Catch::Contains("MASTER_PORT=70000"));
  CHECK_THROWS_WITH(detect_bootstrap(fake_env(without(kSlurm, "SLURM_LOCALID"))),
                    Catch::Contains("SLURM_LOCALID"));
  CHECK_THROWS_WITH(detect_bootstrap(fake_env(without(kSlurm, "SLURM_JOB_NODELIST"))),
                    Catch::Contains("SLURM_JOB_NODELIST"));
  CHECK_THROWS_WITH(detect_bootstrap(fake_env(with(kOpenMpi, "OMPI_COMM_WORLD_SIZE", "-2"))),
                    Catch::Contains("OMPI_COMM_WORLD_SIZE=-2"));
}
