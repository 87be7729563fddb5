// Batched multi-LoRA on CPU: for every row t of a step whose adapter slot s = slot[t] is >= 0,
//     y[t, :] += scale[s] * B[s, :, :rank[s]] @ (A[s, :rank[s], :] @ x[t, :])
// "shrink" to the adapter's rank, then "expand" back to the projection's width, as Punica's
// and S-LoRA's SGMV kernels do on GPUs. Rows with slot -1 (no adapter) are left untouched.
// x and y are float32; the adapters' A and B are float32 or bfloat16 (widened in registers).
//
// Why grouped by slot: at decode batch sizes the arithmetic is small (rank 16 against widths
// of ~1,000) and the cost is reading each adapter's A and B. The rows are counting-sorted by
// slot first, so every adapter present in the step is read once, by the rows of its group,
// however its rows are interleaved in the batch.
//
// Why B is stored rank-major, Bt = [S, R, out]: y's rows want output columns in the vector
// lanes, and row r of Bt holds them contiguously, so the expand is a sum of broadcast h[r]
// times 16 loaded columns, with no transposes or horizontal sums (PEFT's B is [out, R]; the
// engine keeps its CPU stacks transposed once, at load).
//
// Two phases in one parallel region, split so that no two threads write the same memory:
//   shrink: h[i, :] = scale * A[s] @ x[t] for each sorted row i, threads over chunks of each
//           group's rank rows, so every A is read once in all, sequentially;
//   expand: y[t, o0:o0 + 16] += h[i] @ Bt[s, :, o0:o0 + 16] for every group, threads over
//           blocks of 16 output columns, so every Bt is read once in all, group by group.
//
// `streamengine_lora_projections` is the same for the projections of a fused decoder layer that
// read one input (cpu_layer.cpp), with the step's and the layer's tensors as address tables.
//
// Built at run time by kernels/cpu_build.py; called by kernels/cpu_lora.py and cpu_layer.cpp.

#include "cpu_lora.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_simd.h"

#if defined(STREAMENGINE_SIMD)

namespace {

using namespace streamengine_simd;

constexpr int64_t LANES = 16;
constexpr int64_t MAX_RANK = 256;
// Below this many multiply-adds a call is a few microseconds: waking a second thread costs more.
constexpr int64_t PARALLEL_MIN_FMAS = 1 << 16;
// Rank rows of A per shrink work item: a few KiB of contiguous A, enough items to share out.
constexpr int64_t SHRINK_ROWS = 4;
// Weights of A (elements: 4 KiB of bfloat16) the shrink asks for ahead of its loads, into the
// next rank rows: the prefetcher alone keeps too few lines in flight (measured: 25% of the
// step's LoRA time, 16 bfloat16 adapters at rank 16).
constexpr int64_t SHRINK_AHEAD = 2048;

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Rows of slot s at order[start[s] .. start[s + 1]), in batch order; rows of slot -1 left out.
// Returns -2 when a slot is outside [-1, slots), else the number of rows with an adapter.
int64_t group_rows(const int32_t* slot, int64_t rows, int64_t slots, std::vector<int64_t>& start,
                   std::vector<int32_t>& order) {
  start.assign(slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t) {
    const int32_t s = slot[t];
    if (s < -1 || s >= slots) return -2;
    if (s >= 0) ++start[s + 1];
  }
  for (int64_t s = 0; s < slots; ++s) start[s + 1] += start[s];
  order.resize(start[slots]);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < rows; ++t)
    if (slot[t] >= 0) order[next[slot[t]]++] = static_cast<int32_t>(t);
  return start[slots];
}

// 16 adapter weights as float32 lanes: float32 as they are, bfloat16 widened exactly.
inline vf wload(const float* p) { return vload(p); }
inline vf wload(const uint16_t* p) { return vload_bf16(p); }
// Lanes [0, n) of 16, n in [1, 16], the rest zero: no read past p + n.
inline vf wload_first(const float* p, int64_t n) { return n >= LANES ? vload(p) : vload_first(p, n); }
inline vf wload_first(const uint16_t* p, int64_t n) {
  if (n >= LANES) return vload_bf16(p);
  alignas(64) uint16_t tmp[LANES] = {};
  std::memcpy(tmp, p, n * sizeof(uint16_t));
  return vload_bf16(tmp);
}

