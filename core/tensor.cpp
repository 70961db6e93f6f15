#include "core/tensor.h"

#include <cstring>

#include <algorithm>
#include <iomanip>
#include <numeric>
#include <optional>
#include <sstream>

#include "core/autograd.h"
#include "core/backend.h"
#include "core/ops.h"

namespace trainer {

std::string shape_str(const Shape& s) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < s.size(); ++i) out << (i ? ", " : "") << s[i];
  out << "]";
  return out.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& s) {
  Shape strides(s.size());
  int64_t st = 1;
  for (int i = int(s.size()) - 1; i >= 0; --i) {
    strides[i] = st;
    st *= std::max<int64_t>(s[i], 1);
  }
  return strides;
}

// ---- metadata ----

const Shape& Tensor::shape() const { return impl_->shape; }
const Shape& Tensor::strides() const { return impl_->strides; }
int Tensor::dim() const { return int(impl_->shape.size()); }
int64_t Tensor::numel() const { return shape_numel(impl_->shape); }
int64_t Tensor::offset() const { return impl_->offset; }
DType Tensor::dtype() const { return impl_->dtype; }
Device Tensor::device() const { return impl_->device; }
const std::shared_ptr<Storage>& Tensor::storage() const { return impl_->storage; }

int Tensor::wrap_dim(int d) const {
  int n = dim();
  int w = d < 0 ? d + n : d;
  CHECK(w >= 0 && w < std::max(n, 1))
      << "dim " << d << " out of range for a tensor of shape " << shape_str();
  return w;
}
int64_t Tensor::size(int d) const { return impl_->shape[wrap_dim(d)]; }
int64_t Tensor::stride(int d) const { return impl_->strides[wrap_dim(d)]; }

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // no element to misplace
  int64_t expected = 1;
  for (int i = dim() - 1; i >= 0; --i) {
    if (impl_->shape[i] == 1) continue;
    if (impl_->strides[i] != expected) return false;
    expected *= impl_->shape[i];
  }
  return true;
}

void* Tensor::data_ptr() const {
  CHECK(defined()) << "data_ptr() of an undefined tensor";
  CHECK(!is_deferred(*this))
      << "reading a deferred tensor " << shape_str()
      << " (built under DeferredInit: another pipeline stage's weight) before materialize()";
  return static_cast<char*>(impl_->storage->data.get()) + impl_->offset * dtype_size(impl_->dtype);
}

// ---- factories ----

namespace {

// A contiguous tensor over a new storage of shape's bytes, whose memory
// attach(storage) provides.
template <class Attach>
Tensor contiguous_tensor(const Shape& shape, DType dtype, Device device, Attach&& attach) {
  for (int64_t d : shape) CHECK_GE(d, 0) << "negative size in shape " << shape_str(shape);
  auto storage = std::make_shared<Storage>();
  storage->bytes = size_t(shape_numel(shape)) * dtype_size(dtype);
  storage->device = device;
  attach(*storage);
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  impl->device = device;
  return Tensor(std::move(impl));
}

// Whether this thread is inside a DeferredInit.
thread_local bool deferring = false;

}  // namespace

Tensor empty(const Shape& shape, DType dtype, Device device) {
  return contiguous_tensor(shape, dtype, device, [&](Storage& storage) {
    // Nothing to defer in an empty tensor.
    if (deferring && storage.bytes > 0)
      storage.deferred = std::make_shared<std::vector<std::function<void(const Tensor&)>>>();
    else
      storage.data = allocator(device).allocate(storage.bytes);
  });
}

DeferredInit::DeferredInit() : previous_(deferring) { deferring = true; }
DeferredInit::~DeferredInit() { deferring = previous_; }
bool DeferredInit::active() { return deferring; }

bool is_deferred(const Tensor& t) {
  return t.defined() && t.impl()->storage->deferred && !t.impl()->storage->data;
}

