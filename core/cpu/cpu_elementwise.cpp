// CPU fast paths for elementwise kernels: the shared math
// (core/elementwise_math.h) inside the strided loops of core/cpu/loops.h,
// with a unit-stride branch the compiler vectorises.
#include <cstring>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/isa.h"
#include "core/cpu/loops.h"
#include "core/cpu/vec_math.h"
#include "core/elementwise_math.h"
#include "core/ops_conv.h"

namespace trainer {

using cpu::for_each_run;

namespace {

template <class T>
using A = acc_t<T>;

// The unit-stride inner loops, where vectorising pays: each is compiled for
// x86-64-v3 (the build's baseline) and, as a second instance, for x86-64-v4,
// chosen per run by cpu::use_avx512() (core/cpu/isa.h). f, load and store
// are inlined into both, so no AVX-512 code leaks into shared functions.
template <class T, class F>
[[gnu::always_inline]] inline void dense_run(T* o, int64_t n, F& f, const T* x) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = store_as<T>(f(load(x[i])));
}
template <class T, class F>
[[gnu::always_inline]] inline void dense_run(T* o, int64_t n, F& f, const T* x, const T* y) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = store_as<T>(f(load(x[i]), load(y[i])));
}
template <class T, class F>
[[gnu::always_inline]] inline void dense_run(T* o, int64_t n, F& f, const T* x, const T* y,
                                             const T* z) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = store_as<T>(f(load(x[i]), load(y[i]), load(z[i])));
}
template <class T, class F, class... In>
TRAINER_AVX512 void dense_run_avx512(T* o, int64_t n, F& f, const In*... in) {
  dense_run(o, n, f, in...);
}
template <class T, class F, class... In>
void dense_run_avx2(T* o, int64_t n, F& f, const In*... in) {
  dense_run(o, n, f, in...);
}
template <class T, class F, class... In>
inline void dense(T* o, int64_t n, F& f, const In*... in) {
  if (cpu::use_avx512())
    dense_run_avx512(o, n, f, in...);
  else
    dense_run_avx2(o, n, f, in...);
}

// o[i] = x[i] converted (dtype casts such as f32 <-> bf16, which autocast
// and the f32 kernels on bf16 operands run on whole activations).
template <class D, class S>
[[gnu::always_inline]] inline void convert_run(D* o, const S* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = store_as<D>(acc_t<D>(load(x[i])));
}
template <class D, class S>
TRAINER_AVX512 void convert_run_avx512(D* o, const S* x, int64_t n) {
  convert_run(o, x, n);
}
template <class D, class S>
void convert_run_avx2(D* o, const S* x, int64_t n) {
  convert_run(o, x, n);
}

// out = f(a, b) over element type T (all operands T).
template <class T, class F>
void map2(const Tensor& out, const Tensor& a, const Tensor& b, F f) {
  for_each_run<3>(out.shape(), {&out, &a, &b}, [f](char* const* p, const int64_t* s, int64_t n) {
    T* o = reinterpret_cast<T*>(p[0]);
    const T* x = reinterpret_cast<const T*>(p[1]);
    const T* y = reinterpret_cast<const T*>(p[2]);
    if (s[0] == 1 && s[1] == 1 && s[2] == 1) {
      dense(o, n, f, x, y);
    } else if (s[0] == 1 && s[1] == 1 && s[2] == 0) {
      const A<T> yv = load(y[0]);
      auto fx = [&f, yv](A<T> xv) { return f(xv, yv); };
      dense(o, n, fx, x);
    } else if (s[0] == 1 && s[1] == 0 && s[2] == 1) {
      const A<T> xv = load(x[0]);
      auto fy = [&f, xv](A<T> yv) { return f(xv, yv); };
      dense(o, n, fy, y);
    } else {
      for (int64_t i = 0; i < n; ++i)
        o[i * s[0]] = store_as<T>(f(load(x[i * s[1]]), load(y[i * s[2]])));
    }
  });
}

// out = f(a) over element type T.
template <class T, class F>
void map1(const Tensor& out, const Tensor& a, F f) {
  for_each_run<2>(out.shape(), {&out, &a}, [f](char* const* p, const int64_t* s, int64_t n) {
    T* o = reinterpret_cast<T*>(p[0]);
    const T* x = reinterpret_cast<const T*>(p[1]);
    if (s[0] == 1 && s[1] == 1) {
      dense(o, n, f, x);
    } else {
      for (int64_t i = 0; i < n; ++i) o[i * s[0]] = store_as<T>(f(load(x[i * s[1]])));
    }
  });
}

// out = f(a, b, c) over element type T.
template <class T, class F>
void map3(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& c, F f) {
  for_each_run<4>(
      out.shape(), {&out, &a, &b, &c}, [f](char* const* p, const int64_t* s, int64_t n) {
        T* o = reinterpret_cast<T*>(p[0]);
        const T* x = reinterpret_cast<const T*>(p[1]);
        const T* y = reinterpret_cast<const T*>(p[2]);
        const T* z = reinterpret_cast<const T*>(p[3]);
        if (s[0] == 1 && s[1] == 1 && s[2] == 1 && s[3] == 1) {
          dense(o, n, f, x, y, z);
        } else {
          for (int64_t i = 0; i < n; ++i)
            o[i * s[0]] = store_as<T>(f(load(x[i * s[1]]), load(y[i * s[2]]), load(z[i * s[3]])));
        }
      });
}

