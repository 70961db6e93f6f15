#include "comm/alpha_beta.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "comm/algorithms.h"
#include "comm/log.h"

namespace trainer::comm {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The ping-pong's sizes: alpha from one-float messages, beta from 1 MiB ones
// (past UCX's eager limits, so the rendezvous protocol the large segments use
// is what is measured). Minimum of a few round trips: the first warms up,
// and on a loaded machine the minimum is the link, the rest is waiting for a core.
constexpr size_t kSmallBytes = 4, kLargeBytes = size_t(1) << 20;
constexpr int kSmallTrips = 8, kLargeTrips = 3;

struct RoundTrips {
  double small = 0, large = 0;  // seconds, the best round trip of each size
};

// Ping-pong between this rank and peer, messages numbered from `message`
// on; the initiator times the round trips (the other returns zeros).
RoundTrips ping_pong(OpChannel& ch, int peer, bool initiator, char* buffer, uint32_t& message) {
  RoundTrips best{1e30, 1e30};
  for (size_t bytes : {kSmallBytes, kLargeBytes}) {
    double& slot = bytes == kSmallBytes ? best.small : best.large;
    const int trips = 1 + (bytes == kSmallBytes ? kSmallTrips : kLargeTrips);
    for (int trip = 0; trip < trips; ++trip, message += 2) {
      const auto start = Clock::now();
      Request r;
      if (initiator) {
        r = ch.isend(peer, message, buffer, bytes);
        ch.wait(r);
        r = ch.irecv(peer, message + 1, buffer, bytes);
        ch.wait(r);
      } else {
        r = ch.irecv(peer, message, buffer, bytes);
        ch.wait(r);
        r = ch.isend(peer, message + 1, buffer, bytes);
        ch.wait(r);
      }
      if (trip > 0) slot = std::min(slot, seconds_since(start));
    }
  }
  return initiator ? best : RoundTrips{};
}

// Seconds per byte of reduce_into on f32 (1 MiB, in cache after the first pass).
double measure_gamma() {
  const size_t count = kLargeBytes / sizeof(float);
  std::vector<float> a(count, 1.0f), b(count, 2.0f);
  double best = 1e30;
  for (int rep = 0; rep < 4; ++rep) {
    const auto start = Clock::now();
    reduce_into(a.data(), b.data(), count, DType::f32, ReduceOp::sum);
    if (rep > 0) best = std::min(best, seconds_since(start));
  }
  return best / double(kLargeBytes);
}

double log2_floor(int n) {
  int levels = 0;
  while ((2 << levels) <= n) ++levels;
  return double(levels);
}

}  // namespace

std::string LinkModel::str() const {
  char text[160];
  std::snprintf(text, sizeof text, "alpha %.1f us, beta %.2f GB/s, gamma %.2f GB/s", alpha * 1e6,
                beta > 0 ? 1e-9 / beta : 0.0, gamma > 0 ? 1e-9 / gamma : 0.0);
  return text;
}

LinkModel measure_link_model(Communicator& comm) {
  const auto start = Clock::now();
  const int n = comm.size(), rank = comm.rank();
  LinkModel model;
  if (n == 1) return model;
  // Pairs (0,1), (2,3), ...; an odd world's last rank then pairs with rank 0.
  // Each pair's lower rank times; the largest over all is the model.
  OpChannel ch(comm, comm.next_seq(), "alpha-beta ping-pong", comm.options().timeout);
  std::vector<char> buffer(kLargeBytes);
  uint32_t message = 0;
  RoundTrips mine;
  if (rank < n - n % 2) mine = ping_pong(ch, rank ^ 1, rank % 2 == 0, buffer.data(), message);
  if (n % 2 && (rank == 0 || rank == n - 1)) {
    message = 2 * (2 + kSmallTrips + kLargeTrips);  // past the first ping-pong's, on both
    const RoundTrips extra = ping_pong(ch, n - 1 - rank, rank == 0, buffer.data(), message);
    mine = {std::max(mine.small, extra.small), std::max(mine.large, extra.large)};
  }
  double measured[3] = {0, 0, measure_gamma()};
  if (mine.small > 0) {
    measured[0] = mine.small / 2;
    measured[1] = std::max(mine.large / 2 - measured[0], 1e-3 * mine.large) / double(kLargeBytes);
  }
  OpChannel agree(comm, comm.next_seq(), "alpha-beta agreement", comm.options().timeout);
  allreduce_recursive_doubling(agree, measured, 3, DType::f64, ReduceOp::max);
  model.alpha = measured[0];
  model.beta = measured[1];
  model.gamma = measured[2];
  model.measure_seconds = seconds_since(start);
  return model;
}

