// GEMM with weights kept in GGUF block formats (Q4_0, Q4_1, Q8_0) or as bfloat16:
// y[M, N] = x[M, K] @ W^T, dequantization fused into the multiply.
//
// Why: a decode step reads every weight once, so its time is the weight stream. A Q4_1 weight
// is 5 bits (a 4-bit code plus a share of its block's float16 scale and minimum) against 32
// for float32. Each weight is unpacked in registers right before its multiply-add.
//
// Arithmetic. Up to REGISTER_ROWS input rows (decode) each block's scale is factored out of
// its 32-term sum: y += d * sum_k x_k q_k + m * sum_k x_k (Q4_1; Q4_0 and Q8_0 alike), so a
// weight costs one multiply-add instead of two (dequantize, then multiply). That is the float32
// GEMM over the dequantized weights up to the order of float32 roundings, not bit for bit;
// greedy parity with transformers is tested on the default model. Larger batches dequantize
// each weight exactly as GGUF defines it (d * q + m, d * (q - 8), d * q; each exact in float32)
// and accumulate over k in order, one fused multiply-add per weight, as the float32 kernel
// (cpu_gemm_panel.h) does: there the result equals the float32 GEMM bit for bit. bfloat16
// weights widen exactly and take that path at every batch size.
//
// Layout (made by kernels/cpu_quant_linear.py from the file's blocks): panels of NR = 48
// output columns, as in the float32 kernel; a panel is K / 32 blocks, each holding the 48
// columns' float16 scales, then (Q4_1) their float16 minimums, then the codes k-major:
// Q8_0 32 rows of 48 int8; BF16 (no scales) 32 rows of 48 bfloat16; Q4 4 units of 8 k, each 48 columns x 4 bytes, byte b of column j
// holding its codes for k = 2b (low nibble) and 2b + 1 (high nibble) of the unit.
//
// Up to REGISTER_ROWS input rows the codes are unpacked in registers and used by every row at
// once. Larger batches unpack each panel into a float32 buffer in L1/L2 and run the float32
// micro-kernel over it, so the unpacking is shared by all rows.

#include "cpu_quant_gemm.h"

#include <cstdint>
#include <vector>

#include "cpu_gemm.h"

#include "cpu_gemm_panel.h"

#if defined(STREAMENGINE_SIMD)

