// Causal attention for prefill rows on CPU (prompts, chunks of prompts, prompts after a prefix
// cache hit): every query token of every listed row attends to the keys at or before its
// position, read block by block through the row's block table, with a flash-style online
// softmax (a running max and sum per query, one update per tile of keys). One call covers all
// prefill rows of a step.
//
// A work item is up to LANES query lanes (a lane = one query token x one query head of a GQA
// group; one token's group when that is wider) of one row and one KV head. The lanes lie across the vector registers, so both
// products are broadcast-FMA register tiles that read the cache rows as they are stored (no
// transposed copy of K) and the softmax bookkeeping is lane-wise (no horizontal reductions):
//   scores[key][lane] = sum_d K[key][d] * qt[d][lane]      (K broadcast, queries in lanes)
//   acc[d][lane]     += sum_key V[key][d] * p[key][lane]   (V broadcast, probabilities in lanes)
// Items are sorted by their causal work, largest first, and taken by OpenMP threads one at a
// time, so the threads finish together.
//
// Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] (the engine's, see
// model_runner.py), float32 (read in place), or float16 or an 8-bit float (each key tile widened
// to float32 once per item; an 8-bit cache's per-tensor scales are folded into the queries and
// the final normalization, never into the loops). Built at run time by kernels/cpu_build.py; called by kernels/cpu_prefill_attention.py.

#include "cpu_prefill_attention.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_vec_math.h"

#if defined(STREAMENGINE_SIMD)
#include <omp.h>

namespace {

using namespace streamengine_simd;
using streamengine_cpu::e4m3_t, streamengine_cpu::e5m2_t, streamengine_cpu::half_t;
using streamengine_cpu::load16;

// Query lanes per work item: 3 vectors measured faster than 4 (whose register tiles are
// smaller); a group wider than this still takes one token per item, in up to 4 vectors.
constexpr int64_t LANES = 48;
constexpr int64_t MAX_GROUP = 64;
constexpr int64_t KEY_TILE = 64;        // keys per softmax update
constexpr int64_t MAX_SCORE_BLOCK = 24;  // keys per register tile: a tile's keys are padded up to it
constexpr int64_t MAX_HEAD_DIM = 256;
constexpr float MIN_EXPONENT = -87.0f;  // e^x below this is a float32 denormal: taken as 0

struct Layout {
  int64_t block_size, num_heads, group, head_dim;
  int64_t block_stride, token_stride;  // elements between blocks / between tokens of a block
};

// The step's tensors, shared by every item (arguments described at streamengine_paged_prefill_scaled).
struct Step {
  const float* query;
  int64_t q_token_stride;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  float scale;     // the softmax scale times the keys' factor (tensor scale x load unit)
  float v_factor;  // the values' factor
  float* out;
};

// Query tokens [first, first + count) of one row (counted within the row's query), one KV head.
struct Item {
  int64_t row, kv_head, first, count, cost;
};

// One thread's buffers, reused by every item it takes. Widths are the item's lane vectors x 16.
struct Scratch {
  std::vector<float> qt;      // [head_dim][width]: scaled queries, lane = token * group + head
  std::vector<float> acc;     // [head_dim][width]: unnormalized outputs
  std::vector<float> probs;   // [keys padded][width]: scores, then probabilities
  std::vector<float> keys, values;  // [KEY_TILE][head_dim]: a float16 tile widened
  std::vector<float> zero;    // [head_dim]: the padding key
  std::vector<const float*> krow, vrow;  // the tile's key / value rows
  explicit Scratch(int64_t head_dim)
      : qt(head_dim * MAX_GROUP), acc(head_dim * MAX_GROUP), probs((KEY_TILE + MAX_SCORE_BLOCK) * MAX_GROUP),
        keys(KEY_TILE * head_dim), values(KEY_TILE * head_dim), zero(head_dim, 0.0f),
        krow(KEY_TILE + MAX_SCORE_BLOCK), vrow(KEY_TILE) {}
};

// Register tiles per lane-vector count: score tiles of SCORE_BLOCK keys and accumulate tiles
// of ACC_BLOCK head dims (a divisor of 16), each about 24 accumulators of AVX-512's 32
// registers, or 12 of AVX2's 16 (where a vector takes two).
template <int RV> struct Tiles;
#if STREAMENGINE_SIMD == 512
template <> struct Tiles<1> { static constexpr int SCORE_BLOCK = 24, ACC_BLOCK = 16; };
template <> struct Tiles<2> { static constexpr int SCORE_BLOCK = 12, ACC_BLOCK = 8; };
template <> struct Tiles<3> { static constexpr int SCORE_BLOCK = 8, ACC_BLOCK = 8; };
template <> struct Tiles<4> { static constexpr int SCORE_BLOCK = 6, ACC_BLOCK = 4; };
#else
template <> struct Tiles<1> { static constexpr int SCORE_BLOCK = 6, ACC_BLOCK = 4; };
template <> struct Tiles<2> { static constexpr int SCORE_BLOCK = 3, ACC_BLOCK = 2; };
template <> struct Tiles<3> { static constexpr int SCORE_BLOCK = 2, ACC_BLOCK = 2; };
template <> struct Tiles<4> { static constexpr int SCORE_BLOCK = 1, ACC_BLOCK = 1; };
#endif

// Points krow/vrow at keys [start, start + n) of KV head kv: into the cache itself (float32),
// or into the scratch copies widened from float16 or 8 bits.
template <typename T>
void cache_rows(const T* key_cache, const T* value_cache, const int32_t* table, int64_t kv, int64_t start,
                int64_t n, const Layout& L, Scratch& s) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = start + i;
    const int64_t at = table[pos / L.block_size] * L.block_stride + (pos % L.block_size) * L.token_stride +
                       kv * L.head_dim;
    if constexpr (std::is_same_v<T, float>) {
      s.krow[i] = key_cache + at;
      s.vrow[i] = value_cache + at;
    } else {
      float* k = s.keys.data() + i * L.head_dim;
      float* v = s.values.data() + i * L.head_dim;
      for (int64_t d = 0; d < L.head_dim; d += 16) {
        vstore(k + d, load16(key_cache + at + d));
        vstore(v + d, load16(value_cache + at + d));
      }
      s.krow[i] = k;
      s.vrow[i] = v;
    }
  }
}


