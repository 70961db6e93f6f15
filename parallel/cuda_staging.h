// Data parallelism's device side for gradients on a GPU: the BucketCopier
// that stages buckets through pinned host memory (parallel/device_staging.h)
// and the Reducer that lets the ring allreduce reduce device memory in place
// (recipe parallel.gpu_direct, comm/collectives.h). Built with the CUDA
// backend only; the trainer picks one of the two per run (trainer/device.h
// decides which):
//
//   dp_options.reduce = direct ? gpu_direct_reduce(device)
//                              : staged_reduce(cuda_bucket_copier(device));
#pragma once

#include <memory>

#include "comm/collectives.h"
#include "core/device.h"
#include "parallel/device_staging.h"

namespace trainer::parallel {

#if TRAINER_HAVE_CUDA
// Bucket copies device -> pinned host on a comm stream of its own, after an
// event recorded on the compute stream when the bucket became ready, and back.
std::shared_ptr<BucketCopier> cuda_bucket_copier(Device device);

// The ring allreduce's reduction on device memory of `device`: the
// elementwise op of the received segment into the bucket by a CUDA kernel on
// the calling thread's stream, synchronised before it returns; receive
// scratch from the device's caching allocator.
std::shared_ptr<const comm::Reducer> cuda_reducer(Device device);

// DataParallelOptions::reduce for parallel.gpu_direct: each bucket's device
// memory allreduced in place (direct_reduce) once the compute stream has
// produced it.
BucketReduceFn gpu_direct_reduce(Device device);
#endif

}  // namespace trainer::parallel
