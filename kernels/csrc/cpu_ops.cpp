// Fused element-wise steps of a Llama-family layer on CPU, float32, row-major [rows, width].
//
// Why: at decode batch sizes each of these is microseconds of arithmetic, and done as separate
// PyTorch ops (RMSNorm alone is six) the per-op dispatch cost adds up to a sizeable share of
// the weight-read bound of a step. One call per fused step instead.
// Built at run time by kernels/cpu_build.py; called by kernels/cpu_ops.py.

#include "cpu_ops.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_vec_math.h"

#if defined(STREAMENGINE_SIMD)

namespace {

using namespace streamengine_simd;

// Rows are independent; threads only pay off once there is real work in the call.
constexpr int64_t PARALLEL_MIN_ELEMENTS = 1 << 16;

inline float sum_of_squares(const float* x, int64_t n) {
  vf acc = vzero();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const vf v = vload(x + i);
    acc = vfmadd(v, v, acc);
  }
  if (i < n) {
    const vf v = vload_first(x + i, n - i);
    acc = vfmadd(v, v, acc);
  }
  return vreduce_add(acc);
}

// out = weight * (x / sqrt(mean(x^2) + eps)), transformers' RMSNorm order of operations.
inline void norm_row(const float* x, const float* weight, float eps, int64_t n, float* out) {
  const float inv = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  const vf s = vset1(inv);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) vstore(out + i, vmul(vload(weight + i), vmul(vload(x + i), s)));
  for (; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

}  // namespace

// h += delta (when delta is not null), then out = RMSNorm(h) * weight. h, out: [rows, n] dense;
// delta: [rows, >= n] at row stride delta_stride.
extern "C" int streamengine_add_rms_norm(float* h, const float* delta, int64_t delta_stride, const float* weight,
                                         float eps, int64_t rows, int64_t n, float* out) {
#pragma omp parallel for if (rows * n >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; ++r) {
    float* hr = h + r * n;
    if (delta != nullptr) {
      const float* dr = delta + r * delta_stride;
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        vstore(hr + i, vadd(vload(hr + i), vload(dr + i)));
      for (; i < n; ++i) hr[i] += dr[i];
    }
    norm_row(hr, weight, eps, n, out + r * n);
  }
  return 0;
}

// In place, the first `heads` heads of each row of x ([rows, row_stride], head_dim wide each):
// (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) with cos/sin [rows, head_dim / 2] (rotate-half RoPE).
extern "C" int streamengine_rope(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                                 const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  if (head_dim % 2 != 0) return -1;
#pragma omp parallel for if (rows * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * half;
    const float* s = sin + r * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* x1 = x + r * row_stride + h * head_dim;
      float* x2 = x1 + half;
      int64_t i = 0;
      for (; i + 16 <= half; i += 16) {
        const vf a = vload(x1 + i), b = vload(x2 + i);
        const vf cv = vload(c + i), sv = vload(s + i);
        vstore(x1 + i, vsub(vmul(a, cv), vmul(b, sv)));
        vstore(x2 + i, vadd(vmul(b, cv), vmul(a, sv)));
      }
      for (; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  }
  return 0;
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, n + i]; gate_up [rows, >= 2n] at row stride
// in_stride, out [rows, n] dense.
extern "C" int streamengine_silu_mul(const float* gate_up, int64_t in_stride, int64_t rows, int64_t n, float* out) {
#pragma omp parallel for if (rows * n >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * in_stride;
    const float* u = g + n;
    float* o = out + r * n;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const vf gv = vload(g + i);
      const vf sig = vdiv(vset1(1.0f), vadd(vset1(1.0f), streamengine_cpu::exp_ps(vsub(vzero(), gv))));
      vstore(o + i, vmul(vmul(gv, sig), vload(u + i)));
    }
    for (; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
  return 0;
}

