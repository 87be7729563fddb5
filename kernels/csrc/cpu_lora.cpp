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
//   shrink: h[i, :] = scale * A[s] @ x[t] for each sorted row i, threads over rows (a thread's
//           rows are consecutive, so mostly of one group, and it reads that A once);
//   expand: y[t, o0:o0 + 16] += h[i] @ Bt[s, :, o0:o0 + 16] for every group, threads over
//           blocks of 16 output columns, so every Bt is read once in all.
//
// `streamengine_lora_projection` is the same for one projection of the fused decoder layers
// (cpu_layer.cpp), with the step's and the projection's tensors passed as address tables.
//
// Built at run time by kernels/cpu_build.py; called by kernels/cpu_lora.py and cpu_layer.cpp.

#include "cpu_lora.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_simd.h"

#if defined(STREAMENGINE_SIMD)

namespace {

using namespace streamengine_simd;

constexpr int64_t LANES = 16;
constexpr int64_t MAX_RANK = 256;
// Below this many multiply-adds a call is a few microseconds: waking a second thread costs more.
constexpr int64_t PARALLEL_MIN_FMAS = 1 << 16;

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

// h[0, rank rounded up to 16) = scale * (A[:rank] @ x), zero past rank. a: [>= rank, in]
// contiguous. Four A rows at a time share each load of x; their four sums per 16 ranks are
// reduced together by one transpose_sum.
template <typename W>
void shrink_row(const W* a, int64_t in, int64_t rank, float scale, const float* x, float* h) {
  for (int64_t c = 0; c < rank; c += LANES) {
    vf sums[LANES];
    for (int64_t r = 0; r < LANES; r += 4) {
      vf acc[4] = {vzero(), vzero(), vzero(), vzero()};
      if (c + r < rank) {
        // Rows past rank may not exist (rank == R): read the last real row again, its sums
        // are masked off below.
        const W* row[4];
        UNROLL_TILE
        for (int j = 0; j < 4; ++j) row[j] = a + std::min(c + r + j, rank - 1) * in;
        int64_t k = 0;
        for (; k + LANES <= in; k += LANES) {
          const vf xv = vload(x + k);
          UNROLL_TILE
          for (int j = 0; j < 4; ++j) acc[j] = vfmadd(wload(row[j] + k), xv, acc[j]);
        }
        if (k < in) {
          const vf xv = vload_first(x + k, in - k);
          UNROLL_TILE
          for (int j = 0; j < 4; ++j) acc[j] = vfmadd(wload_first(row[j] + k, in - k), xv, acc[j]);
        }
      }
      UNROLL_TILE
      for (int j = 0; j < 4; ++j) sums[r + j] = acc[j];
    }
    vstore(h + c, vmul(keep(first_lanes(std::min(LANES, rank - c)), transpose_sum(sums)), vset1(scale)));
  }
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

// y_j[0, n) += h_j[:rank] @ bt[:rank, 0:n) for NR rows at once: bt's rows at stride `out`
// (Bt of one slot, offset to the block). Each row of bt is loaded once for all NR rows, and
// their NR independent accumulator chains hide the multiply-add latency.
template <typename W, int NR>
void expand_rows(const W* bt, int64_t out, int64_t rank, int64_t n, const float* const* h, float* const* y) {
  vf acc[NR];
  UNROLL_TILE
  for (int j = 0; j < NR; ++j) acc[j] = vzero();
  for (int64_t r = 0; r < rank; ++r) {
    const vf col = wload_first(bt + r * out, n);
    UNROLL_TILE
    for (int j = 0; j < NR; ++j) acc[j] = vfmadd(vset1(h[j][r]), col, acc[j]);
  }
  UNROLL_TILE
  for (int j = 0; j < NR; ++j) add_to_row(y[j], n, acc[j]);
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

// The expand of one group (slot s, sorted rows [first, last)) over output columns [o0, o0 + n).
template <typename W>
void expand_group(const Problem<W>& p, const int32_t* order, const float* h, int64_t s, int64_t first,
                  int64_t last, int64_t o0, int64_t n) {
  const int64_t rank = p.rank[s];
  const W* bt = p.bt + s * p.R * p.out + o0;
  constexpr int TILE = 4;
  int64_t i = first;
  for (; i + TILE <= last; i += TILE) {
    const float* hs[TILE];
    float* ys[TILE];
    for (int j = 0; j < TILE; ++j) {
      hs[j] = h + (i + j) * p.h_stride;
      ys[j] = p.y + order[i + j] * p.y_stride + o0;
    }
    expand_rows<W, TILE>(bt, p.out, rank, n, hs, ys);
  }
  if (last - i >= 2) {
    const float* hs[2] = {h + i * p.h_stride, h + (i + 1) * p.h_stride};
    float* ys[2] = {p.y + order[i] * p.y_stride + o0, p.y + order[i + 1] * p.y_stride + o0};
    expand_rows<W, 2>(bt, p.out, rank, n, hs, ys);
    i += 2;
  }
  if (i < last) {
    const float* hs[1] = {h + i * p.h_stride};
    float* ys[1] = {p.y + order[i] * p.y_stride + o0};
    expand_rows<W, 1>(bt, p.out, rank, n, hs, ys);
  }
}

template <typename W>
int shrink_expand(const float* x, int64_t x_stride, float* y, int64_t y_stride, const int32_t* slot, int64_t rows,
                  const W* a, const W* bt, const int32_t* rank, const float* scale, int64_t slots, int64_t max_rank,
                  int64_t in_features, int64_t out_features) {
  if (rows < 0 || slots < 0 || max_rank < 0 || max_rank > MAX_RANK || in_features <= 0 || out_features <= 0 ||
      (rows > 1 && (x_stride < in_features || y_stride < out_features)))
    return -1;
  for (int64_t s = 0; s < slots; ++s)
    if (rank[s] < 0 || rank[s] > max_rank) return -3;
  std::vector<int64_t> start;
  std::vector<int32_t> order;
  const int64_t active = group_rows(slot, rows, slots, start, order);
  if (active < 0) return static_cast<int>(active);
  if (active == 0 || max_rank == 0) return 0;

  const Problem<W> p{x, x_stride, y, y_stride, a, bt, rank, scale, max_rank, in_features, out_features,
                     round_up(max_rank, LANES)};
  std::vector<float> h(active * p.h_stride);
  // Each sorted row's slot, so the shrink loop needs no search over the groups.
  std::vector<int32_t> row_slot(active);
  for (int64_t s = 0; s < slots; ++s) std::fill(row_slot.begin() + start[s], row_slot.begin() + start[s + 1], s);
  const int64_t blocks = (out_features + LANES - 1) / LANES;
  const int64_t fmas = active * max_rank * (in_features + out_features);

#pragma omp parallel if (fmas >= PARALLEL_MIN_FMAS)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < active; ++i) {
      const int64_t s = row_slot[i];
      shrink_row(a + s * max_rank * in_features, in_features, rank[s], scale[s], x + order[i] * x_stride,
                 h.data() + i * p.h_stride);
    }
    // Implicit barrier: every h row is complete before any expand reads it.
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t o0 = blk * LANES, n = std::min(LANES, out_features - o0);
      for (int64_t s = 0; s < slots; ++s)
        if (start[s + 1] > start[s] && rank[s] > 0)
          expand_group(p, order.data(), h.data(), s, start[s], start[s + 1], o0, n);
    }
  }
  return 0;
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
    case LORA_FLOAT32:
      return shrink_expand(x, x_stride, y, y_stride, slot, rows, static_cast<const float*>(a),
                           static_cast<const float*>(bt), rank, scale, slots, max_rank, in_features, out_features);
    case LORA_BFLOAT16:
      return shrink_expand(x, x_stride, y, y_stride, slot, rows, static_cast<const uint16_t*>(a),
                           static_cast<const uint16_t*>(bt), rank, scale, slots, max_rank, in_features,
                           out_features);
    default:
      return -5;
  }
}