// scores[key][lane] = sum_d K[key][d] * qt[d][lane] for BLOCK keys.
template <int RV, int BLOCK>
inline void score_block(const float* qt, const float* const* krow, int64_t head_dim, float* scores) {
  constexpr int64_t W = RV * 16;
  vf acc[BLOCK][RV];
  UNROLL_TILE
  for (int j = 0; j < BLOCK; ++j)
    for (int v = 0; v < RV; ++v) acc[j][v] = vzero();
  for (int64_t d = 0; d < head_dim; ++d) {
    vf q[RV];
    for (int v = 0; v < RV; ++v) q[v] = vload(qt + d * W + v * 16);
    UNROLL_TILE
    for (int j = 0; j < BLOCK; ++j) {
      const vf k = vset1(krow[j][d]);
      for (int v = 0; v < RV; ++v) acc[j][v] = vfmadd(k, q[v], acc[j][v]);
    }
  }
  UNROLL_TILE
  for (int j = 0; j < BLOCK; ++j)
    for (int v = 0; v < RV; ++v) vstore(scores + j * W + v * 16, acc[j][v]);
}

// Lanes whose exponent is not below MIN_EXPONENT (-inf, from a masked score, is).
inline vf exp_or_zero(vf x) { return keep(ge(x, vset1(MIN_EXPONENT)), streamengine_cpu::exp_ps(x)); }

