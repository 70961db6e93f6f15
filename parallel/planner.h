// The cluster planner: which data x pipeline x tensor parallel layout, how
// many micro-batches, which pipeline schedule, ZeRO-1 and recomputation to
// train a model on N nodes of G GPUs, chosen by a cost model you can print
// and check before spending a cluster on it. It enumerates the
// factorisations of N x G into (dp, pp, tp), the micro-batch counts that
// divide the batch, the schedules of parallel/schedule.h (with V chunks for
// interleaved), ZeRO-1 and recomputation; predicts each plan's step time
// as a sum of named terms and its memory per rank; rejects what cannot run,
// with the reason; and ranks the rest by step time.
//
//   ModelDesc gpt = gpt_model({.n_layer = 96, .n_head = 96, .d_model = 12288,
//                              .context = 2048, .vocab = 50257});
//   PlanRequest request{.cluster = cluster_for("a100-80gb", 128), .global_batch = 1536};
//   FlopBlockTimer timer(request.cluster.device);
//   PlanResult result = plan_cluster(gpt, request, timer);
//   std::cout << plan_table(result, 10) << plan_overrides(result.ranked[0]);
//
// CPU ranks of one core each plan the same way on cpu_cluster(), their
// block times measured (MeasuredBlockTimer over profiles at several
// micro-batch sizes and tp, trainer/plan.h), the optimizer step timed
// (PlanRequest::optimizer_seconds_per_param) and dp not hidden behind
// backward (PlanRequest::overlap_dp).
//
// The cost model, per rank of the slowest pipeline stage (docs/planner.md):
//   step = pipeline(t_f + c_f, t_b + c_b) + pp_comm + dp_exposed + optimizer
// where t_f, t_b are one micro-batch's forward and backward through the
// stage (from a BlockTimer: FLOPs over the device's achievable rate, or
// measured), c_f, c_b the stage's tensor-parallel allreduces, pipeline() the
// schedule's closed form (pipeline_step_time(), as parallel/pipeline_sim.h
// simulates it), pp_comm the activation and gradient messages between
// stages, dp_exposed the part of the gradient allreduce that backward does
// not hide. The printed terms: compute M (t_f + t_b), tp comm M (c_f + c_b),
// bubble (the rest of pipeline()), pp comm, dp comm exposed, optimizer (the
// step over the rank's parameters, when the request times it).
//
// Glossary: N nodes, G GPUs per node, dp/pp/tp the three degrees (tp
// innermost, so a tp group sits on one node), P = pp stages, M micro-batches
// per step, b = global_batch / (dp M) samples per micro-batch, V chunks per
// stage (interleaved), T tokens per sample (the sequence), d width, a heads,
// L transformer layers, Vocab the (padded) vocabulary. Times in seconds,
// sizes in bytes, unless a name says otherwise.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace trainer::parallel {

// ---- the device table and the cluster ----

struct DeviceSpec {
  std::string name;
  double peak_tflops = 0;  // dense bf16 tensor-core FLOP/s, in 1e12
  double memory_gib = 0;
  int per_node = 8;
  // The fraction of peak a large transformer GEMM sustains inside a training
  // step (cuBLAS reaches 70-80% on one big GEMM; layer norms, softmax, GELU
  // and kernel launches between them bring a layer to about half).
  double achievable = 0.5;
};

// One link kind, alpha-beta: a message of n bytes takes alpha + n / bandwidth.
struct LinkSpec {
  double alpha_us = 0;  // per message (per ring step of a collective)
  double gbps = 0;      // per GPU and direction, gigabits per second
  double seconds(double bytes) const { return alpha_us * 1e-6 + bytes * 8.0 / (gbps * 1e9); }
};

struct ClusterSpec {
  DeviceSpec device;
  int nodes = 1;
  int per_node = 8;  // GPUs per node
  LinkSpec intra;    // inside a node (NVLink)
  LinkSpec inter;    // between nodes (InfiniBand)
  // Point-to-point messages inside a node when they differ from the
  // collectives' figures (CPU: UCX send/recv vs the shared-memory channel's
  // allreduce); gbps 0: intra's.
  LinkSpec intra_p2p;
  int world() const { return nodes * per_node; }
  const LinkSpec& p2p_inside() const { return intra_p2p.gbps > 0 ? intra_p2p : intra; }
};

