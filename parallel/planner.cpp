#include "parallel/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>

#include "core/check.h"

namespace trainer::parallel {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;

// Per-message latencies: an NCCL ring step over NVLink costs a few
// microseconds, one over InfiniBand (through the NIC and a switch) more.
constexpr double kNvlinkAlphaUs = 3.0;
constexpr double kInfinibandAlphaUs = 8.0;

struct DeviceLinks {
  const char* device;
  double nvlink_gbps, ib_gbps;
};
// NVLink per GPU and direction: A100 300 GB/s, H100 450 GB/s; one HDR
// (200 Gb/s) or NDR (400 Gb/s) InfiniBand port per GPU, as DGX A100 / H100.
constexpr DeviceLinks kLinks[] = {
    {"a100-40gb", 300 * 8, 200}, {"a100-80gb", 300 * 8, 200}, {"h100-80gb", 450 * 8, 400}};

// CPU ranks on one host: collectives through the communicator's
// shared-memory channel, point-to-point through UCX's shared-memory
// transports; `trainer plan --calibrate` on the 2-core dev VM, 2026-11-25
// (docs/planner.md). Between hosts: TCP over 10 Gb/s Ethernet, a guess.
constexpr LinkSpec kCpuSharedMemory{.alpha_us = 0.17, .gbps = 73};
constexpr LinkSpec kCpuSharedMemoryP2p{.alpha_us = 4.0, .gbps = 43};
constexpr LinkSpec kCpuEthernet{.alpha_us = 30, .gbps = 10};

std::string fixed(double value, int digits) {
  char text[48];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

// The divisors of n >= 1 in increasing order, in O(sqrt n) steps (a loop
// up to n overflowed at INT_MAX and took seconds for a large world).
std::vector<int> divisors(int n) {
  std::vector<int> small, large;
  for (int64_t d = 1; d * d <= n; ++d) {
    if (n % d != 0) continue;
    small.push_back(int(d));
    if (d * d != n) large.push_back(int(n / d));
  }
  small.insert(small.end(), large.rbegin(), large.rend());
  return small;
}

// A ring allreduce over n ranks: reduce-scatter then all-gather, 2(n - 1)
// steps each moving bytes / n, so 2(n-1)/n x bytes / bandwidth + 2(n-1) alpha.
double ring_allreduce(const LinkSpec& link, int ranks, double bytes) {
  if (ranks <= 1 || bytes <= 0) return 0;
  return 2.0 * (ranks - 1) * link.seconds(bytes / ranks);
}
// Its all-gather half alone (ZeRO-1's parameter gather after the step).
double ring_allgather(const LinkSpec& link, int ranks, double bytes) {
  return 0.5 * ring_allreduce(link, ranks, bytes);
}

// Bytes a value takes in the step's precision, relative to 16 bits.
double value_scale(const std::string& precision) { return precision == "fp32" ? 2.0 : 1.0; }

}  // namespace

std::string plan_label(const Plan& plan) {
  std::string label = cat("dp=", plan.dp, plan.ep > 1 ? cat(" ep=", plan.ep) : "", " pp=", plan.pp,
                          plan.cp > 1 ? cat(" cp=", plan.cp) : "", " tp=", plan.tp,
                          " M=", plan.micro_batches, " b=", plan.micro_batch_size);
  if (plan.pp > 1) label += " " + plan.schedule;
  if (plan.chunks > 1) label += cat(" V=", plan.chunks);
  if (plan.zero > 0) label += cat(" zero", plan.zero);
  if (plan.replicas > 1) label += cat(" hybrid ", plan.replicas, "x", plan.shard_group());
  if (plan.recompute != Recompute::none) label += " recompute=" + to_string(plan.recompute);
  return label;
}

// ---- devices ----

const std::vector<DeviceSpec>& device_table() {
  static const std::vector<DeviceSpec> table = {
      {.name = "a100-40gb", .peak_tflops = 312, .memory_gib = 40, .per_node = 8},
      {.name = "a100-80gb", .peak_tflops = 312, .memory_gib = 80, .per_node = 8},
      {.name = "h100-80gb", .peak_tflops = 989, .memory_gib = 80, .per_node = 8},
  };
  return table;
}

ClusterSpec cluster_for(const std::string& device, int nodes, int per_node) {
  for (const DeviceSpec& spec : device_table()) {
    if (spec.name != device) continue;
    ClusterSpec cluster;
    cluster.device = spec;
    cluster.nodes = nodes;
    cluster.per_node = per_node > 0 ? per_node : spec.per_node;
    for (const DeviceLinks& links : kLinks)
      if (device == links.device) {
        cluster.intra = {kNvlinkAlphaUs, links.nvlink_gbps};
        cluster.inter = {kInfinibandAlphaUs, links.ib_gbps};
      }
    return cluster;
  }
  std::string names;
  for (const DeviceSpec& spec : device_table()) names += (names.empty() ? "" : ", ") + spec.name;
  throw Error(cat("unknown device '", device, "'; the devices are ", names,
                  " (or describe one in a --cluster file)"));
}

ClusterSpec cpu_cluster(int nodes, int per_node, double ram_gib) {
  CHECK(per_node >= 1) << per_node;
  ClusterSpec cluster;
  cluster.device = {.name = kCpuDevice,
                    .peak_tflops = 0,
                    .memory_gib = ram_gib / per_node,
                    .per_node = per_node,
                    .achievable = 1};
  cluster.nodes = nodes;
  cluster.per_node = per_node;
  cluster.intra = kCpuSharedMemory;
  cluster.intra_p2p = kCpuSharedMemoryP2p;
  cluster.inter = kCpuEthernet;
  return cluster;
}

// ---- block timers ----

FlopBlockTimer::FlopBlockTimer(DeviceSpec device, double peak_scale, double knee)
    : device_(std::move(device)), peak_scale_(peak_scale), knee_(knee) {}

double FlopBlockTimer::rate(const BlockCost& block, int64_t samples, int tp) const {
  const int split = block.tp_split ? tp : 1;
  const double rows = block.gemm_rows * double(samples);
  const double width = block.gemm_width / split;
  const double small = std::min(rows, width);
  return device_.peak_tflops * 1e12 * peak_scale_ * device_.achievable * small / (small + knee_);
}

BlockTime FlopBlockTimer::time(const ModelDesc& model, size_t index, int64_t samples,
                               int tp) const {
  const BlockCost& block = model.blocks[index];
  const int split = block.tp_split ? tp : 1;
  const double forward = block.forward_flops * double(samples) / split / rate(block, samples, tp);
  return {forward, 2 * forward};
}

std::string FlopBlockTimer::describe() const {
  return cat("FLOPs at ", fixed(device_.achievable * 100, 0), "% of ",
             fixed(device_.peak_tflops * peak_scale_, 0), " TFLOP/s (", device_.name,
             "), less for GEMMs under ", fixed(knee_, 0), " rows or columns");
}

double BlockTimer::split_cost(const ModelDesc& model, size_t index) const {
  return model.blocks[index].forward_flops + 1.0;
}

MeasuredBlockTimer::MeasuredBlockTimer(std::vector<BlockTime> per_sample)
    : MeasuredBlockTimer(std::vector<MeasuredProfile>{{.blocks = std::move(per_sample)}}, "") {}

MeasuredBlockTimer::MeasuredBlockTimer(std::vector<MeasuredProfile> profiles, std::string source)
    : profiles_(std::move(profiles)), source_(std::move(source)) {
  CHECK(!profiles_.empty()) << "a measured block timer needs a profile";
  for (const MeasuredProfile& p : profiles_)
    CHECK(p.samples >= 1 && p.tp >= 1 && p.blocks.size() == profiles_[0].blocks.size())
        << "profile tp=" << p.tp << " samples=" << p.samples << ": " << p.blocks.size()
        << " blocks";
  std::sort(profiles_.begin(), profiles_.end(),
            [](const MeasuredProfile& x, const MeasuredProfile& y) {
              return x.tp != y.tp ? x.tp < y.tp : x.samples < y.samples;
            });
}

BlockTime MeasuredBlockTimer::time(const ModelDesc& model, size_t index, int64_t samples,
                                   int tp) const {
  CHECK(index < profiles_[0].blocks.size())
      << "a measured time for block " << index << " of " << model.blocks.size();
  // This tp's profiles, or tp = 1's divided by tp for the blocks tp splits.
  std::vector<const MeasuredProfile*> at;
  for (const MeasuredProfile& p : profiles_)
    if (p.tp == tp) at.push_back(&p);
  double divide = 1;
  if (at.empty()) {
    for (const MeasuredProfile& p : profiles_)
      if (p.tp == 1) at.push_back(&p);
    divide = model.blocks[index].tp_split ? tp : 1;
  }
  CHECK(!at.empty()) << "no tp=1 profile for tp=" << tp;
  const double n = double(samples);
  if (at.size() == 1) {
    const BlockTime& t = at[0]->blocks[index];
    const double scale = n / double(at[0]->samples) / divide;
    return {t.forward * scale, t.backward * scale};
  }
  // The two nearest sizes: those around n, or the two at the end n lies beyond.
  size_t hi = 1;
  while (hi + 1 < at.size() && double(at[hi]->samples) < n) ++hi;
  const MeasuredProfile &lo_p = *at[hi - 1], &hi_p = *at[hi];
  const double w = (n - double(lo_p.samples)) / double(hi_p.samples - lo_p.samples);
  auto line = [&](double a, double b) {
    const double v = a + w * (b - a);
    // Below the smallest size, a line can cross zero; with a fixed cost per
    // micro-batch the time is at least the smaller size's in proportion.
    if (n < double(lo_p.samples)) return std::max(v, a * n / double(lo_p.samples)) / divide;
    return std::max(v, 0.0) / divide;
  };
  const BlockTime &a = lo_p.blocks[index], &b = hi_p.blocks[index];
  return {line(a.forward, b.forward), line(a.backward, b.backward)};
}

std::string MeasuredBlockTimer::describe() const {
  std::string sizes;
  for (const MeasuredProfile& p : profiles_)
    sizes += cat(sizes.empty() ? "" : ", ", p.tp > 1 ? cat("tp=", p.tp, " ") : "", "b=", p.samples);
  return cat("measured block times", source_.empty() ? "" : " (" + source_ + ")", " at ", sizes,
             ", linear in b between them");
}

double MeasuredBlockTimer::split_cost(const ModelDesc& model, size_t index) const {
  const MeasuredProfile* largest = nullptr;
  for (const MeasuredProfile& p : profiles_)
    if (p.tp == 1) largest = &p;
  if (!largest) return BlockTimer::split_cost(model, index);
  return largest->blocks[index].forward + largest->blocks[index].backward;
}

// ---- pipeline closed forms ----

double pipeline_step_time(const std::string& schedule, int stages, int micro_batches, int chunks,
                          double forward, double backward) {
  const double P = stages, M = micro_batches, V = chunks;
  if (schedule == "none" || stages == 1) return M * (forward + backward);
  if (schedule == "interleaved") return (M + (P - 1) / V) * (forward + backward);
  // (P - 1)(t_f + t_i - t_w) with I = W = t_b / 2 while t_i <= t_f; a
  // longer I holds the fill back by its excess on each of the P - 1 hops.
  if (schedule == "zbh1")
    return M * (forward + backward) + (P - 1) * std::max(forward, backward / 2);
  return (M + P - 1) * (forward + backward);  // gpipe, 1f1b
}

double activations_in_flight(const std::string& schedule, int stages, int stage, int micro_batches,
                             int chunks) {
  if (schedule == "gpipe") return micro_batches;
  if (schedule == "interleaved") {
    const int units =
        std::min(micro_batches * chunks, 2 * (stages - stage - 1) + (chunks - 1) * stages + 1);
    return double(units) / chunks;
  }
  if (schedule == "none" || stages == 1) return 1;
  return std::min(stages - stage, micro_batches);  // 1f1b, zbh1 (until I)
}

std::vector<size_t> balanced_split(const std::vector<double>& cost, int stages) {
  const size_t n = cost.size();
  CHECK(stages >= 1 && size_t(stages) <= n) << stages << " stages over " << n << " blocks";
  std::vector<double> prefix(n + 1, 0);
  for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the slowest stage when blocks [0, i) form k stages; cut[k][i] its last start.
  std::vector<std::vector<double>> best(size_t(stages) + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<size_t>> cut(size_t(stages) + 1, std::vector<size_t>(n + 1, 0));
  best[0][0] = 0;
  for (size_t k = 1; k <= size_t(stages); ++k)
    for (size_t i = k; i <= n - (size_t(stages) - k); ++i)
      for (size_t j = k - 1; j < i; ++j) {
        const double slowest = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (slowest < best[k][i]) best[k][i] = slowest, cut[k][i] = j;
      }
  std::vector<size_t> starts(static_cast<size_t>(stages), 0);
  size_t end = n;
  for (size_t k = size_t(stages); k >= 1; --k) {
    starts[k - 1] = cut[k][end];
    end = starts[k - 1];
  }
  return starts;
}

// ---- plans ----

std::string to_string(Recompute recompute) {
  switch (recompute) {
    case Recompute::none:
      return "none";
    case Recompute::selective:
      return "selective";
    case Recompute::blocks:
      return "blocks";
  }
  return "?";
}

std::string Plan::layout() const {
  return cat(dp, " x ", pp, " x ", tp, cp > 1 ? cat(" cp", cp) : "", ep > 1 ? cat(" ep", ep) : "");
}

namespace {

size_t stage_end(const ModelDesc& model, const Plan& plan, int stage) {
  return size_t(stage) + 1 < plan.stage_starts.size() ? plan.stage_starts[size_t(stage) + 1]
                                                      : model.blocks.size();
}

// The most dense parameters one block of the stage holds on a rank (a
// ZeRO-3 gather's; an ep rank's experts stay whole).
double largest_params(const ModelDesc& model, const Plan& plan, int stage) {
  double largest = 0;
  for (size_t i = plan.stage_starts[size_t(stage)]; i < stage_end(model, plan, stage); ++i)
    largest = std::max(largest, (model.blocks[i].params - model.blocks[i].expert_params) /
                                    (model.blocks[i].tp_split ? plan.tp : 1));
  return largest;
}

// Saved activations of one block for one sample, bytes at 16 bits.
double block_activations(const BlockCost& block, const Plan& plan) {
  const double tp = block.tp_split ? plan.tp : 1;
  const double replicated_split = plan.sequence_parallel ? tp : 1;
  if (plan.recompute == Recompute::blocks) return block.input_bytes / replicated_split;
  double sharded = block.act_sharded;
  if (plan.recompute == Recompute::selective) sharded -= block.act_selective;
  return block.act_replicated / replicated_split + sharded / tp;
}

// The stage's block boundaries for the plan: interleaved chunks of equal
// layer counts (the whole stage: L / P layers, embed on stage 0, head on the
// last), else the balanced split of forward FLOPs.
std::vector<size_t> split_for(const ModelDesc& model, const BlockTimer& timer, int stages,
                              bool even_layers) {
  if (!even_layers) {
    std::vector<double> cost;
    for (size_t i = 0; i < model.blocks.size(); ++i) cost.push_back(timer.split_cost(model, i));
    return balanced_split(cost, stages);
  }
  std::vector<size_t> starts{0};
  const int64_t per_stage = model.n_layer / stages;
  for (int s = 1; s < stages; ++s) starts.push_back(size_t(1 + s * per_stage));
  return starts;
}

}  // namespace

double rank_params(const BlockCost& block, const Plan& plan) {
  return (block.params - block.expert_params) / (block.tp_split ? plan.tp : 1) +
         block.expert_params / plan.ep;
}

std::vector<StageMemory> stage_memory(const ModelDesc& model, const PlanRequest& request,
                                      const Plan& plan) {
  const bool fp32 = request.precision == "fp32";
  const double weight_bytes = fp32 ? 4 : 2, grad_bytes = weight_bytes;
  // AdamW's two fp32 moments, plus fp32 master weights under 16-bit training.
  const double optimizer_bytes = fp32 ? 8 : 12;
  const double scale = value_scale(request.precision);
  std::vector<StageMemory> memory(size_t(plan.pp));
  for (int stage = 0; stage < plan.pp; ++stage) {
    double params = 0, experts = 0, per_sample = 0, largest = 0;
    for (size_t i = plan.stage_starts[size_t(stage)]; i < stage_end(model, plan, stage); ++i) {
      const BlockCost& block = model.blocks[i];
      params += rank_params(block, plan);
      experts += block.expert_params / plan.ep;
      // Context parallelism: this rank's 1/cp of each sequence's tokens.
      per_sample += block_activations(block, plan) / plan.cp;
      if (plan.recompute == Recompute::blocks) {
        Plan whole = plan;
        whole.recompute = Recompute::none;
        largest = std::max(largest, block_activations(block, whole) / plan.cp);
      }
    }
    if (plan.pp > 1 && stage == plan.pp - 1) params += model.tied_params / plan.tp;
    StageMemory& m = memory[size_t(stage)];
    // ZeRO-3 keeps 1/dp of the parameters (1/shard group under hybrid
    // sharding) and, gathered, the block that runs and the one prefetched.
    // An ep rank's experts stay whole beside the shards.
    const double dp = plan.shard_group(), dense = params - experts;
    m.params = plan.zero == 3
                   ? (dense / dp + experts + 2 * largest_params(model, plan, stage)) * weight_bytes
                   : params * weight_bytes;
    m.grads = (plan.zero >= 2 ? dense / dp + experts : params) * grad_bytes;
    m.optimizer = (plan.zero >= 1 ? dense / dp + experts : params) * optimizer_bytes;
    const double in_flight =
        activations_in_flight(plan.schedule, plan.pp, stage, plan.micro_batches, plan.chunks);
    // Under recomputation one block's whole activations live again during its backward.
    m.activations = (in_flight * per_sample + largest) * double(plan.micro_batch_size) * scale;
    m.workspace = request.workspace_gib * kGiB;
  }
  return memory;
}

namespace {

// The slowest stage of a plan: one micro-batch's forward and backward,
// compute and tp allreduces; with the most parameters a stage holds and the
// largest activation sent between stages.
struct SlowestStage {
  double forward = 0, backward = 0, tp_forward = 0, tp_backward = 0;
  double stage_params_max = 0, message_bytes = 0;
  double cp_forward = 0, cp_backward = 0;
  double ep_forward = 0, ep_backward = 0;
};

// One micro-batch of b samples through block i on a rank holding 1/cp of
// each sequence (causal load balancing gives every rank the same share of
// attention too): the time of b / cp whole samples, the GEMMs having as
// many rows; below one sample, a share of one.
BlockTime cp_block_time(const BlockTimer& timer, const ModelDesc& model, size_t i, int64_t b,
                        const Plan& plan) {
  if (plan.cp == 1) return timer.time(model, i, b, plan.tp);
  const int64_t whole = std::max<int64_t>(1, b / plan.cp);
  BlockTime t = timer.time(model, i, whole, plan.tp);
  const double share = double(b) / double(plan.cp) / double(whole);
  t.forward *= share;
  t.backward *= share;
  return t;
}

// Ring attention's messages for one block of one micro-batch that the
// block's own compute (forward f, backward b) does not hide: forward, the
// cp - 1 key/value blocks; backward, those again and the cp key/value
// gradient sums (f32).
std::pair<double, double> ring_exposed(const BlockCost& block, const Plan& plan,
                                       const LinkSpec& link, double scale, int64_t samples,
                                       double f, double b) {
  if (plan.cp == 1 || block.kv_bytes == 0) return {0, 0};
  const double split = double(plan.cp) * (block.tp_split ? plan.tp : 1);
  const double kv = link.seconds(block.kv_bytes * double(samples) * scale / split);
  const double sums = link.seconds(block.kv_bytes * double(samples) * 2 / split);
  return {std::max(0.0, (plan.cp - 1) * kv - f),
          std::max(0.0, (plan.cp - 1) * kv + plan.cp * sums - b)};
}

SlowestStage slowest_stage(const ModelDesc& model, const PlanRequest& request,
                           const BlockTimer& timer, const Plan& plan) {
  const double scale = value_scale(request.precision);
  const LinkSpec& tp_link = request.cluster.intra;
  // The cp ranks of a group are tp apart: on one node while cp x tp fit it.
  const LinkSpec& cp_link =
      plan.cp * plan.tp > request.cluster.per_node ? request.cluster.inter : tp_link;
  const int64_t b = plan.micro_batch_size;
  double forward = 0, backward = 0, tp_forward = 0, tp_backward = 0, slowest = -1;
  double stage_params_max = 0, message_bytes = 0, cp_forward = 0, cp_backward = 0;
  double ep_forward = 0, ep_backward = 0;
  // The ep ranks of a group are tp x cp apart: on one node while they fit it.
  const LinkSpec& ep_link =
      plan.ep * plan.cp * plan.tp > request.cluster.per_node ? request.cluster.inter : tp_link;
  for (int stage = 0; stage < plan.pp; ++stage) {
    double f = 0, bw = 0, cf = 0, cb = 0, params = 0, rf = 0, rb = 0, ef = 0, eb = 0;
    for (size_t i = plan.stage_starts[size_t(stage)]; i < stage_end(model, plan, stage); ++i) {
      const BlockCost& block = model.blocks[i];
      const BlockTime t = cp_block_time(timer, model, i, b, plan);
      double extra = 0;
      if (plan.recompute == Recompute::blocks) extra = t.forward;
      if (plan.recompute == Recompute::selective && block.forward_flops > 0)
        extra = t.forward * block.selective_flops / block.forward_flops;
      const auto [ring_f, ring_b] =
          ring_exposed(block, plan, cp_link, scale, b, t.forward, t.backward);
      rf += ring_f;
      rb += ring_b;
      if (plan.ep > 1 && block.a2a_bytes > 0) {
        // Each rank keeps 1/ep of its rows and sends the rest, 1/ep to each peer.
        const double rows = block.a2a_bytes * double(b) * scale / plan.ep;
        const double a2a = (plan.ep - 1) * ep_link.seconds(rows);
        ef += 2 * a2a;
        eb += (plan.recompute == Recompute::blocks ? 4 : 2) * a2a;
      }
      f += t.forward;
      bw += t.backward + extra;
      params += rank_params(block, plan);
      if (block.tp_split && plan.tp > 1) {
        const double allreduce =
            ring_allreduce(tp_link, plan.tp, block.output_bytes * double(b) * scale);
        const double again = plan.recompute == Recompute::blocks ? block.tp_allreduces_fwd : 0;
        cf += block.tp_allreduces_fwd * allreduce;
        cb += (block.tp_allreduces - block.tp_allreduces_fwd + again) * allreduce;
      }
    }
    if (plan.pp > 1 && stage == plan.pp - 1) params += model.tied_params / plan.tp;
    stage_params_max = std::max(stage_params_max, params);
    if (f + bw + cf + cb + rf + rb + ef + eb > slowest) {
      slowest = f + bw + cf + cb + rf + rb + ef + eb;
      forward = f, backward = bw, tp_forward = cf, tp_backward = cb;
      cp_forward = rf, cp_backward = rb, ep_forward = ef, ep_backward = eb;
    }
    if (stage + 1 < plan.pp) {
      const BlockCost& last = model.blocks[stage_end(model, plan, stage) - 1];
      // Megatron's scatter-gather: each tp rank sends 1/tp of the activation.
      const double split = last.tp_split ? plan.tp : 1;
      message_bytes =
          std::max(message_bytes, last.output_bytes * double(b) * scale / split / plan.cp);
    }
  }
  return {forward,       backward,   tp_forward,  tp_backward, stage_params_max,
          message_bytes, cp_forward, cp_backward, ep_forward,  ep_backward};
}

// The plan's memory: that of its fullest stage, and which stage it is. With
// `why`, *why names that stage's need and the device's memory when it does
// not fit, and is empty when it does.
void set_memory(const ModelDesc& model, const PlanRequest& request, Plan& plan, std::string* why) {
  const std::vector<StageMemory> memory = stage_memory(model, request, plan);
  plan.memory = 0;
  for (int stage = 0; stage < plan.pp; ++stage)
    if (memory[size_t(stage)].total() > plan.memory) {
      plan.memory = memory[size_t(stage)].total();
      plan.memory_stage = stage;
    }
  const ClusterSpec& cluster = request.cluster;
  const double limit = cluster.device.memory_gib * kGiB;
  if (why) {
    why->clear();
    // Whole GiB for a device's memory; below 10 GiB (a CPU rank's share),
    // hundredths, so that the need and the limit differ where they do.
    const int digits = cluster.device.memory_gib < 10 ? 2 : 0;
    if (plan.memory > limit)
      *why = cat("stage ", plan.memory_stage, " needs ", fixed(plan.memory / kGiB, digits ? 2 : 1),
                 " GiB of ", fixed(cluster.device.memory_gib, digits));
  }
}

}  // namespace

// The data-parallel time ZeRO-2 and -3 leave exposed in a step of M
// micro-batches: every micro-batch's gradients are reduce-scattered as
// backward makes them (M reduce-scatters); ZeRO-2 all-gathers the
// parameters after the step, ZeRO-3 gathers each block before its forward
// and again before its backward (2 M all-gathers), prefetched while the
// block before it computes, so only what compute cannot cover shows, and
// at least the first block's gather.
// Under hybrid sharding the collectives run in the shard group (on a host)
// and each reduce-scatter is followed by an allreduce of its 1/shard_group
// slice across the replica groups (`across`).
double sharded_dp_exposed(const ModelDesc& model, const PlanRequest& request, const Plan& plan,
                          const LinkSpec& link, const LinkSpec& across, double grad_bytes,
                          double forward, double backward) {
  const double M = plan.micro_batches;
  const int group = plan.shard_group();
  // A reduce-scatter moves the bytes of a gather.
  const double scatter =
      ring_allgather(link, group, grad_bytes) +
      (plan.replicas > 1 ? ring_allreduce(across, plan.replicas, grad_bytes / group) : 0);
  const double gather = ring_allgather(link, group, grad_bytes);
  if (plan.zero == 2) {
    const double reduce = M * scatter;
    return (request.overlap_dp ? std::max(scatter / M, reduce - M * backward) : reduce) + gather;
  }
  const double comm = M * (scatter + 2 * gather);
  const double first = gather / double(std::max<size_t>(model.blocks.size(), 1));
  return request.overlap_dp ? std::max(first, comm - M * (forward + backward)) : comm;
}

Plan evaluate_plan(const ModelDesc& model, const PlanRequest& request, const BlockTimer& timer,
                   Plan plan, std::string* why) {
  const ClusterSpec& cluster = request.cluster;
  if (plan.stage_starts.empty())
    plan.stage_starts = split_for(model, timer, plan.pp, plan.schedule == "interleaved");
  const int64_t b = plan.micro_batch_size;
  const SlowestStage s = slowest_stage(model, request, timer, plan);
  const double forward = s.forward, backward = s.backward, tp_forward = s.tp_forward,
               tp_backward = s.tp_backward, stage_params_max = s.stage_params_max;

  const int M = plan.micro_batches;
  StepTerms& terms = plan.terms;
  const double pipeline = pipeline_step_time(
      plan.schedule, plan.pp, M, plan.chunks, forward + tp_forward + s.cp_forward + s.ep_forward,
      backward + tp_backward + s.cp_backward + s.ep_backward);
  terms.compute = M * (forward + backward);
  terms.tp_comm = M * (tp_forward + tp_backward);
  terms.cp_comm = M * (s.cp_forward + s.cp_backward);
  terms.ep_comm = M * (s.ep_forward + s.ep_backward);
  terms.bubble =
      std::max(0.0, pipeline - terms.compute - terms.tp_comm - terms.cp_comm - terms.ep_comm);
  if (plan.pp > 1) {
    const LinkSpec& link =
        plan.tp * plan.cp * plan.pp > cluster.per_node ? cluster.inter : cluster.p2p_inside();
    // Each micro-batch crosses V chunk boundaries per stage both ways; the
    // pipeline's fill and drain add P - 1 more of each to the critical path.
    terms.pp_comm = 2 * link.seconds(s.message_bytes) * (double(M) * plan.chunks + plan.pp - 1);
  }
  // Gradients average over the dp ranks and, under context parallelism,
  // the cp ranks (other tokens of the same sequences) in one allreduce.
  const int replicas = plan.dp * plan.cp * plan.ep;
  if (replicas > 1) {
    const LinkSpec& link =
        plan.tp * plan.pp * replicas > cluster.per_node ? cluster.inter : cluster.intra;
    const double grad_bytes = stage_params_max * (request.precision == "fp32" ? 4 : 2);
    const double sync = ring_allreduce(link, replicas, grad_bytes);
    const double last_bucket =
        ring_allreduce(link, replicas, std::min(grad_bytes, request.bucket_mb * kMiB));
    // Buckets reduce while the last micro-batch's backward runs; the last one after it.
    terms.dp_exposed =
        request.overlap_dp ? std::max(last_bucket, sync - (backward + tp_backward)) : sync;
    // Hybrid sharding: the shard group's collectives on a host's links.
    const LinkSpec& group_link = plan.replicas > 1 ? cluster.intra : link;
    if (plan.zero >= 2) {
      terms.dp_exposed = sharded_dp_exposed(model, request, plan, group_link, link, grad_bytes,
                                            forward + tp_forward, backward + tp_backward);
    } else if (plan.zero == 1 && plan.replicas > 1) {
      const int group = plan.shard_group();
      const double reduce = ring_allgather(group_link, group, grad_bytes) +
                            ring_allreduce(link, plan.replicas, grad_bytes / group);
      terms.dp_exposed =
          (request.overlap_dp ? std::max(reduce / plan.micro_batches, reduce - backward) : reduce) +
          ring_allgather(group_link, group, grad_bytes);
    } else if (plan.zero == 1) {
      terms.dp_exposed += ring_allgather(link, plan.shard_group(), grad_bytes);
    }
  }
  terms.optimizer = request.optimizer_seconds_per_param * stage_params_max /
                    (plan.zero >= 1 ? plan.shard_group() : 1);

  set_memory(model, request, plan, why);

  const double step = terms.total();
  const double batch = double(plan.dp) * plan.ep * M * double(b);
  plan.samples_per_second = batch / step;
  plan.tokens_per_second = plan.samples_per_second * model.tokens_per_sample;
  const double peak = cluster.device.peak_tflops * 1e12 * (request.precision == "fp32" ? 0.5 : 1);
  const double model_flops = 3 * model.forward_flops() * batch;
  double recomputed = 0;
  for (const BlockCost& block : model.blocks)
    recomputed += plan.recompute == Recompute::blocks      ? block.forward_flops
                  : plan.recompute == Recompute::selective ? block.selective_flops
                                                           : 0;
  plan.model_flops_utilisation = peak > 0 ? model_flops / (step * cluster.world() * peak) : 0;
  plan.hardware_flops_per_gpu = (model_flops + recomputed * batch) / (step * cluster.world());
  return plan;
}

namespace {

// Rejections grouped by reason, each with one example: the first, or the
// one of the smallest `excess` (the plan closest to fitting in memory).
class Rejections {
 public:
  void add(const std::string& reason, const std::string& example, double excess = 0) {
    auto [it, fresh] = index_.try_emplace(reason, list_.size());
    if (fresh) {
      list_.push_back({reason, example, 0});
      excess_.push_back(excess);
    } else if (excess < excess_[it->second]) {
      list_[it->second].example = example;
      excess_[it->second] = excess;
    }
    list_[it->second].count += 1;
  }
  std::vector<Rejection> take() { return std::move(list_); }

 private:
  std::map<std::string, size_t> index_;
  std::vector<Rejection> list_;
  std::vector<double> excess_;
};

// Why tp cannot split the model, or "".
std::string tp_problem(const ModelDesc& model, const ClusterSpec& cluster, int tp,
                       std::string* reason) {
  if (tp == 1) return "";
  if (tp > cluster.per_node) {
    *reason = "tp crosses hosts";
    return cat("tp=", tp, " > ", cluster.per_node, " GPUs per node");
  }
  if (cluster.per_node % tp != 0) {
    *reason = "tp does not divide the GPUs of a node";
    return cat("tp=", tp, " does not divide ", cluster.per_node);
  }
  if (model.n_head == 0 && model.tp_channels == 0) {
    *reason = "tp splits transformer layers and ResNet blocks only";
    return cat("tp=", tp, ": ", model.name, " plans dp x pp");
  }
  // The vocabulary need not divide: the trainer pads it to a multiple of tp
  // (Megatron's make-vocab-size-divisible-by), a few rows the cost ignores.
  std::vector<std::pair<const char*, int64_t>> sizes = {{"channels", model.tp_channels}};
  if (model.n_head > 0) sizes = {{"n_head", model.n_head}, {"d_model", model.d_model}};
  for (const auto& [key, size] : sizes)
    if (size % tp != 0) {
      *reason = cat("tp does not divide ", key);
      return cat("tp=", tp, " does not divide ", key, " ", size);
    }
  return "";
}

// The (schedule, chunks) pairs a plan of pp stages and M micro-batches may run.
std::vector<std::pair<std::string, int>> schedules_for(const ModelDesc& model,
                                                       const PlanRequest& request, int pp, int M) {
  std::vector<std::pair<std::string, int>> schedules;
  if (pp == 1) {
    schedules.push_back({"none", 1});
  } else {
    schedules = {{"gpipe", 1}, {"1f1b", 1}, {"zbh1", 1}};
    if (M % pp == 0 && model.n_layer > 0)
      for (int v = 2; v <= request.max_chunks; ++v)
        if (model.n_layer % (int64_t(pp) * v) == 0) schedules.push_back({"interleaved", v});
  }
  return schedules;
}

// Scores `base` with each recomputation and ZeRO-1 setting the request
// allows: the plans that fit join result.ranked, the others `rejected`.
void score_variants(const ModelDesc& model, const PlanRequest& request, const BlockTimer& timer,
                    const Plan& base, PlanResult& result, Rejections& rejected) {
  // A plan that fits makes every slower-and-smaller variant of it
  // (more recomputation, ZeRO-1 on) dominated: those are skipped.
  // With the optimizer timed, ZeRO-1 may be the faster (it updates
  // 1/dp of the parameters): then it is dominated only by itself.
  const bool zero_may_win = request.optimizer_seconds_per_param > 0;
  // The shards spread over dp x cp x ep.
  const int max_zero =
      !request.allow_zero1 || base.dp * base.cp * base.ep == 1 ? 0 : request.max_zero;
  bool fits[3][4] = {};
  // Scores a variant: true when it fits (it then joins the ranking).
  auto score = [&](Plan plan) {
    std::string why;
    Plan scored = evaluate_plan(model, request, timer, std::move(plan), &why);
    ++result.evaluated;
    if (!why.empty()) {
      rejected.add("over device memory", cat(plan_label(scored), ": ", why), scored.memory);
      return false;
    }
    result.ranked.push_back(std::move(scored));
    return true;
  };
  for (Recompute recompute : {Recompute::none, Recompute::selective, Recompute::blocks}) {
    const int level = int(recompute);
    if (recompute == Recompute::selective && !model.language_model) continue;
    if (recompute != Recompute::none && !request.allow_recompute) continue;
    for (int zero = 0; zero <= max_zero; ++zero) {
      bool dominated = false;
      for (int l = 0; l <= level; ++l)
        for (int z = zero_may_win ? zero : 0; z <= zero; ++z) dominated = dominated || fits[l][z];
      if (dominated) {
        ++result.pruned;
        continue;
      }
      Plan plan = base;
      plan.zero = zero;
      plan.recompute = recompute;
      fits[level][zero] = score(std::move(plan));
    }
    // Hybrid sharding, when the dp ranks span hosts: shards within a host's
    // dp ranks (at least 2), replicas across hosts. Scored beside each
    // sharded plan above; it takes more memory, and its cross-host traffic
    // is one allreduce of a shard.
    // (The trainer runs expert parallelism without replica groups.)
    const int per_host = request.cluster.per_node / (base.tp * base.pp * base.cp);
    if (max_zero == 0 || base.ep > 1 || per_host < 2 || per_host >= base.dp ||
        base.dp % per_host != 0)
      continue;
    for (int zero = 1; zero <= max_zero; ++zero) {
      Plan plan = base;
      plan.zero = zero;
      plan.replicas = base.dp / per_host;
      plan.recompute = recompute;
      score(std::move(plan));
    }
  }
}

// The context-parallel sizes worth scoring among the divisors of `ranks`:
// 1, and for a model with attention each cp whose 2 cp chunks split the
// sequence evenly (causal load balancing), up to max_cp.
std::vector<int> context_sizes(const ModelDesc& model, int ranks, int max_cp) {
  bool attention = false;
  for (const BlockCost& b : model.blocks) attention = attention || b.kv_bytes > 0;
  std::vector<int> sizes;
  for (int cp : divisors(ranks))
    if (cp == 1 ||
        (attention && cp <= max_cp && int64_t(model.tokens_per_sample) % (2 * int64_t(cp)) == 0))
      sizes.push_back(cp);
  return sizes;
}

// The expert-parallel sizes worth scoring: 1, and for a model with
// experts the divisors of `ranks` that divide its expert count.
std::vector<int> expert_sizes(const ModelDesc& model, int ranks, int max_ep) {
  std::vector<int> sizes{1};
  if (model.experts == 0) return sizes;
  for (int ep : divisors(ranks))
    if (ep > 1 && ep <= max_ep && model.experts % ep == 0) sizes.push_back(ep);
  return sizes;
}

struct LayoutChoice {
  int tp = 1, cp = 1, ep = 1;
  std::map<int, std::vector<size_t>>* balanced;  // the balanced stage split per pp
};

// Every pp (dp the rest of the ranks), micro-batch count and schedule at
// the given tp and cp.
void score_layouts(const ModelDesc& model, const PlanRequest& request, const BlockTimer& timer,
                   const LayoutChoice& c, PlanResult& result, Rejections& rejected) {
  const int world = request.cluster.world(), blocks = int(model.blocks.size());
  for (int pp : divisors(world / c.tp / c.cp / c.ep)) {
    const int dp = world / c.tp / c.cp / c.ep / pp;
    const std::string layout = cat("dp=", dp, c.ep > 1 ? cat(" ep=", c.ep) : "", " pp=", pp,
                                   c.cp > 1 ? cat(" cp=", c.cp) : "", " tp=", c.tp);
    if (pp > blocks) {
      rejected.add("more stages than blocks",
                   cat(layout, ": ", blocks, " blocks cannot fill ", pp, " stages"));
      continue;
    }
    if (request.global_batch % (dp * c.ep) != 0) {
      rejected.add(
          "dp does not divide training.global_batch",
          cat(layout, ": global_batch ", request.global_batch, " over ", dp * c.ep, " replicas"));
      continue;
    }
    auto& balanced = *c.balanced;
    if (!balanced.count(pp)) balanced[pp] = split_for(model, timer, pp, false);
    const int per_replica = int(request.global_batch / (dp * c.ep));
    for (int M : divisors(per_replica)) {
      for (const auto& [schedule, chunks] : schedules_for(model, request, pp, M)) {
        Plan plan;
        plan.dp = dp, plan.pp = pp, plan.tp = c.tp, plan.cp = c.cp, plan.ep = c.ep;
        plan.micro_batches = M;
        plan.micro_batch_size = per_replica / M;
        plan.schedule = schedule;
        plan.chunks = chunks;
        // Sequence parallelism moves the same bytes (reduce-scatter +
        // all-gather = allreduce) and saves memory: always on with tp.
        plan.sequence_parallel = c.tp > 1 && model.n_head > 0;
        if (schedule != "interleaved") plan.stage_starts = balanced[pp];
        score_variants(model, request, timer, plan, result, rejected);
      }
    }
  }
}

}  // namespace

PlanResult plan_cluster(const ModelDesc& model, const PlanRequest& request,
                        const BlockTimer& timer) {
  const auto start = std::chrono::steady_clock::now();
  const ClusterSpec& cluster = request.cluster;
  if (cluster.world() < 1) throw Error("the cluster has no GPUs: give --nodes and --per-node >= 1");
  if (request.global_batch < 1) throw Error("training.global_batch must be at least 1");
  PlanResult result;
  Rejections rejected;
  const int world = cluster.world();
  std::map<int, std::vector<size_t>> balanced;  // per pp
  for (int tp : divisors(world)) {
    std::string reason;
    const std::string problem = tp_problem(model, cluster, tp, &reason);
    if (!problem.empty()) {
      rejected.add(reason, problem);
      continue;
    }
    for (int cp : context_sizes(model, world / tp, request.max_cp))
      for (int ep : expert_sizes(model, world / tp / cp, request.max_ep))
        score_layouts(model, request, timer, {tp, cp, ep, &balanced}, result, rejected);
  }
  std::stable_sort(result.ranked.begin(), result.ranked.end(), [](const Plan& x, const Plan& y) {
    // Equal times: fewer context-parallel ranks (the cost model counts
    // neither the merges nor the ring's latency), then less memory.
    const double tx = x.terms.total(), ty = y.terms.total();
    if (tx != ty) return tx < ty;
    if (x.cp != y.cp) return x.cp < y.cp;
    return x.ep != y.ep ? x.ep < y.ep : x.memory < y.memory;
  });
  result.rejected = rejected.take();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

// ---- printing ----

namespace {

std::string ms(double seconds) {
  const double millis = seconds * 1e3;
  return fixed(millis, millis < 1 ? 3 : millis < 100 ? 2 : 1);
}

std::string rate_text(double per_second) {
  if (per_second >= 1e6) return fixed(per_second / 1e6, 2) + "M";
  if (per_second >= 1e3) return fixed(per_second / 1e3, 1) + "k";
  return fixed(per_second, 1);
}

}  // namespace

std::string plan_table(const PlanResult& result, int top, const ModelDesc& model) {
  const bool tokens = model.language_model;
  std::string out;
  char line[256];
  std::snprintf(
      line, sizeof line, "%4s  %-14s %5s %5s %-14s %-5s %-9s %9s %9s %5s %8s %7s %8s %8s %8s\n",
      "rank", "dp x pp x tp", "M", "b", "schedule", "zero", "recompute", "step ms",
      tokens ? "tokens/s" : "samples/s", "MFU", "mem GiB", "bubble", "tp ms", "pp ms", "dp ms");
  out += line;
  const int rows = std::min<int>(top, int(result.ranked.size()));
  for (int i = 0; i < rows; ++i) {
    const Plan& plan = result.ranked[size_t(i)];
    const std::string schedule =
        plan.chunks > 1 ? cat(plan.schedule, " V=", plan.chunks) : plan.schedule;
    const double step = plan.terms.total();
    std::snprintf(line, sizeof line,
                  "%4d  %-14s %5d %5lld %-14s %-5s %-9s %9s %9s %4.1f%% %8.1f %6.1f%% %8s %8s "
                  "%8s\n",
                  i + 1, plan.layout().c_str(), plan.micro_batches,
                  static_cast<long long>(plan.micro_batch_size), schedule.c_str(),
                  plan.zero == 0       ? "off"
                  : plan.replicas == 1 ? cat(plan.zero).c_str()
                                       : cat(plan.zero, "/h", plan.replicas).c_str(),
                  to_string(plan.recompute).c_str(), ms(step).c_str(),
                  rate_text(tokens ? plan.tokens_per_second : plan.samples_per_second).c_str(),
                  100 * plan.model_flops_utilisation, plan.memory / kGiB,
                  100 * plan.terms.bubble / step, ms(plan.terms.tp_comm).c_str(),
                  ms(plan.terms.pp_comm).c_str(), ms(plan.terms.dp_exposed).c_str());
    out += line;
  }
  if (result.ranked.empty()) out += "  (no plan fits)\n";
  out += cat("\n", result.ranked.size(), " plans fit, ", result.evaluated, " scored, ",
             result.pruned, " skipped as dominated, in ", fixed(result.seconds * 1e3, 1), " ms\n");
  if (!result.rejected.empty()) {
    out += "rejected:\n";
    for (const Rejection& r : result.rejected)
      out += cat("  ", r.count, " x ", r.reason, ", e.g. ", r.example, "\n");
  }
  if (!result.ranked.empty()) {
    const Plan& best = result.ranked[0];
    const StepTerms& t = best.terms;
    out += cat("\nbest: ", plan_label(best), ": step ", ms(t.total()), " ms = compute ",
               ms(t.compute), " + bubble ", ms(t.bubble), " + tp comm ", ms(t.tp_comm),
               " + pp comm ", ms(t.pp_comm), " + dp comm exposed ", ms(t.dp_exposed),
               t.optimizer > 0 ? " + optimizer " + ms(t.optimizer) : std::string(),
               best.cp > 1 ? " + cp comm exposed " + ms(t.cp_comm) : std::string(),
               best.ep > 1 ? " + ep all-to-all " + ms(t.ep_comm) : std::string(), " ms\n");
    out += cat("      ", fixed(best.memory / kGiB, 1), " GiB on the fullest rank (stage ",
               best.memory_stage, "), MFU ", fixed(100 * best.model_flops_utilisation, 1), "%, ",
               fixed(best.hardware_flops_per_gpu / 1e12, 1),
               " TFLOP/s per GPU counting recomputation\n");
  }
  return out;
}

std::string plan_overrides(const Plan& plan) {
  std::string out = cat("parallel.dp=", plan.dp, " parallel.pp=", plan.pp, " parallel.tp=", plan.tp,
                        " parallel.micro_batches=", plan.micro_batches);
  if (plan.cp > 1) out += cat(" parallel.cp=", plan.cp);
  if (plan.ep > 1) out += cat(" parallel.ep=", plan.ep);
  if (plan.pp > 1) out += " parallel.schedule=" + plan.schedule;
  if (plan.chunks > 1) out += cat(" parallel.virtual_stages=", plan.chunks);
  if (plan.pp > 1 && plan.schedule != "interleaved") {
    out += " parallel.stages=[";
    for (size_t s = 1; s < plan.stage_starts.size(); ++s)
      out += cat(s > 1 ? "," : "", plan.stage_starts[s]);
    out += "]";
  }
  static const char* const kShard[] = {"none", "optimizer", "gradients", "parameters"};
  out += cat(" parallel.shard=", kShard[plan.zero],
             " parallel.zero1=", plan.zero == 1 ? "true" : "false");
  if (plan.replicas > 1) out += cat(" parallel.dp_replicate=", plan.replicas);
  if (plan.tp > 1)
    out += cat(" parallel.sequence_parallel=", plan.sequence_parallel ? "true" : "false");
  out += " parallel.recompute=" + to_string(plan.recompute);
  return out;
}

}  // namespace trainer::parallel
