// Small-batch fp32 GEMM for CPU decode steps: y[M, N] = x[M, K] @ W^T.
//
// Why: a decode step multiplies a few rows (one per running sequence) by every weight matrix,
// so it is bound by reading the weights once. MKL's sgemm repacks W on every call, which at
// a few rows costs more than the weight read itself. Here W is packed once, at load time,
// into panels of NR = 48 output columns stored k-major ([N / 48][K][48]): a panel is one
// sequential stream, and each 48-float row of it is used by every input row while it sits in
// registers (MR rows x 3 vectors of accumulators: 8 rows with AVX-512, 2 with AVX2). Above MR
// rows a panel's compute outlasts its stream, so its row chunks prefetch the next panel meanwhile.
//
// Built at run time by kernels/cpu_build.py (g++ -O3 -march=native -fopenmp). OpenMP resolves
// to the libgomp that torch has already loaded, so the threads are torch's own.

#include "cpu_gemm.h"

#include <cstdint>

#include "cpu_gemm_panel.h"

#if defined(STREAMENGINE_SIMD)

using streamengine_panel::NR;
using streamengine_panel::panel_rows;

extern "C" int streamengine_panel_width() { return static_cast<int>(NR); }

// x: [M, K] contiguous; packed: [N_padded / 48][K][48]; y: [M, N_padded] contiguous.
// Returns 0 on success, -1 on a shape it cannot handle.
extern "C" int streamengine_sgemm_packed(const float* x, int64_t M, int64_t K,
                                         const float* packed, int64_t n_padded, float* y) {
  if (M < 0 || K <= 0 || n_padded % NR != 0) return -1;
  const int64_t num_panels = n_padded / NR;
#pragma omp parallel for schedule(guided)
  for (int64_t p = 0; p < num_panels; ++p)
    panel_rows(x, M, K, packed + p * K * NR, y + p * NR, n_padded,
               p + 1 < num_panels ? packed + (p + 1) * K * NR : nullptr);
  return 0;
}

#else  // neither AVX-512 nor AVX2: the Python wrapper sees panel width 0 and keeps PyTorch's matmul.

extern "C" int streamengine_panel_width() { return 0; }

extern "C" int streamengine_sgemm_packed(const float*, int64_t, int64_t, const float*, int64_t,
                                         float*) {
  return -1;
}

#endif
