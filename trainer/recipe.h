// Recipes: YAML files parsed once into typed structs, validated against one schema.
//
// Every key of the schema is declared once in recipe.cpp (path, type,
// default, range) and bound to a struct field. Parsing walks the YAML tree;
// an unknown key is an error naming the file, the line and the closest valid
// key; a wrong type or an out-of-range value names the key, the value and
// the accepted range. Command-line overrides `training.epochs=3` go through
// the same table. Nothing below trainer/ reads a recipe: the loop converts
// these structs into the option structs of models/, data/, optim/ and comm/.
//
//   Recipe r = load_recipe("recipes/fmnist_cnn.yaml", {"training.epochs=1"});
//   std::cout << recipe_to_yaml(r);   // the resolved recipe, printed at start
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace trainer {

// model.moe: GPT's feed-forward layers as mixtures of experts (layers/moe.h).
struct MoERecipe {
  int64_t experts = 0;  // 0: dense
  int64_t top_k = 2;
  int64_t every_n_layers = 1;  // 1: every block; 2: every other, from the second
  int64_t hidden = 0;          // each expert's hidden width; 0: 4 d_model
  double capacity_factor = 1.25;
  bool dropless = false;
  double aux_loss_coef = 0.01;
  double z_loss_coef = 0.0;
  int64_t shared_experts = 0;
  std::string score = "softmax";  // softmax | sigmoid
  bool normalize_top_k = false;
  double bias_update_rate = 0.0;  // auxiliary-loss-free balancing; 0: off
};

struct ModelRecipe {
  std::string name =
      "small_cnn";  // small_cnn, mlp, resnet18..152, resnet*_small, gpt, llama, lstm_lm
  int64_t num_classes = 10;
  int64_t in_channels = 1;
  bool zero_init_residual = false;
  // Language models.
  int64_t vocab_size = 0;  // 0: the data's vocabulary; larger pads it
  int64_t context = 256;   // GPT: the block size (longest sequence)
  int64_t n_layer = 6;     // GPT blocks, or LSTM layers
  int64_t n_head = 6;      // GPT
  int64_t d_model = 384;   // GPT width, or the LSTM LM's embedding width
  int64_t hidden = 512;    // LSTM hidden size
  double dropout = 0.0;
  bool tie_weights = true;     // LM head = token embedding (LSTM: needs d_model == hidden)
  std::string gelu = "exact";  // GPT's MLP: exact (erf, as nanoGPT) | tanh (GPT-2's approximation)
  // Llama (Hugging Face's LlamaConfig names; hidden_size, num_attention_heads,
  // num_hidden_layers, max_position_embeddings and tie_word_embeddings are
  // other names of d_model, n_head, n_layer, context and tie_weights).
  int64_t intermediate_size = 0;    // 0: 8/3 d_model rounded up to a multiple of 256
  int64_t num_key_value_heads = 0;  // 0: n_head
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  std::string rope_scaling = "none";  // none | linear | llama3
  double rope_factor = 1.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_position_embeddings = 8192;
  MoERecipe moe;
};

struct DataRecipe {
  std::string name = "fashion_mnist";  // fashion_mnist, image_folder, text, tokens; data.kind
  std::string root;                    // empty: the dataset's default location
  int64_t image_size = 28;             // training crop / eval center crop
  int64_t resize = 0;                  // eval: shorter side before the crop (0: image_size * 8/7)
  bool augment = false;                // random crop + flip for training
  int64_t workers = 2;
  int64_t prefetch = 4;
  std::string bad_files = "skip";   // skip | error
  double val_fraction = 0.1;        // text, tokens: the last fraction of the corpus
  std::string path;                 // text: the corpus file; tokens: the token directory
  std::string vocab = "char";       // text: byte (256 ids) | char (the corpus's characters)
  int64_t seq_len = 0;              // text: tokens per window (T); 0: model.context
  int64_t val_windows = 0;          // text: windows per evaluation, spread evenly; 0: all
  int64_t val_samples = 0;          // images: the first N validation images per evaluation; 0: all
  std::string sampling = "random";  // text: random windows | contiguous streams (TBPTT)
};

struct OptimizerRecipe {
  std::string name = "sgd";  // sgd | adamw
  double lr = 0.1;
  bool scale_lr = false;  // linear scaling rule: lr x global_batch / 256
  double momentum = 0.9;
  double dampening = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;
  bool decay_norm_and_bias = true;  // false: no weight decay on biases and norm weights
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double clip_grad_norm = 0.0;  // 0: off
};

struct ScheduleRecipe {
  std::string name = "constant";  // constant | step | multistep | cosine
  double warmup_epochs = 0.0;
  int64_t warmup_steps = 0;
  double step_size = 30;           // epochs
  std::vector<double> milestones;  // epochs
  double gamma = 0.1;
  double min_lr = 0.0;  // cosine floor
};

struct TrainingRecipe {
  int64_t epochs = 1;
  int64_t steps = 0;  // > 0 overrides epochs
  int64_t global_batch = 128;
  int64_t grad_accum = 1;
  int64_t eval_every = 0;  // steps; 0: at the end of each epoch
  int64_t log_every = 50;
  int64_t checkpoint_every = 0;  // steps; 0: at the end of each epoch
  int64_t keep_last = 3;
  int64_t max_nonfinite = 5;  // consecutive non-finite losses before aborting
  int64_t threads = 0;        // 0: all cores
  bool trace = false;         // Chrome-trace timeline
  // Load checkpoints whose tensors hold NaN or Inf (refused by default).
  bool allow_non_finite = false;
  // Checkpoints copied into host memory and written in the background
  // (trainer/checkpoint_writer.h); a state over async_checkpoint_mb per
  // rank (0: no cap) is written synchronously.
  bool async_checkpoint = true;
  int64_t async_checkpoint_mb = 0;
  // Each rank's cap on its CPU tensor memory in MiB (0: none): passing it
  // is an error saying what to change (core/allocator.h).
  int64_t memory_limit_mb = 0;
};

struct ParallelRecipe {
  int64_t dp = 0;  // 0: the world size divided by pp x cp x tp
  int64_t pp = 1;
  int64_t tp = 1;
  // Context parallelism: each sequence split over cp ranks
  // (layers/context_parallel.h), attention by cp_attention (ring |
  // all_to_all), rank r holding chunks r and 2 cp - 1 - r with load balancing.
  int64_t cp = 1;
  // Expert parallelism: each mixture-of-experts layer's experts divided
  // over ep ranks, which split the batch as data-parallel ranks do.
  int64_t ep = 1;
  std::string cp_attention = "ring";
  bool cp_load_balance = true;
  // Megatron-SP: LayerNorm and dropout regions split along the sequence
  // over the tp ranks (allgather / reduce-scatter in place of allreduces).
  bool sequence_parallel = false;
  // A pipeline's micro-batches per step; 0: chosen for the layout
  // (trainer/distributed.h resolved_micro_batches), 1 without a pipeline.
  int64_t micro_batches = 0;
  std::string schedule = "1f1b";  // gpipe | 1f1b | interleaved | zbh1 | wavefront
  int64_t virtual_stages = 1;     // model chunks per stage (interleaved)
  // The LSTM LM's wavefront: each step's sequence cut into this many time
  // chunks, the pipeline's micro-batches (schedule wavefront, one layer per stage).
  int64_t time_chunks = 1;
  // How the blocks are cut into stages: "even" (by count), "auto" (by
  // measured time, within stage_memory_mb), or "list": stage_starts, the
  // first block of every piece after the first.
  std::string stages = "even";
  std::vector<int64_t> stage_starts;
  double stage_memory_mb = 0;  // each stage's memory limit (checked on the schedule); 0: none
  int64_t bucket_mb = 25;
  bool overlap = true;  // allreduce buckets during backward (false: after it)
  // The gradient allreduce's algorithm (comm/collectives.h): auto | ring |
  // recursive_doubling | tree | butterfly | all_to_all | master_worker | round_robin.
  std::string allreduce = "auto";
  // What the data-parallel ranks shard (ZeRO stages): none | optimizer (1)
  // | gradients (2) | parameters (3); zero1: true is optimizer.
  std::string shard = "none";
  bool zero1 = false;
  // ZeRO-3: a block's gathered parameters are freed after its forward
  // (false: kept until its backward), except for the last keep_last_blocks
  // units, whose backward comes first.
  bool reshard_after_forward = true;
  int64_t keep_last_blocks = 1;
  // Hybrid sharding (HSDP): the dp ranks form dp_replicate groups of dp /
  // dp_replicate consecutive ranks; each group shards as parallel.shard says
  // and the groups hold replicas (their shards' gradients averaged across).
  int64_t dp_replicate = 1;
  // Mixed precision of sharding (FSDP2's MixedPrecisionPolicy): the dtype
  // ZeRO-3 gathers parameters in (auto: bf16 under precision bf16, else
  // f32) and the one ZeRO-2/3 reduce-scatter gradients in (f32 | bf16).
  // ZeRO-2/3: consecutive blocks sharded as one unit until it holds this
  // many MiB of f32 parameters (0: each block its own unit).
  double shard_unit_mb = 16;
  std::string param_dtype = "auto";
  std::string reduce_dtype = "f32";
  bool sync_bn = false;
  bool auto_plan = false;  // parallel.auto: the layout planned at start-up (trainer/plan.h)
  // Activation checkpointing: "blocks" keeps each block's inputs only and
  // runs its forward again in backward; "selective" recomputes nothing more
  // than "none" here (the fused attention keeps no T x T scores).
  std::string recompute = "none";  // none | blocks | selective
  // GPU gradient buckets handed to UCX as device memory (reduced by a CUDA
  // kernel) instead of staged through pinned host buffers: auto | on | off.
  std::string gpu_direct = "off";
  // How replicas keep in step (parallel/parameter_server.h): "allreduce"
  // (decentralized), or "parameter_server": the last `servers` ranks hold the
  // parameters and apply the optimizer, the others are workers; sync: bsp |
  // asp | ssp (a worker at most `staleness` steps ahead of the slowest).
  std::string mode = "allreduce";
  int64_t servers = 1;
  std::string sync = "bsp";
  int64_t staleness = 2;
};

// Dynamic loss scaling of precision: fp16 (optim/loss_scaler.h; unused otherwise).
struct LossScalerRecipe {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;  // finite steps before the scale grows
};

struct Recipe {
  std::string source;  // the file it came from
  ModelRecipe model;
  DataRecipe data;
  OptimizerRecipe optimizer;
  ScheduleRecipe schedule;
  TrainingRecipe training;
  ParallelRecipe parallel;
  std::string precision = "fp32";  // fp32 | bf16 | fp16
  LossScalerRecipe loss_scaler;
  std::string device = "cpu";  // cpu | cuda
  int64_t seed = 0;
  std::string output_dir = "runs/default";
};

// Parses a recipe file, then applies `key=value` overrides in order. The
// file must be a regular file holding at least one key; a key given twice
// in a map, or one that is not a plain scalar, is an Error naming the lines.
Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides = {});
// Parses recipe text (name is used in messages).
Recipe parse_recipe(const std::string& text, const std::string& name,
                    const std::vector<std::string>& overrides = {});
// The resolved recipe as YAML (every key, defaults included).
std::string recipe_to_yaml(const Recipe& r);
// Every valid dotted key, in schema order.
std::vector<std::string> recipe_keys();

// One key of the schema as people read it: docs/recipes.md's table is checked
// against these (tests/test_trainer_docs.cpp), so the manual cannot go stale.
struct RecipeKey {
  std::string key;            // dotted path, e.g. "training.epochs"
  std::string type;           // int, float, bool, string, list of floats
  std::string default_value;  // as YAML prints it ("" for an empty string)
  std::string range;          // "[1, 65536]", "sgd, adamw", "" for free text
};
// Every key, in schema order, from the same declaration table parsing uses.
std::vector<RecipeKey> recipe_schema();

}  // namespace trainer