// The online-softmax update for keys [start, start + n): masks the keys after each lane's
// position (only a diagonal tile has any), turns the scores into probabilities against the
// new running max, and sets alpha to the factor that rescales each lane's old accumulator.
template <int RV>
inline void softmax_update(float* probs, int64_t n, int64_t start, bool diagonal, const vi* qpos,
                           vf* run_max, vf* run_sum, vf* alpha) {
  constexpr int64_t W = RV * 16;
  vf top[RV], total[RV];
  for (int v = 0; v < RV; ++v) top[v] = vset1(-INFINITY);
  for (int64_t i = 0; i < n; ++i) {
    const vi key = vset1_i(static_cast<int32_t>(start + i));
    for (int v = 0; v < RV; ++v) {
      vf s = vload(probs + i * W + v * 16);
      if (diagonal) {
        s = select(ge(qpos[v], key), s, vset1(-INFINITY));
        vstore(probs + i * W + v * 16, s);
      }
      top[v] = vmax(top[v], s);
    }
  }
  for (int v = 0; v < RV; ++v) {
    top[v] = vmax(run_max[v], top[v]);                 // the new running max
    alpha[v] = exp_or_zero(vsub(run_max[v], top[v]));  // 0 on the first tile (-inf)
    total[v] = vzero();
  }
  for (int64_t i = 0; i < n; ++i)
    for (int v = 0; v < RV; ++v) {
      const vf p = exp_or_zero(vsub(vload(probs + i * W + v * 16), top[v]));
      vstore(probs + i * W + v * 16, p);
      total[v] = vadd(total[v], p);
    }
  for (int v = 0; v < RV; ++v) {
    run_sum[v] = vfmadd(run_sum[v], alpha[v], total[v]);
    run_max[v] = top[v];
  }
}

// acc[d][lane] = acc[d][lane] * alpha[lane] + sum over n keys of V[key][d] * probs[key][lane].
template <int RV, int BLOCK>
void accumulate(const float* probs, const float* const* vrow, int64_t n, int64_t head_dim, const vf* alpha,
                float* acc_mem) {
  constexpr int64_t W = RV * 16;
  for (int64_t d0 = 0; d0 < head_dim; d0 += BLOCK) {
    vf acc[BLOCK][RV];
    UNROLL_TILE
    for (int j = 0; j < BLOCK; ++j)
      for (int v = 0; v < RV; ++v) acc[j][v] = vmul(vload(acc_mem + (d0 + j) * W + v * 16), alpha[v]);
    for (int64_t i = 0; i < n; ++i) {
      vf p[RV];
      for (int v = 0; v < RV; ++v) p[v] = vload(probs + i * W + v * 16);
      const float* value = vrow[i] + d0;
      UNROLL_TILE
      for (int j = 0; j < BLOCK; ++j) {
        const vf x = vset1(value[j]);
        for (int v = 0; v < RV; ++v) acc[j][v] = vfmadd(x, p[v], acc[j][v]);
      }
    }
    UNROLL_TILE
    for (int j = 0; j < BLOCK; ++j)
      for (int v = 0; v < RV; ++v) vstore(acc_mem + (d0 + j) * W + v * 16, acc[j][v]);
  }
}

// The item's queries, scaled, into qt [head_dim][width] (padding lanes zero), and each lane's
// position (padding lanes: never masked, so their max stays finite).
void pack_queries(const Step& st, const Item& it, int64_t token0, int64_t first_pos, int64_t width,
                  const Layout& L, Scratch& s, int32_t* qpos) {
  const int64_t lanes = it.count * L.group;
  for (int64_t lane = 0; lane < width; ++lane) {
    float* column = s.qt.data() + lane;
    if (lane >= lanes) {
      for (int64_t d = 0; d < L.head_dim; ++d) column[d * width] = 0.0f;
      qpos[lane] = INT32_MAX;
      continue;
    }
    const int64_t t = lane / L.group, head = it.kv_head * L.group + lane % L.group;
    const float* q = st.query + (token0 + t) * st.q_token_stride + head * L.head_dim;
    for (int64_t d = 0; d < L.head_dim; ++d) column[d * width] = q[d] * st.scale;
    qpos[lane] = static_cast<int32_t>(first_pos + t);
  }
}

// out rows of the item's lanes: acc / run_sum, back in [token][head][head_dim] order.
void write_out(const Step& st, const Item& it, int64_t token0, int64_t width, const float* sums,
               const Layout& L, const Scratch& s) {
  for (int64_t lane = 0; lane < it.count * L.group; ++lane) {
    const int64_t t = lane / L.group, head = it.kv_head * L.group + lane % L.group;
    float* o = st.out + (token0 + t) * L.num_heads * L.head_dim + head * L.head_dim;
    const float inv = st.v_factor / sums[lane];
    for (int64_t d = 0; d < L.head_dim; ++d) o[d] = s.acc[d * width + lane] * inv;
  }
}

