// Launcher detection: who started this process, and where the rendezvous is.
//
// The only code of the project that reads the environment. Variables are
// tried in this order, the first launcher whose variables are present wins:
//   1. torchrun-style (`trainer launch`, torchrun, hand-set): RANK, WORLD_SIZE,
//      LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
//   2. Slurm (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the first host
//      of SLURM_JOB_NODELIST ("node[01-04,07]" -> "node01");
//   3. OpenMPI (mpirun): OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE;
//   4. none: a single process, world size 1.
// TRAINER_STATUS_DIR, TRAINER_HEARTBEAT_MS and TRAINER_RESTART_COUNT come
// from `trainer launch` whichever launcher started it.
// The job token that authenticates store clients is TRAINER_JOB_TOKEN when
// set, else derived from the launcher's job id (SLURM_JOB_ID, the OpenMPI job
// id, or MASTER_ADDR:MASTER_PORT for torchrun-style launches).
//
//   Bootstrap boot = detect_bootstrap();   // logs "launcher slurm: rank 3 of 8 ..."
//   auto world = init_world(boot);
//
// Glossary: rank = index of this process in the job, world (size) = number of
// processes, local rank = index among the processes of this node.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "comm/log.h"

namespace trainer::comm {

enum class Launcher { none, torchrun, slurm, openmpi };
std::string_view launcher_name(Launcher launcher);

struct Bootstrap {
  Launcher launcher = Launcher::none;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";  // host of the store (rank 0)
  int master_port = 0;
  std::string job_token;                // shared by every rank of the job
  LogLevel log_level = LogLevel::info;  // TRAINER_LOG_LEVEL
  // Set by `trainer launch` (comm/watchdog.h): where this rank keeps its
  // status file (TRAINER_STATUS_DIR), how often it stamps its heartbeat
  // (TRAINER_HEARTBEAT_MS), and how many times the launcher has restarted
  // the job (TRAINER_RESTART_COUNT; the trainer then resumes from the newest
  // checkpoint).
  std::string status_dir;
  int heartbeat_ms = 1000;
  int restart_count = 0;
  // TRAINER_COMM_TIMEOUT_MS: each wait of a communication without progress
  // (CommOptions::timeout); 0: the caller's.
  int comm_timeout_ms = 0;
};

// Reads one variable; nullopt when unset. Tests pass a map instead of the process environment.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
EnvLookup process_environment();

// Detects the launcher from env. Missing or malformed values are an Error
// naming the variable. The process-environment overload logs the result once.
Bootstrap detect_bootstrap(const EnvLookup& env);
Bootstrap detect_bootstrap();

// TRAINER_JOB_TOKEN from the process environment, for `trainer launch`.
std::optional<std::string> job_token_from_environment();

// Expands a Slurm host list: "a[1-3,07],b" -> a1 a2 a3 a07 b. Several bracket
// groups per name are expanded left to right; zero padding follows the lower bound.
std::vector<std::string> expand_slurm_nodelist(std::string_view list);

}  // namespace trainer::comm