namespace {

using namespace streamengine_simd;
using streamengine_panel::NR;

constexpr int64_t QK = 32;           // weights per GGUF block
constexpr int64_t SCALES = NR * 2;   // bytes of 48 float16 values

// Rows served by weights unpacked in registers, and how many of a panel's three 16-column
// groups those rows take in one pass. What must stay in registers is each row's per-block
// partial sums (updated every k; the block totals are touched once per 32 k): few rows take
// all three groups, so that enough independent accumulators hide the multiply-add latency;
// more rows take one group at a time. AVX2 has half the registers of half the width.
constexpr int REGISTER_ROWS = STREAMENGINE_SIMD == 512 ? 8 : 6;
constexpr int groups_for(int rows) { return rows <= (STREAMENGINE_SIMD == 512 ? 4 : 2) ? 3 : 1; }

enum Format : int64_t { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, BF16 = 30 };

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

inline void q4_unit(const uint8_t* codes, int64_t u, int g, const Q4Exact& e, vf w[8]) {
  for (int t = 0; t < 8; ++t) w[t] = vfmadd(q4_code(codes, u, g, t), e.dt[t], e.offset);
}

// Each format: bytes per block; the scales of a block's 48 columns; `unit(...)`, the exactly
// dequantized weights of 16 columns (group g) for the K_PER_UNIT consecutive k of code unit u,
// from the block's `exact(scales)`; for the factored kernels, `code(..., t)`, the t-th k's codes
// of the unit unscaled (one at a time, so the unpacked codes never crowd out the accumulators),
// and `scale(...)`, a block's partial sum over them scaled into the output.
struct Q4_1Format {
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

struct Q4_0Format {
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

// Weights stream from memory once per step. The hardware prefetcher alone keeps too few lines
// in flight while the unpacking keeps the core busy: on Zen 3 (AVX2) one row's Q4_1 GEMM read
// its weights at about 9 GB/s of the 20+ GB/s two cores stream. Asking for the lines
// PREFETCH_BYTES ahead (into L2: the core's L1 is left to the codes in use) overlaps the two.
constexpr int64_t PREFETCH_BYTES = 16 * 1024;

template <typename Fmt>
inline void prefetch_ahead(const uint8_t* block) {
  UNROLL_TILE
  for (int64_t line = 0; line < (Fmt::BLOCK_BYTES + 63) / 64; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(block + PREFETCH_BYTES + line * 64), _MM_HINT_T1);
}

// ROWS input rows against one panel, codes unpacked in registers, GROUPS of the panel's three
// 16-column groups at a time. Each unpacked weight serves every row. Few rows take all three
// groups at once, so that enough independent accumulators hide the multiply-add latency; more
// rows take one group at a time, so that ROWS accumulators, the group's scales and a unit of
// weights fit the registers (groups_for).
template <typename Fmt, int ROWS, int GROUPS>
void register_rows(const float* x, int64_t K, const uint8_t* panel, float* y, int64_t ldy) {
  constexpr int64_t KU = Fmt::K_PER_UNIT;
  for (int g0 = 0; g0 < 3; g0 += GROUPS) {
    vf acc[ROWS][GROUPS];
    UNROLL_TILE
    for (int r = 0; r < ROWS; ++r)
      for (int g = 0; g < GROUPS; ++g) acc[r][g] = vzero();
    for (int64_t b = 0; b < K / QK; ++b) {
      const uint8_t* block = panel + b * Fmt::BLOCK_BYTES;
      typename Fmt::Exact s[GROUPS];
      for (int g = 0; g < GROUPS; ++g) s[g] = Fmt::exact(Fmt::scales(block, g0 + g));
      for (int64_t u = 0; u < QK / KU; ++u) {
        const int64_t k = b * QK + u * KU;
        for (int g = 0; g < GROUPS; ++g) {
          vf w[KU];
          Fmt::unit(block + Fmt::CODES, u, s[g], g0 + g, w);
          for (int64_t t = 0; t < KU; ++t)  // k in order: the float32 kernel's summation order
            UNROLL_TILE
            for (int r = 0; r < ROWS; ++r)
              acc[r][g] = vfmadd(vset1(x[r * K + k + t]), w[t], acc[r][g]);
        }
      }
    }
    UNROLL_TILE
    for (int r = 0; r < ROWS; ++r)
      for (int g = 0; g < GROUPS; ++g) vstore(y + r * ldy + (g0 + g) * 16, acc[r][g]);
  }
}

// The same with each block's scale factored out of its 32-term sum: a weight costs one
// multiply-add (code times input) instead of two (dequantize, then multiply), and the block's
// partial sum is scaled once per block. x_sums[r * K / 32 + b]: row r's inputs summed over block
// b (for a minimum's term).
template <typename Fmt, int ROWS, int GROUPS>
void factored_rows(const float* x, const float* x_sums, int64_t K, const uint8_t* panel, float* y, int64_t ldy) {
  constexpr int64_t KU = Fmt::K_PER_UNIT;
  const int64_t blocks = K / QK;
  for (int g0 = 0; g0 < 3; g0 += GROUPS) {
    vf acc[ROWS][GROUPS];
    UNROLL_TILE
    for (int r = 0; r < ROWS; ++r)
      for (int g = 0; g < GROUPS; ++g) acc[r][g] = vzero();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = panel + b * Fmt::BLOCK_BYTES;
      if (g0 == 0) prefetch_ahead<Fmt>(block);
      vf part[ROWS][GROUPS];
      UNROLL_TILE
      for (int r = 0; r < ROWS; ++r)
        for (int g = 0; g < GROUPS; ++g) part[r][g] = vzero();
      for (int64_t u = 0; u < QK / KU; ++u) {
        const int64_t k = b * QK + u * KU;
        UNROLL_TILE
        for (int t = 0; t < KU; ++t)
          for (int g = 0; g < GROUPS; ++g) {
            const vf q = Fmt::code(block + Fmt::CODES, u, g0 + g, t);
            UNROLL_TILE
            for (int r = 0; r < ROWS; ++r) part[r][g] = vfmadd(vset1(x[r * K + k + t]), q, part[r][g]);
          }
      }
      for (int g = 0; g < GROUPS; ++g) {
        const typename Fmt::Scales s = Fmt::scales(block, g0 + g);
        UNROLL_TILE
        for (int r = 0; r < ROWS; ++r)
          acc[r][g] = Fmt::scale(s, part[r][g], vset1(x_sums[r * blocks + b]), acc[r][g]);
      }
    }
    UNROLL_TILE
    for (int r = 0; r < ROWS; ++r)
      for (int g = 0; g < GROUPS; ++g) vstore(y + r * ldy + (g0 + g) * 16, acc[r][g]);
  }
}

// M (1..REGISTER_ROWS) rows against one panel, each row count its own instance. With AVX-512,
// up to 4 rows take all three groups in one pass: at 3-4 rows some registers spill, but that
// measured faster than three passes while the weights stream from memory.
template <typename Fmt, int ROWS = 1>
void factored_panel(const float* x, const float* x_sums, int64_t M, int64_t K, const uint8_t* panel, float* y,
                    int64_t ldy) {
  if constexpr (ROWS < REGISTER_ROWS) {
    if (M > ROWS) return factored_panel<Fmt, ROWS + 1>(x, x_sums, M, K, panel, y, ldy);
  }
  factored_rows<Fmt, ROWS, groups_for(ROWS)>(x, x_sums, K, panel, y, ldy);
}

template <typename Fmt, int ROWS = 1>
void register_panel(const float* x, int64_t M, int64_t K, const uint8_t* panel, float* y, int64_t ldy) {
  if constexpr (ROWS < REGISTER_ROWS) {
    if (M > ROWS) return register_panel<Fmt, ROWS + 1>(x, M, K, panel, y, ldy);
  }
  register_rows<Fmt, ROWS, groups_for(ROWS)>(x, K, panel, y, ldy);
}

// One panel's weights as float32 [K][48], the float32 kernel's panel layout.
template <typename Fmt>
void dequant_panel(const uint8_t* panel, int64_t K, float* out) {
  constexpr int64_t KU = Fmt::K_PER_UNIT;
  for (int64_t b = 0; b < K / QK; ++b) {
    const uint8_t* block = panel + b * Fmt::BLOCK_BYTES;
    for (int g = 0; g < 3; ++g) {
      const typename Fmt::Exact s = Fmt::exact(Fmt::scales(block, g));
      for (int64_t u = 0; u < QK / KU; ++u) {
        vf w[KU];
        Fmt::unit(block + Fmt::CODES, u, s, g, w);
        for (int64_t t = 0; t < KU; ++t) vstore(out + (b * QK + u * KU + t) * NR + g * 16, w[t]);
      }
    }
  }
}

// This thread's buffer for one unpacked panel [K][48] (192 * K bytes: in L2 for the hidden
// sizes of small models) while all M rows use it. Kept between calls (the pool's threads persist), grown when K grows, never cleared.
inline float* panel_buffer(int64_t K) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < K * NR) buffer.resize(K * NR);
  return buffer.data();
}

