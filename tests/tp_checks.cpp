// The tensor-parallel op checks of one rank (tests/tp_checks.h), run by
// tests/tp_worker.cpp as processes of `trainer launch` and by
// tests/test_parallel_tensor_ops.cpp as threads of one process: the ranks
// form one tensor-parallel group of the world's size, and every rank
// builds the same inputs and the same whole layers (same seeds), runs the
// single-process reference itself and compares its own part of the split
// computation with it. Everything runs in f64 (the layers are built in f32
// and converted, to_f64).
//
// Modes:
//   regions
//       copy_to_region, reduce_from_region, gather_last_dim, gather_sequence,
//       reduce_scatter_sequence and split_sequence, forward and gradient,
//       against what the whole-tensor op gives: small tensors (staged
//       through the shared-memory channel) and large ones (in place in the
//       group's shared region, before and after it grows).
//   loss
//       vocab_parallel_cross_entropy against cross_entropy over the whole
//       logits (mean, sum, none; label smoothing 0 and 0.1; ignored rows),
//       and a finite-difference gradient check.
//   linear
//       a column- then row-parallel Linear pair (parts 1 and 3) and a
//       vocabulary-parallel Embedding against the unsplit layers, with and
//       without sequence parallelism.
//   block
//       a Transformer Block split with Block::shard against the whole block,
//       with and without sequence parallelism.
//   gpt
//       a small GPT split with shard_tensor_parallel: its vocabulary-parallel
//       loss and gradients against the unsplit model's, and its checkpoint
//       state through gather_whole and take_shards.
//   llama
//       a small Llama split with shard_tensor_parallel, key/value heads split
//       (4 and 2 over 2 ranks) and replicated (2 and 1 over 4, 1 over 2),
//       tied and untied: its logits, loss and gradients against the unsplit
//       model's.
//   cuda
//       (a GPU) the region ops and the vocabulary-parallel loss on CUDA
//       tensors against the same on the CPU, in f32.
//
// Mismatches print rank, what, index, expected and actual; each part prints
// "rank R: <part>, n = N: compared" and the rank last
// "rank R: N checks, F failed"; exit 0 only without failures.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "comm/bootstrap.h"
#include "comm/communicator.h"
#include "core/autograd.h"
#include "core/ops.h"
#include "layers/linear.h"
#include "layers/tensor_parallel.h"
#include "layers/transformer.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "parallel/mesh.h"
#include "parallel/tensor_parallel.h"
#include "tests/comparison.h"
#include "tests/tp_checks.h"
#include "tests/worker_checks.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

using Group = std::shared_ptr<parallel::CommGroup>;
using Reduction = CrossEntropyOptions::Reduction;

// ---- tolerances ----
// f64 rounds by 2^-53 ~ 1.1e-16. A split layer computes the sums of the
// whole one in another order (each rank's partial products, then the
// group's allreduce in the ring's order), so the two differ by rounding
// alone: at these sizes ~1e-15 of the tensor's largest element (measured).
// kTol = 1e-10 leaves a wide margin over that, while a wrong slice, a
// missing or doubled reduction or a wrong scale is off by O(1) (and a
// relative error of 1e-9 in the loss's gradient already fails). The region
// ops only move data and add n <= 4 terms: kRegionTol.
constexpr double kTol = 1e-10;
constexpr double kRegionTol = 1e-12;
// Central differences with step h are off by h^2 |f'''| / 6 (truncation)
// and ~2^-53 |f| / h (rounding, |f| ~ log V): with h = 1e-5 both are
// ~1e-11 to 1e-10, about 1e-9 of the largest gradient element (measured).
// 1e-7 of it leaves a margin of 100.
constexpr double kFiniteStep = 1e-5;
constexpr double kFiniteTol = 1e-7;

constexpr uint64_t kSeed = 4321;
constexpr int64_t kBatch = 2;
constexpr int64_t kSeq = 8;  // divides over groups of 2 and 4 (sequence parallelism)
constexpr int64_t kEmbeddingDim = 8;
constexpr int64_t kBlockDim = 16, kHeads = 4;  // heads divide over 2 and 4

double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : t.to_vector<double>()) m = std::max(m, std::fabs(v));
  return m;
}

