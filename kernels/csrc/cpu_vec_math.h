// Vector math shared by the C++ CPU kernels (AVX-512 only; include inside __AVX512F__).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace streamengine_cpu {

// KV-cache element types (EngineConfig.kv_cache_dtype): float32, or IEEE half precision kept
// as raw 16-bit words and converted with the F16C instructions (round to nearest even, as
// torch's .to(torch.float16)). Half the bytes per token: attention over long contexts is
// bound by reading K/V.
enum CacheType : int64_t { CACHE_F32 = 0, CACHE_F16 = 1 };
using half_t = uint16_t;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const half_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// n floats from src into dst, converted to the cache's element type.
inline void store_row(const float* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}
inline void store_row(const float* src, int64_t n, half_t* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// e^x as 2^(x log2 e) = 2^n * 2^f with |f| <= 1/2 and 2^f from its degree-7 Taylor
// polynomial: relative error ~1e-7, float32's own rounding. Inputs clamped to [-88, 88].
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5252733804e-5f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393e-4f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace streamengine_cpu