// nibble_unscale(k mod 8) for 16 consecutive k from a multiple of 8: the prescale of Q4 codes'
// inputs.
alignas(64) constexpr float NIBBLE_SCALES[16] = {
    nibble_unscale(0), nibble_unscale(1), nibble_unscale(2), nibble_unscale(3),
    nibble_unscale(4), nibble_unscale(5), nibble_unscale(6), nibble_unscale(7),
    nibble_unscale(0), nibble_unscale(1), nibble_unscale(2), nibble_unscale(3),
    nibble_unscale(4), nibble_unscale(5), nibble_unscale(6), nibble_unscale(7)};

// What the factored kernels read besides the codes: the inputs they multiply (for Q4 codes,
// scaled by nibble_unscale(t), t = k mod 8 the nibble that input k's code sits in) and each row's sums over
// its 32-input blocks (for a block minimum's or offset's term).
struct FactoredInputs { const float* x; const float* sums; };

// Made once per call in this thread's buffers; both are exact or in a fixed order, so every
// panel (and every thread) sees the same values.
inline FactoredInputs prepare_inputs(const float* x, int64_t M, int64_t K, bool nibble_scaled) {
  thread_local std::vector<float> sums, scaled;
  const int64_t blocks = K / QK;
  if (static_cast<int64_t>(sums.size()) < M * blocks) sums.resize(M * blocks);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + r * K + b * QK;
      sums[r * blocks + b] = vreduce_add(vadd(vload(v), vload(v + 16)));
    }
  if (!nibble_scaled) return {x, sums.data()};
  const vf pattern = vload(NIBBLE_SCALES);
  if (static_cast<int64_t>(scaled.size()) < M * K) scaled.resize(M * K);
  for (int64_t i = 0; i < M * K; i += 16) vstore(scaled.data() + i, vmul(vload(x + i), pattern));
  return {scaled.data(), sums.data()};
}

