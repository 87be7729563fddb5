// The fused element-wise steps of cpu_ops.cpp (C ABI: called from Python through ctypes and
// from cpu_layer.cpp). Defined only in a build with AVX-512 or AVX2 (cpu_simd.h), except the availability probe.
#pragma once

#include <cstdint>

extern "C" {

// h += delta (when delta is not null), then out = RMSNorm(h) * weight.
int streamengine_add_rms_norm(float* h, const float* delta, int64_t delta_stride, const float* weight, float eps,
                              int64_t rows, int64_t n, float* out);

// Rotate-half RoPE, in place, on the first `heads` heads of each row of x.
int streamengine_rope(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                      const float* cos, const float* sin);

// out = silu(gate) * up for gate_up rows [gate | up].
int streamengine_silu_mul(const float* gate_up, int64_t in_stride, int64_t rows, int64_t n, float* out);

// This step's K/V rows into their cache slots, converted to cache_type (CacheType,
// cpu_vec_math.h): an 8-bit cache stores k / k_scale and v / v_scale, the other types take
// scales of 1 only.
int streamengine_store_kv_scaled(const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                                 const int64_t* slots, int64_t tokens, int64_t width, void* key_cache,
                                 void* value_cache, int64_t cache_type, float k_scale, float v_scale);

// n 8-bit codes of cache_type widened to float32 as the attention kernels read them (tests).
int streamengine_fp8_to_float(const uint8_t* src, int64_t n, int64_t cache_type, float* dst);

// y[r, :n] += bias.
int streamengine_add_bias(float* y, int64_t ldy, int64_t rows, int64_t n, const float* bias);

// 1 in a build with AVX-512 or AVX2, else 0.
int streamengine_cpu_ops_available();

}  // extern "C"