bool same_dtype(std::initializer_list<const Tensor*> ts, DType t) {
  for (const Tensor* x : ts)
    if (x->defined() && x->dtype() != t) return false;
  return true;
}

}  // namespace

void CpuBackend::copy(const Tensor& src, const Tensor& dst) {
  // Both dense in the same order (contiguous, or channels-last as the
  // convolutions keep activations): element i of one is element i of the
  // other, so the copy is one flat run, a conversion where dtypes differ.
  const bool flat =
      src.shape() == dst.shape() && ((src.is_contiguous() && dst.is_contiguous()) ||
                                     (is_channels_last(src) && is_channels_last(dst)));
  if (flat && src.dtype() == dst.dtype()) {
    const char* s = static_cast<const char*>(src.data_ptr());
    char* d = static_cast<char*>(dst.data_ptr());
    size_t es = dtype_size(src.dtype());
    cpu::parallel_for(src.numel(), 1 << 18, [&](int64_t b, int64_t e) {
      std::memcpy(d + b * es, s + b * es, size_t(e - b) * es);
    });
    return;
  }
  if (flat && dst.dtype() != DType::boolean) {
    dispatch_all(dst.dtype(), "copy", [&](auto dtag) {
      using D = typename decltype(dtag)::type;
      dispatch_all(src.dtype(), "copy", [&](auto stag) {
        using S = typename decltype(stag)::type;
        if constexpr (!std::is_same_v<D, bool>) {
          D* o = static_cast<D*>(dst.data_ptr());
          const S* x = static_cast<const S*>(src.data_ptr());
          cpu::parallel_for(src.numel(), 1 << 16, [&](int64_t b, int64_t e) {
            if (cpu::use_avx512())
              convert_run_avx512(o + b, x + b, e - b);
            else
              convert_run_avx2(o + b, x + b, e - b);
          });
        }
      });
    });
    return;
  }
  dispatch_all(dst.dtype(), "copy", [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_all(src.dtype(), "copy", [&](auto stag) {
      using S = typename decltype(stag)::type;
      for_each_run<2>(dst.shape(), {&dst, &src}, [](char* const* p, const int64_t* s, int64_t n) {
        D* o = reinterpret_cast<D*>(p[0]);
        const S* x = reinterpret_cast<const S*>(p[1]);
        for (int64_t i = 0; i < n; ++i) {
          auto v = load(x[i * s[1]]);
          if constexpr (std::is_same_v<D, bool>)
            o[i * s[0]] = v != decltype(v)(0);
          else
            o[i * s[0]] = store_as<D>(acc_t<D>(v));
        }
      });
    });
  });
}

void CpuBackend::fill(const Tensor& dst, double value) {
  dispatch_all(dst.dtype(), "fill", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T v;
    if constexpr (std::is_same_v<T, bool>)
      v = value != 0.0;
    else
      v = store_as<T>(acc_t<T>(value));
    for_each_run<1>(dst.shape(), {&dst}, [v](char* const* p, const int64_t* s, int64_t n) {
      T* o = reinterpret_cast<T*>(p[0]);
      for (int64_t i = 0; i < n; ++i) o[i * s[0]] = v;
    });
  });
}

void CpuBackend::unary(UnaryOp op, const Tensor& x, const Tensor& out) {
  // f32 (and bf16/f16, computed in f32) GELU and SiLU through cpu::tanh_f32,
  // cpu::normal_cdf_f32 and cpu::exp_f32, which vectorise (libm's tanhf, erff
  // and expf do not).
  if (op == UnaryOp::gelu_tanh && out.dtype() == x.dtype() && out.dtype() != DType::f64)
    return dispatch_floating(out.dtype(), "gelu_tanh", [&](auto tag) {
      map1<typename decltype(tag)::type>(out, x, [](float v) { return cpu::gelu_tanh_f32(v); });
    });
  if (op == UnaryOp::gelu_erf && out.dtype() == x.dtype() && out.dtype() != DType::f64)
    return dispatch_floating(out.dtype(), "gelu_erf", [&](auto tag) {
      map1<typename decltype(tag)::type>(out, x, [](float v) { return cpu::gelu_erf_f32(v); });
    });
  if (op == UnaryOp::silu && out.dtype() == x.dtype() && out.dtype() != DType::f64)
    return dispatch_floating(out.dtype(), "silu", [&](auto tag) {
      map1<typename decltype(tag)::type>(out, x, [](float v) { return cpu::silu_f32(v); });
    });
  dispatch_floating(out.dtype(), unary_op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    math::visit_unary(op, [&](auto f) { map1<T>(out, x, [f](A<T> v) { return f(v); }); });
  });
}