// |actual - expected| <= rtol (|expected| + max |expected|) elementwise: the
// absolute part because an element that cancels to near zero still carries
// the rounding of the terms it sums. rtol 0: bit for bit.
void expect_close(const std::string& what, const Tensor& actual, const Tensor& expected,
                  double rtol) {
  ++g_checks;
  const double atol = expected.defined() ? rtol * max_abs(expected) : 0;
  std::string why = testing::mismatch(actual, expected, rtol, atol);
  if (why.empty()) {
    // Everything runs in f64: an f32 result would pass kTol only by chance.
    if (actual.dtype() == DType::f64 && expected.dtype() == DType::f64) return;
    why = cat("dtype ", actual.dtype(), ", expected ", expected.dtype(), ", both f64 expected");
  }
  if (why.rfind("mismatch", 0) != 0) why = "mismatch: " + why;
  std::printf("rank %d: %s: %s\n", g_rank, what.c_str(), why.c_str());
  std::fflush(stdout);
  ++g_failures;
}

// ---- inputs ----

Tensor random(const Shape& shape, uint64_t stream, double lo = -1.0, double hi = 1.0) {
  Generator gen(kSeed, stream);
  return uniform(shape, lo, hi, gen, DType::f64);
}

// One tensor per rank of a group of n (streams stream * 16 + rank): every
// rank makes all of them, the reference needs them all.
TensorList per_rank(const Shape& shape, uint64_t stream, int n) {
  TensorList out;
  for (int q = 0; q < n; ++q) out.push_back(random(shape, stream * 16 + uint64_t(q)));
  return out;
}

Tensor sum_of(const TensorList& ts) {
  Tensor s = ts[0].clone();
  for (size_t i = 1; i < ts.size(); ++i) s = s + ts[i];
  return s;
}

// Integers in [0, high) of shape (i64).
Tensor random_indices(const Shape& shape, int64_t high, uint64_t stream) {
  std::vector<int64_t> values;
  for (double u : random(shape, stream, 0.0, 1.0).to_vector<double>())
    values.push_back(std::min<int64_t>(int64_t(u * double(high)), high - 1));
  return from_vector(values, shape);
}

// This rank's part of the sequence (dim 1) of a whole [B, T, ...] tensor.
Tensor seq_part(const Tensor& t, const TensorParallelGroup& g) {
  const int64_t part = t.size(1) / g.size();
  return t.narrow(1, part * g.rank(), part).contiguous();
}

Tensor leaf(const Tensor& t) { return t.detach().clone().requires_grad_(); }

std::string group_name(const TensorParallelGroup& g) {
  return cat("n = ", g.size(), g.sequence_parallel() ? ", sequence parallel" : "");
}

// ---- modules in f64 ----

// The layers have no dtype of their own (they build their parameters in
// f32): this converts every parameter and buffer of m to f64 in place, as
// move_module (trainer/device.h) moves them to a device, so every handle on
// a tensor (a layer's member, the module's list, a tied weight) sees it.
void to_f64(const Module& m) {
  autograd::NoGradGuard no_grad;
  std::set<const TensorImpl*> done;
  for (const NamedTensor& t : m.state()) {
    TensorImpl* impl = t.tensor.impl();
    if (!done.insert(impl).second || t.tensor.dtype() != DType::f32) continue;
    Tensor converted = t.tensor.contiguous().to(DType::f64);
    impl->storage = converted.storage();
    impl->shape = converted.shape();
    impl->strides = converted.strides();
    impl->offset = converted.offset();
    impl->dtype = DType::f64;
  }
}

std::map<std::string, Tensor> by_name(const std::vector<NamedTensor>& named) {
  std::map<std::string, Tensor> out;
  for (const NamedTensor& t : named) out.emplace(t.name, t.tensor);
  return out;
}

ParameterSplit sharded(int dim, int parts, const TensorParallelGroup& g) {
  return {.kind = ParameterSplit::Kind::sharded,
          .dim = dim,
          .parts = parts,
          .rank = g.rank(),
          .size = g.size()};
}

ParameterSplit partial(const TensorParallelGroup& g) {
  return {.kind = ParameterSplit::Kind::partial_gradient, .rank = g.rank(), .size = g.size()};
}

std::string describe(const ParameterSplit& s) {
  return cat(s.kind == ParameterSplit::Kind::sharded ? "sharded" : "partial_gradient", " dim ",
             s.dim, " parts ", s.parts, " rank ", s.rank, " of ", s.size);
}

// The module's parameter_splits() are exactly `expected`.
void expect_splits(const std::string& what, const Module& m,
                   const std::map<std::string, ParameterSplit>& expected) {
  const std::map<std::string, ParameterSplit> actual = m.parameter_splits();
  for (const auto& [name, s] : expected) {
    auto it = actual.find(name);
    const std::string got = it == actual.end() ? "not split" : describe(it->second);
    expect(got == describe(s), cat(what, ": ", name, " is ", got, ", expected ", describe(s)));
  }
  for (const auto& [name, s] : actual)
    expect(expected.count(name) == 1,
           cat(what, ": ", name, " is ", describe(s), ", expected not split"));
}

