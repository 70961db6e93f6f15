// Tensor: a strided view of shared storage, with autograd metadata.
//
// A Tensor is a handle: copying it shares the same tensor, as in PyTorch.
// Views (reshape of contiguous data, permute, transpose, slice, expand,
// squeeze, unsqueeze) share storage and are differentiable; contiguous(),
// clone() and to() copy. Shapes follow PyTorch: negative dims count from the
// end, a 0-dim tensor is a scalar.
//
//   Tensor x = randn({4, 3}, gen).requires_grad_();
//   Tensor y = (x * 2.0).sum();
//   y.backward();            // x.grad() == 2
//
// Glossary: shape = sizes per dim; strides in elements; offset in elements
// from the start of storage; numel = product of the shape.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/check.h"
#include "core/device.h"
#include "core/dtype.h"

namespace trainer {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);
Shape contiguous_strides(const Shape& s);

namespace autograd {
class Node;
}

class Tensor;
using TensorList = std::vector<Tensor>;
using GradHook = std::function<void(const Tensor&)>;

class Tensor;

struct Storage {
  DataPtr data;  // null allocator: external memory, not freed here
  size_t bytes = 0;
  Device device;
  std::shared_ptr<void> owner;  // keeps external memory alive (from_external)
  // Built deferred (see DeferredInit below): the fills that give its tensor
  // its value, in order; deferred while data is null. Null: an ordinary storage.
  std::shared_ptr<std::vector<std::function<void(const Tensor&)>>> deferred;
};

struct TensorImpl;

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

  // ---- metadata ----
  const Shape& shape() const;
  const Shape& strides() const;
  int64_t size(int dim) const;
  int64_t stride(int dim) const;
  int dim() const;
  int64_t numel() const;
  int64_t offset() const;
  DType dtype() const;
  Device device() const;
  bool is_contiguous() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype()); }
  const std::shared_ptr<Storage>& storage() const;
  // Wraps a negative dim and checks the range.
  int wrap_dim(int dim) const;

  // ---- data access (CPU tensors) ----
  void* data_ptr() const;  // address of element 0
  template <class T>
  T* data() const {
    CHECK(dtype() == dtype_of<T>())
        << "data<" << dtype_name(dtype_of<T>()) << ">() on a " << dtype_name(dtype()) << " tensor";
    return static_cast<T*>(data_ptr());
  }
  // The single element of a one-element tensor, converted to T (copies from the device).
  template <class T>
  T item() const;
  // All elements, row-major, converted to T (copies from the device).
  template <class T>
  std::vector<T> to_vector() const;

  // ---- views (differentiable, share storage) ----
  Tensor reshape(Shape shape) const;  // a view when the strides allow, else a copy
  Tensor view(Shape shape) const;     // must be viewable
  Tensor flatten(int start_dim = 0, int end_dim = -1) const;
  Tensor permute(std::vector<int> dims) const;
  Tensor transpose(int a, int b) const;
  Tensor t() const { return transpose(0, 1); }
  Tensor slice(int dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int dim, int64_t index) const;  // slice + squeeze
  Tensor narrow(int dim, int64_t start, int64_t length) const {
    return slice(dim, start, start + length);
  }
  Tensor expand(Shape shape) const;  // -1 keeps a size
  Tensor squeeze(int dim) const;
  Tensor unsqueeze(int dim) const;

  // ---- copies (differentiable) ----
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor to(DType dtype) const;
  Tensor to(Device device) const;

  // ---- in place (not recorded by autograd) ----
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }
  Tensor& copy_(const Tensor& src);  // broadcasts src, converts dtype, crosses devices

  // ---- autograd ----
  bool requires_grad() const;
  // Marks a leaf as needing a gradient (parameters).
  Tensor& requires_grad_(bool value = true);
  bool is_leaf() const;
  Tensor grad() const;
  void set_grad(const Tensor& grad) const;
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  uint32_t output_nr() const;
  // A tensor sharing storage, cut from the graph.
  Tensor detach() const;
  // backward() on a scalar; backward(grad) on any tensor (grad has its shape).
  void backward(const Tensor& grad = Tensor(), bool retain_graph = false) const;
  // Fired when this leaf's gradient is final for a backward pass (after
  // accumulation into grad()); data parallelism starts its allreduce here.
  void register_hook(GradHook hook) const;
  // Where this leaf's gradient lands when backward finds it without one:
  // grad() becomes dest (a contiguous tensor of the leaf's shape, dtype and
  // device), which the ops that make parameter gradients (conv2d, linear)
  // write straight into (autograd::grad_buffer) and any other gradient is
  // copied into. Later passes before zero_grad accumulate there as usual.
  // Data parallelism points each parameter at its slice of a bucket, so the
  // gradient is in the bucket with no copy. An undefined dest clears it.
  void set_grad_destination(const Tensor& dest) const;
  Tensor grad_destination() const;

  std::string str() const;
  std::string shape_str() const { return trainer::shape_str(shape()); }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// A tensor with its global name ("layer1.0.conv1.weight"): parameters,
