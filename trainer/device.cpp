#include "trainer/device.h"

#include <algorithm>
#include <map>

#include "comm/bootstrap.h"
#include "core/autograd.h"
#include "core/ops.h"

#if TRAINER_HAVE_CUDA
#include "core/cuda/device.h"
#endif

namespace trainer {

DeviceAvailability device_availability() {
#if TRAINER_HAVE_CUDA
  return {true, cuda::device_count()};
#else
  return {false, 0};
#endif
}

Device resolve_device(const Recipe& r, int local_rank, const DeviceAvailability& available) {
  if (r.device == "cpu") return Device{};
  if (r.device != "cuda")
    throw Error(cat(r.source, ": device: '", r.device, "' is not a device; use cpu or cuda"));
  if (!available.cuda_built)
    throw Error(cat(r.source, ": device: cuda, but this trainer was built without the CUDA ",
                    "backend (configure with -DTRAINER_CUDA=ON where the CUDA toolkit and cuDNN ",
                    "are installed); use device: cpu"));
  if (available.cuda_devices == 0)
    throw Error(cat(r.source, ": device: cuda, but no CUDA device is visible (no GPU, no ",
                    "driver, or CUDA_VISIBLE_DEVICES hides them); use device: cpu"));
  if (local_rank < 0 || local_rank >= available.cuda_devices)
    throw Error(cat(r.source, ": device: cuda, but this process's local rank ", local_rank,
                    " has no GPU: ", available.cuda_devices,
                    " CUDA device(s) visible; start at most that many processes per node"));
  return Device{kCUDA, local_rank};
}

void check_device_parallel(const Recipe& r, Device device, int world_size, bool ucx_cuda) {
  // ZeRO-1 and SyncBatchNorm stage GPU tensors through host memory
  // (parallel/zero.h, parallel/sync_batchnorm.h), as plain data parallelism
  // does by default. Only the direct path has conditions.
  (void)world_size;
  if (r.parallel.gpu_direct != "on") return;
  if (!device.is_cuda())
    throw Error(cat(r.source, ": parallel.gpu_direct: on hands GPU memory to UCX, but the device ",
                    "is ", device, "; use device: cuda or parallel.gpu_direct: off"));
  if (!ucx_cuda)
    throw Error(cat(r.source, ": parallel.gpu_direct: on, but this process's UCX does not ",
                    "report CUDA memory support (UCX built without CUDA, or its cuda ",
                    "transports not loadable; see `trainer info`); use parallel.gpu_direct: auto ",
                    "or off to stage through pinned host buffers"));
  if (r.parallel.zero1)
    throw Error(cat(r.source, ": parallel.gpu_direct: on with parallel.zero1: ZeRO-1's ",
                    "reduce-scatter and all-gather stage through host memory; use ",
                    "parallel.gpu_direct: auto or off"));
}

bool uses_gpu_direct(const Recipe& r, Device device, int world_size, bool ucx_cuda) {
  const std::string& mode = r.parallel.gpu_direct;
  return device.is_cuda() && world_size > 1 && !r.parallel.zero1 &&
         (mode == "on" || (mode == "auto" && ucx_cuda));
}

void make_device_current(Device device) {
#if TRAINER_HAVE_CUDA
  if (device.is_cuda()) cuda::set_device(device.index);
#else
  CHECK(device.is_cpu()) << "a " << device << " device in a build without CUDA";
#endif
}

Device training_device(const Recipe& r, int world_size) {
  // The environment is read only when a GPU is asked for (it picks which).
  int local_rank = 0;
  if (r.device == "cuda")
    local_rank = comm::detect_bootstrap(comm::process_environment()).local_rank;
  Device device = resolve_device(r, local_rank, device_availability());
  // Asks UCX (a context of its own) only when the recipe cares.
  check_device_parallel(r, device, world_size,
                        r.parallel.gpu_direct != "off" && parallel::ucx_supports_cuda_memory());
  make_device_current(device);
  return device;
}

void rebind_storages(const TensorList& tensors,
                     const std::function<Tensor(const Tensor& bytes)>& copy_storage) {
  // Old storage -> new one; the old ones stay alive until every tensor moved.
  std::map<const Storage*, std::pair<std::shared_ptr<Storage>, std::shared_ptr<Storage>>> moved;
  for (const Tensor& t : tensors) {
    if (!t.defined()) continue;
    const std::shared_ptr<Storage>& old = t.storage();
    auto it = moved.find(old.get());
    if (it == moved.end()) {
      auto impl = std::make_shared<TensorImpl>();
      impl->storage = old;
      impl->shape = {int64_t(old->bytes)};
      impl->strides = {1};
      impl->dtype = DType::u8;
      impl->device = old->device;
      Tensor copy = copy_storage(Tensor(impl));
      CHECK(copy.defined() && copy.dtype() == DType::u8 && copy.numel() == int64_t(old->bytes) &&
            copy.offset() == 0 && copy.is_contiguous())
          << "rebind_storages: the copy of a " << old->bytes << "-byte storage is not its bytes";
      it = moved.emplace(old.get(), std::make_pair(old, copy.storage())).first;
    }
    t.impl()->storage = it->second.second;
    t.impl()->device = it->second.second->device;
  }
}

void move_module(Module& module, Device device) {
  autograd::NoGradGuard no_grad;
  TensorList tensors;
  for (const NamedTensor& p : module.state())
    if (is_deferred(p.tensor))
      move_deferred(p.tensor, device);  // made on its old device when materialised, then moved
    else if (p.tensor.device() != device)
      tensors.push_back(p.tensor);
  for (const Tensor& t : module.parameters()) t.set_grad(Tensor());
  rebind_storages(tensors, [&](const Tensor& bytes) { return bytes.to(device); });
}

Device module_device(const Module& module) {
  std::vector<NamedTensor> state = module.state();
  return state.empty() ? Device{} : state.front().tensor.device();
}

Tensor to_device(const Tensor& t, Device device) {
  if (!t.defined() || t.device() == device) return t;
  autograd::NoGradGuard no_grad;
  return t.to(device);
}

}  // namespace trainer