// y[0, n) += the first n lanes of v, n in [1, 16].
inline void add_to_row(float* y, int64_t n, vf v) {
  if (n == LANES) {
    vstore(y, vadd(vload(y), v));
    return;
  }
  alignas(64) float tmp[LANES];
  vstore(tmp, v);
  for (int64_t i = 0; i < n; ++i) y[i] += tmp[i];
}

// y_j[c, c + 16 NB) += h_j[:rank] @ bt[:rank, c, c + 16 NB) for NR rows j and NB blocks of 16
// columns at once (n columns in all, the last block maybe partial): bt is one slot's Bt at row
// stride `out`, offset to column c. Per rank row, NB loads of Bt and NR broadcasts of h feed
// NR x NB multiply-adds in independent chains: loads, not the multiply-adds, bound a smaller tile.
template <typename W, int NR, int NB>
void expand_tile(const W* bt, int64_t out, int64_t rank, int64_t n, const float* const* h, float* const* y) {
  vf acc[NR][NB];
  UNROLL_TILE
  for (int j = 0; j < NR; ++j)
    UNROLL_TILE
    for (int b = 0; b < NB; ++b) acc[j][b] = vzero();
  for (int64_t r = 0; r < rank; ++r) {
    // The next tile's columns of this rank row: 16 rows of Bt are 16 streams at once, more
    // than the hardware prefetcher runs ahead of.
    _mm_prefetch(reinterpret_cast<const char*>(bt + r * out + NB * LANES), _MM_HINT_T0);
    vf col[NB];
    UNROLL_TILE
    for (int b = 0; b < NB; ++b) col[b] = b * LANES < n ? wload_first(bt + r * out + b * LANES, n - b * LANES) : vzero();
    UNROLL_TILE
    for (int j = 0; j < NR; ++j) {
      const vf hv = vset1(h[j][r]);
      UNROLL_TILE
      for (int b = 0; b < NB; ++b) acc[j][b] = vfmadd(hv, col[b], acc[j][b]);
    }
  }
  UNROLL_TILE
  for (int j = 0; j < NR; ++j)
    UNROLL_TILE
    for (int b = 0; b < NB; ++b)
      if (b * LANES < n) add_to_row(y[j] + b * LANES, std::min(LANES, n - b * LANES), acc[j][b]);
}

template <typename W>
struct Problem {
  const float* x;
  int64_t x_stride;
  float* y;
  int64_t y_stride;
  const W* a;   // [S, R, in]
  const W* bt;  // [S, R, out]
  const int32_t* rank;
  const float* scale;
  int64_t R, in, out;
  int64_t h_stride;  // R rounded up to 16
};

// h[i, r] = scale * (A[s, r] @ x[i's row]) for ROWS sorted rows at once: each 16 weights of A
// loaded once for all of them, two accumulators per row (even and odd chunks) so that the
// multiply-adds of one row do not wait on each other.
template <typename W, int ROWS>
inline void shrink_rows(const W* row, int64_t in, const float* const* xs, float scale, float* const* h, int64_t r) {
  vf acc[2][ROWS];
  UNROLL_TILE
  for (int j = 0; j < ROWS; ++j) acc[0][j] = acc[1][j] = vzero();
  int64_t k = 0;
  for (; k + 2 * LANES <= in; k += 2 * LANES) {
    _mm_prefetch(reinterpret_cast<const char*>(row + k + SHRINK_AHEAD), _MM_HINT_T0);
    const vf w0 = wload(row + k), w1 = wload(row + k + LANES);
    UNROLL_TILE
    for (int j = 0; j < ROWS; ++j) {
      acc[0][j] = vfmadd(w0, vload(xs[j] + k), acc[0][j]);
      acc[1][j] = vfmadd(w1, vload(xs[j] + k + LANES), acc[1][j]);
    }
  }
  for (; k < in; k += LANES) {
    const int64_t n = std::min(LANES, in - k);
    const vf w = wload_first(row + k, n);
    UNROLL_TILE
    for (int j = 0; j < ROWS; ++j) acc[0][j] = vfmadd(w, vload_first(xs[j] + k, n), acc[0][j]);
  }
  UNROLL_TILE
  for (int j = 0; j < ROWS; ++j) h[j][r] = scale * vreduce_add(vadd(acc[0][j], acc[1][j]));
}