// buffers, optimizer state, checkpoint entries.
struct NamedTensor {
  std::string name;
  Tensor tensor;
};

struct AutogradMeta {
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<autograd::Node> grad_fn;
  uint32_t output_nr = 0;
  std::weak_ptr<autograd::Node> grad_accumulator;  // leaves only
  std::vector<GradHook> hooks;
  Tensor grad_destination;  // leaves only: see Tensor::set_grad_destination
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Shape strides;
  int64_t offset = 0;
  DType dtype = DType::f32;
  Device device;
  std::unique_ptr<AutogradMeta> autograd;

  AutogradMeta& meta() {
    if (!autograd) autograd = std::make_unique<AutogradMeta>();
    return *autograd;
  }
};

// ---- memory of a tensor held for its shape only ----
// A pipeline stage keeps the other stages' weights as shapes between
// evaluations: release_storage frees t's memory (every handle on t sees the
// change; its shape, dtype and device stay; reading it before
// reallocate_storage is undefined), reallocate_storage gives it fresh,
// uninitialised contiguous memory of its shape.
void release_storage(const Tensor& t);
void reallocate_storage(const Tensor& t);

// Whether a and b have the same shape, dtype and bytes (on any devices).
bool same_bits(const Tensor& a, const Tensor& b);

// ---- deferred initialisation ----
// A pipeline stage builds the model's structure whole but gives memory only
// to its own blocks, as torchdistx's deferred_init does. While a
// DeferredInit lives on this thread, empty/zeros/ones/full return tensors
// without memory that record how they are filled: fill_, the initialisers of
// layers/init.h (which take the generator's Philox offset and advance it as
// the draw would) and derived tensors (shard_of, a device move).
// materialize(t) then gives t its memory and replays the record: the same
// bits as building it at once. Reading a deferred tensor any other way
// fails a CHECK that says so.
//
//   { DeferredInit deferred; model = make_model(...); }  // shapes, no weights
//   for (const NamedTensor& t : my_stage.state()) materialize(t.tensor);
class DeferredInit {
 public:
  DeferredInit();
  ~DeferredInit();
  DeferredInit(const DeferredInit&) = delete;
  DeferredInit& operator=(const DeferredInit&) = delete;
  static bool active();

 private:
  bool previous_;
};
bool is_deferred(const Tensor& t);
// Appends a fill to deferred t's record; t must be its storage's whole,
// contiguous tensor (a parameter as its layer made it).
void defer_fill(const Tensor& t, std::function<void(const Tensor&)> fill);
// A deferred tensor whose value fill writes when it is materialised
// (fill may read other deferred tensors through value_of).
Tensor deferred_tensor(const Shape& shape, DType dtype, Device device,
                       std::function<void(const Tensor&)> fill);
// Gives deferred t memory and its recorded value; nothing for other tensors.
void materialize(const Tensor& t);
// Frees the memory of a tensor built deferred (materialised or not): it is
// deferred again, its value the recorded one (a profile's passing block).
void unmaterialize(const Tensor& t);
// The value deferred (or ordinary) t would have: a new tensor, t unchanged.
Tensor value_of(const Tensor& t);
// Moves deferred t to device: its value is made where it was, then copied.
void move_deferred(const Tensor& t, Device device);

// ---- factories ----
Tensor empty(const Shape& shape, DType dtype = DType::f32, Device device = {});
Tensor zeros(const Shape& shape, DType dtype = DType::f32, Device device = {});
Tensor ones(const Shape& shape, DType dtype = DType::f32, Device device = {});
Tensor full(const Shape& shape, double value, DType dtype = DType::f32, Device device = {});
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor scalar_tensor(double value, DType dtype = DType::f32, Device device = {});
// 0, 1, ..., n-1.
Tensor arange(int64_t n, DType dtype = DType::i64, Device device = {});
// A CPU tensor holding a copy of values, in the given shape (default: 1-d;
// pass a shape of {} explicitly via reshape({}) for a scalar).
template <class T>
Tensor from_vector(const std::vector<T>& values, Shape shape = {});
// A contiguous tensor over memory this library did not allocate (a mapping
// shared with other processes, a caller's device buffer): owner keeps it
// alive for as long as any tensor or view uses it (null: the caller does);
// nothing is freed through the allocator.
Tensor from_external(void* data, const Shape& shape, DType dtype, Device device,
                     std::shared_ptr<void> owner);
// A tensor that shares a storage with new shape/strides/offset (no autograd).
Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset);

}  // namespace trainer
