// PagedAttention for decode rows on CPU: one query token per sequence attends to its context,
// read block by block through the block table, with the per-block softmax merged by the
// log-sum-exp (online softmax) rule. No gather copy of K/V and no padding to the longest
// context: each (sequence, KV head) pair reads exactly its own blocks.
//
// Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] (the engine's, see
// model_runner.py), float32, float16 or an 8-bit float with per-tensor scales (each widened to
// float32 as it is loaded; the scales never enter the loops: k_scale is folded into the query,
// v_scale into the final normalization). The query heads of a GQA group share one pass over
// their KV head's blocks.
// Built at run time by kernels/cpu_build.py; called by kernels/cpu_attention.py.

#include "cpu_paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_vec_math.h"

#if defined(STREAMENGINE_SIMD)
#include <omp.h>

namespace {

using namespace streamengine_simd;
using streamengine_cpu::e4m3_t, streamengine_cpu::e5m2_t, streamengine_cpu::load16;

constexpr int MAX_GROUP = 16;    // query heads per KV head
constexpr int MAX_VECS = 16;     // head_dim / 16, i.e. head_dim <= 256
constexpr int CHUNK = 16;        // tokens scored together: one vector of scores
constexpr int MAX_KV_PER_ITEM = 8;  // KV heads one work item walks together
constexpr int SPAN = 4;          // pieces of <= 16 tokens per softmax update

struct Layout {
  int64_t block_size, num_kv_heads, group, head_dim;
  int64_t block_stride, token_stride;  // floats between blocks / between tokens of a block
};

// Blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the next one, and
// inside the scoring loops each token's loads wait behind the arithmetic of the tokens before
// it: only a few cache misses are in flight at once. So before a span is scored, one byte of
// every cache line of its K and V rows (these heads) is loaded, back to back, letting dozens of
// misses overlap; the scoring then reads from L1/L2. Software prefetches of the same lines
// (_mm_prefetch, to L1 or L2, one span ahead or the whole context) changed nothing on Zen 4,
// where this took 27-32% off the kernel's time at 32 sequences (bench: docs/performance.md).
// offsets[j] / lens[j]: where piece j of the span starts in the caches and its tokens.
template <typename T>
inline void touch_span(const T* key_cache, const T* value_cache, const int64_t* offsets, const int64_t* lens,
                       int64_t pieces, int64_t first_kv, int64_t last_kv, const Layout& L) {
  for (int64_t j = 0; j < pieces; ++j)
    for (int64_t t = 0; t < lens[j]; ++t)
      for (int64_t d = first_kv * L.head_dim; d < last_kv * L.head_dim; d += 64 / sizeof(T)) {  // a line each
        (void)*reinterpret_cast<const volatile char*>(key_cache + offsets[j] + t * L.token_stride + d);
        (void)*reinterpret_cast<const volatile char*>(value_cache + offsets[j] + t * L.token_stride + d);
      }
}

// The online-softmax state of one KV head's group of query heads: q and the accumulators are
// tiles of GROUP x VECS (head_dim / 16) vectors, compile-time for the common shapes so they
// stay in registers while a chunk is processed; 0 means "read it from L" (generic instance).
template <int GROUP, int VECS>
struct HeadState {
  static constexpr int G_DIM = GROUP > 0 ? GROUP : MAX_GROUP;
  static constexpr int V_DIM = VECS > 0 ? VECS : MAX_VECS;
  vf qv[G_DIM][V_DIM];
  vf acc[G_DIM][V_DIM];
  float running_max[G_DIM], running_sum[G_DIM];
  int64_t group, vecs;