// The built-in devices: a100-40gb, a100-80gb, h100-80gb.
const std::vector<DeviceSpec>& device_table();
// The device name of CPU mode: one rank per core, no fixed peak (block times
// come from a MeasuredBlockTimer), memory = the machine's RAM / ranks per node.
inline constexpr const char* kCpuDevice = "cpu";
// A cluster of CPU ranks: `ram_gib` per node shared by per_node ranks; the
// links default to the shared-memory channel's figures measured on the dev
// VM (docs/planner.md; `trainer plan --calibrate` measures them here).
ClusterSpec cpu_cluster(int nodes, int per_node, double ram_gib);
// A cluster of `nodes` nodes of the named device (per_node 0: the device's),
// with its NVLink and InfiniBand figures; throws Error naming the devices on
// an unknown name.
ClusterSpec cluster_for(const std::string& device, int nodes, int per_node = 0);

// ---- the model ----

// One block of the model's block list (layers/block_list.h), per sample (one
// sequence for a language model). Activation sizes are at 16 bits a value.
struct BlockCost {
  std::string name;
  double params = 0;             // parameters, split by tp when tp_split
  double forward_flops = 0;      // per sample
  double selective_flops = 0;    // the forward part selective recomputation redoes
  double act_replicated = 0;     // saved for backward, whole on every tp rank without SP
  double act_sharded = 0;        // saved for backward, split by tp
  double act_selective = 0;      // the part of act_sharded selective recomputation drops
  double input_bytes = 0;        // the block's input (kept under recomputation)
  double output_bytes = 0;       // the block's output: the p2p message when a stage ends here
  double tp_allreduces = 0;      // allreduces of output_bytes per micro-batch, forward + backward
  double tp_allreduces_fwd = 0;  // of which in the forward (repeated by recomputation)
  // The GEMM shape the block's time depends on: rows (per sample) and width
  // (split by tp); efficiency falls for small GEMMs (FlopBlockTimer).
  double gemm_rows = 1;
  double gemm_width = 1;
  bool tp_split = false;  // tensor parallelism splits this block
  bool is_layer = false;  // a repeated transformer layer (interleaved chunks count these)
  // Attention's keys and values (both, whole sequence, 16 bits): what ring
  // attention passes around the cp ranks; 0 for blocks without attention.
  double kv_bytes = 0;
  // Mixture of experts: the experts' part of params (not split by tp,
  // divided over the ep ranks), and the rows one dispatch all-to-all moves
  // per sample (k T d at 16 bits; forward dispatches and combines, backward
  // the same); 0 for dense blocks.
  double expert_params = 0;
  double a2a_bytes = 0;
};

struct ModelDesc {
  std::string name;
  std::vector<BlockCost> blocks;
  double tokens_per_sample = 1;  // T for language models, 1 for images
  bool language_model = false;
  // Tensor parallelism needs these divisible by tp (0: tp not supported).
  int64_t n_head = 0, d_model = 0, vocab = 0;
  int64_t n_layer = 0;
  int64_t experts = 0;  // per mixture-of-experts layer (0: dense); ep must divide it
  // CNNs: the channels tp splits inside residual blocks (0: none); tp must divide it.
  int64_t tp_channels = 0;
  double tied_params = 0;  // a tied head: a second copy on the last stage when pp > 1
  double params() const;
  double forward_flops() const;  // per sample
};