// The split module's parameters and their gradients against the whole
// module's: this rank's shard_of the whole tensor for a sharded parameter,
// the whole one otherwise (a partial_gradient one's gradient once the group
// added up the shares). Collective (sum_partial_gradients).
void compare_parameters(const std::string& what, const Module& split, const Module& whole,
                        TensorParallelGroup& g) {
  parallel::sum_partial_gradients(
      parallel::parameters_split_as(split, ParameterSplit::Kind::partial_gradient), g);
  const std::map<std::string, ParameterSplit> splits = split.parameter_splits();
  const std::map<std::string, Tensor> reference = by_name(whole.named_parameters());
  const std::vector<NamedTensor> params = split.named_parameters();
  expect(params.size() == reference.size(),
         cat(what, ": ", params.size(), " parameters, the whole module ", reference.size()));
  for (const NamedTensor& p : params) {
    auto ref = reference.find(p.name);
    if (ref == reference.end()) {
      expect(false, cat(what, ": ", p.name, " is not a parameter of the whole module"));
      continue;
    }
    auto s = splits.find(p.name);
    const bool is_sharded = s != splits.end() && s->second.kind == ParameterSplit::Kind::sharded;
    auto part = [&](const Tensor& t) { return is_sharded ? shard_of(t, s->second) : t; };
    expect_close(cat(what, ": ", p.name), p.tensor, part(ref->second), 0.0);
    expect_close(cat(what, ": gradient of ", p.name), p.tensor.grad(), part(ref->second.grad()),
                 kTol);
  }
}

// ---- 1. the region ops ----

// width: the last dim of every tensor. Small ones go through the
// shared-memory channel's staging areas; from 64 KiB on, a CommGroup runs
// its collectives in place in its shared region, which grows to fit.
void check_regions(TensorParallelGroup& g, int64_t width) {
  const int n = g.size(), r = g.rank();
  const Shape whole{kBatch, kSeq, width}, part{kBatch, kSeq / n, width};
  const std::string name = group_name(g);

  {  // f: x as is; every rank's cotangent reaches x, so its gradient is their sum.
    Tensor x = leaf(random(whole, 1));
    TensorList v = per_rank(whole, 2, n);
    Tensor y = copy_to_region(x, g);
    expect_close("copy_to_region forward", y, x.detach(), 0.0);
    y.backward(v[size_t(r)]);
    expect_close("copy_to_region gradient", x.grad(), sum_of(v), kRegionTol);
  }
  {  // g: the sum of the ranks' x; the output is replicated and so is its
     // cotangent: each x gets it as is.
    TensorList xs = per_rank(whole, 3, n);
    Tensor x = leaf(xs[size_t(r)]);
    Tensor v = random(whole, 4);
    Tensor y = reduce_from_region(x, g);
    expect_close("reduce_from_region forward", y, sum_of(xs), kRegionTol);
    y.backward(v);
    expect_close("reduce_from_region gradient", x.grad(), v, kRegionTol);
  }
  {  // The ranks' [B, T, 3] side by side; replicated output, this rank's
     // columns of the cotangent.
    TensorList xs = per_rank(whole, 5, n);
    Tensor x = leaf(xs[size_t(r)]);
    Tensor v = random({kBatch, kSeq, width * n}, 6);
    Tensor y = gather_last_dim(x, g);
    expect_close("gather_last_dim forward", y, concat(xs, 2), 0.0);
    y.backward(v);
    expect_close("gather_last_dim gradient", x.grad(), v.narrow(2, width * r, width).contiguous(),
                 0.0);
  }
  {  // The ranks' [B, T/n, D] parts in sequence order. Each rank's cotangent
     // differs (the column-parallel layer after it): x_r's gradient is its
     // part of their sum.
    TensorList xs = per_rank(part, 7, n);
    Tensor x = leaf(xs[size_t(r)]);
    TensorList v = per_rank(whole, 8, n);
    Tensor y = gather_sequence(x, g);
    expect_close("gather_sequence forward", y, concat(xs, 1), 0.0);
    y.backward(v[size_t(r)]);
    expect_close("gather_sequence gradient", x.grad(), seq_part(sum_of(v), g), kRegionTol);
  }
  {  // This rank's part of the sum; x_r reaches every rank's part, so its
     // gradient is the ranks' cotangents in sequence order.
    TensorList xs = per_rank(whole, 9, n);
    Tensor x = leaf(xs[size_t(r)]);
    TensorList v = per_rank(part, 10, n);
    Tensor y = reduce_scatter_sequence(x, g);
    expect_close("reduce_scatter_sequence forward", y, seq_part(sum_of(xs), g), kRegionTol);
    y.backward(v[size_t(r)]);
    expect_close("reduce_scatter_sequence gradient", x.grad(), concat(v, 1), 0.0);
  }
  {  // This rank's part of a replicated x; every part's cotangent lands in x.
    Tensor x = leaf(random(whole, 11));
    TensorList v = per_rank(part, 12, n);
    Tensor y = split_sequence(x, g);
    expect_close("split_sequence forward", y, seq_part(x.detach(), g), 0.0);
    y.backward(v[size_t(r)]);
    expect_close("split_sequence gradient", x.grad(), concat(v, 1), 0.0);
  }
  report_compared(cat("regions, ", name));
}

