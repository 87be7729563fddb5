// The packed-weight GEMM for batches (prefill chunks, wide decode steps) on Intel AMX: the
// tile unit multiplies bfloat16 pairs into float32 sums at several times the float32 FMA rate.
//
// Exactness. The inputs are float32 and bfloat16 keeps 8 of float32's 24 significant bits, so
// each input row is split into three bfloat16 planes, x = h + m + l with h = bf16(x),
// m = bf16(x - h), l = bf16(x - h - m): each difference is exact in float32, and the three
// parts hold all 24 bits (below 2^-100 or so the lowest part would be a bfloat16 denormal,
// which the tile unit reads as 0: far under any activation's rounding). A weight code
// (0..15 for Q4, -128..127 for Q8_0) is exactly a bfloat16. So every product the tiles form is
// exact, and each 32-input block's partial sum over the three planes is a float32 sum of the
// exact products x_k q_k, in the tile unit's order. The block's scale is then applied as the
// factored register kernel does (cpu_quant_gemm.cpp): y += d * sum_k x_k q_k + m * sum_k x_k.
// The result is the float32 GEMM over the dequantized weights up to the order of float32
// roundings (tested against the float64 product with the same bound as the register kernel);
// not bit for bit the dequantizing kernel, which is why the path can be switched off.
//
// Work. Per 16-row tile and 32-input block: three A tiles (the planes), three B tiles (the
// panel's 48 columns as 3 x 16, codes widened to bfloat16 pairs, VNNI order), nine tile
// products into three C tiles, stored to memory and scaled into float32 accumulators by vector
// code. Storing a C tile and reading it back at once stalls, so each block's stores are read
// one block later (two C buffers). A panel's B tiles are unpacked once per thread and reused by
// every row tile of its row chunk; row chunks bound the A planes a pass walks to what L2 holds.

#include "cpu_amx_gemm.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_quant_formats.h"

#if STREAMENGINE_SIMD == 512 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define STREAMENGINE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(STREAMENGINE_AMX)

namespace {

// Unknown (-1) until the first call asks the environment and the OS: see state().
std::atomic<int> enabled{-1};

using namespace streamengine_quant;

constexpr int64_t TILE_ROWS = 16;   // rows of an A or C tile
constexpr int64_t TILE_ELEMS = 512;  // bfloat16 values in a 16 x 64-byte tile
constexpr int64_t GROUPS = NR / 16;  // 16-column C tiles per panel
constexpr int64_t ROW_CHUNK = 256;   // rows per work item: their A planes (1-2.5 MB at K 576-1536) stay in L2
constexpr int64_t PANEL_GROUP_BYTES = 1 << 20;  // B tiles unpacked at once for several row chunks

// Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); the grant holds for the whole process.
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

bool os_grants_tiles() { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

// 1 active, 0 off; the first call decides from the environment and the OS.
int state() {
  int s = enabled.load(std::memory_order_acquire);
  if (s < 0) {
    const char* env = std::getenv("STREAMENGINE_AMX");
    s = (env != nullptr && std::strcmp(env, "0") == 0) ? 0 : (os_grants_tiles() ? 1 : 0);
    enabled.store(s, std::memory_order_release);
  }
  return s;
}

// Palette 1 with all 8 tiles at their largest: 16 rows of 64 bytes. Per thread (the tile
// configuration is thread state); released after each call so that a descheduled thread's
// context switch does not carry 8 KB of tiles.
struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = TILE_ROWS;
  }
  _tile_loadconfig(&config);
}

// A tiles of the three planes, [M16 / 16][K / 32][3][16][32] bfloat16, so each tile is 1 KB
// contiguous; sums [M16][K / 32]: each row's inputs summed per block (a minimum's term).
// Rows M..M16 are zero. Called by every thread of the GEMM's parallel region (one fork per call,
// not two: a decode step makes 121 of these calls); the rows are shared out, and the loop's end
// is a barrier before any tile reads them.
void split_rows(const float* x, int64_t M, int64_t M16, int64_t K, uint16_t* planes, float* sums) {
  const int64_t blocks = K / QK;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < M16; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      uint16_t* tile = planes + ((r / TILE_ROWS * blocks + b) * 3) * TILE_ELEMS + (r % TILE_ROWS) * QK;
      for (int64_t half = 0; half < QK; half += 16) {
        const __m512 v = r < M ? _mm512_loadu_ps(x + r * K + b * QK + half) : _mm512_setzero_ps();
        __m512 rest = v;
        for (int part = 0; part < 3; ++part) {
          const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest));  // round to nearest
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + part * TILE_ELEMS + half), bits);
          const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
          rest = _mm512_sub_ps(rest, back);  // exact: what bfloat16 dropped
        }
      }
      const float* v = x + r * K + b * QK;
      // The register kernel's order (prepare_inputs), so both paths add the same minimum term.
      sums[r * blocks + b] = r < M ? _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16))) : 0.0f;
    }
}

