// Pooling kernels: one thread per output element for the forwards, one per
// input element for the backwards (each input sums the windows that contain
// it, so no atomics and every gradient element is written). Threads walk
// (n, y, x, c) with c fastest, the memory order of channels-last images.
// Window rules as RefBackend's: padding never wins a max, avg divisors from
// math::avg_pool_divisor, adaptive windows from adaptive_start/adaptive_end.
#include "core/conv_attrs.h"
#include "core/cuda/rows.cuh"
#include "core/nn_math.h"

namespace trainer::cuda {

namespace {

__device__ int64_t at(const Image& im, int64_t n, int64_t c, int64_t y, int64_t x) {
  return n * im.stride[0] + c * im.stride[1] + y * im.stride[2] + x * im.stride[3];
}

// (n, c, y, x) of the thread's element of an [N, C, H, W] shape walked as (n, y, x, c).
struct Coord {
  int64_t n, c, y, x;
};
__device__ Coord coord(int64_t i, const Image& im) {
  Coord k;
  k.c = i % im.c;
  i /= im.c;
  k.x = i % im.w;
  i /= im.w;
  k.y = i % im.h;
  k.n = i / im.h;
  return k;
}

// Outputs whose window [o * stride - pad, o * stride - pad + kernel) contains i: [lo, hi].
__device__ void windows_containing(int64_t i, int64_t kernel, int64_t stride, int64_t pad,
                                   int64_t outs, int64_t& lo, int64_t& hi) {
  int64_t first = i + pad - kernel + 1;
  lo = first <= 0 ? 0 : (first + stride - 1) / stride;
  hi = (i + pad) / stride;
  hi = hi < outs - 1 ? hi : outs - 1;
}

template <class T>
__device__ T* ptr(const Image& im) {
  return reinterpret_cast<T*>(im.data);
}

#define TRAINER_GRID_LOOP(i, n)                                             \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

template <class T>
__global__ void max_pool_kernel(Image out, Image x, Image argmax, PoolGeom p) {
  using A = acc_t<T>;
  TRAINER_GRID_LOOP(i, out.n * out.c * out.h * out.w) {
    Coord o = coord(i, out);
    A best = A(-INFINITY);
    int64_t arg = -1;
    for (int64_t ky = 0; ky < p.kh; ++ky) {
      int64_t iy = o.y * p.sh - p.ph + ky;
      if (iy < 0 || iy >= x.h) continue;
      for (int64_t kx = 0; kx < p.kw; ++kx) {
        int64_t ix = o.x * p.sw - p.pw + kx;
        if (ix < 0 || ix >= x.w) continue;
        A v = load(ptr<const T>(x)[at(x, o.n, o.c, iy, ix)]);
        if (arg < 0 || v > best || isnan(v)) best = v, arg = iy * x.w + ix;
      }
    }
    ptr<T>(out)[at(out, o.n, o.c, o.y, o.x)] = store_as<T>(best);
    ptr<int64_t>(argmax)[at(argmax, o.n, o.c, o.y, o.x)] = arg;
  }
}

template <class T>
__global__ void max_pool_backward_kernel(Image gx, Image gout, Image argmax, PoolGeom p) {
  using A = acc_t<T>;
  TRAINER_GRID_LOOP(i, gx.n * gx.c * gx.h * gx.w) {
    Coord k = coord(i, gx);
    int64_t ylo, yhi, xlo, xhi;
    windows_containing(k.y, p.kh, p.sh, p.ph, gout.h, ylo, yhi);
    windows_containing(k.x, p.kw, p.sw, p.pw, gout.w, xlo, xhi);
    const int64_t self = k.y * gx.w + k.x;
    A sum = 0;
    for (int64_t oy = ylo; oy <= yhi; ++oy)
      for (int64_t ox = xlo; ox <= xhi; ++ox)
        if (ptr<const int64_t>(argmax)[at(argmax, k.n, k.c, oy, ox)] == self)
          sum += load(ptr<const T>(gout)[at(gout, k.n, k.c, oy, ox)]);
    ptr<T>(gx)[at(gx, k.n, k.c, k.y, k.x)] = store_as<T>(sum);
  }
}

__device__ int64_t divisor(const PoolGeom& p, int64_t oy, int64_t ox, int64_t h, int64_t w) {
  return math::avg_pool_divisor(oy * p.sh - p.ph, ox * p.sw - p.pw, p.kh, p.kw, h, w, p.ph, p.pw,
                                p.count_include_pad);
}

template <class T>
__global__ void avg_pool_kernel(Image out, Image x, PoolGeom p) {
  using A = acc_t<T>;
  TRAINER_GRID_LOOP(i, out.n * out.c * out.h * out.w) {
    Coord o = coord(i, out);
    A sum = 0;
    for (int64_t ky = 0; ky < p.kh; ++ky) {
      int64_t iy = o.y * p.sh - p.ph + ky;
      if (iy < 0 || iy >= x.h) continue;
      for (int64_t kx = 0; kx < p.kw; ++kx) {
        int64_t ix = o.x * p.sw - p.pw + kx;
        if (ix >= 0 && ix < x.w) sum += load(ptr<const T>(x)[at(x, o.n, o.c, iy, ix)]);
      }
    }
    ptr<T>(out)[at(out, o.n, o.c, o.y, o.x)] = store_as<T>(sum / A(divisor(p, o.y, o.x, x.h, x.w)));
  }
}

template <class T>
__global__ void avg_pool_backward_kernel(Image gx, Image gout, PoolGeom p) {
  using A = acc_t<T>;
  TRAINER_GRID_LOOP(i, gx.n * gx.c * gx.h * gx.w) {
    Coord k = coord(i, gx);
    int64_t ylo, yhi, xlo, xhi;
    windows_containing(k.y, p.kh, p.sh, p.ph, gout.h, ylo, yhi);
    windows_containing(k.x, p.kw, p.sw, p.pw, gout.w, xlo, xhi);
    A sum = 0;
    for (int64_t oy = ylo; oy <= yhi; ++oy)
      for (int64_t ox = xlo; ox <= xhi; ++ox)
        sum += load(ptr<const T>(gout)[at(gout, k.n, k.c, oy, ox)]) /
               A(divisor(p, oy, ox, gx.h, gx.w));
    ptr<T>(gx)[at(gx, k.n, k.c, k.y, k.x)] = store_as<T>(sum);
  }
}

template <class T>
__global__ void adaptive_avg_pool_kernel(Image out, Image x) {
  using A = acc_t<T>;
  TRAINER_GRID_LOOP(i, out.n * out.c * out.h * out.w) {
    Coord o = coord(i, out);
    int64_t hs = adaptive_start(o.y, x.h, out.h), he = adaptive_end(o.y, x.h, out.h);
    int64_t ws = adaptive_start(o.x, x.w, out.w), we = adaptive_end(o.x, x.w, out.w);
    A sum = 0;
    for (int64_t iy = hs; iy < he; ++iy)
      for (int64_t ix = ws; ix < we; ++ix) sum += load(ptr<const T>(x)[at(x, o.n, o.c, iy, ix)]);
    ptr<T>(out)[at(out, o.n, o.c, o.y, o.x)] = store_as<T>(sum / A((he - hs) * (we - ws)));
  }
}

// Output windows containing input i (adaptive_start(o) <= i < adaptive_end(o))
// lie in [floor(i * outs / in), ceil((i + 1) * outs / in)); membership is checked.
template <class T>
__global__ void adaptive_avg_pool_backward_kernel(Image gx, Image gout) {
  using A = acc_t<T>;
  TRAINER_GRID_LOOP(i, gx.n * gx.c * gx.h * gx.w) {
    Coord k = coord(i, gx);
    int64_t ylo = k.y * gout.h / gx.h, yhi = ((k.y + 1) * gout.h + gx.h - 1) / gx.h;
    int64_t xlo = k.x * gout.w / gx.w, xhi = ((k.x + 1) * gout.w + gx.w - 1) / gx.w;
    A sum = 0;
    for (int64_t oy = ylo; oy < yhi && oy < gout.h; ++oy) {
      int64_t hs = adaptive_start(oy, gx.h, gout.h), he = adaptive_end(oy, gx.h, gout.h);
      if (k.y < hs || k.y >= he) continue;
      for (int64_t ox = xlo; ox < xhi && ox < gout.w; ++ox) {
        int64_t ws = adaptive_start(ox, gx.w, gout.w), we = adaptive_end(ox, gx.w, gout.w);
        if (k.x < ws || k.x >= we) continue;
        sum += load(ptr<const T>(gout)[at(gout, k.n, k.c, oy, ox)]) / A((he - hs) * (we - ws));
      }
    }
    ptr<T>(gx)[at(gx, k.n, k.c, k.y, k.x)] = store_as<T>(sum);
  }
}

#undef TRAINER_GRID_LOOP

unsigned blocks_for(const Image& im) {
  int64_t n = im.n * im.c * im.h * im.w;
  return unsigned(
      std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks)));
}