// One item: its lanes against the keys [0, its last position], a tile of keys at a time.
template <int RV, typename T>
void attend_item(const Step& st, const Item& it, const Layout& L, Scratch& s) {
  constexpr int64_t W = RV * 16;
  constexpr int SCORE_BLOCK = Tiles<RV>::SCORE_BLOCK, ACC_BLOCK = Tiles<RV>::ACC_BLOCK;
  const T* key_cache = static_cast<const T*>(st.key_cache);
  const T* value_cache = static_cast<const T*>(st.value_cache);
  const int32_t* table = st.block_tables + it.row * st.table_stride;
  const int64_t q_len = st.query_start_loc[it.row + 1] - st.query_start_loc[it.row];
  const int64_t token0 = st.query_start_loc[it.row] + it.first;
  const int64_t first_pos = st.seq_lens[it.row] - q_len + it.first, last_pos = first_pos + it.count - 1;
  alignas(64) int32_t qpos_lanes[W];
  pack_queries(st, it, token0, first_pos, W, L, s, qpos_lanes);
  vi qpos[RV];
  vf run_max[RV], run_sum[RV], alpha[RV];
  for (int v = 0; v < RV; ++v) {
    qpos[v] = vload_i(qpos_lanes + v * 16);
    run_max[v] = vset1(-INFINITY);
    run_sum[v] = vzero();
  }
  std::fill(s.acc.begin(), s.acc.begin() + L.head_dim * W, 0.0f);
  for (int64_t start = 0; start <= last_pos; start += KEY_TILE) {
    const int64_t n = std::min(KEY_TILE, last_pos + 1 - start);
    const int64_t padded = (n + SCORE_BLOCK - 1) / SCORE_BLOCK * SCORE_BLOCK;
    cache_rows(key_cache, value_cache, table, it.kv_head, start, n, L, s);
    std::fill(s.krow.begin() + n, s.krow.begin() + padded, s.zero.data());  // the register tile's tail
    for (int64_t j = 0; j < padded; j += SCORE_BLOCK)
      score_block<RV, SCORE_BLOCK>(s.qt.data(), s.krow.data() + j, L.head_dim, s.probs.data() + j * W);
    softmax_update<RV>(s.probs.data(), n, start, start + n - 1 > first_pos, qpos, run_max, run_sum, alpha);
    accumulate<RV, ACC_BLOCK>(s.probs.data(), s.vrow.data(), n, L.head_dim, alpha, s.acc.data());
  }
  alignas(64) float sums[W];
  for (int v = 0; v < RV; ++v) vstore(sums + v * 16, run_sum[v]);
  write_out(st, it, token0, W, sums, L, s);
}

using ItemFn = void (*)(const Step&, const Item&, const Layout&, Scratch&);

template <typename T>
ItemFn pick_item(int64_t lane_vectors) {
  switch (lane_vectors) {
    case 1: return attend_item<1, T>;
    case 2: return attend_item<2, T>;
    case 3: return attend_item<3, T>;
    default: return attend_item<4, T>;
  }
}

// Every row's query split into near-equal tiles of at most LANES lanes, times the KV heads;
// largest causal work (keys read x lane vectors) first.
std::vector<Item> plan_items(const Step& st, const int64_t* rows, int64_t num_rows, int64_t num_kv_heads,
                             int64_t group) {
  const int64_t per_item = std::max<int64_t>(1, LANES / group);
  std::vector<Item> items;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t row = rows[r];
    const int64_t q_len = st.query_start_loc[row + 1] - st.query_start_loc[row];
    if (q_len <= 0) continue;
    const int64_t tiles = (q_len + per_item - 1) / per_item;
    for (int64_t tile = 0, first = 0; tile < tiles; ++tile) {
      const int64_t count = q_len / tiles + (tile < q_len % tiles ? 1 : 0);
      const int64_t keys = st.seq_lens[row] - q_len + first + count;
      for (int64_t kv = 0; kv < num_kv_heads; ++kv)
        items.push_back({row, kv, first, count, keys * ((count * group + 15) / 16)});
      first += count;
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

template <typename T>
void run_items(const Step& st, const std::vector<Item>& items, const Layout& L) {
  const int64_t work = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    Scratch s(L.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < work; ++w) {
      const Item& it = items[w];
      pick_item<T>((it.count * L.group + 15) / 16)(st, it, L, s);
    }
  }
}

}  // namespace