  void init(const float* q, float scale, const Layout& L) {
    group = GROUP > 0 ? GROUP : L.group;
    vecs = VECS > 0 ? VECS : L.head_dim / 16;
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t d = 0; d < vecs; ++d) {
        qv[g][d] = vmul(vload(q + g * L.head_dim + d * 16), vset1(scale));
        acc[g][d] = vzero();
      }
      running_max[g] = -INFINITY;
      running_sum[g] = 0.0f;
    }
  }

  // Up to SPAN pieces of <= 16 consecutive tokens (each within one block): one softmax
  // update for all of them, so the reductions and exps of the update are amortized over up to
  // 64 tokens. offsets[j] is where piece j of this head starts in the caches; keys may come
  // from elsewhere (KT, k_offsets, k_stride: an 8-bit cache's keys widened once for the group).
  template <typename KT, typename T>
  void chunk(const KT* key_cache, const T* value_cache, const int64_t* k_offsets, const int64_t* offsets,
             const int64_t* lens, int64_t pieces, int64_t k_stride, int64_t token_stride) {
    // Compile-time trip counts for the specialized shapes, so the tiles below live in registers.
    const int64_t group = GROUP > 0 ? GROUP : this->group;
    const int64_t vecs = VECS > 0 ? VECS : this->vecs;
    vf probs[G_DIM][SPAN];
    vf a[G_DIM][V_DIM];  // the accumulators, local for the span: no store per FMA
    for (int64_t g = 0; g < group; ++g) {
      vf s[SPAN];
      vf top = vset1(-INFINITY);
      for (int64_t j = 0; j < pieces; ++j) {
        const KT* kbase = key_cache + k_offsets[j];
        vf dots[CHUNK];
        for (int64_t t = 0; t < CHUNK; ++t) {
          if (t >= lens[j]) { dots[t] = vzero(); continue; }
          const KT* k = kbase + t * k_stride;
          vf dot = vmul(qv[g][0], load16(k));
          for (int64_t d = 1; d < vecs; ++d) dot = vfmadd(qv[g][d], load16(k + d * 16), dot);
          dots[t] = dot;
        }
        s[j] = select(first_lanes(lens[j]), transpose_sum(dots), vset1(-INFINITY));
        top = vmax(top, s[j]);
      }
      const float new_max = std::max(running_max[g], vreduce_max(top));
      const float rescale = std::exp(running_max[g] - new_max);  // 0 on the first update
      const vf m = vset1(new_max);
      vf total = vzero();
      for (int64_t j = 0; j < pieces; ++j) {
        probs[g][j] = keep(first_lanes(lens[j]), streamengine_cpu::exp_ps(vsub(s[j], m)));
        total = vadd(total, probs[g][j]);
      }
      running_sum[g] = running_sum[g] * rescale + vreduce_add(total);
      running_max[g] = new_max;
      const vf r = vset1(rescale);
      for (int64_t d = 0; d < vecs; ++d) a[g][d] = vmul(acc[g][d], r);
    }
    for (int64_t j = 0; j < pieces; ++j) {
      const T* vbase = value_cache + offsets[j];
      for (int64_t t = 0; t < lens[j]; ++t) {
        // Lane t of each head's probabilities, broadcast in registers (a store and scalar
        // reloads here stall on store forwarding).
        vf pt[G_DIM];
        for (int64_t g = 0; g < group; ++g) pt[g] = broadcast_lane(probs[g][j], t);
        const T* v = vbase + t * token_stride;
        for (int64_t d = 0; d < vecs; ++d) {
          const vf vv = load16(v + d * 16);
          for (int64_t g = 0; g < group; ++g) a[g][d] = vfmadd(pt[g], vv, a[g][d]);
        }
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < vecs; ++d) acc[g][d] = a[g][d];
  }

  // v_factor: what the loaded values are multiplied by (the V scale, times the load unit).
  void finish(float* out, float v_factor, const Layout& L) const {
    for (int64_t g = 0; g < group; ++g) {
      const vf inv = vset1(v_factor / running_sum[g]);
      for (int64_t d = 0; d < vecs; ++d) vstore(out + g * L.head_dim + d * 16, vmul(acc[g][d], inv));
    }
  }
};

