// PagedAttention for decode rows on CPU: one query token per sequence attends to its context,
// read block by block through the block table, with the per-block softmax merged by the
// log-sum-exp (online softmax) rule. No gather copy of K/V and no padding to the longest
// context: each (sequence, KV head) pair reads exactly its own blocks.
//
// Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] (the engine's, see
// model_runner.py), float32 or float16 (widened to float32 as it is loaded). The query heads of
// a GQA group share one pass over their KV head's blocks.
// Built at run time by kernels/cpu_build.py; called by kernels/cpu_attention.py.

#include "cpu_paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

#include "cpu_vec_math.h"

namespace {

using streamengine_cpu::load16;

constexpr int MAX_GROUP = 16;    // query heads per KV head
constexpr int MAX_VECS = 16;     // head_dim / 16, i.e. head_dim <= 256
constexpr int CHUNK = 16;        // tokens scored together: one zmm of scores
constexpr int MAX_KV_PER_ITEM = 8;  // KV heads one work item walks together
constexpr int SPAN = 4;          // pieces of <= 16 tokens per softmax update

struct Layout {
  int64_t block_size, num_kv_heads, group, head_dim;
  int64_t block_stride, token_stride;  // floats between blocks / between tokens of a block
};

// out[i] = sum of the 16 lanes of v[i]: four rounds of "shuffle halves of two vectors, add",
// then one permute. ~3 instructions per score instead of a full horizontal reduction each.
inline __m512 transpose_sum(const __m512 v[16]) {
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

// Blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the next one: ask
// for the next chunk's K and V rows of these heads while the current chunk is being scored.
template <typename T>
inline void prefetch_chunk(const T* key_cache, const T* value_cache, const int32_t* table,
                           int64_t start, int64_t context_len, int64_t first_kv, int64_t last_kv,
                           const Layout& L) {
  if (start >= context_len) return;
  const int64_t offset = start % L.block_size;
  const int64_t n = std::min<int64_t>({CHUNK, L.block_size - offset, context_len - start});
  const int64_t base = table[start / L.block_size] * L.block_stride + offset * L.token_stride;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = first_kv * L.head_dim; d < last_kv * L.head_dim; d += 64 / sizeof(T)) {  // a line each
      _mm_prefetch(reinterpret_cast<const char*>(key_cache + base + t * L.token_stride + d), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(value_cache + base + t * L.token_stride + d), _MM_HINT_T0);
    }
}

// The online-softmax state of one KV head's group of query heads: q and the accumulators are
// tiles of GROUP x VECS (head_dim / 16) vectors, compile-time for the common shapes so they
// stay in registers while a chunk is processed; 0 means "read it from L" (generic instance).
template <int GROUP, int VECS>
struct HeadState {
  static constexpr int G_DIM = GROUP > 0 ? GROUP : MAX_GROUP;
  static constexpr int V_DIM = VECS > 0 ? VECS : MAX_VECS;
  __m512 qv[G_DIM][V_DIM];
  __m512 acc[G_DIM][V_DIM];
  float running_max[G_DIM], running_sum[G_DIM];
  int64_t group, vecs;

