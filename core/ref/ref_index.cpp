// Reference indexing kernels: one multi-index loop each.
#include "core/ref/ref_backend.h"
#include "core/ref/ref_util.h"

namespace trainer {

namespace {

int64_t index_at(const Tensor& index, const std::vector<int64_t>& i) {
  return int64_t(ref::get(index, i));
}

int64_t checked(int64_t v, int64_t size, const char* op) {
  CHECK(v >= 0 && v < size) << op << ": index " << v << " is outside [0, " << size << ")";
  return v;
}

}  // namespace

// out[..., j, ...] = x[..., index[j], ...]
void RefBackend::index_select(const Tensor& x, int dim, const Tensor& index, const Tensor& out) {
  ref::for_each_index(out.shape(), [&](std::vector<int64_t> i) {
    std::vector<int64_t> src = i;
    src[dim] = checked(index_at(index, {i[dim]}), x.shape()[dim], "index_select");
    ref::set(out, i, ref::get(x, src));
  });
}

// dst[..., index[j], ...] += src[..., j, ...]
void RefBackend::index_add(const Tensor& dst, int dim, const Tensor& index, const Tensor& src) {
  ref::for_each_index(src.shape(), [&](std::vector<int64_t> i) {
    std::vector<int64_t> d = i;
    d[dim] = checked(index_at(index, {i[dim]}), dst.shape()[dim], "index_add");
    ref::set(dst, d, ref::get(dst, d) + ref::get(src, i));
  });
}

// out[i] = x[i with i[dim] = index[i]]
void RefBackend::gather(const Tensor& x, int dim, const Tensor& index, const Tensor& out) {
  ref::for_each_index(out.shape(), [&](std::vector<int64_t> i) {
    std::vector<int64_t> s = i;
    s[dim] = checked(index_at(index, i), x.shape()[dim], "gather");
    ref::set(out, i, ref::get(x, s));
  });
}

// dst[i with i[dim] = index[i]] += src[i]
void RefBackend::scatter_add(const Tensor& dst, int dim, const Tensor& index, const Tensor& src) {
  ref::for_each_index(index.shape(), [&](std::vector<int64_t> i) {
    std::vector<int64_t> d = i;
    d[dim] = checked(index_at(index, i), dst.shape()[dim], "scatter_add");
    ref::set(dst, d, ref::get(dst, d) + ref::get(src, i));
  });
}

void RefBackend::concat(const TensorList& inputs, int dim, const Tensor& out) {
  int64_t base = 0;
  for (const Tensor& in : inputs) {
    ref::for_each_index(in.shape(), [&](std::vector<int64_t> i) {
      double v = ref::get(in, i);
      i[dim] += base;
      ref::set(out, i, v);
    });
    base += in.shape()[dim];
  }
}

}  // namespace trainer
