#include "comm/bootstrap.h"

#include <cerrno>
#include <cstdlib>
#include <functional>
#include <mutex>

namespace trainer::comm {

namespace {

// Ports for launchers that give none: a fixed base plus the job id, so two
// jobs sharing a node are unlikely to collide.
constexpr int kDerivedPortBase = 20000;
constexpr int kDerivedPortRange = 20000;

class EnvReader {
 public:
  EnvReader(const EnvLookup& env, Launcher launcher) : env_(env), launcher_(launcher) {}

  std::optional<std::string> get(const std::string& name) const { return env_(name); }

  std::string require(const std::string& name) const {
    std::optional<std::string> v = env_(name);
    if (!v || v->empty())
      throw Error(cat(name, " is not set, but other ", launcher_name(launcher_),
                      " variables are; set it or unset them all"));
    return *v;
  }

  int require_int(const std::string& name, int lo, int hi) const {
    return parse_int(name, require(name), lo, hi);
  }

  int int_or(const std::string& name, int fallback, int lo, int hi) const {
    std::optional<std::string> v = env_(name);
    return v && !v->empty() ? parse_int(name, *v, lo, hi) : fallback;
  }

  static int parse_int(const std::string& name, const std::string& text, int lo, int hi) {
    char* end = nullptr;
    errno = 0;
    long v = std::strtol(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno != 0 || v < lo || v > hi)
      throw Error(cat(name, "=", text, " is not an integer in [", lo, ", ", hi, "]"));
    return int(v);
  }

 private:
  const EnvLookup& env_;
  Launcher launcher_;
};

constexpr int kMaxRanks = 1 << 20;  // the tag layout holds 20 bits of rank

void check_ranks(const Bootstrap& b, const char* rank_var, const char* local_var) {
  if (b.rank >= b.world_size)
    throw Error(cat(rank_var, "=", b.rank, " is not below the world size ", b.world_size));
  if (b.local_rank >= b.local_world_size)
    throw Error(cat(local_var, "=", b.local_rank, " is not below the local world size ",
                    b.local_world_size));
}

int derived_port(const std::string& job_id) {
  return kDerivedPortBase + int(std::hash<std::string>{}(job_id) % kDerivedPortRange);
}

// "4(x2),3" -> 4: tasks on the first node; SLURM_NTASKS_PER_NODE wins when set.
int slurm_tasks_per_node(const EnvReader& env, int fallback) {
  if (std::optional<std::string> v = env.get("SLURM_NTASKS_PER_NODE"); v && !v->empty())
    return EnvReader::parse_int("SLURM_NTASKS_PER_NODE", *v, 1, kMaxRanks);
  std::optional<std::string> v = env.get("SLURM_TASKS_PER_NODE");
  if (!v || v->empty()) return fallback;
  std::string first = v->substr(0, v->find_first_of("(,"));
  return EnvReader::parse_int("SLURM_TASKS_PER_NODE", first, 1, kMaxRanks);
}

Bootstrap from_torchrun(const EnvReader& env) {
  Bootstrap b;
  b.launcher = Launcher::torchrun;
  b.rank = env.require_int("RANK", 0, kMaxRanks - 1);
  b.world_size = env.require_int("WORLD_SIZE", 1, kMaxRanks);
  b.local_rank = env.int_or("LOCAL_RANK", b.rank, 0, kMaxRanks - 1);
  b.local_world_size = env.int_or("LOCAL_WORLD_SIZE", b.world_size, 1, kMaxRanks);
  check_ranks(b, "RANK", "LOCAL_RANK");
  if (b.world_size > 1) {
    b.master_addr = env.require("MASTER_ADDR");
    b.master_port = env.require_int("MASTER_PORT", 1, 65535);
  }
  b.job_token = cat("torchrun:", b.master_addr, ":", b.master_port);
  return b;
}

Bootstrap from_slurm(const EnvReader& env) {
  Bootstrap b;
  b.launcher = Launcher::slurm;
  b.rank = env.require_int("SLURM_PROCID", 0, kMaxRanks - 1);
  b.world_size = env.require_int("SLURM_NTASKS", 1, kMaxRanks);
  b.local_rank = env.require_int("SLURM_LOCALID", 0, kMaxRanks - 1);
  b.local_world_size = slurm_tasks_per_node(env, b.world_size);
  check_ranks(b, "SLURM_PROCID", "SLURM_LOCALID");
  std::string nodes =
      env.get("SLURM_JOB_NODELIST").value_or(env.get("SLURM_NODELIST").value_or(""));
  if (nodes.empty()) throw Error("SLURM_JOB_NODELIST is not set, but other Slurm variables are");
  b.master_addr = expand_slurm_nodelist(nodes).front();
  std::string job = cat(env.require("SLURM_JOB_ID"), ".", env.get("SLURM_STEP_ID").value_or("0"));
  b.master_port = env.int_or("MASTER_PORT", derived_port(job), 1, 65535);
  b.job_token = cat("slurm:", job);
  return b;
}

Bootstrap from_openmpi(const EnvReader& env) {
  Bootstrap b;
  b.launcher = Launcher::openmpi;
  b.rank = env.require_int("OMPI_COMM_WORLD_RANK", 0, kMaxRanks - 1);
  b.world_size = env.require_int("OMPI_COMM_WORLD_SIZE", 1, kMaxRanks);
  b.local_rank = env.require_int("OMPI_COMM_WORLD_LOCAL_RANK", 0, kMaxRanks - 1);
  b.local_world_size = env.require_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxRanks);
  check_ranks(b, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK");
  std::string job =
      env.get("OMPI_MCA_ess_base_jobid").value_or(env.get("PMIX_NAMESPACE").value_or(""));
  if (job.empty())
    throw Error("OMPI_MCA_ess_base_jobid (or PMIX_NAMESPACE) is not set under OpenMPI");
  if (std::optional<std::string> addr = env.get("MASTER_ADDR"); addr && !addr->empty()) {
    b.master_addr = *addr;
  } else if (b.local_world_size != b.world_size) {
    throw Error(
        "MASTER_ADDR is not set: under mpirun across nodes pass the host of rank 0, "
        "e.g. mpirun -x MASTER_ADDR=node01 ...");
  }
  b.master_port = env.int_or("MASTER_PORT", derived_port(job), 1, 65535);
  b.job_token = cat("ompi:", job);
  return b;
}

bool any_set(const EnvReader& env, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (env.get(n)) return true;
  return false;
}

// Appends the expansion of one host pattern (no top-level commas) to out.
void expand_host(std::string_view host, std::vector<std::string>& out, std::string_view whole) {
  size_t open = host.find('[');
  if (open == std::string_view::npos) {
    if (host.find(']') != std::string_view::npos)
      throw Error(cat("SLURM_JOB_NODELIST=", whole, ": unbalanced ']'"));
    out.emplace_back(host);
    return;
  }
  size_t close = host.find(']', open);
  if (close == std::string_view::npos)
    throw Error(cat("SLURM_JOB_NODELIST=", whole, ": unbalanced '['"));
  std::string_view prefix = host.substr(0, open), ranges = host.substr(open + 1, close - open - 1);
  std::string_view rest = host.substr(close + 1);
  while (!ranges.empty()) {
    size_t comma = ranges.find(',');
    std::string_view item = ranges.substr(0, comma);
    ranges = comma == std::string_view::npos ? std::string_view() : ranges.substr(comma + 1);
    size_t dash = item.find('-');
    std::string lo(item.substr(0, dash));
    std::string hi(dash == std::string_view::npos ? item : item.substr(dash + 1));
    int a = EnvReader::parse_int("SLURM_JOB_NODELIST range", lo, 0, 1 << 30);
    int b = EnvReader::parse_int("SLURM_JOB_NODELIST range", hi, 0, 1 << 30);
    if (b < a) throw Error(cat("SLURM_JOB_NODELIST=", whole, ": range ", item, " is decreasing"));
    for (int i = a; i <= b; ++i) {
      std::string num = std::to_string(i);
      if (num.size() < lo.size()) num.insert(0, lo.size() - num.size(), '0');
      expand_host(cat(prefix, num, rest), out, whole);
    }
  }
}

}  // namespace

std::string_view launcher_name(Launcher launcher) {
  switch (launcher) {
    case Launcher::none:
      return "none";
    case Launcher::torchrun:
      return "torchrun";
    case Launcher::slurm:
      return "slurm";
    case Launcher::openmpi:
      return "openmpi";
  }
  return "?";
}

std::vector<std::string> expand_slurm_nodelist(std::string_view list) {
  std::vector<std::string> hosts;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    if (i < list.size() && list[i] == '[') ++depth;
    if (i < list.size() && list[i] == ']') --depth;
    if (i == list.size() || (list[i] == ',' && depth == 0)) {
      if (i > start) expand_host(list.substr(start, i - start), hosts, list);
      start = i + 1;
    }
  }
  if (hosts.empty()) throw Error(cat("SLURM_JOB_NODELIST=", list, " names no host"));
  return hosts;
}

