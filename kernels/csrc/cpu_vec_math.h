// Vector math shared by the C++ CPU kernels, on the 16-lane vectors of cpu_simd.h (empty in a
// build with neither AVX-512 nor AVX2).
#pragma once

#include <cstdint>

#include "cpu_fp8.h"
#include "cpu_simd.h"

#if defined(STREAMENGINE_SIMD)

namespace streamengine_cpu {

using namespace streamengine_simd;

// KV-cache element types (EngineConfig.kv_cache_dtype): float32, or IEEE half precision kept
// as raw 16-bit words and converted with the F16C instructions (round to nearest even, as
// torch's .to(torch.float16)), or one of the 8-bit floats of cpu_fp8.h with a per-tensor scale.
// Fewer bytes per token: attention over long contexts is bound by reading K/V.
enum CacheType : int64_t { CACHE_F32 = 0, CACHE_F16 = 1, CACHE_FP8_E4M3 = 2, CACHE_FP8_E5M2 = 3 };
using half_t = uint16_t;

// 16 elements as float32, in units of load_unit<T>() (cpu_fp8.h): the caller folds that factor
// and the tensor's scale into one multiply outside its loops.
inline vf load16(const float* p) { return vload(p); }
inline vf load16(const half_t* p) { return vload_half(p); }
inline vf load16(const e4m3_t* p) { return vload_fp8(p); }
inline vf load16(const e5m2_t* p) { return vload_fp8(p); }

// n floats from src into dst, converted to the cache's element type.
inline void store_row(const float* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}
inline void store_row(const float* src, int64_t n, half_t* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) vstore_half(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// 8-bit floats store src * inv_scale (the tensor's scale is 1 / inv_scale), saturated.
template <typename T>
inline void store_row_fp8(const float* src, int64_t n, float inv_scale, T* dst) {
  const vf s = vset1(inv_scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) vstore_fp8(dst + i, vmul(vload(src + i), s));
  for (; i < n; ++i) dst[i].bits = fp8_from_float<T>(src[i] * inv_scale);
}

// e^x as 2^(x log2 e) = 2^n * 2^f with |f| <= 1/2 and 2^f from its degree-7 Taylor
// polynomial: relative error ~1e-7, float32's own rounding. Inputs clamped to [-88, 88].
inline vf exp_ps(vf x) {
  x = vmin(vmax(x, vset1(-88.0f)), vset1(88.0f));
  const vf t = vmul(x, vset1(1.44269504089f));
  const vf n = round_nearest(t);
  const vf f = vsub(t, n);
  vf p = vset1(1.5252733804e-5f);
  p = vfmadd(p, f, vset1(1.5403530393e-4f));
  p = vfmadd(p, f, vset1(1.3333558146e-3f));
  p = vfmadd(p, f, vset1(9.6181291076e-3f));
  p = vfmadd(p, f, vset1(5.5504108665e-2f));
  p = vfmadd(p, f, vset1(2.4022650696e-1f));
  p = vfmadd(p, f, vset1(6.9314718056e-1f));
  p = vfmadd(p, f, vset1(1.0f));
  return scale_pow2(p, n);
}

}  // namespace streamengine_cpu

#endif  // STREAMENGINE_SIMD
