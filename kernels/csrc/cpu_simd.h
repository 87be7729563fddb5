// The 16-lane float32 vector every C++ CPU kernel is written in, on two instruction sets:
//   AVX-512 (STREAMENGINE_SIMD == 512): one zmm register per vector, masks in k registers;
//   AVX2 + FMA + F16C (STREAMENGINE_SIMD == 256): two ymm halves per vector, masks as vectors.
// Why one 16-lane type rather than each kernel written twice: the kernels' layouts (48-column
// weight panels, 16-token score chunks, 16-lane query tiles) are shared by both builds, so the
// packed weights and every caller stay the same; only register-tile sizes differ (AVX2 has 16
// registers of half the width, against AVX-512's 32), and each kernel picks those from
// STREAMENGINE_SIMD. Without either instruction set STREAMENGINE_SIMD is undefined and every
// kernel compiles to its "unsupported" stub, so the Python side keeps its PyTorch path.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#define STREAMENGINE_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define STREAMENGINE_SIMD 256
#endif

#if defined(STREAMENGINE_SIMD)

// Put before a loop over a register tile (an array of vf indexed by template constants) that
// is not the hot loop itself, e.g. the one storing the accumulators after it. With AVX2 a vf
// is a struct, and GCC's loop vectorizer, reaching such a loop before it is unrolled, turns
// the whole array into memory: the hot loop then stores every accumulator on every iteration
// (measured: half the float32 GEMM's speed). Unrolled first, the array stays in registers.
#define UNROLL_TILE _Pragma("GCC unroll 16")

namespace streamengine_simd {

#if STREAMENGINE_SIMD == 512

using vf = __m512;      // 16 float32 lanes
using vi = __m512i;     // 16 int32 lanes
using vmask = __mmask16;

inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline float vreduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline float vreduce_max(vf v) { return _mm512_reduce_max_ps(v); }

inline vi vset1_i(int32_t x) { return _mm512_set1_epi32(x); }
inline vi vload_i(const int32_t* p) { return _mm512_loadu_si512(p); }
// Lane i = base[idx lane i] (a strided column of a row-major matrix, say).
inline vf vgather(const float* base, vi idx) { return _mm512_i32gather_ps(idx, base, 4); }

// Lanes [0, n), n in [0, 16].
inline vmask first_lanes(int64_t n) { return static_cast<vmask>((1u << n) - 1); }
inline vmask ge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline vmask ge(vi a, vi b) { return _mm512_cmpge_epi32_mask(a, b); }
inline vf keep(vmask m, vf v) { return _mm512_maskz_mov_ps(m, v); }  // 0 outside m
inline vf select(vmask m, vf if_true, vf if_false) { return _mm512_mask_mov_ps(if_false, m, if_true); }
inline vf vload_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }

// IEEE half precision <-> float32 (F16C semantics: round to nearest even).
inline vf vload_half(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore_half(uint16_t* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// bfloat16: the upper half of a float32, so each widens exactly with a shift.
inline vf vload_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Integer dot products (the int8-activation GEMM): a vi as 64 bytes, 4 per int32 lane.
inline vi vzero_i() { return _mm512_setzero_si512(); }
inline vi vload_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vi low_nibbles(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline vi high_nibbles(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline vi broadcast4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
// acc + per lane the 4 products of u's unsigned bytes by s's signed ones, for u's bytes below
// 16 (Q4 codes): without VNNI the pairs go through int16, which holds them then.
inline vi dot_u8s8(vi acc, vi u, vi s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
// The same for any unsigned bytes: without VNNI each is split into nibbles (16 h + l), so that
// the pairs stay within int16.
inline vi dot_u8s8_wide(vi acc, vi u, vi s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512i lo = _mm512_madd_epi16(_mm512_maddubs_epi16(low_nibbles(u), s), ones);
  const __m512i hi = _mm512_madd_epi16(_mm512_maddubs_epi16(high_nibbles(u), s), ones);
  return _mm512_add_epi32(acc, _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 4)));
#endif
}
inline vf vcvt_i(vi v) { return _mm512_cvtepi32_ps(v); }
inline vf vabs(vf v) { return _mm512_abs_ps(v); }
// 16 integral floats in [-128, 127] as int8, in lane order.
inline __m128i to_i8(vf v) { return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)); }

inline vf round_nearest(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n.
inline vf scale_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }

// Lane t of v in every lane.
inline vf broadcast_lane(vf v, int64_t t) { return _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(t)), v); }

