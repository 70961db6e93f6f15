// Data parallelism with gradients on a GPU, through the host collectives:
// a DataParallelOptions::reduce (parallel/ddp.h) that stages each bucket
// through host memory. The collectives of comm/ reduce on the host, so a
// bucket's flat gradients are copied device -> host, allreduced, and copied
// back, while backward keeps computing the layers below:
//
//   compute stream:  ... backward of bucket i's layers | record ready_i | backward ...
//   comm stream:                            wait ready_i | D2H_i | ......... | H2D_i
//   issue thread:                                   D2H_i done -> allreduce_async_i
//   completion thread:                      allreduce_i done -> H2D_i done -> Work_i done
//
// Buckets are issued in the order the hooks hand them over (one issue
// thread, FIFO), so every rank issues the same collectives in the same
// order, as DataParallel requires. The Work returned for a bucket finishes
// once the reduced values are back in bucket.flat, so DataParallel::finish()
// returning means the optimizer can read them.
//
// How bytes move is a BucketCopier: on CUDA a comm stream ordered after the
// compute stream by an event, with pinned host buffers
// (parallel/cuda_staging.h, cuda_bucket_copier); on the CPU plain memcpy
// (host_bucket_copier), which lets the pipeline be tested without a GPU.
//
//   DataParallelOptions o;
//   o.reduce = staged_reduce(cuda_bucket_copier(device));
//   DataParallel dp(model, comm, o);
//
// Glossary: bucket, rank: as in ddp.h; staging buffer = the host copy of one
// bucket, kept per bucket index and reused every step.
#pragma once

#include <functional>
#include <memory>

#include "comm/collectives.h"
#include "parallel/ddp.h"

namespace trainer::parallel {

class BucketCopier {
 public:
  virtual ~BucketCopier() = default;
  // On the thread running backward, once the bucket's gradients are
  // complete in the device's stream order: a token the copy to the host
  // waits for (CUDA: an event recorded on the compute stream).
  virtual std::shared_ptr<void> ready(const Tensor& flat) = 0;
  // Copies flat (contiguous) into host after `ready`; returns when done.
  virtual void to_host(const Tensor& flat, const std::shared_ptr<void>& ready, void* host) = 0;
  // Copies host back into flat; returns when done.
  virtual void from_host(const void* host, const Tensor& flat) = 0;
  // A staging buffer of bytes (CUDA: pinned, so the copies are DMA transfers).
  virtual std::shared_ptr<void> host_buffer(size_t bytes) = 0;
};

// For CPU tensors: memcpy both ways (tests of the staging pipeline).
std::shared_ptr<BucketCopier> host_bucket_copier();

struct DeviceStagingOptions {
  // The reduction of the staged buffers (DataParallel's default: average).
  comm::AllreduceOptions allreduce = {.op = comm::ReduceOp::avg};
};

// Whether UCX moves CUDA memory itself (comm/transport.h). staged_reduce
// stages either way; parallel.gpu_direct (auto, on) uses direct_reduce below
// only where this is true.
using comm::ucx_supports_cuda_memory;

// A BucketReduceFn without staging (recipe parallel.gpu_direct): each
// bucket's own memory is handed to the ring allreduce, whose transport
// (UCX built with CUDA) moves device memory itself, and whose reduction
// step is `reducer` (CUDA: a kernel on the bucket's device, parallel/cuda_staging.h).
// ready(flat) runs first on the backward thread and returns once the
// bucket's gradients are in memory (CUDA: the compute stream synchronised);
// empty: nothing to wait for (CPU tensors, as in the tests).
BucketReduceFn direct_reduce(std::shared_ptr<const comm::Reducer> reducer,
                             std::function<void(const Tensor& flat)> ready = {},
                             DeviceStagingOptions options = {});

// Allreduces t (contiguous, any device) in place through host memory: t is
// copied to a host tensor (a CPU one too, so the CPU tests run this data
// flow), allreduced there and copied back (Tensor::copy_ crosses devices and returns once the
// copy is done). For small tensors off the bucket path (SyncBatchNorm's
// statistics). Collective.
void allreduce_through_host(comm::Communicator& comm, const Tensor& t,
                            const comm::AllreduceOptions& options = {});

// A BucketReduceFn staging every bucket through host memory with copier.
// The function owns two threads (issue, completion), joined when the last
// copy of it is destroyed.
BucketReduceFn staged_reduce(std::shared_ptr<BucketCopier> copier,
                             DeviceStagingOptions options = {});

}  // namespace trainer::parallel
