// The packed small-batch GEMM of cpu_gemm.cpp (C ABI: called from Python through ctypes and
// from cpu_layer.cpp).
#pragma once

#include <cstdint>

extern "C" {

// Output columns per packed panel (48), or 0 in a build without AVX-512 or AVX2.
int streamengine_panel_width();

// y[M, n_padded] = x[M, K] @ W^T with W packed as [n_padded / 48][K][48]; 0, or -1 on a shape
// it cannot handle.
int streamengine_sgemm_packed(const float* x, int64_t M, int64_t K, const float* packed, int64_t n_padded,
                              float* y);

}  // extern "C"