namespace {

// Every communicator's model, keyed by its members' world ranks: a
// communicator over the same ranks crosses the same links. Every member made
// the same communicators, so all find (or miss) an entry alike. Entries are
// never erased, so references to them stay valid.
struct ModelCache {
  std::mutex mutex;
  std::map<std::vector<int>, LinkModel> models;
};

ModelCache& model_cache() {
  static ModelCache cache;
  return cache;
}

// TRAINER_LINK_MODEL's model, if set.
std::optional<LinkModel> environment_model() {
  static const std::optional<LinkModel> model = []() -> std::optional<LinkModel> {
    const char* text = std::getenv("TRAINER_LINK_MODEL");
    if (text == nullptr || *text == '\0') return std::nullopt;
    return parse_link_model(text);
  }();
  return model;
}

}  // namespace

LinkModel parse_link_model(const std::string& text) {
  double values[3];
  size_t at = 0;
  for (int k = 0; k < 3; ++k) {
    const size_t end = k < 2 ? text.find(',', at) : text.size();
    const std::string field = end == std::string::npos ? "" : text.substr(at, end - at);
    char* rest = nullptr;
    values[k] = std::strtod(field.c_str(), &rest);
    if (field.empty() || *rest != '\0' || !std::isfinite(values[k]) || values[k] <= 0)
      throw Error(cat("TRAINER_LINK_MODEL=", text,
                      ": expected three positive numbers ALPHA_US,BETA_GBPS,GAMMA_GBPS (the "
                      "latency of a message in microseconds, the bandwidth of a link and of a "
                      "reduction in GB/s), e.g. \"2,1.5,12\""));
    at = end + 1;
  }
  return LinkModel{.alpha = values[0] * 1e-6, .beta = 1e-9 / values[1], .gamma = 1e-9 / values[2]};
}

const LinkModel& link_model(Communicator& comm) {
  ModelCache& cache = model_cache();
  std::vector<int> members(size_t(comm.size()));
  for (int r = 0; r < comm.size(); ++r) members[size_t(r)] = comm.world_rank(r);
  {
    std::lock_guard lock(cache.mutex);
    if (auto it = cache.models.find(members); it != cache.models.end()) return it->second;
  }
  const std::optional<LinkModel> given = environment_model();
  const LinkModel model = given ? *given : measure_link_model(comm);
  COMM_LOG(comm.rank() == 0 ? LogLevel::info : LogLevel::debug,
           "allreduce cost model of communicator ", comm.id(), " (", comm.size(), " ranks), ",
           given ? std::string("from TRAINER_LINK_MODEL")
                 : cat("measured in ", int(model.measure_seconds * 1e3 + 0.5), " ms"),
           ": ", model.str());
  std::lock_guard lock(cache.mutex);
  return cache.models.emplace(std::move(members), model).first->second;
}

std::map<std::vector<int>, LinkModel> link_models() {
  ModelCache& cache = model_cache();
  std::lock_guard lock(cache.mutex);
  return cache.models;
}

void preset_link_model(const std::vector<int>& members, const LinkModel& model) {
  ModelCache& cache = model_cache();
  std::lock_guard lock(cache.mutex);
  cache.models[members] = model;
}

double predict_allreduce(AllreduceAlgorithm algorithm, int n, size_t bytes, size_t segment_bytes,
                         const LinkModel& model) {
  const double a = model.alpha, b = model.beta, g = model.gamma, m = double(bytes);
  if (n <= 1 || bytes == 0)
    return algorithm == AllreduceAlgorithm::automatic || algorithm == AllreduceAlgorithm::shm ? -1
                                                                                              : 0;
  const double levels = log2_floor(n), p = std::exp2(levels);
  // Non-powers of two fold onto p first and unfold at the end.
  const double fold = p == n ? 0 : 2 * (a + m * b) + m * g;
  switch (algorithm) {
    case AllreduceAlgorithm::ring:
      return 2 * (n - 1) * a + 2.0 * (n - 1) / n * m * b + double(n - 1) / n * m * g;
    case AllreduceAlgorithm::recursive_doubling:
      return levels * (a + m * b + m * g) + fold;
    case AllreduceAlgorithm::butterfly:
      return 2 * levels * a + 2 * (p - 1) / p * m * b + (p - 1) / p * m * g + fold;
    case AllreduceAlgorithm::tree: {
      const double segments = std::ceil(m / double(std::max<size_t>(segment_bytes, 1)));
      const double s = m / segments, children = std::min(2, n - 1);
      const double steps = levels + segments - 1;
      return 2 * steps * (a + children * s * b) + steps * children * s * g;
    }
    case AllreduceAlgorithm::all_to_all:
      return (n - 1) * (a + m * b + m * g);
    case AllreduceAlgorithm::master_worker:
      return 2 * (n - 1) * (a + m * b) + (n - 1) * m * g;
    case AllreduceAlgorithm::round_robin: {
      const double block = m / n;
      return (n - 1) * (a + block * b) + (n - 1) * block * g + n * (n - 1) * (a + block * b);
    }
    case AllreduceAlgorithm::automatic:
    case AllreduceAlgorithm::shm:
      break;
  }
  return -1;
}

