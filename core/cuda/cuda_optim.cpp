// CudaBackend's optimizer section (core/backend.h): Tensor lists ->
// multi-tensor tables (kernels.h, section optim.cu) -> one launch.
//
// The tables (one record per tensor with its pointers and scalars, then one
// ChunkRef per chunk) are built on the host and travel to the device in a
// single transfer on the current stream, so an optimizer step over any
// number of parameters costs one copy and one kernel. The scalars are
// computed in double on the host by the functions of core/optim_math.h the
// CPU loops use.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/cuda/cuda_backend.h"
#include "core/cuda/kernel_scope.h"
#include "core/cuda/kernels.h"

namespace trainer::cuda {

std::vector<ChunkRef> plan_chunks(const std::vector<int64_t>& numels) {
  std::vector<ChunkRef> chunks;
  for (size_t k = 0; k < numels.size(); ++k) {
    const int64_t n = (numels[k] + kMultiTensorChunk - 1) / kMultiTensorChunk;
    CHECK_LE(n, int64_t(INT32_MAX)) << "a tensor of " << numels[k] << " elements";
    for (int64_t c = 0; c < n; ++c) chunks.push_back({int32_t(k), int32_t(c)});
  }
  CHECK_LE(numels.size(), size_t(INT32_MAX));
  return chunks;
}

namespace {

// The device tables of one launch; `storage` keeps them alive (stream-ordered).
template <class Record>
struct Tables {
  Tensor storage;
  const Record* tensors = nullptr;
  const ChunkRef* chunks = nullptr;
  int64_t num_chunks = 0;
};

template <class Record>
Tables<Record> upload(const std::vector<Record>& records, const std::vector<int64_t>& numels,
                      int device) {
  static_assert(std::is_trivially_copyable_v<Record>);
  const std::vector<ChunkRef> chunks = plan_chunks(numels);
  const size_t head = (records.size() * sizeof(Record) + 15) / 16 * 16;
  std::vector<uint8_t> bytes(head + chunks.size() * sizeof(ChunkRef));
  std::memcpy(bytes.data(), records.data(), records.size() * sizeof(Record));
  std::memcpy(bytes.data() + head, chunks.data(), chunks.size() * sizeof(ChunkRef));
  Tables<Record> t;
  t.storage = from_vector(bytes).to(Device{kCUDA, device});
  const char* base = static_cast<const char*>(t.storage.data_ptr());
  t.tensors = reinterpret_cast<const Record*>(base);
  t.chunks = reinterpret_cast<const ChunkRef*>(base + head);
  t.num_chunks = int64_t(chunks.size());
  return t;
}

// The CUDA device of every tensor of the lists (undefined ones skipped); all
// contiguous, and of params[0]'s dtype and numel entry by entry.
int lists_device(const char* op, const TensorList& first,
                 std::initializer_list<const TensorList*> rest, bool same_dtype) {
  CHECK(!first.empty()) << op << ": no tensors";
  int index = -1;
  auto check = [&](const Tensor& t, size_t k) {
    CHECK(t.defined()) << op << ": tensor " << k << " is undefined";
    CHECK(t.device().is_cuda()) << op << ": tensor " << k << " on " << t.device()
                                << " reached the CUDA backend";
    if (index < 0) index = t.device().index;
    CHECK_EQ(t.device().index, index) << op << ": tensors on different GPUs";
    CHECK(t.is_contiguous()) << op << ": tensor " << k << " is not contiguous";
    if (same_dtype) CHECK(t.dtype() == first[0].dtype()) << op << ": mixed dtypes";
    CHECK_EQ(t.numel(), first[k].numel()) << op << ": tensor " << k << " differs in size";
  };
  for (size_t k = 0; k < first.size(); ++k) check(first[k], k);
  for (const TensorList* list : rest) {
    if (list->empty()) continue;
    CHECK_EQ(list->size(), first.size()) << op << ": lists of different lengths";
    for (size_t k = 0; k < list->size(); ++k) check((*list)[k], k);
  }
  return index;
}

void* ptr_or_null(const TensorList& list, size_t k) {
  return list.empty() ? nullptr : list[k].data_ptr();
}

std::vector<int64_t> numels_of(const TensorList& list) {
  std::vector<int64_t> out;
  for (const Tensor& t : list) out.push_back(t.numel());
  return out;
}

}  // namespace

void CudaBackend::sgd_step(const MultiTensorSgd& a) {
  if (a.params.empty()) return;
  const int device = lists_device("sgd_step", a.params, {&a.grads, &a.momentum_buffers}, true);
  CHECK(a.lr.size() == a.params.size() && a.weight_decay.size() == a.params.size() &&
        a.step.size() == a.params.size())
      << "sgd_step: per-tensor scalars of the wrong length";
  CHECK_EQ(a.momentum_buffers.empty(), a.momentum == 0) << "sgd_step: momentum buffers";
  DeviceGuard guard(device);
  std::vector<SgdTensor> records;
  for (size_t k = 0; k < a.params.size(); ++k)
    records.push_back({a.params[k].data_ptr(), a.grads[k].data_ptr(),
                       ptr_or_null(a.momentum_buffers, k), a.params[k].numel(),
                       optim::sgd_scalars<double>(a.lr[k], a.momentum, a.dampening,
                                                  a.weight_decay[k], a.nesterov, a.step[k] == 1)});
  Tables<SgdTensor> t = upload(records, numels_of(a.params), device);
  launch_sgd_step(t.tensors, t.chunks, t.num_chunks, a.params[0].dtype(), current_stream());
}

void CudaBackend::adamw_step(const MultiTensorAdamW& a) {
  if (a.params.empty()) return;
  const int device = lists_device("adamw_step", a.params,
                                  {&a.grads, &a.exp_avg, &a.exp_avg_sq, &a.max_exp_avg_sq}, true);
  CHECK(a.lr.size() == a.params.size() && a.weight_decay.size() == a.params.size() &&
        a.step.size() == a.params.size() && a.exp_avg.size() == a.params.size() &&
        a.exp_avg_sq.size() == a.params.size())
      << "adamw_step: per-tensor lists of the wrong length";
  CHECK_EQ(a.max_exp_avg_sq.empty(), !a.amsgrad) << "adamw_step: max_exp_avg_sq";
  DeviceGuard guard(device);
  std::vector<AdamWTensor> records;
  for (size_t k = 0; k < a.params.size(); ++k)
    records.push_back({a.params[k].data_ptr(), a.grads[k].data_ptr(), a.exp_avg[k].data_ptr(),
                       a.exp_avg_sq[k].data_ptr(), ptr_or_null(a.max_exp_avg_sq, k),
                       a.params[k].numel(),
                       optim::adamw_scalars<double>(a.lr[k], a.beta1, a.beta2, a.eps,
                                                    a.weight_decay[k], a.amsgrad, a.step[k])});
  Tables<AdamWTensor> t = upload(records, numels_of(a.params), device);
  launch_adamw_step(t.tensors, t.chunks, t.num_chunks, a.params[0].dtype(), current_stream());
}

namespace {

// Calls fn(tables, dtype) once per dtype present in grads (usually one).
template <class Fn>
void for_each_dtype_tables(const TensorList& grads, int device, Fn&& fn) {
  std::vector<DType> dtypes;
  for (const Tensor& g : grads)
    if (std::find(dtypes.begin(), dtypes.end(), g.dtype()) == dtypes.end())
      dtypes.push_back(g.dtype());
  for (DType t : dtypes) {
    std::vector<GradTensor> records;
    std::vector<int64_t> numels;
    for (const Tensor& g : grads)
      if (g.dtype() == t) {
        records.push_back({g.data_ptr(), g.numel()});
        numels.push_back(g.numel());
      }
    fn(upload(records, numels, device), t);
  }
}

}  // namespace

bool CudaBackend::unscale_grads(const TensorList& grads, double inv_scale) {
  if (grads.empty()) return false;
  const int device = lists_device("unscale_grads", grads, {}, false);
  DeviceGuard guard(device);
  Tensor found = zeros({1}, DType::i32, Device{kCUDA, device});
  for_each_dtype_tables(grads, device, [&](const Tables<GradTensor>& t, DType dtype) {
    launch_unscale_grads(t.tensors, t.chunks, t.num_chunks, dtype, inv_scale,
                         static_cast<int32_t*>(found.data_ptr()), current_stream());
  });
  return found.item<int32_t>() != 0;
}

double CudaBackend::grads_power_sum(const TensorList& grads, double p) {
  if (grads.empty()) return 0;
  const int device = lists_device("grads_power_sum", grads, {}, false);
  DeviceGuard guard(device);
  const bool is_max = std::isinf(p);
  double total = 0;
  for_each_dtype_tables(grads, device, [&](const Tables<GradTensor>& t, DType dtype) {
    Tensor partial = empty({t.num_chunks}, DType::f64, Device{kCUDA, device});
    launch_grad_power_sums(t.tensors, t.chunks, t.num_chunks, dtype, p,
                           static_cast<double*>(partial.data_ptr()), current_stream());
    // Chunks in order: the sum depends on the sizes alone.
    for (double v : partial.to_vector<double>())
      total = is_max ? ((v > total || std::isnan(v)) ? v : total) : total + v;
  });
  return total;
}

}  // namespace trainer::cuda