// ---- 2. the vocabulary-parallel loss ----

constexpr int64_t kRows = 10;
constexpr int64_t kVocab = 24;  // splits over 2 and 4

// Targets in [0, V) with rows 2 and 7 set to ignore_index.
Tensor loss_targets(int64_t ignore_index) {
  Tensor t = random_indices({kRows}, kVocab, 20);
  int64_t* p = t.data<int64_t>();
  p[2] = p[7] = ignore_index;
  return t;
}

std::string describe(const CrossEntropyOptions& o) {
  const char* reduction = o.reduction == Reduction::mean  ? "mean"
                          : o.reduction == Reduction::sum ? "sum"
                                                          : "none";
  return cat("cross-entropy (", reduction, ", label_smoothing ", o.label_smoothing,
             ", ignore_index ", o.ignore_index, ")");
}

// The cotangent of the loss, the same on every rank (the loss is).
Tensor loss_cotangent(const CrossEntropyOptions& o) {
  return o.reduction == Reduction::none ? random({kRows}, 21, 0.5, 1.5) : full({}, 0.7, DType::f64);
}

void compare_loss(TensorParallelGroup& g, const Tensor& logits, const Tensor& targets,
                  const CrossEntropyOptions& o) {
  const int64_t width = kVocab / g.size(), start = width * g.rank();
  const std::string what = describe(o);
  Tensor whole = leaf(logits);
  Tensor expected = cross_entropy(whole, targets, o);
  expected.backward(loss_cotangent(o));
  Tensor local = leaf(logits.narrow(1, start, width));
  Tensor loss = vocab_parallel_cross_entropy(local, targets, start, g, o);
  expect_close(what + ": loss", loss, expected.detach(), kTol);
  loss.backward(loss_cotangent(o));
  expect_close(what + ": gradient", local.grad(), whole.grad().narrow(1, start, width).contiguous(),
               kTol);
}

// Central differences of sum(w * loss) in every element of the whole
// logits, against this rank's gradient. The loss is a collective: every
// rank runs both forwards of every element, only the rank holding the
// element's column perturbs it.
void check_finite_differences(TensorParallelGroup& g, const Tensor& logits, const Tensor& targets,
                              const CrossEntropyOptions& o) {
  const int64_t width = kVocab / g.size(), start = width * g.rank();
  Tensor local = leaf(logits.narrow(1, start, width));
  const Tensor w = loss_cotangent(o);
  auto f = [&] { return sum(vocab_parallel_cross_entropy(local, targets, start, g, o) * w); };
  f().backward();
  Tensor numeric = zeros(local.shape(), DType::f64);
  autograd::NoGradGuard no_grad;
  double* x = local.data<double>();
  double* d = numeric.data<double>();
  for (int64_t i = 0; i < kRows * kVocab; ++i) {
    const int64_t row = i / kVocab, column = i % kVocab;
    const bool mine = column >= start && column < start + width;
    double* element = mine ? x + row * width + (column - start) : nullptr;
    const double saved = mine ? *element : 0.0;
    if (mine) *element = saved + kFiniteStep;
    const double plus = f().item<double>();
    if (mine) *element = saved - kFiniteStep;
    const double minus = f().item<double>();
    if (mine) {
      *element = saved;
      d[row * width + (column - start)] = (plus - minus) / (2 * kFiniteStep);
    }
  }
  expect_close(describe(o) + ": gradient against finite differences", local.grad(), numeric,
               kFiniteTol);
}