struct GptShape {
  int64_t n_layer = 12, n_head = 12, d_model = 768, context = 1024, vocab = 50257;
  int64_t pad_vocab_to = 128;  // Megatron pads the vocabulary to a multiple of this (1: none)
  bool tie_weights = true;
  // Mixture of experts (model.moe): 0 experts is dense; hidden 0 is 4 d.
  int64_t experts = 0, top_k = 2, moe_hidden = 0, moe_every = 1;
};
// GPT blocks: "embed", "h.0" .. "h.<L-1>", "head". A mixture-of-experts
// layer's MLP is E experts of width H of which a token uses k: 2 E d H
// expert parameters, 4 k d H FLOPs per token (the active ones), its MLP
// activations k H / 4d times the dense one's. Per token per layer the
// forward costs 24 d^2 + 4 T d FLOPs, the logits 2 d Vocab; parameters
// 12 L d^2 + Vocab d + T d; per layer and sample the saved activations are
// T d (34 + 5 a T / d) bytes (Korthikanti et al. 2022): 10 T d whole on every
// tp rank without sequence parallelism, 24 T d + 5 a T^2 split by tp.
ModelDesc gpt_model(const GptShape& shape);

struct LlamaShape {
  int64_t n_layer = 16, n_head = 32, n_kv_head = 8, d_model = 2048, intermediate = 8192;
  int64_t context = 2048, vocab = 128256;
  bool tie_weights = false;
};
// Llama blocks: "embed", "model.layers.0" .. "model.layers.<L-1>", "head".
// Per layer: q and o d^2 each, k and v d kv (kv = n_kv_head d / n_head
// columns), the SwiGLU MLP 3 d I; forward FLOPs per token twice that plus
// 4 T d for attention. Attention is fused (no T^2 activation): saved per
// layer and sample 8 T d bytes whole on every tp rank (the norms' inputs
// and outputs) and 2 T (2 d + 2 kv) + 8 T I split by tp (q, k, v, the
// attention output, the MLP's gate, up and product).
ModelDesc llama_model(const LlamaShape& shape);

// Coarse descriptions of the other model families (tp = 1: dp and pp only).
struct ResNetShape {
  int depth = 50;  // 18, 34, 50, 101, 152
  int64_t num_classes = 1000, in_channels = 3, image_size = 224, width = 64;
  bool small = false;  // the 3x3 stride-1 stem without max-pool
};
ModelDesc resnet_model(const ResNetShape& shape);
ModelDesc lstm_lm_model(int64_t vocab, int64_t embedding, int64_t hidden, int64_t layers,
                        int64_t sequence, bool tie_weights);
ModelDesc mlp_model(int64_t in_features, const std::vector<int64_t>& hidden, int64_t classes);
ModelDesc small_cnn_model(int64_t in_channels, int64_t image_size, int64_t classes);

// ---- block times: FLOP-based, or measured ----

struct BlockTime {
  double forward = 0, backward = 0;  // seconds, one micro-batch
};

// The hook between the cost model and where its times come from.
class BlockTimer {
 public:
  virtual ~BlockTimer() = default;
  // One micro-batch of `samples` samples through model.blocks[index], split tp ways.
  virtual BlockTime time(const ModelDesc& model, size_t index, int64_t samples, int tp) const = 0;
  virtual std::string describe() const = 0;
  // The cost balanced_split() evens out over stages (default: forward FLOPs).
  virtual double split_cost(const ModelDesc& model, size_t index) const;
};

// FLOPs / (peak x achievable x rows / (rows + knee)): a GEMM of fewer rows
// (micro-batch tokens) or a narrower tp shard than `knee` runs well below
// the rate of a large one. Backward costs twice the forward.
class FlopBlockTimer : public BlockTimer {
 public:
  explicit FlopBlockTimer(DeviceSpec device, double peak_scale = 1.0, double knee = 64);
  BlockTime time(const ModelDesc& model, size_t index, int64_t samples, int tp) const override;
  std::string describe() const override;
  double rate(const BlockCost& block, int64_t samples, int tp) const;  // FLOP/s

 private:
  DeviceSpec device_;
  double peak_scale_, knee_;
};

// One profile of every block: one micro-batch of `samples` samples through
// each, on rank 0's part of the model split tp ways.
struct MeasuredProfile {
  int tp = 1;
  int64_t samples = 1;
  std::vector<BlockTime> blocks;
};