// 16 int32 codes (each below 256 in magnitude) as the pair (lo, hi) of bfloat16 per lane: the
// low half lo's bits, the high half hi's. Small integers convert to float32 exactly and their
// low 16 bits are zero, so truncating to bfloat16 is exact too.
inline __m512i bf16_pairs(__m512i lo, __m512i hi) {
  const __m512i lo_bits = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(lo)), 16);
  const __m512i hi_bits = _mm512_and_si512(_mm512_castps_si512(_mm512_cvtepi32_ps(hi)), _mm512_set1_epi32(~0xFFFF));
  return _mm512_or_si512(lo_bits, hi_bits);
}

// One panel's codes as B tiles, [K / 32][3 groups][16 k-pairs][16 columns][2] bfloat16 (the
// tile unit's pair-interleaved order: row p holds k = 2p and 2p + 1 of every column).
template <typename Fmt>
void unpack_panel(const uint8_t* panel, int64_t K, uint16_t* tiles) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const uint8_t* codes = panel + b * Fmt::BLOCK_BYTES + Fmt::CODES;
    for (int64_t g = 0; g < GROUPS; ++g) {
      uint16_t* tile = tiles + (b * GROUPS + g) * TILE_ELEMS;
      if constexpr (std::is_same_v<Fmt, Q8_0Format>) {
        // 32 rows of 48 int8 codes, k-major.
        for (int64_t p = 0; p < QK / 2; ++p) {
          const auto row = [&](int64_t k) {
            return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * NR + g * 16)));
          };
          _mm512_storeu_si512(tile + p * 32, bf16_pairs(row(2 * p), row(2 * p + 1)));
        }
      } else {
        // Q4: per unit of 8 k a column's int32 holds byte j = codes of k = 2j (low nibble) and
        // 2j + 1 (high): exactly one k-pair per byte.
        const __m512i nibble = _mm512_set1_epi32(0x0F);
        for (int64_t u = 0; u < QK / 8; ++u) {
          const __m512i unit = _mm512_loadu_si512(codes + (u * NR + g * 16) * 4);
          for (int j = 0; j < 4; ++j) {
            const __m512i byte = _mm512_srlv_epi32(unit, _mm512_set1_epi32(8 * j));
            const __m512i lo = _mm512_and_si512(byte, nibble);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(byte, 4), nibble);
            _mm512_storeu_si512(tile + (u * 4 + j) * 32, bf16_pairs(lo, hi));
          }
        }
      }
    }
  }
}

// Block b's partial sums (C, [16][48] float32) scaled into the accumulators.
template <typename Fmt>
inline void scale_block(const uint8_t* block, const float* partial, const float* sums, int64_t blocks, int64_t b,
                        float* acc) {
  typename Fmt::Scales s[GROUPS];
  for (int64_t g = 0; g < GROUPS; ++g) s[g] = Fmt::scales(block, static_cast<int>(g));
  for (int64_t i = 0; i < TILE_ROWS; ++i) {
    const vf x_sum = vset1(sums[i * blocks + b]);
    for (int64_t g = 0; g < GROUPS; ++g) {
      float* a = acc + i * NR + g * 16;
      vstore(a, Fmt::scale(s[g], vload(partial + i * NR + g * 16), x_sum, vload(a)));
    }
  }
}

// One 16-row tile against one panel: y rows [0, rows) of the tile.
template <typename Fmt>
void tile_rows(const uint16_t* a_tiles, const float* sums, int64_t K, const uint8_t* panel, const uint16_t* b_tiles,
               float* y, int64_t ldy, int64_t rows) {
  const int64_t blocks = K / QK;
  alignas(64) float acc[TILE_ROWS * NR] = {};
  alignas(64) float partial[2][TILE_ROWS * NR];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* a = a_tiles + b * 3 * TILE_ELEMS;
    const uint16_t* w = b_tiles + b * GROUPS * TILE_ELEMS;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_loadd(5, w, 64);
    _tile_loadd(6, w + TILE_ELEMS, 64);
    _tile_loadd(7, w + 2 * TILE_ELEMS, 64);
    // The three planes in turn, each against the three column groups: consecutive products
    // go to different C tiles, so none waits on the one before.
    _tile_loadd(3, a, 64);
    _tile_dpbf16ps(0, 3, 5);
    _tile_dpbf16ps(1, 3, 6);
    _tile_dpbf16ps(2, 3, 7);
    _tile_loadd(4, a + TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(3, a + 2 * TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 3, 5);
    _tile_dpbf16ps(1, 3, 6);
    _tile_dpbf16ps(2, 3, 7);
    if (b > 0) scale_block<Fmt>(panel + (b - 1) * Fmt::BLOCK_BYTES, partial[(b - 1) & 1], sums, blocks, b - 1, acc);
    float* c = partial[b & 1];
    _tile_stored(0, c, NR * 4);
    _tile_stored(1, c + 16, NR * 4);
    _tile_stored(2, c + 32, NR * 4);
  }
  scale_block<Fmt>(panel + (blocks - 1) * Fmt::BLOCK_BYTES, partial[(blocks - 1) & 1], sums, blocks, blocks - 1, acc);
  for (int64_t i = 0; i < rows; ++i) std::memcpy(y + i * ldy, acc + i * NR, NR * sizeof(float));
}

