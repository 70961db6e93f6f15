// CPU fast paths for the indexing kernels.
//
//   concat        memcpy of each input's contiguous blocks into the output rows,
//                 split across threads by bytes
//   index_select  row copies when x is contiguous (the embedding lookup)
//   index_add     row adds; threads own disjoint destination elements (whole
//                 outer slices, else column ranges), so repeated indices add up
//                 in source order, as in the reference, without races
//   gather        the strided loops of core/cpu/loops.h over index's shape,
//                 x seen with stride 0 along dim plus index * its stride
//   scatter_add   the same loops over the lines of index along dim: one line
//                 per destination line, so two threads never meet
//
// Other layouts take a strided path (one copy or add per slice); mixed dtypes
// and integer accumulation run the reference loops.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/loops.h"
#include "core/cpu/threads.h"

namespace trainer {

namespace {

// Bytes below which a block copy stays on one thread.
constexpr int64_t kCopyGrainBytes = 1 << 18;

// Product of shape[begin, end).
int64_t extent(const Shape& shape, int begin, int end) {
  int64_t n = 1;
  for (int d = begin; d < end; ++d) n *= shape[d];
  return n;
}

// t restricted to position i along dim (kept as a size-1 dim).
Tensor slice_at(const Tensor& t, int dim, int64_t i) {
  Shape shape = t.shape();
  shape[dim] = 1;
  return make_view(t, shape, t.strides(), t.offset() + i * t.strides()[dim]);
}

// The values of a 1-d index tensor, each checked against [0, bound).
std::vector<int64_t> read_index(const Tensor& index, int64_t bound, const char* op) {
  CHECK(index.dim() == 1) << op << ": index must be 1-d, got " << index.shape_str();
  std::vector<int64_t> out(size_t(index.numel()));
  dispatch_index(index.dtype(), op, [&](auto tag) {
    using I = typename decltype(tag)::type;
    const I* p = index.data<I>();
    const int64_t stride = index.strides()[0];
    for (size_t j = 0; j < out.size(); ++j) {
      int64_t v = int64_t(p[int64_t(j) * stride]);
      CHECK(v >= 0 && v < bound) << op << ": index " << v << " is outside [0, " << bound << ")";
      out[j] = v;
    }
  });
  return out;
}

// Copies `rows` packed rows of row_bytes from src to dst rows dst_pitch bytes apart.
void copy_rows(const char* src, char* dst, int64_t rows, int64_t row_bytes, int64_t dst_pitch) {
  cpu::parallel_for(rows * row_bytes, kCopyGrainBytes, [&](int64_t begin, int64_t end) {
    for (int64_t pos = begin; pos < end;) {
      int64_t row = pos / row_bytes, col = pos % row_bytes;
      int64_t n = std::min(row_bytes - col, end - pos);
      std::memcpy(dst + row * dst_pitch + col, src + pos, size_t(n));
      pos += n;
    }
  });
}

}  // namespace

// out = [inputs...] along dim; out contiguous [outer, sum of sizes, inner].
void CpuBackend::concat(const TensorList& inputs, int dim, const Tensor& out) {
  if (!out.is_contiguous()) return RefBackend::concat(inputs, dim, out);
  const int64_t outer = extent(out.shape(), 0, dim);
  const int64_t inner = extent(out.shape(), dim + 1, out.dim());
  const int64_t es = int64_t(dtype_size(out.dtype()));
  int64_t offset = 0;  // rows of out along dim already filled
  for (const Tensor& in : inputs) {
    Tensor dst = make_view(out, in.shape(), out.strides(), out.offset() + offset * inner);
    offset += in.shape()[dim];
    if (in.numel() == 0) continue;
    if (in.dtype() == out.dtype() && in.is_contiguous())
      copy_rows(static_cast<const char*>(in.data_ptr()), static_cast<char*>(dst.data_ptr()), outer,
                in.shape()[dim] * inner * es, out.shape()[dim] * inner * es);
    else
      copy(in, dst);
  }
}

// out[o, j, :] = x[o, index[j], :] with x as [outer, n, inner].
void CpuBackend::index_select(const Tensor& x, int dim, const Tensor& index, const Tensor& out) {
  std::vector<int64_t> idx = read_index(index, x.shape()[dim], "index_select");
  const int64_t m = int64_t(idx.size());
  if (x.dtype() == out.dtype() && x.is_contiguous() && out.is_contiguous()) {
    const int64_t outer = extent(x.shape(), 0, dim), n = x.shape()[dim];
    const int64_t inner = extent(x.shape(), dim + 1, x.dim());
    dispatch_all(x.dtype(), "index_select", [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* src = x.data<T>();
      T* dst = out.data<T>();
      int64_t grain_rows = std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(inner, 1));
      cpu::parallel_for(outer * m, grain_rows, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          int64_t o = r / m, j = r % m;
          std::copy_n(src + (o * n + idx[j]) * inner, inner, dst + r * inner);
        }
      });
    });
    return;
  }
  for (int64_t j = 0; j < m; ++j) copy(slice_at(x, dim, idx[j]), slice_at(out, dim, j));
}