EnvLookup process_environment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

Bootstrap detect_bootstrap(const EnvLookup& lookup) {
  Bootstrap b;
  if (any_set(EnvReader(lookup, Launcher::torchrun), {"RANK", "WORLD_SIZE"}))
    b = from_torchrun(EnvReader(lookup, Launcher::torchrun));
  else if (any_set(EnvReader(lookup, Launcher::slurm), {"SLURM_PROCID", "SLURM_NTASKS"}))
    b = from_slurm(EnvReader(lookup, Launcher::slurm));
  else if (any_set(EnvReader(lookup, Launcher::openmpi),
                   {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}))
    b = from_openmpi(EnvReader(lookup, Launcher::openmpi));
  if (std::optional<std::string> token = lookup("TRAINER_JOB_TOKEN"); token && !token->empty())
    b.job_token = *token;
  if (std::optional<std::string> level = lookup("TRAINER_LOG_LEVEL"); level && !level->empty())
    b.log_level = parse_log_level(*level);
  const EnvReader launch(lookup, Launcher::torchrun);
  b.status_dir = lookup("TRAINER_STATUS_DIR").value_or("");
  b.heartbeat_ms = launch.int_or("TRAINER_HEARTBEAT_MS", b.heartbeat_ms, 1, 3600000);
  b.restart_count = launch.int_or("TRAINER_RESTART_COUNT", 0, 0, 1000000);
  b.comm_timeout_ms = launch.int_or("TRAINER_COMM_TIMEOUT_MS", 0, 0, 1 << 30);
  return b;
}

Bootstrap detect_bootstrap() {
  Bootstrap b = detect_bootstrap(process_environment());
  static std::once_flag logged;
  std::call_once(logged, [&] {
    set_log_rank(b.rank);
    set_log_level(b.log_level);
    COMM_LOG(LogLevel::info, "launcher ", launcher_name(b.launcher), ": rank ", b.rank, " of ",
             b.world_size, ", local rank ", b.local_rank, " of ", b.local_world_size, ", store at ",
             b.master_addr, ":", b.master_port);
  });
  return b;
}

std::optional<std::string> job_token_from_environment() {
  return process_environment()("TRAINER_JOB_TOKEN");
}

}  // namespace trainer::comm
