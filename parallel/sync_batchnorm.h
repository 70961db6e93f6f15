// SyncBatchNorm: batch normalisation whose statistics cover the batches of
// every rank of the data-parallel group (torch.nn.SyncBatchNorm), for small
// per-rank batches. With per-rank batches b it computes what BatchNorm2d
// computes on the concatenated batch of world * b: the same outputs, running
// statistics (the unbiased variance over all M values of a channel), and
// gradients.
//
//   convert_sync_batchnorm(*model, dp_comm);   // every BatchNorm2d of the model, in place
//   DataParallel dp(model, dp_comm);           // parameter gradients averaged as usual
//
// Forward (training, or no running statistics), per channel c over the
// channels-last x [N, C, H, W]: each rank sums x and x^2 over its N*H*W values
// (in double), one allreduce of [sum, sum of squares, count] gives the
// global mean and biased variance, and x is normalised by them. Backward: one
// allreduce of [sum g, sum g * xhat] gives the global terms of the input
// gradient; the gamma and beta gradients stay local (each rank's share of the
// global one), since data parallelism averages parameter gradients anyway.
// Evaluation with running statistics communicates nothing.
//
// Every rank must run the converted layers the same number of times in the
// same order (as every collective); evaluation that only some ranks run
// must use running statistics (eval mode).
//
// Glossary: M = values per channel (N*H*W on one rank, summed over the ranks
// for the global statistics), xhat = (x - mean) * invstd.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "layers/conv.h"

namespace trainer::parallel {

// Batch normalisation of x [N, C, H, W] (f32 or f64) by the statistics
// of every rank's x, relu after it when asked. result.mean/var are the global
// mean and biased variance [C] (no gradient); count is the global M. Collective.
// CPU tensors take the fused loops below; device tensors (a GPU) take
// sync_batch_norm_ops.
BatchStatsResult sync_batch_norm(comm::Communicator& comm, const Tensor& x, const Tensor& gamma,
                                 const Tensor& beta, double eps, bool relu = false);

// The same normalisation with device-generic tensor ops (f64 sums where x
// lives), the per-channel statistics staged through host memory for the
// allreduce (allreduce_through_host, parallel/device_staging.h). What a GPU
// runs; on CPU tensors it is the reference the tests hold the GPU path to.
// x may also be bf16 or f16 (autocast) with gamma and beta of another
// floating dtype: the math is f64, the output and statistics x's dtype, the
// gamma and beta gradients theirs.
BatchStatsResult sync_batch_norm_ops(comm::Communicator& comm, const Tensor& x, const Tensor& gamma,
                                     const Tensor& beta, double eps, bool relu = false);

// Makes every BatchNorm2d in model (itself included) normalise with
// sync_batch_norm over comm, in place: names, parameters, buffers and the
// running-statistics update stay those of the BatchNorm2d (torch's
// convert_sync_batchnorm). by_ops: sync_batch_norm_ops on any tensors (the
// tests hold the GPU's path to the fused one with it). Returns the number of
// layers converted.
int convert_sync_batchnorm(Module& model, std::shared_ptr<comm::Communicator> comm,
                           bool by_ops = false);

// A BatchNorm2d that is synchronised from the start, for models built with it.
class SyncBatchNorm : public BatchNorm2d {
 public:
  SyncBatchNorm(int64_t channels, std::shared_ptr<comm::Communicator> comm,
                const BatchNormOptions& options = {});
};

}  // namespace trainer::parallel