// Panels are handed out dynamically (guided), as in the float32 kernel: on a shared machine a
// thread that is descheduled mid-GEMM leaves its share to the others instead of stalling them.
template <typename Fmt>
void quant_gemm(const float* x, int64_t M, int64_t K, const uint8_t* panels, int64_t n_padded, float* y) {
  const int64_t num_panels = n_padded / NR, panel_bytes = K / QK * Fmt::BLOCK_BYTES;
  if (M <= REGISTER_ROWS) {
    if constexpr (Fmt::FACTORED) {
      const FactoredInputs in = prepare_inputs(x, M, K, Fmt::NIBBLE_SCALED);
#pragma omp parallel for schedule(guided)
      for (int64_t p = 0; p < num_panels; ++p)
        factored_panel<Fmt>(in.x, in.sums, M, K, panels + p * panel_bytes, y + p * NR, n_padded);
    } else {
#pragma omp parallel for schedule(guided)
      for (int64_t p = 0; p < num_panels; ++p)
        register_panel<Fmt>(x, M, K, panels + p * panel_bytes, y + p * NR, n_padded);
    }
    return;
  }
#pragma omp parallel for schedule(guided)
  for (int64_t p = 0; p < num_panels; ++p) {
    float* buffer = panel_buffer(K);
    dequant_panel<Fmt>(panels + p * panel_bytes, K, buffer);
    streamengine_panel::panel_rows(x, M, K, buffer, y + p * NR, n_padded, nullptr);
  }
}

template <typename Fmt>
void dequant_all(const uint8_t* panels, int64_t K, int64_t n_padded, float* out) {
  const int64_t panel_bytes = K / QK * Fmt::BLOCK_BYTES;
#pragma omp parallel for schedule(guided)
  for (int64_t p = 0; p < n_padded / NR; ++p) dequant_panel<Fmt>(panels + p * panel_bytes, K, out + p * K * NR);
}

bool valid(const int64_t* w) {
  return w[WEIGHT_K] > 0 && w[WEIGHT_N_PADDED] > 0 && w[WEIGHT_N_PADDED] % NR == 0 &&
         (w[WEIGHT_FORMAT] == F32 || w[WEIGHT_K] % QK == 0);
}

}  // namespace

extern "C" int streamengine_quant_register_rows() { return REGISTER_ROWS; }

extern "C" int64_t streamengine_quant_block_bytes(int64_t format) {
  switch (format) {
    case Q4_0: return Q4_0Format::BLOCK_BYTES;
    case Q4_1: return Q4_1Format::BLOCK_BYTES;
    case Q8_0: return Q8_0Format::BLOCK_BYTES;
    case BF16: return BF16Format::BLOCK_BYTES;
    default: return 0;
  }
}

extern "C" int streamengine_gemm(const int64_t* weight, const float* x, int64_t M, float* y) {
  if (M < 0 || !valid(weight)) return -1;
  if (M == 0) return 0;  // the row kernels assume at least one row
  const int64_t K = weight[WEIGHT_K], n_padded = weight[WEIGHT_N_PADDED];
  const auto* data = reinterpret_cast<const uint8_t*>(weight[WEIGHT_DATA]);
  switch (weight[WEIGHT_FORMAT]) {
    case F32: return streamengine_sgemm_packed(x, M, K, reinterpret_cast<const float*>(data), n_padded, y);
    case Q4_0: quant_gemm<Q4_0Format>(x, M, K, data, n_padded, y); return 0;
    case Q4_1: quant_gemm<Q4_1Format>(x, M, K, data, n_padded, y); return 0;
    case Q8_0: quant_gemm<Q8_0Format>(x, M, K, data, n_padded, y); return 0;
    case BF16: quant_gemm<BF16Format>(x, M, K, data, n_padded, y); return 0;
    default: return -1;
  }
}

extern "C" int streamengine_dequant_panels(const int64_t* weight, float* out) {
  if (!valid(weight)) return -1;
  const int64_t K = weight[WEIGHT_K], n_padded = weight[WEIGHT_N_PADDED];
  const auto* data = reinterpret_cast<const uint8_t*>(weight[WEIGHT_DATA]);
  switch (weight[WEIGHT_FORMAT]) {
    case Q4_0: dequant_all<Q4_0Format>(data, K, n_padded, out); return 0;
    case Q4_1: dequant_all<Q4_1Format>(data, K, n_padded, out); return 0;
    case Q8_0: dequant_all<Q8_0Format>(data, K, n_padded, out); return 0;
    case BF16: dequant_all<BF16Format>(data, K, n_padded, out); return 0;
    default: return -1;
  }
}

#else  // neither AVX-512 nor AVX2: no format is supported and Python keeps the dequantized weights.

extern "C" int64_t streamengine_quant_block_bytes(int64_t) { return 0; }
extern "C" int streamengine_quant_register_rows() { return 0; }
extern "C" int streamengine_gemm(const int64_t*, const float*, int64_t, float*) { return -1; }
extern "C" int streamengine_dequant_panels(const int64_t*, float*) { return -1; }

#endif