const std::vector<AllreduceAlgorithm>& modelled_algorithms() {
  static const std::vector<AllreduceAlgorithm> all{
      AllreduceAlgorithm::recursive_doubling, AllreduceAlgorithm::ring,
      AllreduceAlgorithm::butterfly,          AllreduceAlgorithm::tree,
      AllreduceAlgorithm::round_robin,        AllreduceAlgorithm::all_to_all,
      AllreduceAlgorithm::master_worker};
  return all;
}

AllreduceAlgorithm choose_allreduce(int n, size_t bytes, size_t segment_bytes,
                                    const LinkModel& model) {
  AllreduceAlgorithm best = AllreduceAlgorithm::recursive_doubling;
  double best_seconds = predict_allreduce(best, n, bytes, segment_bytes, model);
  for (AllreduceAlgorithm candidate : modelled_algorithms()) {
    const double seconds = predict_allreduce(candidate, n, bytes, segment_bytes, model);
    // Strictly better by a margin: a near tie keeps the earlier (simpler) one.
    if (seconds < best_seconds * (1 - 1e-9)) {
      best = candidate;
      best_seconds = seconds;
    }
  }
  return best;
}

AllreduceTraffic allreduce_traffic(AllreduceAlgorithm algorithm, int n, size_t bytes,
                                   size_t segment_bytes) {
  if (n <= 1 || bytes == 0) return {};
  const double m = double(bytes), levels = log2_floor(n), p = std::exp2(levels), rem = n - p;
  auto segments_of = [&](double part) {
    return std::max(1.0, std::ceil(part / double(std::max<size_t>(segment_bytes, 1))));
  };
  // The fold: rem messages in, rem results out; an odd rank of it sends the result back.
  const double fold_messages = 2 * rem, fold_bytes = rem > 0 ? m : 0;
  switch (algorithm) {
    case AllreduceAlgorithm::ring:
      return {2.0 * n * (n - 1) * segments_of(m / n), 2.0 * (n - 1) / n * m, 2.0 * (n - 1) * m};
    case AllreduceAlgorithm::recursive_doubling:
      return {p * levels + fold_messages, levels * m + fold_bytes, (p * levels + 2 * rem) * m};
    case AllreduceAlgorithm::butterfly:
      return {2 * p * levels + fold_messages, 2 * (p - 1) / p * m + fold_bytes,
              (2 * (p - 1) + 2 * rem) * m};
    case AllreduceAlgorithm::tree: {
      double busiest = 0;  // each rank sends one copy up and one per child down
      for (int v = 0; v < n; ++v)
        busiest = std::max(busiest, double(v > 0) + double((2 * v + 1 < n) + (2 * v + 2 < n)));
      return {2.0 * (n - 1) * segments_of(m), busiest * m, 2.0 * (n - 1) * m};
    }
    case AllreduceAlgorithm::all_to_all:
      return {double(n) * (n - 1) * segments_of(m), (n - 1) * m, double(n) * (n - 1) * m};
    case AllreduceAlgorithm::master_worker:
      return {2.0 * (n - 1) * segments_of(m), (n - 1) * m, 2.0 * (n - 1) * m};
    case AllreduceAlgorithm::round_robin:
      return {2.0 * n * (n - 1), 2.0 * (n - 1) / n * m, 2.0 * (n - 1) * m};
    case AllreduceAlgorithm::automatic:
    case AllreduceAlgorithm::shm:
      break;
  }
  return {};
}

}  // namespace trainer::comm