// KV heads [first_kv, last_kv) of one sequence: q and out are that sequence's [heads, head_dim]
// rows (dense). Each span of up to 64 tokens is read once for all of these heads: with all of
// them, a block's K and V are each one contiguous run of memory. scale: the softmax scale times
// the K factor (scale and load unit); v_factor: the V one.
template <int GROUP, int VECS, typename T>
void attend(const float* q, float scale, float v_factor, const void* key_cache_bytes, const void* value_cache_bytes,
            const int32_t* table, int64_t context_len, int64_t first_kv, int64_t last_kv,
            const Layout& L, float* out) {
  const T* key_cache = static_cast<const T*>(key_cache_bytes);
  const T* value_cache = static_cast<const T*>(value_cache_bytes);
  HeadState<GROUP, VECS> state[MAX_KV_PER_ITEM];
  const int64_t heads = last_kv - first_kv;
  for (int64_t h = 0; h < heads; ++h) state[h].init(q + (first_kv + h) * L.group * L.head_dim, scale, L);
  int64_t start = 0;
  while (start < context_len) {
    int64_t offsets[SPAN], lens[SPAN], pieces = 0;
    for (; pieces < SPAN && start < context_len; ++pieces) {  // pieces never cross a block
      const int64_t offset = start % L.block_size;
      lens[pieces] = std::min<int64_t>({CHUNK, L.block_size - offset, context_len - start});
      offsets[pieces] = table[start / L.block_size] * L.block_stride + offset * L.token_stride;
      start += lens[pieces];
    }
    touch_span(key_cache, value_cache, offsets, lens, pieces, first_kv, last_kv, L);
    for (int64_t h = 0; h < heads; ++h) {
      int64_t head_offsets[SPAN];
      for (int64_t j = 0; j < pieces; ++j) head_offsets[j] = offsets[j] + (first_kv + h) * L.head_dim;
      if constexpr (std::is_same_v<T, e4m3_t> || std::is_same_v<T, e5m2_t>) {
        // Every query head of the group reads each key: widen the span's keys once, not per head.
        alignas(64) float keys[SPAN * CHUNK * (VECS > 0 ? VECS : MAX_VECS) * 16];
        int64_t k_offsets[SPAN];
        for (int64_t j = 0; j < pieces; ++j) {
          k_offsets[j] = j * CHUNK * L.head_dim;
          for (int64_t t = 0; t < lens[j]; ++t)
            for (int64_t d = 0; d < L.head_dim; d += 16)
              vstore(keys + k_offsets[j] + t * L.head_dim + d, load16(key_cache + head_offsets[j] + t * L.token_stride + d));
        }
        state[h].chunk(static_cast<const float*>(keys), value_cache, k_offsets, head_offsets, lens, pieces,
                       L.head_dim, L.token_stride);
      } else {
        state[h].chunk(key_cache, value_cache, head_offsets, head_offsets, lens, pieces, L.token_stride,
                       L.token_stride);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) state[h].finish(out + (first_kv + h) * L.group * L.head_dim, v_factor, L);
}

using AttendFn = void (*)(const float*, float, float, const void*, const void*, const int32_t*, int64_t,
                         int64_t, int64_t, const Layout&, float*);

template <int GROUP, typename T>
AttendFn pick_vecs(int64_t vecs) {
  switch (vecs) {
    case 1: return attend<GROUP, 1, T>;
    case 2: return attend<GROUP, 2, T>;
    case 4: return attend<GROUP, 4, T>;
    case 8: return attend<GROUP, 8, T>;
    default: return attend<0, 0, T>;
  }
}

template <typename T>
AttendFn pick_attend(int64_t group, int64_t vecs) {
  switch (group) {
    case 1: return pick_vecs<1, T>(vecs);
    case 2: return pick_vecs<2, T>(vecs);
    case 3: return pick_vecs<3, T>(vecs);
    case 4: return pick_vecs<4, T>(vecs);
    case 6: return pick_vecs<6, T>(vecs);
    case 8: return pick_vecs<8, T>(vecs);
    default: return attend<0, 0, T>;
  }
}

}  // namespace

extern "C" int streamengine_paged_decode_supported(int64_t num_heads, int64_t num_kv_heads,
                                                   int64_t head_dim, int64_t block_size) {
  return num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= MAX_GROUP &&
         head_dim % 16 == 0 && head_dim / 16 <= MAX_VECS && block_size % 8 == 0;
}

// query:  [num_tokens, num_heads, head_dim] at strides (q_token_stride, head_dim, 1).
// rows:   the sequences to attend (indices into query_start_loc / seq_lens / block_tables);
//         each has one query token, at query_start_loc[row].
// out:    [num_tokens, num_heads, head_dim] contiguous; only the rows' tokens are written.
// The caches hold cache_type elements (streamengine_cpu::CacheType); an 8-bit cache's values
// are its codes times k_scale / v_scale (scales of 1 only for the other types).
extern "C" int streamengine_paged_decode_scaled(
    const float* query, int64_t q_token_stride, const void* key_cache, const void* value_cache,
    int64_t cache_type, int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
    const int32_t* query_start_loc, const int64_t* rows, int64_t num_rows, float scale, float k_scale,
    float v_scale, float* out) {
  using namespace streamengine_cpu;
  if (!streamengine_paged_decode_supported(num_heads, num_kv_heads, head_dim, block_size)) return -1;
  const Layout L{block_size, num_kv_heads, num_heads / num_kv_heads, head_dim,
                 block_size * num_kv_heads * head_dim, num_kv_heads * head_dim};
  const bool unit = k_scale == 1.0f && v_scale == 1.0f;
  const int64_t vecs = head_dim / 16;
  AttendFn attend_one = nullptr;
  float unit_factor = 1.0f;
  if (cache_type == CACHE_F32 && unit) attend_one = pick_attend<float>(L.group, vecs);
  if (cache_type == CACHE_F16 && unit) attend_one = pick_attend<half_t>(L.group, vecs);
  if (cache_type == CACHE_FP8_E4M3) {
    attend_one = pick_attend<e4m3_t>(L.group, vecs);
    unit_factor = load_unit<e4m3_t>();
  }
  if (cache_type == CACHE_FP8_E5M2) attend_one = pick_attend<e5m2_t>(L.group, vecs);
  if (attend_one == nullptr || !(k_scale > 0.0f && v_scale > 0.0f)) return -1;
  const float k_factor = scale * k_scale * unit_factor, v_factor = v_scale * unit_factor;
  // Work items: all KV heads of a sequence (one contiguous read per block) when there are
  // enough sequences to keep every thread busy, else single heads (batch 1 still uses both
  // cores). Dynamic scheduling: context lengths differ.
  const int64_t threads = omp_get_max_threads();
  const int64_t split = (num_rows >= 4 * threads || num_kv_heads == 1) ? 1 : num_kv_heads;
  const int64_t per_item = std::max<int64_t>(1, std::min<int64_t>(MAX_KV_PER_ITEM, num_kv_heads / split));
  const int64_t items_per_row = (num_kv_heads + per_item - 1) / per_item;
  const int64_t work = num_rows * items_per_row;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t w = 0; w < work; ++w) {
    const int64_t row = rows[w / items_per_row];
    const int64_t first_kv = (w % items_per_row) * per_item;
    const int64_t last_kv = std::min(num_kv_heads, first_kv + per_item);
    const int64_t token = query_start_loc[row];
    attend_one(query + token * q_token_stride, k_factor, v_factor, key_cache, value_cache,
               block_tables + row * table_stride, seq_lens[row], first_kv, last_kv, L,
               out + token * num_heads * head_dim);
  }
  return 0;
}

#else  // neither AVX-512 nor AVX2: the Python side keeps the PyTorch path.

extern "C" int streamengine_paged_decode_supported(int64_t, int64_t, int64_t, int64_t) { return 0; }

extern "C" int streamengine_paged_decode_scaled(const float*, int64_t, const void*, const void*, int64_t,
                                                int64_t, int64_t, int64_t, int64_t, const int32_t*, int64_t,
                                                const int32_t*, const int32_t*, const int64_t*, int64_t,
                                                float, float, float, float*) {
  return -1;
}

#endif