void CpuBackend::unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y,
                                const Tensor& grad_x) {
  if (op == UnaryOp::gelu_tanh && grad_x.dtype() == x.dtype() && grad.dtype() == x.dtype() &&
      x.dtype() != DType::f64)
    return dispatch_floating(x.dtype(), "gelu_tanh", [&](auto tag) {
      map3<typename decltype(tag)::type>(grad_x, x, x, grad, [](float v, float, float g) {
        return cpu::gelu_tanh_grad_f32(v, g);
      });
    });
  if (op == UnaryOp::gelu_erf && grad_x.dtype() == x.dtype() && grad.dtype() == x.dtype() &&
      x.dtype() != DType::f64)
    return dispatch_floating(x.dtype(), "gelu_erf", [&](auto tag) {
      map3<typename decltype(tag)::type>(
          grad_x, x, x, grad, [](float v, float, float g) { return cpu::gelu_erf_grad_f32(v, g); });
    });
  if (op == UnaryOp::silu && grad_x.dtype() == x.dtype() && grad.dtype() == x.dtype() &&
      x.dtype() != DType::f64)
    return dispatch_floating(x.dtype(), "silu", [&](auto tag) {
      map3<typename decltype(tag)::type>(
          grad_x, x, x, grad, [](float v, float, float g) { return cpu::silu_grad_f32(v, g); });
    });
  dispatch_floating(grad_x.dtype(), unary_op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    math::visit_unary(op, [&](auto f) {
      // Operands: (x, y, grad); y may be absent for ops whose derivative uses only x.
      const Tensor& yy = y.defined() ? y : x;
      map3<T>(grad_x, x, yy, grad, [f](A<T> xv, A<T> yv, A<T> g) { return f.grad(xv, yv, g); });
    });
  });
}

void CpuBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  if (!same_dtype({&a, &b}, out.dtype())) return RefBackend::binary(op, a, b, out);
  dispatch_floating(out.dtype(), binary_op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    math::visit_binary(op, [&](auto f) { map2<T>(out, a, b, f); });
  });
}

void CpuBackend::binary_scalar(BinaryOp op, const Tensor& a, double s, bool scalar_first,
                               const Tensor& out) {
  if (a.dtype() != out.dtype()) return RefBackend::binary_scalar(op, a, s, scalar_first, out);
  dispatch_floating(out.dtype(), binary_op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const A<T> sv = A<T>(s);
    math::visit_binary(op, [&](auto f) {
      if (scalar_first)
        map1<T>(out, a, [f, sv](A<T> v) { return f(sv, v); });
      else
        map1<T>(out, a, [f, sv](A<T> v) { return f(v, sv); });
    });
  });
}

void CpuBackend::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  if (cond.dtype() != DType::boolean || !same_dtype({&a, &b}, out.dtype()))
    return RefBackend::where(cond, a, b, out);
  dispatch_all(out.dtype(), "where", [&](auto tag) {
    using T = typename decltype(tag)::type;
    for_each_run<4>(out.shape(), {&out, &cond, &a, &b},
                    [](char* const* p, const int64_t* s, int64_t n) {
                      T* o = reinterpret_cast<T*>(p[0]);
                      const bool* c = reinterpret_cast<const bool*>(p[1]);
                      const T* x = reinterpret_cast<const T*>(p[2]);
                      const T* y = reinterpret_cast<const T*>(p[3]);
                      for (int64_t i = 0; i < n; ++i)
                        o[i * s[0]] = c[i * s[1]] ? x[i * s[2]] : y[i * s[3]];
                    });
  });
}

void CpuBackend::clamp(const Tensor& x, double lo, double hi, const Tensor& out) {
  dispatch_floating(out.dtype(), "clamp", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const A<T> l = A<T>(lo), h = A<T>(hi);
    map1<T>(out, x, [l, h](A<T> v) { return math::clamp(v, l, h); });
  });
}

void CpuBackend::clamp_backward(const Tensor& grad, const Tensor& x, double lo, double hi,
                                const Tensor& grad_x) {
  dispatch_floating(grad_x.dtype(), "clamp_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const A<T> l = A<T>(lo), h = A<T>(hi);
    map2<T>(grad_x, grad, x, [l, h](A<T> g, A<T> v) { return v >= l && v <= h ? g : A<T>(0); });
  });
}

void CpuBackend::compare(CompareOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  if (a.dtype() != b.dtype() || !is_floating(a.dtype())) return RefBackend::compare(op, a, b, out);
  dispatch_floating(a.dtype(), "compare", [&](auto tag) {
    using T = typename decltype(tag)::type;
    for_each_run<3>(out.shape(), {&out, &a, &b}, [op](char* const* p, const int64_t* s, int64_t n) {
      bool* o = reinterpret_cast<bool*>(p[0]);
      const T* x = reinterpret_cast<const T*>(p[1]);
      const T* y = reinterpret_cast<const T*>(p[2]);
      for (int64_t i = 0; i < n; ++i) {
        A<T> u = load(x[i * s[1]]), v = load(y[i * s[2]]);
        o[i * s[0]] = op == CompareOp::eq ? u == v : (op == CompareOp::lt ? u < v : u > v);
      }
    });
  });
}

}  // namespace trainer