// dst[o, index[j], :] += src[o, j, :] with dst as [outer, n, inner].
void CpuBackend::index_add(const Tensor& dst, int dim, const Tensor& index, const Tensor& src) {
  if (dst.dtype() != src.dtype() || !is_floating(dst.dtype()))
    return RefBackend::index_add(dst, dim, index, src);
  std::vector<int64_t> idx = read_index(index, dst.shape()[dim], "index_add");
  const int64_t m = int64_t(idx.size());
  if (!dst.is_contiguous() || !src.is_contiguous()) {
    // Slice by slice in source order, each an in-place add.
    for (int64_t j = 0; j < m; ++j) {
      Tensor d = slice_at(dst, dim, idx[j]);
      binary(BinaryOp::add, d, slice_at(src, dim, j), d);
    }
    return;
  }
  const int64_t outer = extent(dst.shape(), 0, dim), n = dst.shape()[dim];
  const int64_t inner = extent(dst.shape(), dim + 1, dst.dim());
  dispatch_floating(dst.dtype(), "index_add", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    T* d = dst.data<T>();
    const T* s = src.data<T>();
    // Adds columns [c0, c1) of every source row of outer slices [o0, o1),
    // rows in source order (the reference's order for repeated indices).
    auto add_block = [&](int64_t o0, int64_t o1, int64_t c0, int64_t c1) {
      for (int64_t o = o0; o < o1; ++o)
        for (int64_t j = 0; j < m; ++j) {
          T* drow = d + (o * n + idx[j]) * inner;
          const T* srow = s + (o * m + j) * inner;
#pragma omp simd
          for (int64_t c = c0; c < c1; ++c) drow[c] = store_as<T>(A(load(drow[c]) + load(srow[c])));
        }
    };
    if (outer * m * inner < cpu::kParallelGrain)
      add_block(0, outer, 0, inner);
    else if (outer >= 2 * int64_t(num_threads()))
      cpu::parallel_for(outer, 0, [&](int64_t b, int64_t e) { add_block(b, e, 0, inner); });
    else
      cpu::parallel_for(inner, 0, [&](int64_t b, int64_t e) { add_block(0, outer, b, e); });
  });
}

// out[i] = x[i with i[dim] = index[i]]: x is viewed with index's shape and
// stride 0 along dim, and the body adds index[i] * x.stride(dim).
void CpuBackend::gather(const Tensor& x, int dim, const Tensor& index, const Tensor& out) {
  if (x.dtype() != out.dtype()) return RefBackend::gather(x, dim, index, out);
  Shape xs = x.strides();
  xs[dim] = 0;
  Tensor xv = make_view(x, index.shape(), xs, x.offset());
  const int64_t bound = x.shape()[dim], step = x.strides()[dim];
  dispatch_all(x.dtype(), "gather", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_index(index.dtype(), "gather", [&](auto itag) {
      using I = typename decltype(itag)::type;
      cpu::for_each_run<3>(index.shape(), {&out, &xv, &index},
                           [bound, step](char* const* p, const int64_t* s, int64_t n) {
                             T* o = reinterpret_cast<T*>(p[0]);
                             const T* xp = reinterpret_cast<const T*>(p[1]);
                             const I* ip = reinterpret_cast<const I*>(p[2]);
                             for (int64_t i = 0; i < n; ++i) {
                               int64_t k = int64_t(ip[i * s[2]]);
                               CHECK(k >= 0 && k < bound)
                                   << "gather: index " << k << " is outside [0, " << bound << ")";
                               o[i * s[0]] = xp[i * s[1] + k * step];
                             }
                           });
    });
  });
}

// dst[i with i[dim] = index[i]] += src[i]. The loops run over the lines of
// index along dim (its shape with dim set to 1); a line writes only its own
// line of dst, so lines split across threads never race, and within a line
// the additions keep index order along dim, as the reference does.
void CpuBackend::scatter_add(const Tensor& dst, int dim, const Tensor& index, const Tensor& src) {
  if (dst.dtype() != src.dtype() || !is_floating(dst.dtype()))
    return RefBackend::scatter_add(dst, dim, index, src);
  Shape lines = index.shape();
  const int64_t m = lines[dim];
  lines[dim] = 1;
  Tensor dl = make_view(dst, lines, dst.strides(), dst.offset());
  Tensor sl = make_view(src, lines, src.strides(), src.offset());
  Tensor il = make_view(index, lines, index.strides(), index.offset());
  const int64_t bound = dst.shape()[dim];
  const int64_t d_step = dst.strides()[dim], s_step = src.strides()[dim];
  const int64_t i_step = index.strides()[dim];
  dispatch_floating(dst.dtype(), "scatter_add", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    dispatch_index(index.dtype(), "scatter_add", [&](auto itag) {
      using I = typename decltype(itag)::type;
      cpu::for_each_run<3>(
          lines, {&dl, &sl, &il}, [=](char* const* p, const int64_t* s, int64_t n) {
            T* dp = reinterpret_cast<T*>(p[0]);
            const T* sp = reinterpret_cast<const T*>(p[1]);
            const I* ip = reinterpret_cast<const I*>(p[2]);
            auto add = [&](int64_t i, int64_t j) {
              int64_t k = int64_t(ip[i * s[2] + j * i_step]);
              CHECK(k >= 0 && k < bound)
                  << "scatter_add: index " << k << " is outside [0, " << bound << ")";
              T& t = dp[i * s[0] + k * d_step];
              t = store_as<T>(A(load(t) + load(sp[i * s[1] + j * s_step])));
            };
            // Walk index in its memory order: along dim innermost when that is
            // the smaller stride, else across the lines of the run.
            if (std::abs(i_step) < std::abs(s[2])) {
              for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < m; ++j) add(i, j);
            } else {
              for (int64_t j = 0; j < m; ++j)
                for (int64_t i = 0; i < n; ++i) add(i, j);
            }
          });
    });
  });
}

}  // namespace trainer