// h[i, r] = scale * (A[s, r] @ x[order[i]]) for the group's sorted rows i in [first, last) and
// rank rows r in [r0, r1). The rows of A are contiguous, so this is one sequential pass over
// that part of A[s], each row loaded once for up to four x rows (from L1) at a time: a stream
// the hardware prefetcher follows, where a pass per x row would read A again for every row.
template <typename W>
void shrink_group(const Problem<W>& p, const int32_t* order, int64_t s, int64_t first, int64_t last, int64_t r0,
                  int64_t r1, float* h) {
  const W* a = p.a + s * p.R * p.in;
  const float scale = p.scale[s];
  for (int64_t r = r0; r < r1; ++r) {
    const W* row = a + r * p.in;
    for (int64_t i = first; i < last; i += 4) {
      const int64_t rows = std::min<int64_t>(4, last - i);
      const float* xs[4];
      float* hs[4];
      for (int64_t j = 0; j < rows; ++j) {
        xs[j] = p.x + order[i + j] * p.x_stride;
        hs[j] = h + (i + j) * p.h_stride;
      }
      switch (rows) {
        case 1: shrink_rows<W, 1>(row, p.in, xs, scale, hs, r); break;
        case 2: shrink_rows<W, 2>(row, p.in, xs, scale, hs, r); break;
        case 3: shrink_rows<W, 3>(row, p.in, xs, scale, hs, r); break;
        default: shrink_rows<W, 4>(row, p.in, xs, scale, hs, r);
      }
    }
  }
}

// The expand of one group (slot s, sorted rows [first, last)) over output columns [c0, c1):
// tiles of four rows by two blocks, or of two (or one) rows by four blocks.
template <typename W>
void expand_group(const Problem<W>& p, const int32_t* order, const float* h, int64_t s, int64_t first,
                  int64_t last, int64_t c0, int64_t c1) {
  const int64_t rank = p.rank[s];
  const W* bt = p.bt + s * p.R * p.out;
  for (int64_t i = first; i < last;) {
    const int64_t rows = last - i >= 4 ? 4 : std::min<int64_t>(2, last - i);
    const float* hs[4];
    float* ys[4];
    for (int64_t j = 0; j < rows; ++j) {
      hs[j] = h + (i + j) * p.h_stride;
      ys[j] = p.y + order[i + j] * p.y_stride;
    }
    const int64_t width = (rows == 4 ? 2 : 4) * LANES;
    for (int64_t c = c0; c < c1; c += width) {
      const int64_t n = std::min(width, c1 - c);
      float* yc[4];
      for (int64_t j = 0; j < rows; ++j) yc[j] = ys[j] + c;
      if (rows == 4) expand_tile<W, 4, 2>(bt + c, p.out, rank, n, hs, yc);
      else if (rows == 2) expand_tile<W, 2, 4>(bt + c, p.out, rank, n, hs, yc);
      else expand_tile<W, 1, 4>(bt + c, p.out, rank, n, hs, yc);
    }
    i += rows;
  }
}

// Checks one problem's sizes and ranks: 0, -1 or -3 as streamengine_lora_shrink_expand says.
template <typename W>
int check_problem(const Problem<W>& p, int64_t rows, int64_t slots) {
  if (p.R < 0 || p.R > MAX_RANK || p.in <= 0 || p.out <= 0 ||
      (rows > 1 && (p.x_stride < p.in || p.y_stride < p.out)))
    return -1;
  for (int64_t s = 0; s < slots; ++s)
    if (p.rank[s] < 0 || p.rank[s] > p.R) return -3;
  return 0;
}