int streamengine_lora_projection(const int64_t* step, const int64_t* projection, const float* x, int64_t x_stride,
                                 float* y, int64_t y_stride, int64_t rows, int64_t in_features,
                                 int64_t out_features) {
  if (step == nullptr || projection[LORA_A] == 0) return 0;
  auto address = [](int64_t v) { return reinterpret_cast<const void*>(v); };
  return streamengine_lora_shrink_expand(
      x, x_stride, y, y_stride, static_cast<const int32_t*>(address(step[LORA_SLOT])), rows,
      address(projection[LORA_A]), address(projection[LORA_BT]),
      static_cast<const int32_t*>(address(projection[LORA_RANK])),
      static_cast<const float*>(address(projection[LORA_SCALE])), step[LORA_SLOTS], step[LORA_MAX_RANK],
      in_features, out_features, step[LORA_WEIGHT_TYPE]);
}

extern "C" int streamengine_lora_available() { return 1; }

#else  // neither AVX-512 nor AVX2: the Python side keeps the PyTorch path.

extern "C" int streamengine_lora_shrink_expand(const float*, int64_t, float*, int64_t, const int32_t*, int64_t,
                                               const void*, const void*, const int32_t*, const float*, int64_t,
                                               int64_t, int64_t, int64_t, int64_t) {
  return -4;
}

int streamengine_lora_projection(const int64_t*, const int64_t*, const float*, int64_t, float*, int64_t, int64_t,
                                 int64_t, int64_t) {
  return -4;
}

extern "C" int streamengine_lora_available() { return 0; }

#endif
