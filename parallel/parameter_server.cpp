#include "parallel/parameter_server.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <numeric>
#include <optional>
#include <thread>
#include <utility>

#include "comm/transport.h"
#include "comm/watchdog.h"
#include "core/autograd.h"
#include "core/check.h"
#include "optim/clip.h"

namespace trainer::parallel {

namespace {

enum Command : int { kInit = 1, kPush = 2, kGetState = 3, kSetState = 4, kDone = 5 };
constexpr int64_t kHeader = 4;  // f64: command, step, lr, unused | version, staleness, -, -
constexpr int64_t kTagWrap = int64_t(1) << comm::P2PTag::kMicroBatchBits;

// Stream 0 carries headers, 1 payloads; the tag's direction says which way
// (activation: worker -> server, gradient: back), not what the message is:
// label() does, for errors.
comm::P2PTag tag(int64_t message, bool to_server, int stream) {
  return {.micro_batch = message % kTagWrap,
          .direction = to_server ? comm::P2PDirection::activation : comm::P2PDirection::gradient,
          .stream = stream};
}

// What a worker's message of command is ("gradient push").
const char* command_name(int command) {
  switch (command) {
    case kInit:
      return "initial parameters";
    case kPush:
      return "gradient push";
    case kGetState:
      return "optimizer state request";
    case kSetState:
      return "optimizer state upload";
    case kDone:
      return "end of training";
    default:
      return "unknown command";
  }
}

// "the gradients of gradient push message 12": part of message number n
// (counted per direction, as the tag) of a kind.
comm::P2POptions label(const char* part, const char* kind, int64_t n) {
  return {.label = cat("the ", part, " of ", kind, " message ", n)};
}

// The ranks among peers (of world) whose process has died, with how: a
// transport error about a peer can come before its death is known (a receive
// from a killed sender fails as its memory goes, before its process has
// exited), so they are polled for up to a second.
std::vector<std::pair<int, std::string>> dead_peers(comm::Communicator& world,
                                                    const std::vector<int>& peers) {
  std::vector<std::pair<int, std::string>> dead;
  for (int attempt = 0; attempt < 100 && dead.empty(); ++attempt) {
    if (attempt) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    for (int peer : peers)
      if (std::string failure = world.transport().poll_peer(world.world_rank(peer));
          !failure.empty())
        dead.push_back({peer, failure});
  }
  return dead;
}

// error (of an exchange of `me` with its peers) said as the death of the
// peers that died, each named by its role ("worker", "parameter server" k =
// rank - first), with what to do.
Error death_error(const std::string& me, const char* role, int first,
                  const std::vector<std::pair<int, std::string>>& dead, const Error& error) {
  std::string who;
  for (const auto& [peer, failure] : dead)
    who +=
        cat(who.empty() ? "" : "; ", role, " ", peer - first, " (rank ", peer, ") died: ", failure);
  return Error(cat(me, ": ", who, "; the job cannot go on without ",
                   dead.size() == 1 ? "it" : "them",
                   ": restart the job (trainer launch --max-restarts N resumes it from the newest "
                   "checkpoint). Noticed in: ",
                   error.what()));
}

std::vector<NamedTensor> flat_params(const std::vector<optim::ParamGroup>& groups) {
  std::vector<NamedTensor> out;
  for (const optim::ParamGroup& g : groups) out.insert(out.end(), g.params.begin(), g.params.end());
  return out;
}

int64_t total_elements(const std::vector<NamedTensor>& params) {
  int64_t n = 0;
  for (const NamedTensor& p : params) n += p.tensor.numel();
  return n;
}

void check_f32_cpu(const NamedTensor& p) {
  if (p.tensor.dtype() != DType::f32 || !p.tensor.device().is_cpu() || !p.tensor.is_contiguous())
    throw Error(cat("parameter servers: parameter ", p.name,
                    " is not a contiguous f32 CPU tensor (parallel.mode = parameter_server "
                    "trains on the CPU in f32)"));
}

// Gradients into buffer (zeros where a parameter has none), or buffer into the parameters.
void pack_grads(const std::vector<NamedTensor>& params, float* buffer) {
  for (const NamedTensor& p : params) {
    const size_t n = size_t(p.tensor.numel());
    const Tensor g = p.tensor.grad();
    if (g.defined())
      std::memcpy(buffer, g.contiguous().data<float>(), n * sizeof(float));
    else
      std::fill(buffer, buffer + n, 0.0f);
    buffer += n;
  }
}
void pack_params(const std::vector<NamedTensor>& params, float* buffer) {
  for (const NamedTensor& p : params) {
    const size_t n = size_t(p.tensor.numel());
    std::memcpy(buffer, p.tensor.data<float>(), n * sizeof(float));
    buffer += n;
  }
}
void unpack_params(const std::vector<NamedTensor>& params, const float* buffer) {
  for (const NamedTensor& p : params) {
    const size_t n = size_t(p.tensor.numel());
    std::memcpy(p.tensor.data<float>(), buffer, n * sizeof(float));
    buffer += n;
  }
}

// The optimizer state entries of `names`' parameters, flattened as f64.
bool owned(const std::string& entry, const std::map<std::string, int>& owner, int k) {
  const std::string param = entry.substr(0, entry.rfind('.'));
  auto it = owner.find(param);
  return it != owner.end() && it->second == k;
}
int64_t state_elements(const std::vector<NamedTensor>& state, const ShardMap& shards, int k) {
  int64_t n = 0;
  for (const NamedTensor& e : state)
    if (owned(e.name, shards.owner, k)) n += e.tensor.numel();
  return n;
}
void pack_state(const std::vector<NamedTensor>& state, const ShardMap& shards, int k, double* out) {
  for (const NamedTensor& e : state) {
    if (!owned(e.name, shards.owner, k)) continue;
    std::vector<double> v = e.tensor.to_vector<double>();
    out = std::copy(v.begin(), v.end(), out);
  }
}
void unpack_state(const std::vector<NamedTensor>& state, const ShardMap& shards, int k,
                  const double* in) {
  for (const NamedTensor& e : state) {
    if (!owned(e.name, shards.owner, k)) continue;
    const size_t n = size_t(e.tensor.numel());
    if (e.tensor.dtype() == DType::f32) {
      float* d = e.tensor.data<float>();
      for (size_t i = 0; i < n; ++i) d[i] = float(in[i]);
    } else if (e.tensor.dtype() == DType::i64) {
      int64_t* d = e.tensor.data<int64_t>();
      for (size_t i = 0; i < n; ++i) d[i] = int64_t(in[i]);
    } else {
      CHECK(e.tensor.dtype() == DType::f64) << e.name;
      std::memcpy(e.tensor.data<double>(), in, n * sizeof(double));
    }
    in += n;
  }
}

}  // namespace

Sync parse_sync(const std::string& name) {
  if (name == "bsp") return Sync::bsp;
  if (name == "asp") return Sync::asp;
  if (name == "ssp") return Sync::ssp;
  throw Error(cat("parallel.sync '", name, "': use bsp, asp or ssp"));
}

ShardMap assign_shards(const std::vector<optim::ParamGroup>& groups, int servers) {
  CHECK(servers >= 1) << servers << " servers";
  const std::vector<NamedTensor> params = flat_params(groups);
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), 0);
  // Largest first, each to the least loaded server (ties: the lower index).
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return params[a].tensor.numel() > params[b].tensor.numel();
  });
  ShardMap m;
  m.servers = servers;
  m.elements.assign(size_t(servers), 0);
  for (size_t i : order) {
    const int k = int(std::min_element(m.elements.begin(), m.elements.end()) - m.elements.begin());
    m.owner[params[i].name] = k;
    m.elements[size_t(k)] += params[i].tensor.numel();
  }
  return m;
}

