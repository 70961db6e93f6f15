// Tensor parallelism's ops and split layers (layers/tensor_parallel.h,
// parallel/tensor_parallel.h) over groups of 2 and 4 ranks as threads of
// this process, in double (tests/tp_checks.h; tests/tp_worker.cpp runs the
// same checks as processes, end to end). Every rank runs the
// single-process reference itself and compares its own part: the region
// ops against their whole-tensor definitions, the vocabulary-parallel
// cross-entropy against cross_entropy and finite differences, a column- and
// row-parallel Linear pair and a vocabulary-parallel Embedding, a
// Transformer block and a small GPT against the unsplit ones, with and
// without sequence parallelism. (The trainer at tp > 1 is
// test_parallel_tensor's.)

#include "core/autograd.h"
#include "core/ops.h"
#include "layers/tensor_parallel.h"
#include "parallel/tensor_parallel.h"
#include "tests/process.h"  // after the others: it brings Catch's CHECK
#include "tests/thread_checks.h"
#include "tests/tp_checks.h"

using namespace trainer;
using trainer::testing::ProcessResult;
using trainer::testing::run_process;

namespace {

// A hung collective ends at the worker's 30 s comm timeout; this only
// bounds a worker that hangs otherwise.
constexpr double kTimeoutSeconds = 90;

// `trainer launch` of nproc tp_workers in one group, one thread each (ranks
// waiting on each other while OpenMP threads spin would oversubscribe the
// cores).
ProcessResult launch(int nproc, const std::string& mode) {
  return run_process({TRAINER_BINARY, "launch", "--nproc-per-node", cat(nproc), "--program",
                      TP_WORKER_BINARY, "--", mode},
                     {.env = {{"OMP_NUM_THREADS", "1"}}, .timeout_s = kTimeoutSeconds});
}

// Runs mode (tests/tp_checks.h) over groups of 2 and 4 ranks as threads of
// this process: every rank passed, ran at least min_checks checks and
// compared each of its parts ("<part>, n = N"; with sequence_parallel also
// "<part>, n = N, sequence parallel").
void require_passed(const std::string& mode, int min_checks, const std::vector<std::string>& parts,
                    bool sequence_parallel) {
  for (int n : {2, 4}) {
    INFO("group of " << n << " (mismatches are printed above)");
    const std::vector<trainer::testing::RankReport> reports =
        trainer::testing::run_checks_on_threads(
            n, [&](const auto& world) { return trainer::testing::run_tp_checks(world, mode); },
            comm::Millis(30000));
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r);
      const trainer::testing::RankReport& report = reports[size_t(r)];
      CHECK(report.code == 0);
      CHECK(report.failures == 0);
      CHECK(report.checks >= min_checks);
      for (const std::string& part : parts) {
        const std::string line = cat(part, ", n = ", n);
        CHECK(report.has_compared(line));
        if (sequence_parallel) CHECK(report.has_compared(line + ", sequence parallel"));
      }
    }
  }
}

}  // namespace

TEST_CASE(
    "tensor parallel: copy_to_region, reduce_from_region, gather_last_dim, gather_sequence, "
    "reduce_scatter_sequence and split_sequence give the whole-tensor op's values and "
    "gradients",
    "[parallel][threads]") {
  require_passed("regions", 3 * 12 + 2, {"regions"}, false);
}

TEST_CASE(
    "tensor parallel: vocab_parallel_cross_entropy equals cross_entropy over the gathered "
    "logits (mean, sum, none, label smoothing, ignored rows) and finite differences",
    "[parallel][threads]") {
  require_passed("loss", 2 * 8 + 2, {"loss", "loss finite differences"}, false);
}

TEST_CASE(
    "tensor parallel: vocab_parallel_cross_entropy over a padded vocabulary leaves the padding "
    "columns out of the softmax and their gradient zero",
    "[parallel]") {
  // One rank holding 7 columns of which the first 5 are the vocabulary (as
  // the last rank of a padded split holds them): cross_entropy over those 5.
  const auto group = trainer::parallel::shape_only_group(0, 1, false);
  Generator gen(3, kStreamInit);
  const Tensor logits = normal({6, 7}, 0.0, 2.0, gen, DType::f64);
  const Tensor targets = from_vector(std::vector<int64_t>{0, 4, 2, -100, 3, 1}, {6});
  for (double smoothing : {0.0, 0.1}) {
    INFO("label smoothing " << smoothing);
    const CrossEntropyOptions o{.label_smoothing = smoothing, .ignore_index = -100};
    Tensor whole = logits.narrow(1, 0, 5).contiguous().requires_grad_();
    Tensor expected = cross_entropy(whole, targets, o);
    expected.backward();
    Tensor padded = logits.clone().requires_grad_();
    Tensor loss = vocab_parallel_cross_entropy(padded, targets, 0, *group, o, /*vocab=*/5);
    loss.backward();
    trainer::testing::require_close(loss, expected.detach(), 1e-12, 1e-12, "loss");
    trainer::testing::require_close(padded.grad().narrow(1, 0, 5).contiguous(), whole.grad(), 1e-12,
                                    1e-12, "gradient");
    CHECK(padded.grad().narrow(1, 5, 2).contiguous().to_vector<double>() ==
          std::vector<double>(12, 0.0));
  }
}

TEST_CASE(
    "tensor parallel: a column- then row-parallel Linear pair (parts 1 and 3) and a "
    "vocabulary-parallel Embedding equal the unsplit layers, with and without sequence "
    "parallelism",
    "[parallel][threads]") {
  require_passed("linear", 40, {"linear"}, true);
}

TEST_CASE(
    "tensor parallel: a Transformer block split by heads and hidden width equals the whole "
    "block, with and without sequence parallelism",
    "[parallel][threads]") {
  require_passed("block", 2 * 30, {"block"}, true);
}

TEST_CASE(
    "tensor parallel: a GPT split with shard_tensor_parallel gives the unsplit model's loss "
    "and gradients, and its checkpoint state through gather_whole and take_shards",
    "[parallel][threads]") {
  require_passed("gpt", 100, {"gpt"}, true);
}

TEST_CASE(
    "tensor parallel: a Llama split by heads, its key/value heads split or replicated, gives "
    "the unsplit model's logits, loss and gradients",
    "[parallel][threads][llama]") {
  require_passed("llama", 6 * 40, {"llama"}, true);
}

TEST_CASE(
    "tensor parallel on CUDA tensors: the region ops and the vocabulary-parallel loss give the "
    "CPU's values and gradients",
    "[parallel][mp][cuda]") {
  trainer::testing::require_gpu_or_skip();
  require_passed("cuda", 2 * 5 + 5, {"cuda"}, false);
}

TEST_CASE("tensor parallel: the region ops as processes of trainer launch, end to end",
          "[parallel][mp]") {
  // Each rank its own process: shared regions mapped across processes.
  for (int n : {2, 4}) {
    INFO("group of " << n);
    ProcessResult o = launch(n, "regions");
    trainer::testing::require_ranks_passed(o.code, o.output, n);
    for (int r = 0; r < n; ++r)
      CHECK(o.output.find(cat("rank ", r, ": regions, n = ", n, ": compared")) !=
            std::string::npos);
  }
}