namespace {

void check_whole_storage(const Tensor& t, const char* what) {
  CHECK(t.offset() == 0 && t.is_contiguous() &&
        size_t(t.numel()) * dtype_size(t.dtype()) == t.impl()->storage->bytes)
      << what << " of a view " << t.shape_str() << " of a deferred tensor; only whole ones";
}

void check_whole(const Tensor& t, const char* what) {
  CHECK(is_deferred(t)) << what << " of a tensor that is not deferred";
  check_whole_storage(t, what);
}

// Deferral off while a record replays (its fills make temporaries).
struct NotDeferring {
  bool was = deferring;
  NotDeferring() { deferring = false; }
  ~NotDeferring() { deferring = was; }
};

void replay(const Tensor& t, const std::vector<std::function<void(const Tensor&)>>& record) {
  NotDeferring off;
  for (const auto& fill : record) fill(t);
}

}  // namespace

void defer_fill(const Tensor& t, std::function<void(const Tensor&)> fill) {
  check_whole(t, "defer_fill");
  t.impl()->storage->deferred->push_back(std::move(fill));
}

Tensor deferred_tensor(const Shape& shape, DType dtype, Device device,
                       std::function<void(const Tensor&)> fill) {
  Tensor t = contiguous_tensor(shape, dtype, device, [](Storage& storage) {
    storage.deferred = std::make_shared<std::vector<std::function<void(const Tensor&)>>>();
  });
  t.impl()->storage->deferred->push_back(std::move(fill));
  return t;
}

void materialize(const Tensor& t) {
  if (!is_deferred(t)) return;
  check_whole(t, "materialize");
  Storage& storage = *t.impl()->storage;
  storage.data = allocator(storage.device).allocate(storage.bytes);
  replay(t, *storage.deferred);
}

void unmaterialize(const Tensor& t) {
  CHECK(t.defined() && t.impl()->storage->deferred)
      << "unmaterialize of a tensor that was not built deferred";
  check_whole_storage(t, "unmaterialize");
  t.impl()->storage->data.reset();
}

Tensor value_of(const Tensor& t) {
  if (!is_deferred(t)) return t.clone();
  check_whole(t, "value_of");
  Tensor out;
  {
    NotDeferring off;
    out = empty(t.shape(), t.dtype(), t.device());
  }
  replay(out, *t.impl()->storage->deferred);
  return out;
}

void move_deferred(const Tensor& t, Device device) {
  check_whole(t, "move_deferred");
  if (t.device() == device) return;
  Tensor here = deferred_tensor(t.shape(), t.dtype(), t.device(), [](const Tensor&) {});
  here.impl()->storage->deferred = t.impl()->storage->deferred;
  auto moved = std::make_shared<Storage>();
  moved->bytes = t.impl()->storage->bytes;
  moved->device = device;
  moved->deferred = std::make_shared<std::vector<std::function<void(const Tensor&)>>>();
  moved->deferred->push_back([here](const Tensor& out) {
    Tensor whole = out;
    whole.copy_(value_of(here));
  });
  t.impl()->storage = std::move(moved);
  t.impl()->device = device;
}

Tensor from_external(void* data, const Shape& shape, DType dtype, Device device,
                     std::shared_ptr<void> owner) {
  return contiguous_tensor(shape, dtype, device, [&](Storage& storage) {
    storage.data = DataPtr(data, BlockDeleter{nullptr, storage.bytes});
    storage.owner = std::move(owner);
  });
}

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}
Tensor zeros(const Shape& shape, DType dtype, Device device) {
  return full(shape, 0.0, dtype, device);
}
Tensor ones(const Shape& shape, DType dtype, Device device) {
  return full(shape, 1.0, dtype, device);
}
Tensor empty_like(const Tensor& t) { return empty(t.shape(), t.dtype(), t.device()); }

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  Tensor ca = a.to(Device{}).contiguous(), cb = b.to(Device{}).contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

void release_storage(const Tensor& t) {
  CHECK(t.defined()) << "release_storage of an undefined tensor";
  auto none = std::make_shared<Storage>();
  none->device = t.device();
  t.impl()->storage = std::move(none);
  t.impl()->offset = 0;
}

