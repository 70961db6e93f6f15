#include "parallel/parameter_server.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <numeric>
#include <thread>

#include "core/autograd.h"
#include "core/check.h"
#include "optim/clip.h"

namespace trainer::parallel {

namespace {

enum Command : int { kInit = 1, kPush = 2, kGetState = 3, kSetState = 4, kDone = 5 };
constexpr int64_t kHeader = 4;  // f64: command, step, lr, unused | version, staleness, -, -
constexpr int64_t kTagWrap = int64_t(1) << comm::P2PTag::kMicroBatchBits;

// Stream 0 carries headers, 1 payloads; activation: worker -> server, gradient: back.
comm::P2PTag tag(int64_t message, bool to_server, int stream) {
  return {.micro_batch = message % kTagWrap,
          .direction = to_server ? comm::P2PDirection::activation : comm::P2PDirection::gradient,
          .stream = stream};
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

void ParameterServerClient::send(Link& link, double command, const Tensor* payload) const {
  double* h = link.header.data<double>();
  h[0] = command;
  h[1] = double(step_);
  h[2] = lr_;
  comm::Work head = world_->send(link.header, link.server, tag(link.sent, true, 0));
  comm::Work body;
  if (payload) body = world_->send(*payload, link.server, tag(link.sent, true, 1));
  ++link.sent;
  head.wait();
  body.wait();
}

void ParameterServerClient::step() {
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
    sends.push_back(world_->send(link->header, link->server, tag(link->sent, true, 0)));
    sends.push_back(world_->send(link->payload, link->server, tag(link->sent, true, 1)));
    ++link->sent;
  }
  for (comm::Work& w : sends) w.wait();
  last_staleness_ = 0;
  for (auto& link : links_) {
    recvs.push_back(world_->recv(link->reply, link->server, tag(link->received, false, 0)));
    recvs.push_back(world_->recv(link->payload, link->server, tag(link->received, false, 1)));
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
  for (auto& link : links_) {
    send(*link, kGetState, nullptr);
    Tensor flat =
        empty({std::max<int64_t>(1, state_elements(state, shards_, link->k))}, DType::f64);
    world_->recv(flat, link->server, tag(link->received, false, 1)).wait();
    ++link->received;
    unpack_state(state, shards_, link->k, flat.data<double>());
  }
  return state;
}

void ParameterServerClient::load_state(const std::vector<NamedTensor>& state) {
  shadow_->load_state(state);  // checks names, shapes and dtypes
  step_ = 0;
  if (world_->rank() != 0) return;
  const std::vector<NamedTensor> loaded = shadow_->state();
  for (auto& link : links_) {
    Tensor flat =
        empty({std::max<int64_t>(1, state_elements(loaded, shards_, link->k))}, DType::f64);
    pack_state(loaded, shards_, link->k, flat.data<double>());
    send(*link, kSetState, &flat);
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
    for (int w = 0; w < workers_; ++w) post(w);
    int done = 0;
    for (int idle = 0; done < workers_;) {
      bool any = false;
      for (int w = 0; w < workers_; ++w) {
        Peer& p = peers_[size_t(w)];
        // Worker 0's parameters (after its checkpoint's state) come first.
        if (!initialized_ && w != 0) continue;
        if (p.done || !p.next.test()) continue;
        any = true;
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

  void post(int w) {
    Peer& p = peers_[size_t(w)];
    p.next = world_->recv(p.header, w, tag(p.received, true, 0));
  }
  // The payload that follows the header just received.
  void receive_payload(int w, const Tensor& into) {
    Peer& p = peers_[size_t(w)];
    world_->recv(into, w, tag(p.received, true, 1)).wait();
  }
  void handled(int w) { ++peers_[size_t(w)].received; }

  void handle(int w, int command, int64_t step, double lr) {
    Peer& p = peers_[size_t(w)];
    if (command == kInit) {
      receive_payload(w, p.gradient);
      unpack_params(params_, p.gradient.data<float>());
      handled(w);
      initialized_ = true;
      return;
    }
    if (command == kSetState) {
      std::vector<NamedTensor> state =
          optimizer_ ? optimizer_->state() : std::vector<NamedTensor>();
      Tensor flat = empty({std::max<int64_t>(1, state_elements(state, shards_, k_))}, DType::f64);
      receive_payload(w, flat);
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
      world_->send(flat, w, tag(p.sent, false, 1)).wait();
      ++p.sent;
      return;
    }
    CHECK(command == kPush) << "parameter server: command " << command << " from rank " << w;
    receive_payload(w, p.gradient);
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
    p.sending = world_->send(p.reply, w, tag(p.sent, false, 0));
    p.sending_body = world_->send(p.answer, w, tag(p.sent, false, 1));
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
