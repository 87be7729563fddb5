// 8-bit float KV-cache elements (EngineConfig.kv_cache_dtype "fp8_e4m3" / "fp8_e5m2"), converted
// in registers, 16 lanes at a time, on both instruction sets of cpu_simd.h.
//
// Both formats are read through the F16C half -> float conversion: an e5m2 byte is the upper
// byte of an IEEE half, and an e4m3fn byte (bias 7, no infinities, NaN = S.1111.111) moved to a
// half's exponent/mantissa fields is its value times 2^-8, exactly (e4m3 subnormals land on half
// subnormals, which F16C widens exactly). So a load is a byte widen, two shifts and one
// conversion, and the 2^8 is folded by the caller into the per-tensor scale (`load_unit`).
//
// Stores round float32 to nearest even on the float's own bits (no double rounding through
// half), after saturating to the format's largest finite value (448 / 57344, as vLLM's
// conversion; NaN stays NaN): bit for bit torch's `x.clamp(-max, max).to(float8_*)`.
#pragma once

#include <cstdint>

#include "cpu_simd.h"

#if defined(STREAMENGINE_SIMD)

namespace streamengine_cpu {

using streamengine_simd::vf;

struct e4m3_t { uint8_t bits; };  // torch.float8_e4m3fn
struct e5m2_t { uint8_t bits; };  // torch.float8_e5m2

// A format's constants: mantissa bits, exponent bias, largest finite value, smallest normal.
template <typename T> struct Fp8Format;
template <> struct Fp8Format<e4m3_t> {
  static constexpr int MANT = 3, BIAS = 7;
  static constexpr float MAX = 448.0f, MIN_NORMAL = 0x1p-6f, SUBNORMAL_UNIT = 0x1p-9f;
};
template <> struct Fp8Format<e5m2_t> {
  static constexpr int MANT = 2, BIAS = 15;
  static constexpr float MAX = 57344.0f, MIN_NORMAL = 0x1p-14f, SUBNORMAL_UNIT = 0x1p-16f;
};

// What a load16 of T must be multiplied by to give the stored value (before the tensor scale).
template <typename T> constexpr float load_unit() { return 1.0f; }
template <> constexpr float load_unit<e4m3_t>() { return 256.0f; }

// The code of |x| (x saturated, NaN-free path), RNE, as an int: the scalar twin of the vector code.
template <typename T>
inline uint8_t fp8_from_float(float x) {
  using F = Fp8Format<T>;
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  if (x != x) return sign | 0x7F;
  float ax = x < 0 ? -x : x;
  ax = ax < F::MAX ? ax : F::MAX;
  if (ax < F::MIN_NORMAL) return sign | static_cast<uint8_t>(__builtin_nearbyintf(ax / F::SUBNORMAL_UNIT));
  uint32_t u;
  std::memcpy(&u, &ax, 4);
  constexpr int SHIFT = 23 - F::MANT;
  u = (u + ((1u << (SHIFT - 1)) - 1) + ((u >> SHIFT) & 1)) >> SHIFT;
  return sign | static_cast<uint8_t>(u - ((127 - F::BIAS) << F::MANT));
}

// 16 bytes as halves: e4m3 moved into the half's fields (NaN forced to a half NaN whose float is
// torch's 0x7FF00000), e5m2 as the upper byte.
// 256-bit integer steps only: the same for the AVX-512 and the AVX2 build.
inline __m256i fp8_to_half_bits(const e4m3_t* p) {
  // Sign-extended and shifted by 7, a byte lands with its sign in bits 15 and 14 and its other
  // seven bits in 13..7: clearing bit 14 leaves the half. NaN (S.1111.111) gets exponent 31.
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x3F80)), _mm256_set1_epi16(0x3F80));
  return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x4000)));
}
inline __m256i fp8_to_half_bits(const e5m2_t* p) {
  return _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
}

#if STREAMENGINE_SIMD == 512

template <typename T>
inline vf vload_fp8(const T* p) { return _mm512_cvtph_ps(fp8_to_half_bits(p)); }

// 16 floats to codes, stored as 16 bytes.
template <typename T>
inline void vstore_fp8(T* p, vf x) {
  using F = Fp8Format<T>;
  constexpr int SHIFT = 23 - F::MANT;
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512 ax = _mm512_min_ps(_mm512_set1_ps(F::MAX), _mm512_abs_ps(x));  // NaN: min returns ax
  const __m512i u = _mm512_castps_si512(ax);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, SHIFT), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32((1 << (SHIFT - 1)) - 1), odd)), SHIFT);
  __m512i code = _mm512_sub_epi32(rounded, _mm512_set1_epi32((127 - F::BIAS) << F::MANT));
  const __m512i sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(ax, _mm512_set1_ps(1.0f / F::SUBNORMAL_UNIT)),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(ax, _mm512_set1_ps(F::MIN_NORMAL), _CMP_LT_OQ), sub);
  code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(ax, ax, _CMP_UNORD_Q), _mm512_set1_epi32(0x7F));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign)));
}

#else  // STREAMENGINE_SIMD == 256

template <typename T>
inline vf vload_fp8(const T* p) {
  const __m256i h = fp8_to_half_bits(p);
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}

// 8 floats to codes as int32 lanes (the AVX-512 version's steps, blends for masks).
template <typename T>
inline __m256i fp8_codes8(__m256 x) {
  using F = Fp8Format<T>;
  constexpr int SHIFT = 23 - F::MANT;
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256 abs = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  const __m256 ax = _mm256_min_ps(_mm256_set1_ps(F::MAX), abs);  // NaN: min returns abs
  const __m256i u = _mm256_castps_si256(ax);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, SHIFT), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32((1 << (SHIFT - 1)) - 1), odd)), SHIFT);
  const __m256i code = _mm256_sub_epi32(rounded, _mm256_set1_epi32((127 - F::BIAS) << F::MANT));
  const __m256 scaled = _mm256_round_ps(_mm256_mul_ps(ax, _mm256_set1_ps(1.0f / F::SUBNORMAL_UNIT)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i sub = _mm256_cvtps_epi32(scaled);  // integral already: exact whatever the mode
  const __m256 is_sub = _mm256_cmp_ps(ax, _mm256_set1_ps(F::MIN_NORMAL), _CMP_LT_OQ);
  const __m256 is_nan = _mm256_cmp_ps(ax, ax, _CMP_UNORD_Q);
  __m256i out = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(code), _mm256_castsi256_ps(sub), is_sub));
  out = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(out), _mm256_castsi256_ps(_mm256_set1_epi32(0x7F)), is_nan));
  return _mm256_or_si256(out, sign);
}
template <typename T>
inline void vstore_fp8(T* p, vf x) {
  // int32 codes (0..255) -> uint16 -> uint8; packus interleaves 128-bit lanes, the permute undoes it.
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(fp8_codes8<T>(x.lo), fp8_codes8<T>(x.hi)), 0xD8);
  const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bytes);
}

#endif

}  // namespace streamengine_cpu

#endif  // STREAMENGINE_SIMD
