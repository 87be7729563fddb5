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
// micro-kernel over it, so the unpacking is shared by all rows; where the CPU has AMX-BF16,
// those of Q4_0, Q4_1 and Q8_0 run on its tiles instead (cpu_amx_gemm.cpp).

#include "cpu_quant_gemm.h"

#include <cstdint>
#include <vector>

#include "cpu_amx_gemm.h"
#include "cpu_gemm.h"

#include "cpu_gemm_panel.h"
#include "cpu_quant_formats.h"

#if defined(STREAMENGINE_SIMD)

namespace {

using namespace streamengine_simd;
using streamengine_panel::NR;
using namespace streamengine_quant;

// Rows served by weights unpacked in registers, and how many of a panel's three 16-column
// groups those rows take in one pass. What must stay in registers is each row's per-block
// partial sums (updated every k; the block totals are touched once per 32 k): few rows take
// all three groups, so that enough independent accumulators hide the multiply-add latency;
// more rows take one group at a time. AVX2 has half the registers of half the width.
constexpr int REGISTER_ROWS = STREAMENGINE_SIMD == 512 ? 8 : 6;
constexpr int groups_for(int rows) { return rows <= (STREAMENGINE_SIMD == 512 ? 4 : 2) ? 3 : 1; }

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
  if (Fmt::FACTORED && streamengine_amx::gemm(Fmt::FORMAT, x, M, K, panels, n_padded, y)) return;
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

// ---- int8 activations (opt-in: not the float32 GEMM) ----
//
// Each row's inputs are quantized per 32-input block as llama.cpp quantizes them for its Q4
// formats (Q8_1): dx = max |x| / 127, xq = round(x / dx) in int8. A block's Q4 codes (0..15,
// unsigned) times xq then sum in integers, four products per int32 lane in one instruction
// (VNNI's vpdpbusd, or a multiply-add pair without it), and the block adds
//   d * dx * sum_k q_k xq_k + m * dx * sum_k xq_k  (Q4_1; Q4_0 is m = -8 d)
// to the float32 output. Per 32 inputs x 16 columns: 8 integer dot instructions where the
// float32 kernel does 32 multiply-adds. Not exact: each input moves by up to dx / 2. Q8_0
// weights take the same path from their own layout (Q8_0Int8Format, cpu_quant_formats.h).
//
// The codes are read from the same panels as above, unpacked in registers: a column's unit
// (8 k) is one int32 whose low nibbles hold its codes for the even k and whose high nibbles
// those for the odd k, so each row's quantized inputs are stored per unit as its 4 even-k
// then its 4 odd-k values (what one int32 lane multiplies by the low, then the high, nibbles).

// Rows' quantized inputs: q [M][K] int8 in unit order (above), per 32-input block the scale
// dx and dx * sum xq, [M][K / 32] each.
struct Int8Rows { const int8_t* q; const float* scale; const float* sum; int64_t K; };

// x[0..32) quantized into q (unit order), *scale and *sum.
inline void quantize_block(const float* x, int8_t* q, float* scale, float* sum) {
  const vf a = vload(x), b = vload(x + 16);
  const float dx = vreduce_max(vmax(vabs(a), vabs(b))) / 127.0f;
  const vf inverse = vset1(dx != 0.0f ? 1.0f / dx : 0.0f);
  const vf qa = round_nearest(vmul(a, inverse)), qb = round_nearest(vmul(b, inverse));
  // Within each unit of 8: even positions, then odd ones.
  const __m128i units = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_shuffle_epi8(to_i8(qa), units));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm_shuffle_epi8(to_i8(qb), units));
  *scale = dx;
  *sum = dx * vreduce_add(vadd(qa, qb));
}

// Rows per register tile, and how many of a panel's three column groups a pass takes: with
// AVX-512 4 rows x 3 groups of integer and float accumulators fill 24 of the 32 registers;
// AVX2 (16 registers, each vector two) takes one group at a time.
constexpr int INT8_ROWS = 4;
constexpr int INT8_GROUPS = STREAMENGINE_SIMD == 512 ? 3 : 1;