std::vector<optim::ParamGroup> shard_groups(const std::vector<optim::ParamGroup>& groups,
                                            const ShardMap& shards, int k) {
  std::vector<optim::ParamGroup> out;
  for (const optim::ParamGroup& g : groups) {
    optim::ParamGroup mine = g;
    mine.params.clear();
    for (const NamedTensor& p : g.params)
      if (shards.owner.at(p.name) == k) mine.params.push_back(p);
    if (!mine.params.empty()) out.push_back(std::move(mine));
  }
  return out;
}

// ---- worker ----

struct ParameterServerClient::Link {
  int server = 0;  // world rank
  int k = 0;       // shard
  std::vector<NamedTensor> params;
  Tensor header, reply, payload;  // f64[kHeader], f64[kHeader], f32[n]
  mutable int64_t sent = 0, received = 0;
};

ParameterServerClient::ParameterServerClient(std::shared_ptr<comm::Communicator> world,
                                             ShardMap shards, int workers,
                                             std::vector<optim::ParamGroup> groups,
                                             const OptimizerFactory& make)
    : world_(std::move(world)),
      shards_(std::move(shards)),
      workers_(workers),
      groups_(std::move(groups)),
      shadow_(make(groups_)) {
  CHECK(world_->rank() < workers_) << "a parameter-server client on server rank " << world_->rank();
  for (const NamedTensor& p : flat_params(groups_)) check_f32_cpu(p);
  for (int k = 0; k < shards_.servers; ++k) {
    auto link = std::make_unique<Link>();
    link->server = workers_ + k;
    link->k = k;
    for (const optim::ParamGroup& g : shard_groups(groups_, shards_, k))
      link->params.insert(link->params.end(), g.params.begin(), g.params.end());
    link->header = zeros({kHeader}, DType::f64);
    link->reply = zeros({kHeader}, DType::f64);
    link->payload = empty({std::max<int64_t>(1, total_elements(link->params))}, DType::f32);
    links_.push_back(std::move(link));
  }
}