void check_loss(TensorParallelGroup& g) {
  // Wide enough that the row maxima sit on different ranks.
  const Tensor logits = random({kRows, kVocab}, 22, -4.0, 4.0);
  for (Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none})
    for (double smoothing : {0.0, 0.1}) {
      const CrossEntropyOptions o{.label_smoothing = smoothing, .reduction = reduction};
      compare_loss(g, logits, loss_targets(o.ignore_index), o);
    }
  // An ignore_index that is a class index: its rows are left out all the same.
  const CrossEntropyOptions five{.label_smoothing = 0.1, .ignore_index = 5};
  compare_loss(g, logits, loss_targets(5), five);
  // Every row ignored: 0 and no gradient, as cross_entropy.
  const CrossEntropyOptions mean{.label_smoothing = 0.1};
  compare_loss(g, logits, full({kRows}, -100, DType::i64), mean);
  report_compared(cat("loss, ", group_name(g)));

  check_finite_differences(g, logits, loss_targets(-100), mean);
  check_finite_differences(
      g, logits, loss_targets(-100),
      CrossEntropyOptions{.label_smoothing = 0.1, .reduction = Reduction::none});
  report_compared(cat("loss finite differences, ", group_name(g)));
}

// ---- 3. Linear and Embedding ----

// column -> tanh -> row, the pattern of a split MLP.
class LinearPair : public Module {
 public:
  LinearPair(int64_t width, int64_t hidden) {
    Generator gen(kSeed, kStreamInit);
    column = register_module("column", std::make_shared<Linear>(width, hidden, gen));
    row = register_module("row", std::make_shared<Linear>(hidden, width, gen));
    to_f64(*this);
  }
  Tensor forward(const Tensor& x) override { return (*row)(tanh((*column)(x))); }
  std::shared_ptr<Linear> column, row;
};

// The row layer takes the column layer's parts as they are: with parts = 3
// (c_attn's q, k, v) it is split in the same 3 pieces.
void check_linear_pair(const Group& g, int parts) {
  constexpr int64_t kWidth = 8, kHidden = 24;
  const bool sp = g->sequence_parallel();
  const std::string what = cat("Linear pair, parts ", parts, ", ", group_name(*g));
  LinearPair whole(kWidth, kHidden), split(kWidth, kHidden);
  split.column->shard(g, LinearSplit::column, parts);
  split.row->shard(g, LinearSplit::row, parts);
  std::map<std::string, ParameterSplit> expected{{"column.weight", sharded(0, parts, *g)},
                                                 {"column.bias", sharded(0, parts, *g)},
                                                 {"row.weight", sharded(1, parts, *g)}};
  if (sp) expected.emplace("row.bias", partial(*g));
  expect_splits(what, split, expected);

  const Tensor x = random({kBatch, kSeq, kWidth}, 30), v = random({kBatch, kSeq, kWidth}, 31);
  Tensor xw = leaf(x);
  Tensor hw = (*whole.column)(xw);
  Tensor yw = (*whole.row)(tanh(hw));
  yw.backward(v);

  // Under sequence parallelism the input and output are this rank's part of the sequence.
  Tensor xs = leaf(sp ? seq_part(x, *g) : x);
  Tensor hs = (*split.column)(xs);
  expect_close(what + ": column output", hs, shard_of(hw.detach(), sharded(2, parts, *g)), kTol);
  Tensor ys = (*split.row)(tanh(hs));
  expect_close(what + ": output", ys, sp ? seq_part(yw.detach(), *g) : yw.detach(), kTol);
  ys.backward(sp ? seq_part(v, *g) : v);
  expect_close(what + ": input gradient", xs.grad(), sp ? seq_part(xw.grad(), *g) : xw.grad(),
               kTol);
  compare_parameters(what, split, whole, *g);
}

void check_embedding(const Group& g) {
  const bool sp = g->sequence_parallel();
  const std::string what = cat("Embedding::shard_vocab, ", group_name(*g));
  auto make = [] {
    Generator gen(kSeed, kStreamInit);
    auto e = std::make_shared<Embedding>(kVocab, kEmbeddingDim, gen);
    to_f64(*e);
    return e;
  };
  std::shared_ptr<Embedding> whole = make(), split = make();
  split->shard_vocab(g);
  expect_splits(what, *split, {{"weight", sharded(0, 1, *g)}});
  expect(split->vocab_start() == kVocab / g->size() * g->rank(),
         cat(what, ": vocab_start ", split->vocab_start()));

  const Tensor tokens = random_indices({kBatch, kSeq}, kVocab, 32);
  const Tensor v = random({kBatch, kSeq, kEmbeddingDim}, 33);
  Tensor yw = (*whole)(tokens);
  yw.backward(v);
  Tensor ys = (*split)(tokens);
  expect_close(what + ": output", ys, sp ? seq_part(yw.detach(), *g) : yw.detach(), kTol);
  ys.backward(sp ? seq_part(v, *g) : v);
  compare_parameters(what, *split, *whole, *g);
}