// Block times from measured profiles (trainer/pipeline_split.h's
// profile_blocks). With one profile at a tp, times scale in proportion to
// the samples; with several, they are interpolated linearly between the two
// nearest sizes (extrapolated from the two nearest outside them), so a
// fixed per-micro-batch cost is kept. A tp without a profile takes tp = 1's
// divided by tp for the blocks tp splits.
class MeasuredBlockTimer : public BlockTimer {
 public:
  // Per-sample times per block (one profile, tp = 1, one sample).
  explicit MeasuredBlockTimer(std::vector<BlockTime> per_sample);
  MeasuredBlockTimer(std::vector<MeasuredProfile> profiles, std::string source);
  BlockTime time(const ModelDesc& model, size_t index, int64_t samples, int tp) const override;
  std::string describe() const override;
  // Forward + backward of the largest tp = 1 profile.
  double split_cost(const ModelDesc& model, size_t index) const override;

 private:
  std::vector<MeasuredProfile> profiles_;  // by tp, then samples
  std::string source_;
};

// ---- the pipeline's closed forms ----

// The step time of a schedule on P uniform stages, t_f and t_b being one
// micro-batch's forward and backward through a whole stage (all V chunks):
//   gpipe, 1f1b: (M + P - 1)(t_f + t_b)
//   interleaved: (M + (P - 1)/V)(t_f + t_b)
//   zbh1:        M (t_f + t_b) + (P - 1) max(t_f, t_b / 2)   (I = W = t_b / 2)
// as parallel::simulate() times them. "none" (one stage) is M (t_f + t_b).
double pipeline_step_time(const std::string& schedule, int stages, int micro_batches, int chunks,
                          double forward, double backward);
// Micro-batches whose activations stage `stage` holds at its peak, in units
// of one micro-batch through the whole stage: M for gpipe, min(P - s, M) for
// 1f1b and zbh1, for interleaved (min(M V, 2(P - s - 1) + (V - 1) P + 1)) / V.
double activations_in_flight(const std::string& schedule, int stages, int stage, int micro_batches,
                             int chunks);

// Stage boundaries minimising the slowest stage: starts[s] is the first block
// of stage s (starts[0] = 0), by dynamic programme over the block costs.
std::vector<size_t> balanced_split(const std::vector<double>& cost, int stages);

// ---- the plans ----

enum class Recompute { none, selective, blocks };
std::string to_string(Recompute recompute);

struct PlanRequest {
  ClusterSpec cluster;
  int64_t global_batch = 0;        // samples (sequences) per optimizer step
  std::string precision = "bf16";  // bf16 | fp16 | fp32 (TF32 at half the bf16 peak)
  double bucket_mb = 25;           // DP gradient bucket: the last one is exposed
  double workspace_gib = 2.0;      // CUDA context, cuBLAS workspace, allocator slack
  int max_chunks = 8;              // interleaved: V up to this
  // The optimizer step per parameter a rank updates (0: not timed); CPU
  // mode measures it. ZeRO-1 divides the parameters by dp.
  double optimizer_seconds_per_param = 0;
  // Gradient buckets reduce during backward. False when a rank has one core
  // (CPU mode): the progress thread's copies and sums take the core
  // backward runs on, so the whole allreduce adds to the step.
  bool overlap_dp = true;
  bool allow_recompute = true;
  bool allow_zero1 = true;  // ZeRO at all
  // The highest ZeRO stage scored: 1 shards the optimizer state, 2 the
  // gradients too, 3 the parameters too (2 and 3 on CPUs, as the trainer
  // runs them: cpu_plan_request sets 3).
  int max_zero = 1;
  // Context parallelism up to this many ranks per sequence (1: not
  // scored), for models with attention whose sequence splits into 2 cp
  // chunks.
  int max_cp = 16;
  int max_ep = 4096;  // expert-parallel ranks (1: leave ep out)
};