ParameterServerClient::~ParameterServerClient() {
  try {
    for (auto& link : links_) send(*link, kDone, nullptr);
  } catch (const Error&) {
    // The server is gone: nobody to tell.
  }
}

void ParameterServerClient::send(Link& link, int command, const Tensor* payload) const {
  double* h = link.header.data<double>();
  h[0] = command;
  h[1] = double(step_);
  h[2] = lr_;
  const char* kind = command_name(command);
  comm::Work head = world_->send(link.header, link.server, tag(link.sent, true, 0),
                                 label("header", kind, link.sent));
  comm::Work body;
  if (payload)
    body = world_->send(*payload, link.server, tag(link.sent, true, 1),
                        label(command == kInit ? "parameters" : "state", kind, link.sent));
  ++link.sent;
  head.wait();
  body.wait();
}

void ParameterServerClient::step() {
  try {
    push_and_pull();
  } catch (const Error& e) {
    rethrow_naming_dead_servers(e);
  }
}

void ParameterServerClient::rethrow_naming_dead_servers(const Error& error) const {
  std::vector<int> servers;
  for (const auto& link : links_) servers.push_back(link->server);
  const std::vector<std::pair<int, std::string>> dead = dead_peers(*world_, servers);
  if (dead.empty()) throw error;
  throw death_error(cat("worker ", world_->rank(), " (rank ", world_->rank(), ")"),
                    "parameter server", workers_, dead, error);
}

void ParameterServerClient::push_and_pull() {
  autograd::NoGradGuard no_grad;
  if (!initialized_) {
    // Worker 0's parameters (fresh, or loaded from a checkpoint) seed the servers.
    if (world_->rank() == 0)
      for (auto& link : links_) {
        pack_params(link->params, link->payload.data<float>());
        send(*link, kInit, &link->payload);
      }
    initialized_ = true;
  }
  // Every server's gradients out, then every server's parameters back.
  std::vector<comm::Work> sends, recvs;
  for (auto& link : links_) {
    pack_grads(link->params, link->payload.data<float>());
    double* h = link->header.data<double>();
    h[0] = kPush;
    h[1] = double(step_);
    h[2] = lr_;
    sends.push_back(world_->send(link->header, link->server, tag(link->sent, true, 0),
                                 label("header", "gradient push", link->sent)));
    sends.push_back(world_->send(link->payload, link->server, tag(link->sent, true, 1),
                                 label("gradients", "gradient push", link->sent)));
    ++link->sent;
  }
  for (comm::Work& w : sends) w.wait();
  last_staleness_ = 0;
  for (auto& link : links_) {
    recvs.push_back(world_->recv(link->reply, link->server, tag(link->received, false, 0),
                                 label("header", "parameter pull", link->received)));
    recvs.push_back(world_->recv(link->payload, link->server, tag(link->received, false, 1),
                                 label("parameters", "parameter pull", link->received)));
    ++link->received;
  }
  for (comm::Work& w : recvs) w.wait();
  for (auto& link : links_) {
    unpack_params(link->params, link->payload.data<float>());
    last_staleness_ = std::max(last_staleness_, int64_t(link->reply.data<double>()[1]));
  }
  ++step_;
}

