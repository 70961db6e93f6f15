// Reference elementwise kernels: one multi-index loop each, math in double.
#include "core/elementwise_math.h"
#include "core/ref/ref_backend.h"
#include "core/ref/ref_util.h"

namespace trainer {
namespace ref {

double get(const Tensor& t, int64_t offset) {
  return dispatch_all(t.dtype(), "ref::get", [&](auto tag) -> double {
    using T = typename decltype(tag)::type;
    const T* p = static_cast<const T*>(t.data_ptr()) + offset;
    return double(load(*p));
  });
}

void set(const Tensor& t, int64_t offset, double v) {
  dispatch_all(t.dtype(), "ref::set", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(t.data_ptr()) + offset;
    if constexpr (std::is_same_v<T, bool>)
      *p = v != 0.0;
    else
      *p = store_as<T>(acc_t<T>(v));
  });
}

}  // namespace ref

using ref::for_each_index;
using ref::get;
using ref::set;

void RefBackend::copy(const Tensor& src, const Tensor& dst) {
  for_each_index(dst.shape(), [&](const auto& i) { set(dst, i, get(src, i)); });
}

void RefBackend::fill(const Tensor& dst, double value) {
  for_each_index(dst.shape(), [&](const auto& i) { set(dst, i, value); });
}

void RefBackend::unary(UnaryOp op, const Tensor& x, const Tensor& out) {
  math::visit_unary(op, [&](auto f) {
    for_each_index(out.shape(), [&](const auto& i) { set(out, i, f(get(x, i))); });
  });
}

void RefBackend::unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y,
                                const Tensor& grad_x) {
  math::visit_unary(op, [&](auto f) {
    for_each_index(grad_x.shape(), [&](const auto& i) {
      set(grad_x, i, f.grad(get(x, i), y.defined() ? get(y, i) : 0.0, get(grad, i)));
    });
  });
}

void RefBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  math::visit_binary(op, [&](auto f) {
    for_each_index(out.shape(), [&](const auto& i) { set(out, i, f(get(a, i), get(b, i))); });
  });
}

void RefBackend::binary_scalar(BinaryOp op, const Tensor& a, double s, bool scalar_first,
                               const Tensor& out) {
  math::visit_binary(op, [&](auto f) {
    for_each_index(out.shape(), [&](const auto& i) {
      double x = get(a, i);
      set(out, i, scalar_first ? f(s, x) : f(x, s));
    });
  });
}

void RefBackend::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  for_each_index(out.shape(),
                 [&](const auto& i) { set(out, i, get(cond, i) != 0.0 ? get(a, i) : get(b, i)); });
}

void RefBackend::clamp(const Tensor& x, double lo, double hi, const Tensor& out) {
  for_each_index(out.shape(), [&](const auto& i) { set(out, i, math::clamp(get(x, i), lo, hi)); });
}

void RefBackend::clamp_backward(const Tensor& grad, const Tensor& x, double lo, double hi,
                                const Tensor& grad_x) {
  for_each_index(grad_x.shape(), [&](const auto& i) {
    double v = get(x, i);
    set(grad_x, i, v >= lo && v <= hi ? get(grad, i) : 0.0);
  });
}

void RefBackend::compare(CompareOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  for_each_index(out.shape(), [&](const auto& i) {
    double x = get(a, i), y = get(b, i);
    bool r = op == CompareOp::eq ? x == y : (op == CompareOp::lt ? x < y : x > y);
    set(out, i, r ? 1.0 : 0.0);
  });
}

}  // namespace trainer
