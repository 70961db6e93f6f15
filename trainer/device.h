// The training device: the recipe's `device: cpu | cuda`, resolved for this
// process, and the moves that put a session on it.
//
// With cuda, the GPU is the process's local rank (LOCAL_RANK, SLURM_LOCALID
// or OMPI_COMM_WORLD_LOCAL_RANK, read by comm's launcher detection), checked
// against the visible device count; the model's parameters and buffers move
// there in place once, before the optimizer builds its state beside them;
// batches are copied there as they arrive (pageable host memory goes through
// the CUDA backend's pinned staging buffers, core/cuda/transfer.cpp), and
// checkpoints are written from host copies and loaded back by copy_, which
// crosses devices. A recipe asking for cuda where the build has no CUDA
// backend or no GPU is visible is an Error naming the recipe file and key.
//
//   Device device = training_device(recipe);      // cpu, or cuda:<local rank>, made current
//   move_module(*model, device);
//   Tensor x = to_device(batch.images, device);
//   dp_options.reduce = parallel::staged_reduce(parallel::cuda_bucket_copier(device));
#pragma once

#include <functional>

#include "core/tensor.h"
#include "layers/module.h"
#include "parallel/cuda_staging.h"
#include "trainer/recipe.h"

namespace trainer {

// What the process can see, for resolve_device (tests pass their own).
struct DeviceAvailability {
  bool cuda_built = false;  // the CUDA backend is compiled in
  int cuda_devices = 0;     // visible GPUs
};
// This process's: the build's backend and the driver's device count.
DeviceAvailability device_availability();

// The device the recipe asks for on a process of this local rank, or an
// Error naming r.source and the key `device` and saying what to do.
Device resolve_device(const Recipe& r, int local_rank, const DeviceAvailability& available);

// Whether the recipe's parallel settings run on device with world_size
// data-parallel ranks, ucx_cuda saying whether UCX moves CUDA memory
// (parallel::ucx_supports_cuda_memory); an Error naming r.source and the key
// otherwise. On GPUs plain data parallelism, parallel.zero1 and
// parallel.sync_bn stage through host memory; parallel.gpu_direct: on needs
// device: cuda, UCX with CUDA support, and no parallel.zero1 (whose
// reduce-scatter and all-gather are staged).
void check_device_parallel(const Recipe& r, Device device, int world_size, bool ucx_cuda);

// Whether the gradient buckets go to the collectives as device memory
// (parallel::gpu_direct_reduce, parallel/cuda_staging.h) rather than staged: on, or
// auto where UCX moves CUDA memory; only on a GPU with several ranks and
// without ZeRO-1. Assumes check_device_parallel passed.
bool uses_gpu_direct(const Recipe& r, Device device, int world_size, bool ucx_cuda);

// resolve_device for this process (its local rank from the launcher's
// environment), checked by check_device_parallel, and makes a GPU current
// for this thread.
Device training_device(const Recipe& r, int world_size = 1);

// Makes device current for this thread (a GPU; nothing for the CPU).
void make_device_current(Device device);

// Rebinds every tensor's storage to copy_storage(bytes), where bytes is a
// u8 tensor over the whole old storage: the tensors keep their identity
// (layers hold handles to them), shape, strides and offset, and tensors that
// shared a storage (tied weights, views) share the new one. Each storage is
// copied once.
void rebind_storages(const TensorList& tensors,
                     const std::function<Tensor(const Tensor& bytes)>& copy_storage);

// Moves the module's parameters and buffers to device in place (no copy for
// those already there). Gradients are dropped.
void move_module(Module& module, Device device);

// The device of the module's first parameter (or buffer); the CPU without any.
Device module_device(const Module& module);

// t on device (t itself when it is there already).
Tensor to_device(const Tensor& t, Device device);

}  // namespace trainer