void ParameterServerClient::zero_grad(bool set_to_none) { optim::zero_grads(groups_, set_to_none); }

double ParameterServerClient::clip_grad_norm(double max_norm) {
  return optim::clip_grad_norm(optim::parameters(groups_), max_norm);
}

std::vector<NamedTensor> ParameterServerClient::state() const {
  std::vector<NamedTensor> state = shadow_->state();
  // The other workers' copy is the layout only (what they loaded, if anything).
  if (world_->rank() != 0) return state;
  try {
    for (auto& link : links_) {
      send(*link, kGetState, nullptr);
      Tensor flat =
          empty({std::max<int64_t>(1, state_elements(state, shards_, link->k))}, DType::f64);
      world_
          ->recv(flat, link->server, tag(link->received, false, 1),
                 label("state", "optimizer state reply", link->received))
          .wait();
      ++link->received;
      unpack_state(state, shards_, link->k, flat.data<double>());
    }
  } catch (const Error& e) {
    rethrow_naming_dead_servers(e);
  }
  return state;
}

void ParameterServerClient::load_state(const std::vector<NamedTensor>& state) {
  shadow_->load_state(state);  // checks names, shapes and dtypes
  step_ = 0;
  if (world_->rank() != 0) return;
  const std::vector<NamedTensor> loaded = shadow_->state();
  try {
    for (auto& link : links_) {
      Tensor flat =
          empty({std::max<int64_t>(1, state_elements(loaded, shards_, link->k))}, DType::f64);
      pack_state(loaded, shards_, link->k, flat.data<double>());
      send(*link, kSetState, &flat);
    }
  } catch (const Error& e) {
    rethrow_naming_dead_servers(e);
  }
}

// ---- server ----

std::string ServerReport::summary() const {
  int64_t most = 0;
  double sum = 0;
  std::string histogram;
  for (const auto& [s, n] : staleness) {
    most = std::max(most, s);
    sum += double(s) * double(n);
    histogram += cat(histogram.empty() ? "" : " ", s, ":", n);
  }
  char mean[32];
  std::snprintf(mean, sizeof mean, "%.2f", gradients ? sum / double(gradients) : 0.0);
  return cat(gradients, " gradients in ", updates, " updates; staleness mean ", mean, ", max ",
             most, " (staleness:count ", histogram, ")");
}

namespace {

class Server {
 public:
  Server(std::shared_ptr<comm::Communicator> world, const ShardMap& shards, int workers,
         const std::vector<optim::ParamGroup>& groups, const OptimizerFactory& make,
         const ServeOptions& options)
      : world_(std::move(world)),
        shards_(shards),
        workers_(workers),
        k_(world_->rank() - workers),
        groups_(shard_groups(groups, shards, k_)),
        params_(flat_params(groups_)),
        n_(std::max<int64_t>(1, total_elements(params_))),
        options_(options),
        peers_(size_t(workers)),
        update_(static_cast<size_t>(n_)) {
    for (const NamedTensor& p : params_) check_f32_cpu(p);
    if (!groups_.empty()) optimizer_ = make(groups_);
    for (Peer& p : peers_) {
      p.header = zeros({kHeader}, DType::f64);
      p.reply = zeros({kHeader}, DType::f64);
      p.gradient = empty({n_}, DType::f32);
      p.answer = empty({n_}, DType::f32);
    }
  }

  ServerReport run() {
    try {
      return serve();
    } catch (const Error& e) {
      std::vector<int> workers(static_cast<size_t>(workers_));
      std::iota(workers.begin(), workers.end(), 0);
      const std::vector<std::pair<int, std::string>> dead = dead_peers(*world_, workers);
      if (dead.empty()) throw;
      // The record is left waiting on the dead worker, so the launcher's
      // report names it as where the job stopped, not this server that the
      // others wait on; the answers in flight end first (their waits would
      // replace the record as the error unwinds).
      settle_answers();
      const int first = dead.front().first;
      comm::watchdog::Wait on_the_dead("gradient push", world_->id(),
                                       uint32_t(peers_[size_t(first)].received),
                                       world_->world_rank(first));
      throw death_error(cat("parameter server ", k_, " (rank ", world_->rank(), ")"), "worker", 0,
                        dead, e);
    }
  }

