// The GGUF block formats of the packed-weight GEMM (cpu_quant_gemm.cpp, cpu_amx_gemm.cpp): how
// a panel's block of 32 k x 48 columns is laid out, read and scaled. The layout itself is
// described at the top of cpu_quant_gemm.cpp.
#pragma once

#include <cstdint>

#include "cpu_gemm_panel.h"
#include "cpu_quant_gemm.h"
#include "cpu_simd.h"

#if defined(STREAMENGINE_SIMD)

namespace streamengine_quant {

using namespace streamengine_simd;
using streamengine_panel::NR;

constexpr int64_t QK = 32;           // weights per GGUF block
constexpr int64_t SCALES = NR * 2;   // bytes of 48 float16 values

enum Format : int64_t { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, BF16 = 30 };
constexpr int64_t INT8_ACTIVATIONS = STREAMENGINE_INT8_ACTIVATIONS;  // cpu_quant_gemm.h

inline vf half16(const uint8_t* p) { return vload_half(reinterpret_cast<const uint16_t*>(p)); }

// Q4 codes: per 32-bit lane (one column), the 4-bit codes of 8 consecutive k, the t-th in bits
// 4t..4t+3. Each comes out as q * 2^NIBBLE_SHIFT[t] exactly (cpu_simd.h's nibble(): masked in
// place and converted; AVX2 shifts the top code down); whatever multiplies it
// is scaled by nibble_unscale(t) (exact too: a power of two), so the product is exact as with q
// itself. A lookup (shift, then a lane permute in a table of the 16 values) was the earlier
// AVX-512 way: on the Zen 4 cores this was measured on, shift and permute share two pipes and
// bounded the kernel; a mask and a conversion spread over more.
inline vf q4_code(const uint8_t* codes, int64_t u, int g, int t) { return nibble(codes + (u * NR + g * 16) * 4, t); }

// What exact dequantization of a Q4 block needs: the scale times nibble_unscale(t) for each
// nibble t, and the offset (the minimum m, or -8 d).
struct Q4Exact { vf dt[8], offset; };

inline Q4Exact q4_exact(vf d, vf offset) {
  Q4Exact e;
  for (int t = 0; t < 8; ++t) e.dt[t] = vmul(d, vset1(nibble_unscale(t)));
  e.offset = offset;
  return e;
}

// What the int8-activation kernel reads from a Q4 format: unit u's codes of group g (a
// column's 8 codes per int32 lane) as bytes, those of the even k, then those of the odd k; and
// how they multiply (codes below 16).
struct Q4Int8 {
  static void int8_codes(const uint8_t* codes, int64_t u, int g, vi& even, vi& odd) {
    const vi v = vload_bytes(codes + (u * NR + g * 16) * 4);
    even = low_nibbles(v);
    odd = high_nibbles(v);
  }
  static vi int8_dot(vi acc, vi codes, vi xq) { return dot_u8s8(acc, codes, xq); }
};

inline void q4_unit(const uint8_t* codes, int64_t u, int g, const Q4Exact& e, vf w[8]) {
  for (int t = 0; t < 8; ++t) w[t] = vfmadd(q4_code(codes, u, g, t), e.dt[t], e.offset);
}

// Each format: bytes per block; the scales of a block's 48 columns; `unit(...)`, the exactly
// dequantized weights of 16 columns (group g) for the K_PER_UNIT consecutive k of code unit u,
// from the block's `exact(scales)`; for the factored kernels, `code(..., t)`, the t-th k's codes
// of the unit unscaled (one at a time, so the unpacked codes never crowd out the accumulators),
// and `scale(...)`, a block's partial sum over them scaled into the output.
struct Q4_1Format : Q4Int8 {
  static constexpr int64_t FORMAT = Q4_1;
  static constexpr bool FACTORED = true;
  static constexpr int64_t BLOCK_BYTES = 2 * SCALES + 16 * NR, CODES = 2 * SCALES, K_PER_UNIT = 8;
  struct Scales { vf d, m; };
  static Scales scales(const uint8_t* block, int g) { return {half16(block + g * 32), half16(block + SCALES + g * 32)}; }
  // Exact weights d * q + m from scaled codes q * 2^s: (q * 2^s) * (d * 2^-s) is q * d
  // exactly, and the multiply-add rounds once, as d * q + m does.
  using Exact = Q4Exact;
  static Exact exact(const Scales& s) { return q4_exact(s.d, s.m); }
  static void unit(const uint8_t* codes, int64_t u, const Exact& e, int g, vf w[8]) { q4_unit(codes, u, g, e, w); }
  static constexpr bool NIBBLE_SCALED = true;
  static vf code(const uint8_t* codes, int64_t u, int g, int t) { return q4_code(codes, u, g, t); }
  // sum_k x_k (d q_k + m) = d sum_k x_k q_k + m sum_k x_k
  static vf scale(const Scales& s, vf part, vf x_sum, vf acc) { return vfmadd(s.m, x_sum, vfmadd(s.d, part, acc)); }
};

struct Q4_0Format : Q4Int8 {
  static constexpr int64_t FORMAT = Q4_0;
  static constexpr bool FACTORED = true;
  static constexpr int64_t BLOCK_BYTES = SCALES + 16 * NR, CODES = SCALES, K_PER_UNIT = 8;
  struct Scales { vf d; };
  static Scales scales(const uint8_t* block, int g) { return {half16(block + g * 32)}; }
  using Exact = Q4Exact;  // d * (q - 8) = d * q + (-8 d), each exact
  static Exact exact(const Scales& s) { return q4_exact(s.d, vmul(s.d, vset1(-8.0f))); }
  static void unit(const uint8_t* codes, int64_t u, const Exact& e, int g, vf w[8]) { q4_unit(codes, u, g, e, w); }
  static constexpr bool NIBBLE_SCALED = true;
  static vf code(const uint8_t* codes, int64_t u, int g, int t) { return q4_code(codes, u, g, t); }
  // sum_k x_k d (q_k - 8) = d sum_k x_k q_k - 8 d sum_k x_k
  static vf scale(const Scales& s, vf part, vf x_sum, vf acc) {
    return vfmadd(vmul(s.d, vset1(-8.0f)), x_sum, vfmadd(s.d, part, acc));
  }
};

struct Q8_0Format {
  static constexpr int64_t FORMAT = Q8_0;
  static constexpr bool FACTORED = true;
  static constexpr int64_t BLOCK_BYTES = SCALES + QK * NR, CODES = SCALES, K_PER_UNIT = 1;
  using Scales = Q4_0Format::Scales;
  using Exact = Scales;
  static Scales scales(const uint8_t* block, int g) { return Q4_0Format::scales(block, g); }
  static const Exact& exact(const Scales& s) { return s; }
  static void unit(const uint8_t* codes, int64_t u, const Scales& s, int g, vf w[1]) {
    w[0] = vmul(vload_i8(reinterpret_cast<const int8_t*>(codes + u * NR + g * 16)), s.d);
  }
  static constexpr bool NIBBLE_SCALED = false;
  static vf code(const uint8_t* codes, int64_t u, int g, int) {
    return vload_i8(reinterpret_cast<const int8_t*>(codes + u * NR + g * 16));
  }
  static vf scale(const Scales& s, vf part, vf, vf acc) { return vfmadd(s.d, part, acc); }
};

// bfloat16 weights: the upper half of a float32, so each widens exactly with a shift.
struct BF16Format {
  static constexpr int64_t FORMAT = BF16;
  static constexpr bool FACTORED = false;  // one multiply-add per weight already
  static constexpr int64_t BLOCK_BYTES = QK * NR * 2, CODES = 0, K_PER_UNIT = 1;
  struct Scales {};
  using Exact = Scales;
  static Scales scales(const uint8_t*, int) { return {}; }
  static const Exact& exact(const Scales& s) { return s; }
  static void unit(const uint8_t* codes, int64_t u, const Scales&, int g, vf w[1]) {
    w[0] = vload_bf16(reinterpret_cast<const uint16_t*>(codes + (u * NR + g * 16) * 2));
  }
};

// Q8_0 for the int8-activation kernel (made by cpu_quant_linear.pack_blocks with
// int8_layout): the same bytes per block as Q8_0, the 48 float16 scales, then per unit of 8 k
// two rows of 48 columns x 4 bytes, a column's codes for the unit's even k, then for its odd k,
// each stored plus 128 (unsigned, as the dot instruction's first operand must be):
// sum_k (w_k + 128) xq_k = sum_k w_k xq_k + 128 sum_k xq_k.
struct Q8_0Int8Format {
  static constexpr int64_t BLOCK_BYTES = Q8_0Format::BLOCK_BYTES, CODES = Q8_0Format::CODES;
  using Scales = Q4_0Format::Scales;
  static Scales scales(const uint8_t* block, int g) { return Q4_0Format::scales(block, g); }
  static void int8_codes(const uint8_t* codes, int64_t u, int g, vi& even, vi& odd) {
    even = vload_bytes(codes + (2 * u * NR + g * 16) * 4);
    odd = vload_bytes(codes + ((2 * u + 1) * NR + g * 16) * 4);
  }
  static vi int8_dot(vi acc, vi codes, vi xq) { return dot_u8s8_wide(acc, codes, xq); }  // codes up to 255
  static vf scale(const Scales& s, vf part, vf x_sum, vf acc) {
    return vfmadd(vmul(s.d, vset1(-128.0f)), x_sum, vfmadd(s.d, part, acc));
  }
};

}  // namespace streamengine_quant

#endif  // STREAMENGINE_SIMD