extern "C" int streamengine_paged_prefill_supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                                    int64_t block_size) {
  return num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= MAX_GROUP &&
         head_dim > 0 && head_dim % 16 == 0 && head_dim <= MAX_HEAD_DIM && block_size > 0;
}

// query:  [num_tokens, num_heads, head_dim] at strides (q_token_stride, head_dim, 1).
// rows:   the sequences to attend (indices into query_start_loc / seq_lens / block_tables);
//         row r's query tokens query_start_loc[r] .. query_start_loc[r + 1] - 1 sit at
//         positions seq_lens[r] - q_len .. seq_lens[r] - 1, and the keys and values of
//         positions 0 .. seq_lens[r] - 1 are already in the caches.
// out:    [num_tokens, num_heads, head_dim] contiguous; only the rows' tokens are written.
// The caches hold cache_type elements (streamengine_cpu::CacheType); an 8-bit cache's values
// are its codes times k_scale / v_scale (scales of 1 only for the other types). Returns 0, -1
// for an unsupported shape or cache type, -2 for a row with more query tokens than context.
extern "C" int streamengine_paged_prefill_scaled(
    const float* query, int64_t q_token_stride, const void* key_cache, const void* value_cache,
    int64_t cache_type, int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
    const int32_t* query_start_loc, const int64_t* rows, int64_t num_rows, float scale, float k_scale,
    float v_scale, float* out) {
  using namespace streamengine_cpu;
  if (!streamengine_paged_prefill_supported(num_heads, num_kv_heads, head_dim, block_size)) return -1;
  const bool unit = k_scale == 1.0f && v_scale == 1.0f, eight_bit = cache_type == CACHE_FP8_E4M3 || cache_type == CACHE_FP8_E5M2;
  if (!(eight_bit || ((cache_type == CACHE_F32 || cache_type == CACHE_F16) && unit))) return -1;
  if (!(k_scale > 0.0f && v_scale > 0.0f)) return -1;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t q_len = query_start_loc[rows[r] + 1] - query_start_loc[rows[r]];
    if (q_len < 0 || q_len > seq_lens[rows[r]]) return -2;
  }
  const Layout L{block_size, num_heads, num_heads / num_kv_heads, head_dim,
                 block_size * num_kv_heads * head_dim, num_kv_heads * head_dim};
  const float unit_factor = cache_type == CACHE_FP8_E4M3 ? load_unit<e4m3_t>() : 1.0f;
  const Step st{query, q_token_stride, key_cache, value_cache, block_tables, table_stride,
                seq_lens, query_start_loc, scale * k_scale * unit_factor, v_scale * unit_factor, out};
  const std::vector<Item> items = plan_items(st, rows, num_rows, num_kv_heads, L.group);
  switch (cache_type) {
    case CACHE_F16: run_items<half_t>(st, items, L); break;
    case CACHE_FP8_E4M3: run_items<e4m3_t>(st, items, L); break;
    case CACHE_FP8_E5M2: run_items<e5m2_t>(st, items, L); break;
    default: run_items<float>(st, items, L);
  }
  return 0;
}

#else  // neither AVX-512 nor AVX2: the Python side keeps the PyTorch path.

extern "C" int streamengine_paged_prefill_supported(int64_t, int64_t, int64_t, int64_t) { return 0; }

extern "C" int streamengine_paged_prefill_scaled(const float*, int64_t, const void*, const void*, int64_t,
                                                 int64_t, int64_t, int64_t, int64_t, const int32_t*, int64_t,
                                                 const int32_t*, const int32_t*, const int64_t*, int64_t,
                                                 float, float, float, float*) {
  return -1;
}

#endif