 private:
  struct Peer {
    Tensor header, reply, gradient, answer;
    comm::Work next, sending, sending_body;
    int64_t received = 0, sent = 0;
    int64_t clock = 0;      // gradients applied
    int64_t pulled = 0;     // the shard's version its last answer carried
    int64_t staleness = 0;  // of its last applied gradient
    bool parked = false, done = false;
  };

  ServerReport serve() {
    for (int w = 0; w < workers_; ++w) post(w);
    int done = 0;
    // Between messages: waiting on the worker furthest behind, for the
    // launcher's report of who waits on whom (comm/watchdog.h).
    std::optional<comm::watchdog::Wait> waiting;
    for (int idle = 0; done < workers_;) {
      bool any = false;
      for (int w = 0; w < workers_; ++w) {
        Peer& p = peers_[size_t(w)];
        // Worker 0's parameters (after its checkpoint's state) come first.
        if (!initialized_ && w != 0) continue;
        if (p.done) continue;
        if (!waiting) {
          const int slowest = furthest_behind();
          waiting.emplace("gradient push", world_->id(), uint32_t(peers_[size_t(slowest)].received),
                          world_->world_rank(slowest));
        }
        if (!p.next.test()) continue;
        any = true;
        if (waiting) {
          waiting->done();
          waiting.reset();
        }
        const double* h = p.header.data<double>();
        const int command = int(h[0]);
        if (command == kDone) {
          p.done = true;
          ++done;
          answer_parked();  // the others no longer wait for this one
          continue;
        }
        handle(w, command, int64_t(h[1]), h[2]);
        post(w);
      }
      idle = any ? 0 : idle + 1;
      if (idle > 1000)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      else if (idle > 0)
        std::this_thread::yield();
    }
    for (Peer& p : peers_) p.sending.wait();
    return report_;
  }

  // Waits out the answers in flight, whatever becomes of them.
  void settle_answers() {
    for (Peer& p : peers_)
      for (comm::Work* answer : {&p.sending, &p.sending_body}) {
        try {
          answer->wait();
        } catch (const Error&) {
          // An answer to a dead worker: its failure is already the error.
        }
      }
  }

  // The running worker with the fewest messages received (the lowest rank of those).
  int furthest_behind() const {
    int slowest = 0;
    for (int w = 0; w < workers_; ++w) {
      const Peer& p = peers_[size_t(w)];
      if (!p.done &&
          (peers_[size_t(slowest)].done || p.received < peers_[size_t(slowest)].received))
        slowest = w;
    }
    return slowest;
  }

  void post(int w) {
    Peer& p = peers_[size_t(w)];
    p.next = world_->recv(
        p.header, w, tag(p.received, true, 0),
        {.label = cat("the header of the next gradient push or command, message ", p.received)});
  }
  // The payload (part) that follows the header of command just received.
  void receive_payload(int w, int command, const char* part, const Tensor& into) {
    Peer& p = peers_[size_t(w)];
    world_->recv(into, w, tag(p.received, true, 1), label(part, command_name(command), p.received))
        .wait();
  }
  void handled(int w) { ++peers_[size_t(w)].received; }