void reallocate_storage(const Tensor& t) {
  CHECK(t.defined()) << "reallocate_storage of an undefined tensor";
  Tensor fresh = empty_like(t);
  t.impl()->storage = fresh.impl()->storage;
  t.impl()->strides = fresh.strides();
  t.impl()->offset = 0;
}
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), t.dtype(), t.device()); }
Tensor scalar_tensor(double value, DType dtype, Device device) {
  return full({}, value, dtype, device);
}

Tensor arange(int64_t n, DType dtype, Device device) {
  Tensor t = empty({n}, dtype, Device{});
  dispatch_all(dtype, "arange", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = t.data<T>();
    for (int64_t i = 0; i < n; ++i) p[i] = store_as<T>(acc_t<T>(i));
  });
  return device.is_cpu() ? t : t.to(device);
}

template <class T>
Tensor from_vector(const std::vector<T>& values, Shape shape) {
  if (shape.empty()) shape = {int64_t(values.size())};
  CHECK_EQ(shape_numel(shape), int64_t(values.size())) << "from_vector: shape " << shape_str(shape);
  Tensor t = empty(shape, dtype_of<T>());
  T* p = t.data<T>();
  for (size_t i = 0; i < values.size(); ++i) p[i] = values[i];
  return t;
}
template Tensor from_vector(const std::vector<float>&, Shape);
template Tensor from_vector(const std::vector<double>&, Shape);
template Tensor from_vector(const std::vector<int32_t>&, Shape);
template Tensor from_vector(const std::vector<int64_t>&, Shape);
template Tensor from_vector(const std::vector<uint8_t>&, Shape);
template Tensor from_vector(const std::vector<bool>&, Shape);
template Tensor from_vector(const std::vector<bf16>&, Shape);
template Tensor from_vector(const std::vector<f16>&, Shape);

Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.storage();
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = base.dtype();
  impl->device = base.device();
  return Tensor(std::move(impl));
}

// ---- views ----