struct StepTerms {
  double compute = 0;     // M (t_f + t_b) on the slowest stage
  double bubble = 0;      // the schedule's idle time on it
  double tp_comm = 0;     // M (c_f + c_b)
  double pp_comm = 0;     // activation and gradient messages between stages
  double dp_exposed = 0;  // the gradient sync backward does not hide
  double optimizer = 0;   // the optimizer step over the fullest stage's parameters
  double cp_comm = 0;     // M (ring attention's messages compute does not hide)
  double ep_comm = 0;     // M (the experts' all-to-alls, forward and backward)
  double total() const {
    return compute + bubble + tp_comm + pp_comm + dp_exposed + optimizer + cp_comm + ep_comm;
  }
};

struct Plan {
  int dp = 1, pp = 1, tp = 1;
  // Context parallelism: each sequence over cp ranks (ring attention).
  int cp = 1;
  // Expert parallelism: the experts over ep ranks, which split the batch
  // as dp ranks do (no ZeRO with it, as the trainer runs it).
  int ep = 1;
  int micro_batches = 1;
  int64_t micro_batch_size = 1;   // samples
  std::string schedule = "none";  // none (pp = 1) | gpipe | 1f1b | interleaved | zbh1
  int chunks = 1;
  int zero = 0;  // the ZeRO stage over dp: 0 none, 1 optimizer, 2 + gradients, 3 + parameters
  // Hybrid sharding: the dp ranks in `replicas` groups (one per host's dp
  // ranks), each sharding as `zero` says, the groups' shards averaged
  // across hosts. 1: one group of dp ranks.
  int replicas = 1;
  // The ranks a shard is one of: a replica group's dp ranks and the cp and
  // ep ranks, which hold the same dense parameters.
  int shard_group() const { return dp / replicas * cp * ep; }
  bool sequence_parallel = false;
  Recompute recompute = Recompute::none;
  StepTerms terms;
  double memory = 0;  // bytes, the fullest stage's rank
  int memory_stage = 0;
  double samples_per_second = 0, tokens_per_second = 0;
  double model_flops_utilisation = 0;  // model FLOPs (no recomputation) / peak
  double hardware_flops_per_gpu = 0;   // FLOP/s per GPU, counting recomputation
  std::vector<size_t> stage_starts;    // first block of each stage
  std::string layout() const;          // "16 x 8 x 8", "4 x 1 x 2 cp4", "2 x 1 x 1 ep4"
};

struct Rejection {
  std::string reason;   // "over device memory", "tp crosses hosts", ...
  std::string example;  // the first plan rejected so, with its numbers
  int64_t count = 0;
};

struct PlanResult {
  std::vector<Plan> ranked;  // every plan that fits, fastest first
  std::vector<Rejection> rejected;
  int64_t evaluated = 0;  // plans scored
  int64_t pruned = 0;     // skipped as dominated (see docs/planner.md)
  double seconds = 0;     // planning time
  std::vector<std::string> notes;
};

// Scores every plan; throws Error on an empty cluster or a zero batch.
PlanResult plan_cluster(const ModelDesc& model, const PlanRequest& request,
                        const BlockTimer& timer);

// One plan's cost and memory, its terms filled; `why` is set (and the memory
// left as computed) when it does not fit. Used by plan_cluster and tests.
Plan evaluate_plan(const ModelDesc& model, const PlanRequest& request, const BlockTimer& timer,
                   Plan plan, std::string* why);

// Memory per rank of each stage (bytes) for a plan: parameters, gradients,
// optimizer state, activations in flight, workspace.
struct StageMemory {
  double params = 0, grads = 0, optimizer = 0, activations = 0, workspace = 0;
  double total() const { return params + grads + optimizer + activations + workspace; }
};
std::vector<StageMemory> stage_memory(const ModelDesc& model, const PlanRequest& request,
                                      const Plan& plan);

// The ranked table (top rows), the rejections grouped by reason, the best
// plan's terms; plan_overrides: the best plan as recipe key=value overrides.
std::string plan_table(const PlanResult& result, int top, const ModelDesc& model);
// "dp=8 pp=2 tp=4 M=8 b=2 1f1b zero1 recompute=selective": a plan in one line.
std::string plan_label(const Plan& plan);
std::string plan_overrides(const Plan& plan);

}  // namespace trainer::parallel