  void handle(int w, int command, int64_t step, double lr) {
    Peer& p = peers_[size_t(w)];
    if (command == kInit) {
      receive_payload(w, command, "parameters", p.gradient);
      unpack_params(params_, p.gradient.data<float>());
      handled(w);
      initialized_ = true;
      return;
    }
    if (command == kSetState) {
      std::vector<NamedTensor> state =
          optimizer_ ? optimizer_->state() : std::vector<NamedTensor>();
      Tensor flat = empty({std::max<int64_t>(1, state_elements(state, shards_, k_))}, DType::f64);
      receive_payload(w, command, "state", flat);
      unpack_state(state, shards_, k_, flat.data<double>());
      handled(w);
      return;
    }
    if (command == kGetState) {
      handled(w);
      std::vector<NamedTensor> state =
          optimizer_ ? optimizer_->state() : std::vector<NamedTensor>();
      Tensor flat = empty({std::max<int64_t>(1, state_elements(state, shards_, k_))}, DType::f64);
      pack_state(state, shards_, k_, flat.data<double>());
      p.sending.wait();
      p.sending_body.wait();
      world_->send(flat, w, tag(p.sent, false, 1), label("state", "optimizer state reply", p.sent))
          .wait();
      ++p.sent;
      return;
    }
    CHECK(command == kPush) << "parameter server: command " << command << " from rank " << w;
    receive_payload(w, command, "gradients", p.gradient);
    handled(w);
    if (options_.sync == Sync::bsp) {
      p.parked = true;
      if (++pending_ < workers_) return;
      // Every worker's gradient of this step: their mean, summed in worker order.
      std::fill(update_.begin(), update_.end(), 0.0f);
      for (const Peer& q : peers_) {
        const float* g = q.gradient.data<float>();
        for (int64_t i = 0; i < n_; ++i) update_[size_t(i)] += g[i];
      }
      for (float& v : update_) v /= float(workers_);
      apply(update_.data(), lr);
      report_.gradients += workers_;
      report_.staleness[0] += workers_;
      pending_ = 0;
      for (int q = 0; q < workers_; ++q) answer(q);
      return;
    }
    // asp and ssp: this gradient now, weighted 1/W.
    const int64_t staleness = version_ - p.pulled;
    const float* g = p.gradient.data<float>();
    for (int64_t i = 0; i < n_; ++i) update_[size_t(i)] = g[i] / float(workers_);
    apply(update_.data(), lr);
    ++p.clock;
    p.staleness = staleness;
    ++report_.gradients;
    ++report_.staleness[staleness];
    (void)step;
    p.parked = true;
    answer_parked();
  }

  void apply(const float* gradient, double lr) {
    autograd::NoGradGuard no_grad;
    for (const NamedTensor& q : params_) {
      Tensor grad = q.tensor.grad();
      if (!grad.defined()) {
        q.tensor.set_grad(zeros_like(q.tensor));
        grad = q.tensor.grad();
      }
      const size_t n = size_t(q.tensor.numel());
      std::memcpy(grad.data<float>(), gradient, n * sizeof(float));
      gradient += n;
    }
    if (optimizer_) {
      optimizer_->set_lr(lr);
      optimizer_->step();
    }
    ++version_;
    ++report_.updates;
  }

  // Answers the parked workers allowed to go on: under ssp those at most
  // `staleness` gradients ahead of the slowest worker still running.
  void answer_parked() {
    int64_t slowest = INT64_MAX;
    for (const Peer& q : peers_)
      if (!q.done) slowest = std::min(slowest, q.clock);
    for (int w = 0; w < workers_; ++w) {
      Peer& q = peers_[size_t(w)];
      if (!q.parked) continue;
      if (options_.sync == Sync::ssp && slowest != INT64_MAX &&
          q.clock - slowest > options_.staleness)
        continue;
      answer(w);
    }
  }

  void answer(int w) {
    Peer& p = peers_[size_t(w)];
    p.parked = false;
    p.sending.wait();  // the last answer's buffers are free again
    p.sending_body.wait();
    double* r = p.reply.data<double>();
    r[0] = double(version_);
    r[1] = double(options_.sync == Sync::bsp ? 0 : p.staleness);
    pack_params(params_, p.answer.data<float>());
    p.sending =
        world_->send(p.reply, w, tag(p.sent, false, 0), label("header", "parameter pull", p.sent));
    p.sending_body = world_->send(p.answer, w, tag(p.sent, false, 1),
                                  label("parameters", "parameter pull", p.sent));
    ++p.sent;
    p.pulled = version_;
  }

  std::shared_ptr<comm::Communicator> world_;
  const ShardMap& shards_;
  int workers_, k_;
  std::vector<optim::ParamGroup> groups_;
  std::vector<NamedTensor> params_;
  int64_t n_;
  ServeOptions options_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::vector<Peer> peers_;
  std::vector<float> update_;  // the gradient applied next (bsp: the mean; asp, ssp: scaled)
  bool initialized_ = false;   // worker 0's kInit has come
  int pending_ = 0;            // bsp: gradients of the current step received
  int64_t version_ = 0;
  ServerReport report_;
};

}  // namespace

ServerReport serve_parameters(std::shared_ptr<comm::Communicator> world, const ShardMap& shards,
                              int workers, const std::vector<optim::ParamGroup>& groups,
                              const OptimizerFactory& make, const ServeOptions& options) {
  CHECK(world->rank() >= workers) << "serve_parameters on worker rank " << world->rank();
  return Server(std::move(world), shards, workers, groups, make, options).run();
}

}  // namespace trainer::parallel