// The deltas of `count` projections that read the same x (q, k and v, say), in one parallel
// region: the rows are grouped once, the shrinks of all of them share the threads, then each
// projection's expand is split by columns as below.
template <typename W>
int shrink_expand(const Problem<W>* ps, int64_t count, const int32_t* slot, int64_t rows, int64_t slots) {
  if (rows < 0 || slots < 0) return -1;
  for (int64_t q = 0; q < count; ++q)
    if (const int rc = check_problem(ps[q], rows, slots); rc != 0) return rc;
  std::vector<int64_t> start;
  std::vector<int32_t> order;
  const int64_t active = group_rows(slot, rows, slots, start, order);
  if (active < 0) return static_cast<int>(active);
  if (active == 0) return 0;

  std::vector<std::vector<float>> h(count);
  // The shrink's work items: each projection's present groups' rank rows in chunks of
  // SHRINK_ROWS, as (projection, slot, first rank row), so two threads share even a single
  // adapter's A.
  struct Item { int64_t q, s, r0; };
  std::vector<Item> items;
  int64_t fmas = 0;
  for (int64_t q = 0; q < count; ++q) {
    const Problem<W>& p = ps[q];
    h[q].resize(active * p.h_stride);
    fmas += active * p.R * (p.in + p.out);
    for (int64_t s = 0; s < slots; ++s)
      if (start[s + 1] > start[s])
        for (int64_t r0 = 0; r0 < p.rank[s]; r0 += SHRINK_ROWS) items.push_back({q, s, r0});
  }
  const int64_t num_items = static_cast<int64_t>(items.size());

#pragma omp parallel if (fmas >= PARALLEL_MIN_FMAS)
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < num_items; ++item) {
      const auto [q, s, r0] = items[item];
      shrink_group(ps[q], order.data(), s, start[s], start[s + 1], r0,
                   std::min<int64_t>(r0 + SHRINK_ROWS, ps[q].rank[s]), h[q].data());
    }
    // Implicit barrier: every h row is complete before any expand reads it.
    // Each thread owns one range of whole column blocks of each projection and runs every
    // group over it, group by group: no two threads write the same y entries, and a thread
    // streams one adapter's Bt at a time (blocks outside and groups inside would keep rank
    // rows of every adapter in flight at once, more streams than the hardware prefetcher follows).
    const int64_t threads = omp_get_num_threads(), tid = omp_get_thread_num();
    for (int64_t q = 0; q < count; ++q) {
      const Problem<W>& p = ps[q];
      const int64_t blocks = (p.out + LANES - 1) / LANES;
      const int64_t c0 = std::min(p.out, blocks * tid / threads * LANES);
      const int64_t c1 = std::min(p.out, blocks * (tid + 1) / threads * LANES);
      if (c0 < c1)
        for (int64_t s = 0; s < slots; ++s)
          if (start[s + 1] > start[s] && p.rank[s] > 0)
            expand_group(p, order.data(), h[q].data(), s, start[s], start[s + 1], c0, c1);
    }
  }
  return 0;
}

template <typename W>
Problem<W> problem(const float* x, int64_t x_stride, float* y, int64_t y_stride, const void* a, const void* bt,
                   const int32_t* rank, const float* scale, int64_t max_rank, int64_t in, int64_t out) {
  return {x, x_stride, y, y_stride, static_cast<const W*>(a), static_cast<const W*>(bt), rank, scale, max_rank, in,
          out, round_up(max_rank, LANES)};
}

}  // namespace