  void init(const float* q, float scale, const Layout& L) {
    group = GROUP > 0 ? GROUP : L.group;
    vecs = VECS > 0 ? VECS : L.head_dim / 16;
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t d = 0; d < vecs; ++d) {
        qv[g][d] = _mm512_mul_ps(_mm512_loadu_ps(q + g * L.head_dim + d * 16), _mm512_set1_ps(scale));
        acc[g][d] = _mm512_setzero_ps();
      }
      running_max[g] = -INFINITY;
      running_sum[g] = 0.0f;
    }
  }

  // Up to SPAN pieces of <= 16 consecutive tokens (each within one block): one softmax
  // update for all of them, so the reductions and exps of the update are amortized over up to
  // 64 tokens. offsets[j] is where piece j of this head starts in the caches.
  template <typename T>
  void chunk(const T* key_cache, const T* value_cache, const int64_t* offsets, const int64_t* lens,
             int64_t pieces, int64_t token_stride) {
    // Compile-time trip counts for the specialized shapes, so the tiles below live in registers.
    const int64_t group = GROUP > 0 ? GROUP : this->group;
    const int64_t vecs = VECS > 0 ? VECS : this->vecs;
    __m512 probs[G_DIM][SPAN];
    __m512 a[G_DIM][V_DIM];  // the accumulators, local for the span: no store per FMA
    for (int64_t g = 0; g < group; ++g) {
      __m512 s[SPAN];
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < pieces; ++j) {
        const T* kbase = key_cache + offsets[j];
        __m512 dots[CHUNK];
        for (int64_t t = 0; t < CHUNK; ++t) {
          if (t >= lens[j]) { dots[t] = _mm512_setzero_ps(); continue; }
          const T* k = kbase + t * token_stride;
          __m512 dot = _mm512_mul_ps(qv[g][0], load16(k));
          for (int64_t d = 1; d < vecs; ++d) dot = _mm512_fmadd_ps(qv[g][d], load16(k + d * 16), dot);
          dots[t] = dot;
        }
        const __mmask16 valid = static_cast<__mmask16>((1u << lens[j]) - 1);
        s[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, transpose_sum(dots));
        top = _mm512_max_ps(top, s[j]);
      }
      const float new_max = std::max(running_max[g], _mm512_reduce_max_ps(top));
      const float rescale = std::exp(running_max[g] - new_max);  // 0 on the first update
      const __m512 m = _mm512_set1_ps(new_max);
      __m512 total = _mm512_setzero_ps();
      for (int64_t j = 0; j < pieces; ++j) {
        const __mmask16 valid = static_cast<__mmask16>((1u << lens[j]) - 1);
        probs[g][j] = _mm512_maskz_mov_ps(valid, streamengine_cpu::exp_ps(_mm512_sub_ps(s[j], m)));
        total = _mm512_add_ps(total, probs[g][j]);
      }
      running_sum[g] = running_sum[g] * rescale + _mm512_reduce_add_ps(total);
      running_max[g] = new_max;
      const __m512 r = _mm512_set1_ps(rescale);
      for (int64_t d = 0; d < vecs; ++d) a[g][d] = _mm512_mul_ps(acc[g][d], r);
    }
    for (int64_t j = 0; j < pieces; ++j) {
      const T* vbase = value_cache + offsets[j];
      for (int64_t t = 0; t < lens[j]; ++t) {
        // Lane t of each head's probabilities, broadcast in registers (a store and scalar
        // reloads here stall on store forwarding).
        const __m512i lane = _mm512_set1_epi32(static_cast<int>(t));
        __m512 pt[G_DIM];
        for (int64_t g = 0; g < group; ++g) pt[g] = _mm512_permutexvar_ps(lane, probs[g][j]);
        const T* v = vbase + t * token_stride;
        for (int64_t d = 0; d < vecs; ++d) {
          const __m512 vv = load16(v + d * 16);
          for (int64_t g = 0; g < group; ++g) a[g][d] = _mm512_fmadd_ps(pt[g], vv, a[g][d]);
        }
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < vecs; ++d) acc[g][d] = a[g][d];
  }

  void finish(float* out, const Layout& L) const {
    for (int64_t g = 0; g < group; ++g) {
      const __m512 inv = _mm512_set1_ps(1.0f / running_sum[g]);
      for (int64_t d = 0; d < vecs; ++d)
        _mm512_storeu_ps(out + g * L.head_dim + d * 16, _mm512_mul_ps(acc[g][d], inv));
    }
  }
};

// KV heads [first_kv, last_kv) of one sequence: q and out are that sequence's [heads, head_dim]
// rows (dense). Each span of up to 64 tokens is read once for all of these heads: with all of
// them, a block's K and V are each one contiguous run of memory.
template <int GROUP, int VECS, typename T>
void attend(const float* q, float scale, const void* key_cache_bytes, const void* value_cache_bytes,
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
    prefetch_chunk(key_cache, value_cache, table, start, context_len, first_kv, last_kv, L);
    for (int64_t h = 0; h < heads; ++h) {
      int64_t head_offsets[SPAN];
      for (int64_t j = 0; j < pieces; ++j) head_offsets[j] = offsets[j] + (first_kv + h) * L.head_dim;
      state[h].chunk(key_cache, value_cache, head_offsets, lens, pieces, L.token_stride);
    }
  }
  for (int64_t h = 0; h < heads; ++h) state[h].finish(out + (first_kv + h) * L.group * L.head_dim, L);
}

using AttendFn = void (*)(const float*, float, const void*, const void*, const int32_t*, int64_t,
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
// The caches hold cache_type elements (streamengine_cpu::CacheType).
extern "C" int streamengine_paged_decode(
    const float* query, int64_t q_token_stride, const void* key_cache, const void* value_cache,
    int64_t cache_type, int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
    const int32_t* query_start_loc, const int64_t* rows, int64_t num_rows, float scale, float* out) {
  if (!streamengine_paged_decode_supported(num_heads, num_kv_heads, head_dim, block_size)) return -1;
  const Layout L{block_size, num_kv_heads, num_heads / num_kv_heads, head_dim,
                 block_size * num_kv_heads * head_dim, num_kv_heads * head_dim};
  using streamengine_cpu::CACHE_F16, streamengine_cpu::CACHE_F32, streamengine_cpu::half_t;
  if (cache_type != CACHE_F32 && cache_type != CACHE_F16) return -1;
  const AttendFn attend_one = cache_type == CACHE_F16 ? pick_attend<half_t>(L.group, head_dim / 16)
                                                      : pick_attend<float>(L.group, head_dim / 16);
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
    attend_one(query + token * q_token_stride, scale, key_cache, value_cache,
               block_tables + row * table_stride, seq_lens[row], first_kv, last_kv, L,
               out + token * num_heads * head_dim);
  }
  return 0;
}

#else  // no AVX-512: the Python side keeps the PyTorch path.

extern "C" int streamengine_paged_decode_supported(int64_t, int64_t, int64_t, int64_t) { return 0; }

extern "C" int streamengine_paged_decode(const float*, int64_t, const void*, const void*, int64_t, int64_t,
                                         int64_t, int64_t, int64_t, const int32_t*, int64_t,
                                         const int32_t*, const int32_t*, const int64_t*, int64_t,
                                         float, float*) {
  return -1;
}

#endif
