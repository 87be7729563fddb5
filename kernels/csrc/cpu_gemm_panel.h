// The register-tile micro-kernel of the packed float32 GEMM (cpu_gemm.cpp), shared with the
// packed-weight GEMM (cpu_quant_gemm.cpp), which runs it over panels it has just dequantized.
// Panel layout: NR = 48 output columns stored k-major, [K][48] floats per panel.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu_simd.h"

#if defined(STREAMENGINE_SIMD)

namespace streamengine_panel {

using namespace streamengine_simd;

constexpr int64_t NR = 48;          // output columns per panel: 3 vectors
// Input rows per micro-kernel call: their 3 vectors of accumulators each fill most registers
// (AVX-512: 24 of 32 zmm; AVX2: 12 of 16 ymm, a vector being two).
constexpr int64_t MR = STREAMENGINE_SIMD == 512 ? 8 : 2;
constexpr int64_t PREFETCH = 1024;  // floats ahead in the panel stream (~21 k-rows)

constexpr int64_t LINE = 16;        // floats per 64-byte cache line
constexpr int64_t OVERLAP_CHUNKS = 3;  // fewest row chunks above MR rows: share of the next panel each

// NEXT: also pull `next_lines` cache lines from `next` (a share of the following panel) into
// L2, spread over the k loop, so the weight stream goes on while later row chunks compute.
template <int ROWS, bool NEXT>
inline void micro_kernel(const float* x, int64_t ldx, const float* panel, int64_t K,
                         float* y, int64_t ldy, const float* next, int64_t next_lines) {
  vf acc[ROWS][3];
  UNROLL_TILE
  for (int m = 0; m < ROWS; ++m)
    for (int j = 0; j < 3; ++j) acc[m][j] = vzero();
  const int64_t per_k = NEXT ? (next_lines + K - 1) / K : 0;
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * NR;
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + 32), _MM_HINT_T0);
    if constexpr (NEXT) {
      for (int64_t j = k * per_k; j < (k + 1) * per_k && j < next_lines; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(next + j * LINE), _MM_HINT_T1);
    }
    const vf w0 = vload(w);
    const vf w1 = vload(w + 16);
    const vf w2 = vload(w + 32);
    UNROLL_TILE
    for (int m = 0; m < ROWS; ++m) {
      const vf xb = vset1(x[m * ldx + k]);
      acc[m][0] = vfmadd(xb, w0, acc[m][0]);
      acc[m][1] = vfmadd(xb, w1, acc[m][1]);
      acc[m][2] = vfmadd(xb, w2, acc[m][2]);
    }
  }
  UNROLL_TILE
  for (int m = 0; m < ROWS; ++m) {
    vstore(y + m * ldy, acc[m][0]);
    vstore(y + m * ldy + 16, acc[m][1]);
    vstore(y + m * ldy + 32, acc[m][2]);
  }
}

// `rows` (1..MR) input rows, each row count its own instance.
template <bool NEXT, int ROWS = 1>
inline void rows_kernel(int64_t rows, const float* x, int64_t K, const float* panel, float* y, int64_t ldy,
                        const float* next, int64_t next_lines) {
  if constexpr (ROWS < MR) {
    if (rows > ROWS) return rows_kernel<NEXT, ROWS + 1>(rows, x, K, panel, y, ldy, next, next_lines);
  }
  micro_kernel<ROWS, NEXT>(x, K, panel, K, y, ldy, next, next_lines);
}

// All M rows against one panel; the panel stays in L1/L2 across the row chunks. Above MR rows
// a panel's compute outlasts its stream, so the chunks also prefetch equal shares of the next
// panel (`next`, nullptr for the last): memory and compute overlap. Up to MR rows the hardware
// prefetcher alone streams faster.
inline void panel_rows(const float* x, int64_t M, int64_t K, const float* panel, float* y,
                       int64_t ldy, const float* next) {
  if (M <= 0) return;
  // Above MR rows: at least three chunks (9-16 rows as three of <= 6, not two of 8).
  const bool overlap = next != nullptr && M > MR;
  const int64_t chunks = M > MR ? std::max(OVERLAP_CHUNKS, (M + MR - 1) / MR) : 1;
  const int64_t step = (M + chunks - 1) / chunks;  // rows per chunk
  const int64_t lines = K * NR / LINE;
  for (int64_t c = 0; c * step < M; ++c) {
    const int64_t m = c * step, rows = M - m < step ? M - m : step;
    if (overlap) {
      const int64_t first = lines * c / chunks, last = lines * (c + 1) / chunks;
      rows_kernel<true>(rows, x + m * K, K, panel, y + m * ldy, ldy, next + first * LINE, last - first);
    } else {
      rows_kernel<false>(rows, x + m * K, K, panel, y + m * ldy, ldy, nullptr, 0);
    }
  }
}

}  // namespace streamengine_panel

#endif
