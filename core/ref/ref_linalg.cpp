// Reference matmul: the triple loop, per batch index, in double.
#include "core/ref/ref_backend.h"
#include "core/ref/ref_util.h"

namespace trainer {

// out[..., m, n] = sum_k a[..., m, k] b[..., k, n]
void RefBackend::matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  int nd = out.dim();
  int64_t M = out.shape()[nd - 2], N = out.shape()[nd - 1], K = a.shape()[nd - 1];
  Shape batch(out.shape().begin(), out.shape().end() - 2);
  ref::for_each_index(batch, [&](const std::vector<int64_t>& bi) {
    std::vector<int64_t> ia(bi), ib(bi), io(bi);
    ia.resize(nd), ib.resize(nd), io.resize(nd);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0.0;
        for (int64_t k = 0; k < K; ++k) {
          ia[nd - 2] = m, ia[nd - 1] = k;
          ib[nd - 2] = k, ib[nd - 1] = n;
          acc += ref::get(a, ia) * ref::get(b, ib);
        }
        io[nd - 2] = m, io[nd - 1] = n;
        ref::set(out, io, acc);
      }
    }
  });
}

}  // namespace trainer