namespace {

// The strides of x viewed as shape, if its memory allows (PyTorch's rule:
// each group of merged/split dims must be contiguous within itself).
std::optional<Shape> view_strides(const Tensor& x, const Shape& shape) {
  if (x.is_contiguous()) return contiguous_strides(shape);  // includes every empty tensor
  const Shape& old_shape = x.shape();
  const Shape& old_strides = x.strides();
  Shape strides(shape.size());
  int view_d = int(shape.size()) - 1;
  int64_t chunk_base_stride = old_strides.empty() ? 1 : old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int d = int(old_shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= old_shape[d];
    if (d == 0 ||
        (old_shape[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base_stride = old_strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return strides;
}

Shape infer_shape(Shape shape, int64_t numel, const Tensor& x) {
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      CHECK_EQ(infer, -1) << "reshape: only one dim may be -1";
      infer = int(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    CHECK(known > 0 && numel % known == 0)
        << "cannot reshape " << x.shape_str() << " to " << shape_str(shape);
    shape[infer] = numel / known;
  }
  CHECK_EQ(shape_numel(shape), numel)
      << "cannot reshape " << x.shape_str() << " to " << shape_str(shape);
  return shape;
}

// View ops: forward builds a view sharing storage; backward maps the gradient back.
struct ViewOp {
  struct Saved {
    Shape input_shape;
  };
  static constexpr const char* name = "view";
  static Tensor forward(Saved& s, const Tensor& x, const Shape& shape) {
    s.input_shape = x.shape();
    std::optional<Shape> strides = view_strides(x, shape);
    CHECK(strides) << "view: shape " << shape_str(shape) << " is incompatible with the strides of "
                   << x.shape_str() << "; use reshape()";
    return make_view(x, shape, *strides, x.offset());
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask&) {
    return {g[0].reshape(s.input_shape)};
  }
};

struct PermuteOp {
  struct Saved {
    std::vector<int> dims;
  };
  static constexpr const char* name = "permute";
  static Tensor forward(Saved& s, const Tensor& x, const std::vector<int>& dims) {
    CHECK_EQ(int(dims.size()), x.dim())
        << "permute: " << dims.size() << " dims for " << x.shape_str();
    std::vector<bool> seen(dims.size());
    Shape shape(dims.size()), strides(dims.size());
    for (size_t i = 0; i < dims.size(); ++i) {
      int d = x.wrap_dim(dims[i]);
      CHECK(!seen[d]) << "permute: repeated dim " << d;
      seen[d] = true;
      shape[i] = x.shape()[d];
      strides[i] = x.strides()[d];
      s.dims.push_back(d);
    }
    return make_view(x, shape, strides, x.offset());
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask&) {
    std::vector<int> inverse(s.dims.size());
    for (size_t i = 0; i < s.dims.size(); ++i) inverse[s.dims[i]] = int(i);
    return {g[0].permute(inverse)};
  }
};

struct SliceOp {
  struct Saved {
    Shape input_shape;
    int dim;
    int64_t start, end, step;
  };
  static constexpr const char* name = "slice";
  static Tensor forward(Saved& s, const Tensor& x, int dim, int64_t start, int64_t end,
                        int64_t step) {
    int d = x.wrap_dim(dim);
    int64_t n = x.shape()[d];
    CHECK(step > 0) << "slice: step must be positive, got " << step;
    if (start < 0) start += n;
    if (end < 0) end += n;
    start = std::clamp<int64_t>(start, 0, n);
    end = std::clamp<int64_t>(end, start, n);
    s = Saved{x.shape(), d, start, end, step};
    Shape shape = x.shape(), strides = x.strides();
    shape[d] = (end - start + step - 1) / step;
    strides[d] *= step;
    return make_view(x, shape, strides, x.offset() + start * x.strides()[d]);
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask&) {
    Tensor grad = zeros(s.input_shape, g[0].dtype(), g[0].device());
    grad.slice(s.dim, s.start, s.end, s.step).copy_(g[0]);
    return {grad};
  }
};

struct ExpandOp {
  struct Saved {
    Shape input_shape;
  };
  static constexpr const char* name = "expand";
  static Tensor forward(Saved& s, const Tensor& x, const Shape& shape) {
    s.input_shape = x.shape();
    CHECK_GE(shape.size(), size_t(x.dim()))
        << "expand: " << x.shape_str() << " to " << shape_str(shape);
    size_t lead = shape.size() - size_t(x.dim());
    Shape out_shape(shape.size()), strides(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) {
      if (i < lead) {
        CHECK_GE(shape[i], 0) << "expand: -1 in a new leading dim";
        out_shape[i] = shape[i];
        strides[i] = 0;
        continue;
      }
      int64_t in = x.shape()[i - lead];
      int64_t want = shape[i] == -1 ? in : shape[i];
      CHECK(in == want || in == 1)
          << "expand: cannot expand " << x.shape_str() << " to " << shape_str(shape);
      out_shape[i] = want;
      strides[i] = in == want ? x.strides()[i - lead] : 0;
    }
    return make_view(x, out_shape, strides, x.offset());
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask&) {
    return {sum_to(g[0], s.input_shape)};
  }
};

struct CopyOp {  // contiguous() and clone()
  struct Saved {};
  static constexpr const char* name = "copy";
  static Tensor forward(Saved&, const Tensor& x) {
    Tensor out = empty(x.shape(), x.dtype(), x.device());
    backend(x.device()).copy(x, out);
    return out;
  }
  static TensorList backward(Saved&, const TensorList& g, const autograd::GradMask&) {
    return {g[0]};
  }
};

struct ToDTypeOp {
  struct Saved {
    DType input_dtype;
  };
  static constexpr const char* name = "to_dtype";
  static Tensor forward(Saved& s, const Tensor& x, DType dtype) {
    s.input_dtype = x.dtype();
    Tensor out = empty(x.shape(), dtype, x.device());
    backend(x.device()).copy(x, out);
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask&) {
    return {g[0].to(s.input_dtype)};
  }
};

struct ToDeviceOp {
  struct Saved {
    Device input_device;
  };
  static constexpr const char* name = "to_device";
  static Tensor forward(Saved& s, const Tensor& x, Device device) {
    s.input_device = x.device();
    Tensor out = empty(x.shape(), x.dtype(), device);
    out.copy_(x);
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask&) {
    return {g[0].to(s.input_device)};
  }
};

}  // namespace

Tensor Tensor::view(Shape shape) const {
  return autograd::apply<ViewOp>(*this, infer_shape(std::move(shape), numel(), *this));
}

Tensor Tensor::reshape(Shape shape) const {
  Shape s = infer_shape(std::move(shape), numel(), *this);
  if (view_strides(*this, s)) return autograd::apply<ViewOp>(*this, s);
  return contiguous().view(s);
}

Tensor Tensor::flatten(int start_dim, int end_dim) const {
  if (dim() == 0) return reshape({1});
  int a = wrap_dim(start_dim), b = wrap_dim(end_dim);
  Shape s(shape().begin(), shape().begin() + a);
  int64_t merged = 1;
  for (int i = a; i <= b; ++i) merged *= shape()[i];
  s.push_back(merged);
  s.insert(s.end(), shape().begin() + b + 1, shape().end());
  return reshape(s);
}

Tensor Tensor::permute(std::vector<int> dims) const {
  return autograd::apply<PermuteOp>(*this, dims);
}

Tensor Tensor::transpose(int a, int b) const {
  std::vector<int> dims(dim());
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[wrap_dim(a)], dims[wrap_dim(b)]);
  return permute(dims);
}

Tensor Tensor::slice(int d, int64_t start, int64_t end, int64_t step) const {
  return autograd::apply<SliceOp>(*this, d, start, end, step);
}

Tensor Tensor::select(int d, int64_t index) const {
  int w = wrap_dim(d);
  int64_t n = shape()[w];
  if (index < 0) index += n;
  CHECK(index >= 0 && index < n) << "select: index " << index << " out of range for dim " << w
                                 << " of size " << n;
  return slice(w, index, index + 1).squeeze(w);
}

Tensor Tensor::expand(Shape s) const { return autograd::apply<ExpandOp>(*this, s); }

Tensor Tensor::squeeze(int d) const {
  int w = wrap_dim(d);
  if (shape()[w] != 1) return *this;
  Shape s = shape();
  s.erase(s.begin() + w);
  return reshape(s);
}

Tensor Tensor::unsqueeze(int d) const {
  int n = dim() + 1;
  int w = d < 0 ? d + n : d;
  CHECK(w >= 0 && w < n) << "unsqueeze: dim " << d << " out of range for " << shape_str();
  Shape s = shape();
  s.insert(s.begin() + w, 1);
  return reshape(s);
}

// ---- copies ----

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }
Tensor Tensor::clone() const { return autograd::apply<CopyOp>(*this); }
Tensor Tensor::to(DType t) const {
  return t == dtype() ? *this : autograd::apply<ToDTypeOp>(*this, t);
}
Tensor Tensor::to(Device d) const {
  return d == device() ? *this : autograd::apply<ToDeviceOp>(*this, d);
}

Tensor& Tensor::fill_(double value) {
  if (is_deferred(*this)) {
    defer_fill(*this, [value](const Tensor& t) {
      Tensor whole = t;
      whole.fill_(value);
    });
    return *this;
  }
  backend(device()).fill(*this, value);
  return *this;
}

Tensor& Tensor::copy_(const Tensor& src) {
  autograd::NoGradGuard no_grad;
  Tensor s = src.shape() == shape() ? src : src.expand(shape());
  if (s.device() == device()) {
    backend(device()).copy(s, *this);
  } else {
    // Convert on the source side, then move the bytes.
    Tensor converted = s.dtype() == dtype() ? s : s.to(dtype());
    Device accel = device().is_cpu() ? s.device() : device();
    backend(accel).copy_across(converted, *this);
  }
  return *this;
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  Tensor c = device().is_cpu() ? contiguous() : to(Device{}).contiguous();
  std::vector<T> out(size_t(c.numel()));
  dispatch_all(c.dtype(), "to_vector", [&](auto tag) {
    using S = typename decltype(tag)::type;
    const S* p = static_cast<const S*>(c.data_ptr());
    for (size_t i = 0; i < out.size(); ++i) {
      if constexpr (std::is_same_v<S, bf16> || std::is_same_v<S, f16>)
        out[i] = static_cast<T>(to_float(p[i]));
      else
        out[i] = static_cast<T>(p[i]);
    }
  });
  return out;
}

template <class T>
T Tensor::item() const {
  CHECK_EQ(numel(), 1) << "item() on a tensor of shape " << shape_str();
  return to_vector<T>()[0];
}

template std::vector<float> Tensor::to_vector() const;
template std::vector<double> Tensor::to_vector() const;
template std::vector<int32_t> Tensor::to_vector() const;
template std::vector<int64_t> Tensor::to_vector() const;
template std::vector<uint8_t> Tensor::to_vector() const;
template float Tensor::item() const;
template double Tensor::item() const;
template int32_t Tensor::item() const;
template int64_t Tensor::item() const;
template bool Tensor::item() const;

// ---- autograd ----

bool Tensor::requires_grad() const { return impl_->autograd && impl_->autograd->requires_grad; }

Tensor& Tensor::requires_grad_(bool value) {
  CHECK(is_leaf()) << "requires_grad_() on a non-leaf tensor; detach() it first";
  CHECK(!value || is_floating(dtype()))
      << "only floating tensors can require grad, not " << dtype_name(dtype());
  impl_->meta().requires_grad = value;
  return *this;
}

bool Tensor::is_leaf() const { return !impl_->autograd || !impl_->autograd->grad_fn; }

Tensor Tensor::grad() const { return impl_->autograd ? impl_->autograd->grad : Tensor(); }

void Tensor::set_grad(const Tensor& g) const { impl_->meta().grad = g; }

void Tensor::set_grad_destination(const Tensor& dest) const {
  CHECK(is_leaf() && requires_grad()) << "set_grad_destination() is for leaves that require grad";
  CHECK(!dest.defined() || (dest.shape() == shape() && dest.dtype() == dtype() &&
                            dest.device() == device() && dest.is_contiguous()))
      << "set_grad_destination: " << dest.str() << " for a leaf " << str()
      << "; the destination must be contiguous, of the leaf's shape, dtype and device";
  impl_->meta().grad_destination = dest.defined() ? dest.detach() : Tensor();
}

Tensor Tensor::grad_destination() const {
  return impl_->autograd ? impl_->autograd->grad_destination : Tensor();
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<autograd::Node> none;
  return impl_->autograd ? impl_->autograd->grad_fn : none;
}

uint32_t Tensor::output_nr() const { return impl_->autograd ? impl_->autograd->output_nr : 0; }

Tensor Tensor::detach() const { return make_view(*this, shape(), strides(), offset()); }

void Tensor::backward(const Tensor& grad, bool retain_graph) const {
  Tensor g = grad;
  if (!g.defined()) {
    CHECK_EQ(numel(), 1) << "backward() without a gradient needs a scalar output, got shape "
                         << shape_str() << "; pass backward(grad)";
    g = ones(shape(), dtype(), device());
  }
  CHECK(g.shape() == shape()) << "backward: gradient shape " << g.shape_str()
                              << " differs from the output shape " << shape_str();
  autograd::run_backward({*this}, {g}, retain_graph);
}

void Tensor::register_hook(GradHook hook) const {
  CHECK(is_leaf() && requires_grad()) << "register_hook() is for leaves that require grad";
  impl_->meta().hooks.push_back(std::move(hook));
}

// ---- printing ----

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  std::ostringstream out;
  out << "Tensor(shape=" << shape_str() << ", dtype=" << dtype_name(dtype())
      << ", device=" << device();
  if (requires_grad()) out << ", requires_grad";
  out << ")";
  constexpr int64_t kMaxPrinted = 64;
  std::vector<double> v = to_vector<double>();
  out << "\n[";
  for (int64_t i = 0; i < int64_t(v.size()) && i < kMaxPrinted; ++i) {
    if (i) out << (dim() > 0 && i % shape().back() == 0 ? ",\n " : ", ");
    out << std::setprecision(6) << v[i];
  }
  if (int64_t(v.size()) > kMaxPrinted) out << ", ... (" << v.size() << " elements)";
  out << "]";
  return out.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

}  // namespace trainer