// Enqueues kernel<T> over the elements of `walk` for a floating dtype t.
template <class Launcher>
void run(DType t, const char* op, const Image& walk, Launcher&& launcher) {
  if (walk.n * walk.c * walk.h * walk.w == 0) return;
  dispatch_floating(t, op, [&](auto tag) {
    launcher(tag, blocks_for(walk));
    CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace

void launch_max_pool(const Image& out, const Image& x, const Image& argmax, const PoolGeom& p,
                     DType t, cudaStream_t stream) {
  run(t, "max_pool2d", out, [&](auto tag, unsigned blocks) {
    max_pool_kernel<typename decltype(tag)::type>
        <<<blocks, kThreads, 0, stream>>>(out, x, argmax, p);
  });
}

void launch_max_pool_backward(const Image& grad_x, const Image& grad_out, const Image& argmax,
                              const PoolGeom& p, DType t, cudaStream_t stream) {
  run(t, "max_pool2d_backward", grad_x, [&](auto tag, unsigned blocks) {
    max_pool_backward_kernel<typename decltype(tag)::type>
        <<<blocks, kThreads, 0, stream>>>(grad_x, grad_out, argmax, p);
  });
}

void launch_avg_pool(const Image& out, const Image& x, const PoolGeom& p, DType t,
                     cudaStream_t stream) {
  run(t, "avg_pool2d", out, [&](auto tag, unsigned blocks) {
    avg_pool_kernel<typename decltype(tag)::type><<<blocks, kThreads, 0, stream>>>(out, x, p);
  });
}

void launch_avg_pool_backward(const Image& grad_x, const Image& grad_out, const PoolGeom& p,
                              DType t, cudaStream_t stream) {
  run(t, "avg_pool2d_backward", grad_x, [&](auto tag, unsigned blocks) {
    avg_pool_backward_kernel<typename decltype(tag)::type>
        <<<blocks, kThreads, 0, stream>>>(grad_x, grad_out, p);
  });
}

void launch_adaptive_avg_pool(const Image& out, const Image& x, DType t, cudaStream_t stream) {
  run(t, "adaptive_avg_pool2d", out, [&](auto tag, unsigned blocks) {
    adaptive_avg_pool_kernel<typename decltype(tag)::type><<<blocks, kThreads, 0, stream>>>(out, x);
  });
}

void launch_adaptive_avg_pool_backward(const Image& grad_x, const Image& grad_out, DType t,
                                       cudaStream_t stream) {
  run(t, "adaptive_avg_pool2d_backward", grad_x, [&](auto tag, unsigned blocks) {
    adaptive_avg_pool_backward_kernel<typename decltype(tag)::type>
        <<<blocks, kThreads, 0, stream>>>(grad_x, grad_out);
  });
}

}  // namespace trainer::cuda