void check_linear(const Group& plain, const Group& sp) {
  for (const Group& g : {plain, sp}) {
    for (int parts : {1, 3}) check_linear_pair(g, parts);
    check_embedding(g);
    report_compared(cat("linear, ", group_name(*g)));
  }
}

// ---- 4. a Transformer block ----

void check_block(const Group& g) {
  const bool sp = g->sequence_parallel();
  const std::string what = cat("Block, ", group_name(*g));
  auto make = [] {
    const TransformerOptions o{
        .d_model = kBlockDim, .num_heads = kHeads, .dropout = 0.0, .seed = kSeed};
    Generator gen(kSeed, kStreamInit);
    auto b = std::make_shared<Block>(o, gen, 0);
    to_f64(*b);
    return b;
  };
  std::shared_ptr<Block> whole = make(), split = make();
  split->shard(g);
  expect(split->attn->local_heads() == kHeads / g->size(),
         cat(what, ": ", split->attn->local_heads(), " local heads"));
  std::map<std::string, ParameterSplit> expected{
      {"attn.c_attn.weight", sharded(0, 3, *g)}, {"attn.c_attn.bias", sharded(0, 3, *g)},
      {"attn.c_proj.weight", sharded(1, 1, *g)}, {"mlp.c_fc.weight", sharded(0, 1, *g)},
      {"mlp.c_fc.bias", sharded(0, 1, *g)},      {"mlp.c_proj.weight", sharded(1, 1, *g)}};
  if (sp)
    for (const char* name : {"ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias",
                             "attn.c_proj.bias", "mlp.c_proj.bias"})
      expected.emplace(name, partial(*g));
  expect_splits(what, *split, expected);

  const Tensor x = random({kBatch, kSeq, kBlockDim}, 40, -2.0, 2.0);
  const Tensor v = random({kBatch, kSeq, kBlockDim}, 41);
  Tensor xw = leaf(x);
  Tensor yw = (*whole)(xw);
  yw.backward(v);
  // Under sequence parallelism the block gets this rank's part of x and
  // gives its part of the output; x's gradient is allgathered whole.
  Tensor xs = leaf(x);
  Tensor ys = (*split)(sp ? split_sequence(xs, *g) : xs);
  expect_close(what + ": output", ys, sp ? seq_part(yw.detach(), *g) : yw.detach(), kTol);
  ys.backward(sp ? seq_part(v, *g) : v);
  expect_close(what + ": input gradient", xs.grad(), xw.grad(), kTol);
  compare_parameters(what, *split, *whole, *g);
  report_compared(cat("block, ", group_name(*g)));
}

// ---- 5. GPT ----

