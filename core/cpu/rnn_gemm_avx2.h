// The per-step recurrent GEMM of the CPU LSTM and GRU (core/cpu/cpu_rnn.cpp)
// on AVX2 and FMA: c [M, N] = a [M, K] b [K, N], M small (the batch rows one
// thread owns, <= 32 in the LSTM LM benchmark), K and N the layer's H and 4H
// (forward: h W_hh^T) or 4H and H (backward: dgates W_hh). Inside the LSTM
// LM's training step (H 512, B 32) oneDNN 2.6's AVX2 sgemm ran these shapes
// at 40-47 GFLOP/s on a Zen 3 core (its large GEMMs at 70-80, the core's FMA
// peak about 100; alone with hot caches 72 for 32 rows but 32 for the 16 rows
// a thread owns on two threads); this kernel runs them at 80-90. It is used
// where the project's loops run AVX2 (cpu::use_avx512() false), oneDNN's
// brgemm otherwise.
//
// b is packed once per call into column panels of kRnnPanelWidth (16): panel
// p holds b[k, 16 p + j] at [p K 16 + 16 k + j], zero past N. The kernel keeps
// a tile of up to 6 rows x 16 columns of c in 12 ymm accumulators and walks
// the panel's K rows with one broadcast of a per row and two loads of b.
//
// Every element of c is one FMA chain over k = 0, 1, ..., K - 1 (starting
// from c's old value when accumulating), whatever M and however the rows
// are tiled: the result of a batch row does not depend on how many threads
// split the batch.
//
//   std::vector<float> panels(rnn_packed_size(K, N));
//   pack_rnn_panels(b, K, N, b_row_stride, b_col_stride, panels.data());
//   rnn_gemm_avx2(a, M, K, lda, panels.data(), N, c, ldc, /*accumulate=*/false);
#pragma once

#include <cstdint>

namespace trainer::cpu {

inline constexpr int64_t kRnnPanelWidth = 16;

// Floats of packed b [K, N]: ceil(N / 16) panels of K x 16.
int64_t rnn_packed_size(int64_t K, int64_t N);

// Packs b [K, N], element (k, n) at b[k rs + n cs], into panels (above).
void pack_rnn_panels(const float* b, int64_t K, int64_t N, int64_t rs, int64_t cs, float* panels);

// c [M, N] (row stride ldc) = a [M, K] (row stride lda, unit column stride)
// times the packed b, or c += a b when accumulate.
void rnn_gemm_avx2(const float* a, int64_t M, int64_t K, int64_t lda, const float* panels,
                   int64_t N, float* c, int64_t ldc, bool accumulate);

}  // namespace trainer::cpu
