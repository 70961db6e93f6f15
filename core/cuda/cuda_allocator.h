// The CUDA caching allocator: allocator(Device{kCUDA}) (core/allocator.h).
//
// Blocks come from cudaMalloc, are rounded to size classes and, when released,
// go to per-device free lists instead of cudaFree, so a steady training step
// never calls the driver's allocator. New blocks are allocated on the current
// device (device.h) for use on its current stream (stream.h).
//
// Stream order. A released block is tagged with the current stream S of the
// releasing thread: everything that used it was queued on S before the
// release. Reuse then follows from stream order:
//   - on S itself, a block is reused at once (later work on S runs after the
//     earlier uses);
//   - on another stream, the allocator records an event ("fence") on S the
//     first time it considers the block, and hands the block out only once
//     that event has completed. No host or device wait is ever inserted: a
//     block still in flight is skipped and a new one allocated.
// We chose events over cudaMallocAsync-style stream waits so that an
// allocation never delays one stream behind another. A tensor used on a
// second stream must therefore be released with that stream current (or
// after synchronising it), as with PyTorch's record_stream.
// When a Stream is destroyed (after it is synchronised) its blocks become
// free for every stream.
//
// Out of memory: the allocator synchronises the device, returns every cached
// block to the driver and retries once; if the memory is really exhausted it
// throws Error naming the requested bytes, the device and what is in use.
//
//   AllocatorStats s = cuda::memory_stats(0);   // current, peak, cached bytes
//   allocator(Device{kCUDA}).empty_cache();
#pragma once

#include <cuda_runtime.h>

#include "core/allocator.h"

namespace trainer::cuda {

// Statistics of one device (allocator(Device{kCUDA}).stats() sums all devices).
AllocatorStats memory_stats(int device);

// Called by ~Stream after synchronising stream: its free blocks become free
// for every stream of device.
void forget_stream(int device, cudaStream_t stream);

}  // namespace trainer::cuda