void check_gpt(const Group& g) {
  const bool sp = g->sequence_parallel();
  const int n = g->size(), r = g->rank();
  const std::string what = cat("GPT, ", group_name(*g));
  const GPTOptions o{.vocab_size = kVocab,
                     .block_size = 16,
                     .n_layer = 2,
                     .n_head = 4,
                     .n_embd = 16,
                     .dropout = 0.0,
                     .tie_weights = true,
                     .seed = kSeed};
  std::shared_ptr<GPT> whole = make_gpt(o), split = make_gpt(o);
  to_f64(*whole);
  to_f64(*split);
  split->shard_tensor_parallel(g);
  const std::map<std::string, ParameterSplit> splits = split->parameter_splits();
  for (const char* name : {"transformer.wte.weight", "lm_head.weight"})
    expect(splits.count(name) && describe(splits.at(name)) == describe(sharded(0, 1, *g)),
           cat(what, ": ", name, " is not split by vocabulary"));
  expect(split->lm_head_weight().impl() == split->wte->weight.impl(),
         what + ": the LM head no longer shares the token embedding");
  expect(splits.count("transformer.wpe.weight") == (sp ? 1u : 0u),
         cat(what, ": transformer.wpe.weight is ",
             splits.count("transformer.wpe.weight") ? "" : "not ", "split"));

  // Checkpoints: the whole tensors from the parts, and the parts from the
  // whole tensors, bit for bit; with an optimizer slot of each split parameter.
  const std::vector<NamedTensor> whole_state = whole->state(), split_state = split->state();
  std::vector<NamedTensor> split_with_slots = split_state, whole_with_slots = whole_state;
  const std::map<std::string, Tensor> whole_by_name = by_name(whole_state);
  for (const auto& [name, s] : splits) {
    if (s.kind != ParameterSplit::Kind::sharded) continue;
    const Tensor slot = whole_by_name.at(name) * 2.0;
    whole_with_slots.push_back({name + ".exp_avg", slot});
    split_with_slots.push_back({name + ".exp_avg", shard_of(slot, s)});
  }
  const std::vector<NamedTensor> gathered = parallel::gather_whole(split_with_slots, *split, *g);
  expect(gathered.size() == whole_with_slots.size(),
         cat(what, ": gather_whole gives ", gathered.size(), " tensors, expected ",
             whole_with_slots.size()));
  for (size_t i = 0; i < std::min(gathered.size(), whole_with_slots.size()); ++i) {
    expect(gathered[i].name == whole_with_slots[i].name,
           cat(what, ": gather_whole's tensor ", i, " is ", gathered[i].name, ", expected ",
               whole_with_slots[i].name));
    expect_close(cat(what, ": gather_whole of ", gathered[i].name), gathered[i].tensor,
                 whole_with_slots[i].tensor, 0.0);
  }
  std::map<std::string, Tensor> loaded;
  for (const NamedTensor& t : whole_with_slots) loaded[t.name] = t.tensor.clone();
  parallel::take_shards(loaded, *split);
  for (const NamedTensor& t : split_with_slots)
    expect_close(cat(what, ": take_shards of ", t.name), loaded.at(t.name), t.tensor, 0.0);

  // The loss of this rank's logits and the gradients against the whole model's.
  const Tensor tokens = random_indices({kBatch, kSeq}, kVocab, 50);
  Tensor targets = random_indices({kBatch, kSeq}, kVocab, 51);
  targets.data<int64_t>()[3] = -100;
  const CrossEntropyOptions loss_options{.label_smoothing = 0.1};
  Tensor logits_w = (*whole)(tokens);  // [B, T, V]
  Tensor loss_w = cross_entropy(logits_w.flatten(0, 1), targets.flatten(), loss_options);
  loss_w.backward();
  Tensor logits_s = (*split)(tokens);  // [B, T, V / n]
  const int64_t width = kVocab / n;
  expect_close(what + ": logits", logits_s,
               logits_w.detach().narrow(2, width * r, width).contiguous(), kTol);
  Tensor loss_s = split->output_loss(logits_s.flatten(0, 1), targets.flatten(), loss_options);
  expect_close(what + ": loss", loss_s, loss_w.detach(), kTol);
  loss_s.backward();
  compare_parameters(what, *split, *whole, *g);
  report_compared(cat("gpt, ", group_name(*g)));
}

// ---- 6. Llama ----

void check_llama(const Group& g, int64_t kv_heads, bool tied) {
  const int n = g->size(), r = g->rank();
  const std::string what =
      cat("Llama, ", kv_heads, " key/value heads, ", tied ? "tied, " : "", group_name(*g));
  const LlamaOptions o{.vocab_size = kVocab,
                       .hidden_size = 16,
                       .intermediate_size = 24,
                       .num_hidden_layers = 2,
                       .num_attention_heads = 4,
                       .num_key_value_heads = kv_heads,
                       .max_position_embeddings = 16,
                       .tie_word_embeddings = tied,
                       .seed = kSeed};
  std::shared_ptr<Llama> whole = make_llama(o), split = make_llama(o);
  to_f64(*whole);
  to_f64(*split);
  split->shard_tensor_parallel(g);
  const LlamaAttention& attn = *split->layers[0]->self_attn;
  expect(attn.local_heads() == 4 / n, cat(what, ": ", attn.local_heads(), " local heads"));
  expect(attn.local_kv_heads() == std::max<int64_t>(kv_heads / n, 1),
         cat(what, ": ", attn.local_kv_heads(), " local key/value heads"));
  const Tensor tokens = random_indices({kBatch, kSeq}, kVocab, 52);
  const Tensor targets = random_indices({kBatch, kSeq}, kVocab, 53);
  Tensor logits_w = (*whole)(tokens);
  Tensor loss_w = cross_entropy(logits_w.flatten(0, 1), targets.flatten());
  loss_w.backward();
  Tensor logits_s = (*split)(tokens);
  const int64_t width = kVocab / n;
  expect_close(what + ": logits", logits_s,
               logits_w.detach().narrow(2, width * r, width).contiguous(), kTol);
  Tensor loss_s = split->output_loss(logits_s.flatten(0, 1), targets.flatten());
  expect_close(what + ": loss", loss_s, loss_w.detach(), kTol);
  loss_s.backward();
  compare_parameters(what, *split, *whole, *g);
  report_compared(cat("llama, ", group_name(*g)));
}

// ---- 7. CUDA tensors ----