// Rows [r0, r0 + ROWS) against one panel.
template <typename Fmt, int ROWS>
void int8_rows(const Int8Rows& x, int64_t r0, const uint8_t* panel, float* y, int64_t ldy) {
  const int64_t K = x.K, blocks = K / QK;
  for (int g0 = 0; g0 < 3; g0 += INT8_GROUPS) {
    vf acc[ROWS][INT8_GROUPS];
    UNROLL_TILE
    for (int r = 0; r < ROWS; ++r)
      for (int g = 0; g < INT8_GROUPS; ++g) acc[r][g] = vzero();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = panel + b * Fmt::BLOCK_BYTES;
      vi dots[ROWS][INT8_GROUPS];
      UNROLL_TILE
      for (int r = 0; r < ROWS; ++r)
        for (int g = 0; g < INT8_GROUPS; ++g) dots[r][g] = vzero_i();
      for (int64_t u = 0; u < QK / 8; ++u) {
        const int8_t* xq = x.q + r0 * K + b * QK + u * 8;
        UNROLL_TILE
        for (int g = 0; g < INT8_GROUPS; ++g) {
          vi even, odd;
          Fmt::int8_codes(block + Fmt::CODES, u, g0 + g, even, odd);
          UNROLL_TILE
          for (int r = 0; r < ROWS; ++r)
            dots[r][g] = Fmt::int8_dot(Fmt::int8_dot(dots[r][g], even, broadcast4(xq + r * K)), odd, broadcast4(xq + r * K + 4));
        }
      }
      UNROLL_TILE
      for (int g = 0; g < INT8_GROUPS; ++g) {
        const typename Fmt::Scales s = Fmt::scales(block, g0 + g);
        UNROLL_TILE
        for (int r = 0; r < ROWS; ++r) {
          const int64_t i = (r0 + r) * blocks + b;
          acc[r][g] = Fmt::scale(s, vmul(vcvt_i(dots[r][g]), vset1(x.scale[i])), vset1(x.sum[i]), acc[r][g]);
        }
      }
    }
    UNROLL_TILE
    for (int r = 0; r < ROWS; ++r)
      for (int g = 0; g < INT8_GROUPS; ++g) vstore(y + r * ldy + (g0 + g) * 16, acc[r][g]);
  }
}

// The last 1..INT8_ROWS - 1 rows (from r0), each count its own instance, as factored_panel does.
template <typename Fmt, int ROWS = 1>
void int8_tail(const Int8Rows& x, int64_t rows, int64_t r0, const uint8_t* panel, float* y, int64_t ldy) {
  if constexpr (ROWS + 1 < INT8_ROWS) {
    if (rows > ROWS) return int8_tail<Fmt, ROWS + 1>(x, rows, r0, panel, y, ldy);
  }
  int8_rows<Fmt, ROWS>(x, r0, panel, y, ldy);
}

template <typename Fmt>
void int8_panel(const Int8Rows& x, int64_t M, const uint8_t* panel, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + INT8_ROWS <= M; r += INT8_ROWS) int8_rows<Fmt, INT8_ROWS>(x, r, panel, y + r * ldy, ldy);
  if (r < M) int8_tail<Fmt>(x, M - r, r, panel, y + r * ldy, ldy);
}

// Quantizes the rows once (the buffers belong to the calling thread, shared by the team for
// this call), then hands out panels as the other kernels do.
template <typename Fmt>
void int8_gemm(const float* x, int64_t M, int64_t K, const uint8_t* panels, int64_t n_padded, float* y) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scales, sums;
  const int64_t blocks = K / QK, num_panels = n_padded / NR, panel_bytes = blocks * Fmt::BLOCK_BYTES;
  if (static_cast<int64_t>(q.size()) < M * K) q.resize(M * K);
  if (static_cast<int64_t>(scales.size()) < M * blocks) scales.resize(M * blocks), sums.resize(M * blocks);
  const Int8Rows rows{q.data(), scales.data(), sums.data(), K};
  int8_t* q_out = q.data();
  float *scale_out = scales.data(), *sum_out = sums.data();
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M * blocks; ++i) quantize_block(x + i * QK, q_out + i * QK, scale_out + i, sum_out + i);
#pragma omp for schedule(guided)
    for (int64_t p = 0; p < num_panels; ++p)
      int8_panel<Fmt>(rows, M, panels + p * panel_bytes, y + p * NR, n_padded);
  }
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
    case Q4_0 | INT8_ACTIVATIONS: int8_gemm<Q4_0Format>(x, M, K, data, n_padded, y); return 0;
    case Q4_1 | INT8_ACTIVATIONS: int8_gemm<Q4_1Format>(x, M, K, data, n_padded, y); return 0;
    case Q8_0 | INT8_ACTIVATIONS: int8_gemm<Q8_0Int8Format>(x, M, K, data, n_padded, y); return 0;
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
    case Q4_0 | INT8_ACTIVATIONS:
    case Q4_0: dequant_all<Q4_0Format>(data, K, n_padded, out); return 0;
    case Q4_1 | INT8_ACTIVATIONS:
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