template <typename Fmt>
void amx_gemm(const float* x, int64_t M, int64_t K, const uint8_t* panels, int64_t n_padded, float* y) {
  // The calling thread's buffers, shared by the team for this call; kept between calls.
  thread_local std::vector<uint16_t> planes;
  thread_local std::vector<float> sums;
  const int64_t M16 = (M + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS, blocks = K / QK;
  if (static_cast<int64_t>(planes.size()) < M16 * K * 3) planes.resize(M16 * K * 3);
  if (static_cast<int64_t>(sums.size()) < M16 * blocks) sums.resize(M16 * blocks);
  const int64_t num_panels = n_padded / NR, panel_bytes = blocks * Fmt::BLOCK_BYTES;
  const int64_t chunks = (M16 + ROW_CHUNK - 1) / ROW_CHUNK, tile_bytes = blocks * GROUPS * TILE_ELEMS;
  // Pointers, not the thread_local vectors: the team's other threads have their own (empty) ones.
  uint16_t* a_planes = planes.data();
  float* a_sums = sums.data();
  const auto rows_of = [=](int64_t chunk, int64_t p, const uint16_t* b_tiles) {
    for (int64_t r = chunk * ROW_CHUNK; r < std::min(M16, (chunk + 1) * ROW_CHUNK); r += TILE_ROWS)
      tile_rows<Fmt>(a_planes + r * K * 3, a_sums + r * blocks, K, panels + p * panel_bytes, b_tiles,
                     y + r * n_padded + p * NR, n_padded, std::min(TILE_ROWS, M - r));
  };
  if (chunks == 1) {
    // One row chunk: each thread unpacks the panels it takes and uses them at once.
#pragma omp parallel
    {
      configure_tiles();
      split_rows(x, M, M16, K, a_planes, a_sums);
      thread_local std::vector<uint16_t> b_tiles;
      if (static_cast<int64_t>(b_tiles.size()) < tile_bytes) b_tiles.resize(tile_bytes);
#pragma omp for schedule(dynamic, 1)
      for (int64_t p = 0; p < num_panels; ++p) {
        unpack_panel<Fmt>(panels + p * panel_bytes, K, b_tiles.data());
        rows_of(0, p, b_tiles.data());
      }
      _tile_release();
    }
    return;
  }
  // Several chunks: a group of panels (about PANEL_GROUP_BYTES of tiles) is unpacked once into
  // a shared buffer, then each thread takes a row chunk and runs it against every panel of the
  // group, so its A planes stay in L2 while the B tiles change (the other way round, every
  // panel would stream all the planes from L3 again).
  const int64_t group = std::max<int64_t>(1, PANEL_GROUP_BYTES / (tile_bytes * 2));
  thread_local std::vector<uint16_t> shared;
  if (static_cast<int64_t>(shared.size()) < group * tile_bytes) shared.resize(group * tile_bytes);
  uint16_t* b_all = shared.data();
#pragma omp parallel
  {
    configure_tiles();
    split_rows(x, M, M16, K, a_planes, a_sums);
    for (int64_t p0 = 0; p0 < num_panels; p0 += group) {
      const int64_t count = std::min(group, num_panels - p0);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < count; ++i) unpack_panel<Fmt>(panels + (p0 + i) * panel_bytes, K, b_all + i * tile_bytes);
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < chunks * count; ++item)
        rows_of(item / count, p0 + item % count, b_all + (item % count) * tile_bytes);
    }
    _tile_release();
  }
}

}  // namespace

bool streamengine_amx::gemm(int64_t format, const float* x, int64_t M, int64_t K, const uint8_t* panels,
                            int64_t n_padded, float* y) {
  if (state() != 1 || M <= 0 || K % QK != 0 || n_padded % NR != 0) return false;
  switch (format) {
    case Q4_0: amx_gemm<Q4_0Format>(x, M, K, panels, n_padded, y); return true;
    case Q4_1: amx_gemm<Q4_1Format>(x, M, K, panels, n_padded, y); return true;
    case Q8_0: amx_gemm<Q8_0Format>(x, M, K, panels, n_padded, y); return true;
    default: return false;
  }
}

extern "C" int streamengine_amx_active() { return state(); }

extern "C" int streamengine_amx_enable(int on) {
  const int granted = on && os_grants_tiles() ? 1 : 0;
  enabled.store(granted, std::memory_order_release);
  return granted;
}

#else  // no AMX in this build (or CPU): the caller keeps its own kernels.

bool streamengine_amx::gemm(int64_t, const float*, int64_t, int64_t, const uint8_t*, int64_t, float*) { return false; }

extern "C" int streamengine_amx_active() { return 0; }

extern "C" int streamengine_amx_enable(int) { return 0; }

#endif