namespace {

using streamengine_cpu::e4m3_t, streamengine_cpu::e5m2_t, streamengine_cpu::half_t;

template <typename T>
inline void store_row_as(const float* src, int64_t n, float inv_scale, T* dst) {
  if constexpr (std::is_same_v<T, e4m3_t> || std::is_same_v<T, e5m2_t>)
    streamengine_cpu::store_row_fp8(src, n, inv_scale, dst);
  else
    streamengine_cpu::store_row(src, n, dst);  // unscaled formats: the caller checked inv_scale == 1
}

template <typename T>
void store_kv_rows(const float* k, int64_t k_stride, const float* v, int64_t v_stride, const int64_t* slots,
                   int64_t tokens, int64_t width, float k_inv, float v_inv, void* key_cache, void* value_cache) {
  T* kc = static_cast<T*>(key_cache);
  T* vc = static_cast<T*>(value_cache);
  // Slots are scattered over the pool: each row is a cache miss, so spread them over threads.
#pragma omp parallel for if (tokens >= 16)
  for (int64_t t = 0; t < tokens; ++t) {
    store_row_as(k + t * k_stride, width, k_inv, kc + slots[t] * width);
    store_row_as(v + t * v_stride, width, v_inv, vc + slots[t] * width);
  }
}

}  // namespace

// The K/V of this step's tokens into their cache slots: k/v rows [tokens, kv_heads * head_dim]
// at row strides k_stride / v_stride; caches [num_slots, kv_heads * head_dim] of cache_type
// (streamengine_cpu::CacheType). An 8-bit cache stores k / k_scale and v / v_scale (rounded to
// nearest even, saturated); the other types take scales of 1 only. Returns 0, or -1.
extern "C" int streamengine_store_kv_scaled(const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                                            const int64_t* slots, int64_t tokens, int64_t width, void* key_cache,
                                            void* value_cache, int64_t cache_type, float k_scale, float v_scale) {
  using namespace streamengine_cpu;
  if (!(k_scale > 0.0f && v_scale > 0.0f)) return -1;
  // One reciprocal per call, so the stored codes are those of torch's x * (1 / scale) in float32.
  const float k_inv = 1.0f / k_scale, v_inv = 1.0f / v_scale;
  const bool unit = k_scale == 1.0f && v_scale == 1.0f;
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    store_kv_rows<T>(k, k_stride, v, v_stride, slots, tokens, width, k_inv, v_inv, key_cache, value_cache);
    return 0;
  };
  switch (cache_type) {
    case CACHE_F32: return unit ? run(static_cast<float*>(nullptr)) : -1;
    case CACHE_F16: return unit ? run(static_cast<half_t*>(nullptr)) : -1;
    case CACHE_FP8_E4M3: return run(static_cast<e4m3_t*>(nullptr));
    case CACHE_FP8_E5M2: return run(static_cast<e5m2_t*>(nullptr));
    default: return -1;
  }
}

// Tests' view of the kernels' 8-bit reads: n (a multiple of 16) codes of cache_type (an 8-bit
// CacheType) widened to float32 as the attention kernels load them. Returns 0, or -1.
extern "C" int streamengine_fp8_to_float(const uint8_t* src, int64_t n, int64_t cache_type, float* dst) {
  using namespace streamengine_cpu;
  if (n % 16 != 0) return -1;
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const vf unit = vset1(load_unit<T>());
    for (int64_t i = 0; i < n; i += 16) vstore(dst + i, vmul(load16(reinterpret_cast<const T*>(src) + i), unit));
    return 0;
  };
  if (cache_type == CACHE_FP8_E4M3) return run(static_cast<e4m3_t*>(nullptr));
  if (cache_type == CACHE_FP8_E5M2) return run(static_cast<e5m2_t*>(nullptr));
  return -1;
}

// y[r, :n] += bias for a [rows, >= n] matrix at row stride ldy.
extern "C" int streamengine_add_bias(float* y, int64_t ldy, int64_t rows, int64_t n, const float* bias) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) y[r * ldy + i] += bias[i];
  return 0;
}

extern "C" int streamengine_cpu_ops_available() { return 1; }

#else

extern "C" int streamengine_cpu_ops_available() { return 0; }

#endif