// out lane i = the sum of the 16 lanes of v[i]: four rounds of "shuffle halves of two vectors,
// add", then one permute; ~3 instructions per sum instead of a full horizontal reduction each.
inline vf transpose_sum(const vf v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 128-bit quarters: vector 2i in quarters 0-1, 2i+1 in 2-3
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // quarter q of b[i] holds vector 4i + q
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // pairs of lanes within quarters
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // r's lane 4j + q holds vector 4q + j (worked out by simulating the shuffles): transpose back.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// Q4 codes: 16 int32 lanes (one per weight column), each holding the 4-bit codes of 8
// consecutive k, the t-th in bits 4t..4t+3. nibble(p, t) = code t * 2^NIBBLE_SHIFT[t], exactly: each
// code is masked in place and converted (unsigned, so bits 28-31 convert too), which spreads
// over more pipes than shifting it down first.
constexpr int NIBBLE_SHIFT[8] = {0, 4, 8, 12, 16, 20, 24, 28};
inline vf nibble(const uint8_t* p, int t) {
  return _mm512_cvtepu32_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(static_cast<int>(0xFu << (4 * t)))));
}

#else  // STREAMENGINE_SIMD == 256

struct vf { __m256 lo, hi; };     // lanes 0-7, 8-15
struct vi { __m256i lo, hi; };
struct vmask { __m256 lo, hi; };  // all ones in a selected lane

inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset1(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf vfmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf vmin(vf a, vf b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }

inline float reduce8_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vreduce_add(vf v) { return reduce8_add(_mm256_add_ps(v.lo, v.hi)); }
inline float vreduce_max(vf v) {
  const __m256 m = _mm256_max_ps(v.lo, v.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline vi vset1_i(int32_t x) { const __m256i v = _mm256_set1_epi32(x); return {v, v}; }
inline vi vload_i(const int32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
inline vf vgather(const float* base, vi idx) {
  return {_mm256_i32gather_ps(base, idx.lo, 4), _mm256_i32gather_ps(base, idx.hi, 4)};
}

inline vmask first_lanes(int64_t n) {
  const __m256i count = _mm256_set1_epi32(static_cast<int>(n));
  return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(count, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
          _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)))};
}
inline vmask ge(vf a, vf b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ)}; }
inline vmask ge(vi a, vi b) {  // a >= b: not b > a
  const __m256i ones = _mm256_set1_epi32(-1);
  return {_mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpgt_epi32(b.lo, a.lo), ones)),
          _mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpgt_epi32(b.hi, a.hi), ones))};
}
inline vf keep(vmask m, vf v) { return {_mm256_and_ps(m.lo, v.lo), _mm256_and_ps(m.hi, v.hi)}; }
inline vf select(vmask m, vf if_true, vf if_false) {
  return {_mm256_blendv_ps(if_false.lo, if_true.lo, m.lo), _mm256_blendv_ps(if_false.hi, if_true.hi, m.hi)};
}
inline vf vload_first(const float* p, int64_t n) {
  const vmask m = first_lanes(n);
  return {_mm256_maskload_ps(p, _mm256_castps_si256(m.lo)), _mm256_maskload_ps(p + 8, _mm256_castps_si256(m.hi))};
}

inline vf vload_half(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void vstore_half(uint16_t* p, vf v) {
  constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v.lo, ROUND));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(v.hi, ROUND));
}
inline vf vload_bf16(const uint16_t* p) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16))};
}
inline vf vload_i8(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
}

