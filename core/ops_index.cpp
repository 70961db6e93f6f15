// Joining, splitting and indexing ops: forward and backward side by side.
//
// concat copies its inputs into one tensor; stack is concat of unsqueezed
// inputs; split returns views (slices), so it has no backward of its own.
// index_select, gather and embedding read through an index tensor (i32 or
// i64); their backwards add the gradient back at the same indices
// (index_add / scatter_add into zeros), so repeated indices accumulate.
// Index values are range-checked by the kernels, which name the index and
// the bound.
#include "core/ops.h"

namespace trainer {

using autograd::GradMask;

namespace {

void check_index_tensor(const char* op, const Tensor& x, const Tensor& index) {
  CHECK(index.defined()) << op << ": undefined index";
  CHECK(index.dtype() == DType::i32 || index.dtype() == DType::i64)
      << op << ": index must be i32 or i64, got " << index.dtype() << " of shape "
      << index.shape_str();
  CHECK(index.device() == x.device())
      << op << ": input on " << x.device() << ", index on " << index.device();
}

// out = [inputs[0], inputs[1], ...] along dim.
// Backward: input k receives the slice of grad at its own rows,
// grad.slice(dim, offset_k, offset_k + size_k).
struct ConcatFn {
  struct Saved {
    int dim;
    std::vector<int64_t> sizes;
  };
  static constexpr const char* name = "concat";
  static Tensor forward(Saved& s, const TensorList& inputs, int dim) {
    CHECK(!inputs.empty()) << "concat: no inputs";
    for (const Tensor& t : inputs) CHECK(t.defined()) << "concat: undefined input";
    const Tensor& first = inputs[0];
    CHECK_GE(first.dim(), 1) << "concat: input 0 is a scalar; unsqueeze it or use stack";
    int d = first.wrap_dim(dim);
    Shape shape = first.shape();
    shape[d] = 0;
    s.dim = d;
    for (size_t k = 0; k < inputs.size(); ++k) {
      const Tensor& t = inputs[k];
      CHECK(t.dim() == first.dim()) << "concat: input " << k << " has shape " << t.shape_str()
                                    << ", input 0 has " << first.shape_str() << " (ranks differ)";
      CHECK(t.dtype() == first.dtype())
          << "concat: input " << k << " is " << t.dtype() << ", input 0 is " << first.dtype();
      CHECK(t.device() == first.device())
          << "concat: input " << k << " on " << t.device() << ", input 0 on " << first.device();
      for (int i = 0; i < t.dim(); ++i)
        CHECK(i == d || t.shape()[i] == first.shape()[i])
            << "concat along dim " << d << ": input " << k << " has shape " << t.shape_str()
            << ", input 0 has " << first.shape_str();
      shape[d] += t.shape()[d];
      s.sizes.push_back(t.shape()[d]);
    }
    Tensor out = empty(shape, first.dtype(), first.device());
    backend(first.device()).concat(inputs, d, out);
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask& needs) {
    TensorList grads(s.sizes.size());
    int64_t offset = 0;
    for (size_t k = 0; k < s.sizes.size(); ++k) {
      if (needs[k]) grads[k] = g[0].slice(s.dim, offset, offset + s.sizes[k]);
      offset += s.sizes[k];
    }
    return grads;
  }
};

// out[..., j, ...] = x[..., index[j], ...] along dim.
// Backward: grad_x = zeros; grad_x[..., index[j], ...] += grad[..., j, ...].
struct IndexSelectFn {
  struct Saved {
    Shape in_shape;
    int dim;
    Tensor index;
  };
  static constexpr const char* name = "index_select";
  static Tensor forward(Saved& s, const Tensor& x, int dim, const Tensor& index) {
    CHECK(x.defined()) << "index_select: undefined input";
    check_index_tensor("index_select", x, index);
    CHECK_GE(x.dim(), 1) << "index_select: input is a scalar";
    CHECK(index.dim() == 1) << "index_select: index must be 1-d, got shape " << index.shape_str()
                            << " (input " << x.shape_str() << ")";
    int d = x.wrap_dim(dim);
    Shape shape = x.shape();
    shape[d] = index.numel();
    Tensor out = empty(shape, x.dtype(), x.device());
    backend(x.device()).index_select(x, d, index, out);
    s = Saved{x.shape(), d, index};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    // Straight into the leaf's gradient destination when the engine offers
    // it (an embedding table's DataParallel bucket view): no dense temporary.
    Tensor grad = autograd::grad_buffer(0, s.in_shape, g[0].dtype(), g[0].device());
    grad.fill_(0.0);
    backend(grad.device()).index_add(grad, s.dim, s.index, g[0]);
    return {grad, Tensor()};
  }
};

// out = zeros with `size` rows along dim; out[..., index[j], ...] +=
// src[..., j, ...] (torch.zeros(...).index_add_(dim, index, src)).
// Backward: grad_src = grad.index_select(dim, index).
struct IndexAddFn {
  struct Saved {
    int dim;
    Tensor index;
  };
  static constexpr const char* name = "index_add";
  static Tensor forward(Saved& s, const Tensor& src, int dim, const Tensor& index, int64_t size) {
    CHECK(src.defined()) << "index_add: undefined source";
    check_index_tensor("index_add", src, index);
    CHECK_GE(src.dim(), 1) << "index_add: source is a scalar";
    const int d = src.wrap_dim(dim);
    CHECK(index.dim() == 1 && index.numel() == src.shape()[d])
        << "index_add: index of shape " << index.shape_str() << " for a source of shape "
        << src.shape_str() << " along dim " << d << " (one index per source row)";
    CHECK(size >= 0) << "index_add: " << size << " rows";
    Shape shape = src.shape();
    shape[d] = size;
    Tensor out = zeros(shape, src.dtype(), src.device());
    if (index.numel() > 0) backend(src.device()).index_add(out, d, index, src);
    s = Saved{d, index};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Shape shape = g[0].shape();
    shape[s.dim] = s.index.numel();
    Tensor grad = empty(shape, g[0].dtype(), g[0].device());
    if (s.index.numel() > 0) backend(grad.device()).index_select(g[0], s.dim, s.index, grad);
    return {grad, Tensor()};
  }
};

// out[i] = x[i with i[dim] replaced by index[i]] (torch.gather).
// Backward: grad_x = zeros; grad_x[i with i[dim] = index[i]] += grad[i].
struct GatherFn {
  struct Saved {
    Shape in_shape;
    int dim;
    Tensor index;
  };
  static constexpr const char* name = "gather";
  static Tensor forward(Saved& s, const Tensor& x, int dim, const Tensor& index) {
    CHECK(x.defined()) << "gather: undefined input";
    check_index_tensor("gather", x, index);
    CHECK_GE(x.dim(), 1) << "gather: input is a scalar";
    CHECK(index.dim() == x.dim()) << "gather: index has shape " << index.shape_str()
                                  << ", input has " << x.shape_str() << " (ranks must match)";
    int d = x.wrap_dim(dim);
    for (int i = 0; i < x.dim(); ++i)
      CHECK(i == d || index.shape()[i] <= x.shape()[i])
          << "gather along dim " << d << ": index shape " << index.shape_str()
          << " exceeds input shape " << x.shape_str() << " in dim " << i;
    Tensor out = empty(index.shape(), x.dtype(), x.device());
    backend(x.device()).gather(x, d, index, out);
    s = Saved{x.shape(), d, index};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad = zeros(s.in_shape, g[0].dtype(), g[0].device());
    backend(grad.device()).scatter_add(grad, s.dim, s.index, g[0]);
    return {grad, Tensor()};
  }
};

}  // namespace

Tensor concat(const TensorList& inputs, int dim) { return autograd::apply<ConcatFn>(inputs, dim); }

Tensor stack(const TensorList& inputs, int dim) {
  CHECK(!inputs.empty()) << "stack: no inputs";
  CHECK(inputs[0].defined()) << "stack: undefined input 0";
  int rank = inputs[0].dim();
  int d = dim < 0 ? dim + rank + 1 : dim;
  CHECK(d >= 0 && d <= rank) << "stack: dim " << dim << " out of range for inputs of shape "
                             << inputs[0].shape_str();
  TensorList expanded;
  for (size_t k = 0; k < inputs.size(); ++k) {
    CHECK(inputs[k].defined()) << "stack: undefined input " << k;
    CHECK(inputs[k].shape() == inputs[0].shape())
        << "stack: input " << k << " has shape " << inputs[k].shape_str() << ", input 0 has "
        << inputs[0].shape_str();
    expanded.push_back(inputs[k].unsqueeze(d));
  }
  return concat(expanded, d);
}

TensorList split(const Tensor& x, int64_t split_size, int dim) {
  CHECK(x.defined()) << "split: undefined input";
  CHECK_GE(x.dim(), 1) << "split: input is a scalar";
  CHECK(split_size > 0) << "split: split_size must be positive, got " << split_size << " (input "
                        << x.shape_str() << ")";
  int d = x.wrap_dim(dim);
  int64_t n = x.shape()[d];
  if (n == 0) return {x};
  TensorList pieces;
  for (int64_t start = 0; start < n; start += split_size)
    pieces.push_back(x.slice(d, start, std::min(n, start + split_size)));
  return pieces;
}

Tensor index_select(const Tensor& x, int dim, const Tensor& index) {
  return autograd::apply<IndexSelectFn>(x, dim, index);
}

Tensor gather(const Tensor& x, int dim, const Tensor& index) {
  return autograd::apply<GatherFn>(x, dim, index);
}

Tensor index_add(const Tensor& src, int dim, const Tensor& index, int64_t size) {
  return autograd::apply<IndexAddFn>(src, dim, index, size);
}

// out[..., :] = weight[indices[...], :]: index_select on the flattened ids,
// whose backward (index_add) is the scatter-add into weight's gradient.
Tensor embedding(const Tensor& weight, const Tensor& indices) {
  CHECK(weight.defined()) << "embedding: undefined weight";
  CHECK(weight.dim() == 2) << "embedding: weight must be [V, D], got " << weight.shape_str();
  check_index_tensor("embedding", weight, indices);
  Shape shape = indices.shape();
  shape.push_back(weight.shape()[1]);
  return index_select(weight, 0, indices.reshape({-1})).reshape(shape);
}

}  // namespace trainer
