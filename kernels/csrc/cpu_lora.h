// The batched multi-LoRA kernel of cpu_lora.cpp (C ABI: called from Python through ctypes).
#pragma once

#include <cstdint>

extern "C" {

// y[t, :] += scale[s] * B[s, :, :rank[s]] @ (A[s, :rank[s], :] @ x[t, :]) for every row t with
// s = slot[t] >= 0. 0, or a negative code (see the definition) without touching y.
int streamengine_lora_shrink_expand(const float* x, int64_t x_stride, float* y, int64_t y_stride,
                                    const int32_t* slot, int64_t rows, const float* a, const float* b,
                                    const int32_t* rank, const float* scale, int64_t slots, int64_t max_rank,
                                    int64_t in_features, int64_t out_features);

// 1 in a build with AVX-512 or AVX2, else 0.
int streamengine_lora_available();

}  // extern "C"