inline vi vzero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline vi vload_bytes(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline vi low_nibbles(vi v) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(v.lo, m), _mm256_and_si256(v.hi, m)};
}
inline vi high_nibbles(vi v) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(v.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(v.hi, 4), m)};
}
inline vi broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  const __m256i b = _mm256_set1_epi32(v);
  return {b, b};
}
// As with AVX-512 without VNNI: pairs through int16 (exact while u's bytes are below 16).
inline __m256i dot_u8s8_8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline vi dot_u8s8(vi acc, vi u, vi s) { return {dot_u8s8_8(acc.lo, u.lo, s.lo), dot_u8s8_8(acc.hi, u.hi, s.hi)}; }
// Any unsigned bytes: each split into nibbles (16 h + l), so that the pairs stay within int16.
inline vi dot_u8s8_wide(vi acc, vi u, vi s) {
  const vi lo = dot_u8s8(vzero_i(), low_nibbles(u), s), hi = dot_u8s8(vzero_i(), high_nibbles(u), s);
  return {_mm256_add_epi32(acc.lo, _mm256_add_epi32(lo.lo, _mm256_slli_epi32(hi.lo, 4))),
          _mm256_add_epi32(acc.hi, _mm256_add_epi32(lo.hi, _mm256_slli_epi32(hi.hi, 4)))};
}
inline vf vcvt_i(vi v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
inline vf vabs(vf v) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(v.lo, m), _mm256_and_ps(v.hi, m)};
}
inline __m128i to_i8(vf v) {
  const __m256i lo = _mm256_cvtps_epi32(v.lo), hi = _mm256_cvtps_epi32(v.hi);
  const __m128i lo16 = _mm_packs_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
  const __m128i hi16 = _mm_packs_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  return _mm_packs_epi16(lo16, hi16);
}

inline vf round_nearest(vf x) {
  constexpr int MODE = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, MODE), _mm256_round_ps(x.hi, MODE)};
}
// p * 2^n for integral n in [-252, 254], as two factors 2^(n/2) and 2^(n - n/2), each a
// normal float built from its exponent bits: as AVX-512's scalef, results below the normal
// range come out as denormals rather than zero.
inline __m256 scale_pow2_8(__m256 p, __m256 n) {
  const __m256i k = _mm256_cvtps_epi32(n);
  const __m256i k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}
inline vf scale_pow2(vf p, vf n) { return {scale_pow2_8(p.lo, n.lo), scale_pow2_8(p.hi, n.hi)}; }

inline vf broadcast_lane(vf v, int64_t t) {
  const __m256 b = _mm256_permutevar8x32_ps(t < 8 ? v.lo : v.hi, _mm256_set1_epi32(static_cast<int>(t & 7)));
  return {b, b};
}

// Lane i = the sum of the lanes of s[i], for 8 vectors of 8: three rounds of pairwise
// horizontal adds leave each 128-bit half holding four of the sums' halves; adding the halves
// finishes them.
inline __m256 transpose_sum8(const __m256 s[8]) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
inline vf transpose_sum(const vf v[16]) {
  __m256 s[16];
  for (int i = 0; i < 16; ++i) s[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {transpose_sum8(s), transpose_sum8(s + 8)};
}

// AVX2: codes 0-6 masked in place and converted (code t * 2^4t), as AVX-512 does; code 7
// shifted down instead, since AVX2 converts signed int32 only (bits 28-31 would read as a
// negative number). Callers unpack one code at a time, so the seven masks are loaded as memory
// operands rather than held in AVX2's 16 registers: measured on Zen 3, one batch-1 pass over
// the default model's layer weights took 8-10% less time than shifting every code down first.
constexpr int NIBBLE_SHIFT[8] = {0, 4, 8, 12, 16, 20, 24, 0};
inline vf nibble(const uint8_t* p, int t) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  if (t == 7) return {_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 28)), _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 28))};
  const __m256i mask = _mm256_set1_epi32(0xF << (4 * t));
  return {_mm256_cvtepi32_ps(_mm256_and_si256(lo, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask))};
}

#endif

// 2^-NIBBLE_SHIFT[t]: what undoes the factor nibble() leaves on code t (a power of two: exact).
constexpr float nibble_unscale(int t) { return 1.0f / static_cast<float>(1u << NIBBLE_SHIFT[t]); }

}  // namespace streamengine_simd

#endif  // STREAMENGINE_SIMD