// x: [rows, in_features] at row stride x_stride; y: [rows, out_features] at row stride
// y_stride (a column slice of a wider output is fine), updated in place; slot: [rows] int32 in
// [-1, slots); a: [slots, max_rank, in_features] and bt: [slots, max_rank, out_features] (B
// transposed), both contiguous, of weight_type (entries past a slot's rank are never read);
// rank: [slots] int32 in [0, max_rank]; scale: [slots].
// Returns 0; -1 on impossible sizes or strides, -2 on a slot outside [-1, slots), -3 on a rank
// outside [0, max_rank], -5 on an unknown weight type. On an error y is untouched.
extern "C" int streamengine_lora_shrink_expand(const float* x, int64_t x_stride, float* y, int64_t y_stride,
                                               const int32_t* slot, int64_t rows, const void* a, const void* bt,
                                               const int32_t* rank, const float* scale, int64_t slots,
                                               int64_t max_rank, int64_t in_features, int64_t out_features,
                                               int64_t weight_type) {
  switch (weight_type) {
    case LORA_FLOAT32: {
      const auto p = problem<float>(x, x_stride, y, y_stride, a, bt, rank, scale, max_rank, in_features, out_features);
      return shrink_expand(&p, 1, slot, rows, slots);
    }
    case LORA_BFLOAT16: {
      const auto p = problem<uint16_t>(x, x_stride, y, y_stride, a, bt, rank, scale, max_rank, in_features,
                                       out_features);
      return shrink_expand(&p, 1, slot, rows, slots);
    }
    default:
      return -5;
  }
}

namespace {

template <typename W>
int projections(const int64_t* step, const int64_t* layer, const LoraProjection* which, int64_t count,
                const float* x, int64_t x_stride, int64_t in_features, float* const* y, int64_t y_stride,
                const int64_t* out_features, int64_t rows) {
  Problem<W> ps[LORA_PROJECTIONS];
  int64_t used = 0;
  auto address = [](int64_t v) { return reinterpret_cast<const void*>(v); };
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* f = layer + which[i] * LORA_PROJECTION_FIELDS;
    if (f[LORA_A] == 0) continue;  // no resident adapter adapts it
    ps[used++] = problem<W>(x, x_stride, y[i], y_stride, address(f[LORA_A]), address(f[LORA_BT]),
                            static_cast<const int32_t*>(address(f[LORA_RANK])),
                            static_cast<const float*>(address(f[LORA_SCALE])), step[LORA_MAX_RANK], in_features,
                            out_features[i]);
  }
  if (used == 0) return 0;
  return shrink_expand(ps, used, static_cast<const int32_t*>(address(step[LORA_SLOT])), rows, step[LORA_SLOTS]);
}

}  // namespace

int streamengine_lora_projections(const int64_t* step, const int64_t* layer, const LoraProjection* which,
                                  int64_t count, const float* x, int64_t x_stride, int64_t in_features,
                                  float* const* y, int64_t y_stride, const int64_t* out_features, int64_t rows) {
  if (step == nullptr || count <= 0 || count > LORA_PROJECTIONS) return step == nullptr ? 0 : -1;
  switch (step[LORA_WEIGHT_TYPE]) {
    case LORA_FLOAT32:
      return projections<float>(step, layer, which, count, x, x_stride, in_features, y, y_stride, out_features, rows);
    case LORA_BFLOAT16:
      return projections<uint16_t>(step, layer, which, count, x, x_stride, in_features, y, y_stride, out_features,
                                   rows);
    default:
      return -5;
  }
}

extern "C" int streamengine_lora_available() { return 1; }

#else  // neither AVX-512 nor AVX2: the Python side keeps the PyTorch path.

extern "C" int streamengine_lora_shrink_expand(const float*, int64_t, float*, int64_t, const int32_t*, int64_t,
                                               const void*, const void*, const int32_t*, const float*, int64_t,
                                               int64_t, int64_t, int64_t, int64_t) {
  return -4;
}

int streamengine_lora_projections(const int64_t*, const int64_t*, const LoraProjection*, int64_t, const float*,
                                  int64_t, int64_t, float* const*, int64_t, const int64_t*, int64_t) {
  return -4;
}

extern "C" int streamengine_lora_available() { return 0; }

#endif