// The group moves device tensors through host memory: the region ops and
// the vocabulary-parallel loss on CUDA copies of f32 inputs give the CPU's
// values (forward and gradient) to f32 rounding.
void expect_close_f32(const std::string& what, const Tensor& actual, const Tensor& expected) {
  ++g_checks;
  const Tensor a = actual.to(Device{}).to(DType::f64), e = expected.to(DType::f64);
  const std::string why = testing::mismatch(a, e, 1e-5, 1e-5 * max_abs(e));
  if (why.empty()) return;
  std::printf("rank %d: %s: %s\n", g_rank, what.c_str(), why.c_str());
  std::fflush(stdout);
  ++g_failures;
}

void check_cuda(TensorParallelGroup& g) {
  const int n = g.size(), r = g.rank();
  const Device gpu{kCUDA, 0};
  // op on x (this rank's input) on the CPU and on the GPU, backward with
  // the same cotangent v: outputs and input gradients compared.
  auto compare = [&](const std::string& what, const Tensor& x, const Tensor& v,
                     const std::function<Tensor(const Tensor&)>& op) {
    Tensor xc = x.to(DType::f32).detach(), xg = x.to(DType::f32).to(gpu).detach();
    xc.requires_grad_();
    xg.requires_grad_();
    Tensor yc = op(xc), yg = op(xg);
    expect(yg.device() == gpu, what + ": the result left the GPU");
    expect_close_f32(what + " forward", yg, yc);
    yc.backward(v.to(DType::f32));
    yg.backward(v.to(DType::f32).to(gpu));
    expect_close_f32(what + " gradient", xg.grad(), xc.grad());
  };
  const Shape whole{kBatch, kSeq, 64}, part{kBatch, kSeq / n, 64};
  compare("reduce_from_region", per_rank(whole, 31, n)[size_t(r)], random(whole, 32),
          [&](const Tensor& x) { return reduce_from_region(x, g); });
  compare("copy_to_region", random(whole, 33), per_rank(whole, 34, n)[size_t(r)],
          [&](const Tensor& x) { return copy_to_region(x, g); });
  compare("gather_sequence", per_rank(part, 35, n)[size_t(r)], per_rank(whole, 36, n)[size_t(r)],
          [&](const Tensor& x) { return gather_sequence(x, g); });
  compare("reduce_scatter_sequence", per_rank(whole, 37, n)[size_t(r)],
          per_rank(part, 38, n)[size_t(r)],
          [&](const Tensor& x) { return reduce_scatter_sequence(x, g); });
  const int64_t width = kVocab / n;
  const Tensor targets = loss_targets(-100);
  compare("vocab_parallel_cross_entropy", per_rank({kRows, width}, 39, n)[size_t(r)],
          random({}, 40), [&](const Tensor& x) {
            return vocab_parallel_cross_entropy(x, targets.to(x.device()), width * r, g, {});
          });
  report_compared(cat("cuda, ", group_name(g)));
}

}  // namespace

int trainer::testing::run_tp_checks(const std::shared_ptr<comm::Communicator>& world,
                                    const std::string& mode) {
  parallel::Mesh mesh(parallel::MeshShape{{parallel::Dim::tp, world->size()}}, world);
  // Two groups over one communicator, used one after the other.
  const Group plain = parallel::make_comm_group(mesh.comm(parallel::Dim::tp), false);
  const Group sp = parallel::make_comm_group(mesh.comm(parallel::Dim::tp), true);
  if (mode == "regions") {
    // Staged; in place (256 KiB tensors of f64 at width 2048); in place
    // after the region grows past its first 8 MiB (width 65536).
    for (int64_t width : {5, 2048, 65536}) {
      check_regions(*plain, width);
      if (width == 2048) expect(plain->in_place(), "no shared region for 256 KiB tensors");
    }
    expect(plain->in_place(), "no shared region after the growth");
  } else if (mode == "loss") {
    check_loss(*plain);
  } else if (mode == "linear") {
    check_linear(plain, sp);
  } else if (mode == "block") {
    for (const Group& g : {plain, sp}) check_block(g);
  } else if (mode == "gpt") {
    for (const Group& g : {plain, sp}) check_gpt(g);
  } else if (mode == "llama") {
    for (const Group& g : {plain, sp})
      for (int64_t kv : {4, 2, 1}) check_llama(g, kv, /*tied=*/kv == 2);
  } else if (mode == "cuda") {
    check_cuda(*plain);
  } else {
    std::fprintf(stderr,
                 "tp checks: modes are regions | loss | linear | block | gpt | llama | cuda\n");
    return 64;
  }
  return report_checks();
}
