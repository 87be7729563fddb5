// A Llama-family decoder layer in two calls, around the attention: the packed GEMMs
// (cpu_gemm.cpp for float32 panels, cpu_quant_gemm.cpp for GGUF blocks, both behind
// streamengine_gemm) and the fused element-wise steps (cpu_ops.cpp) composed in C++.
//
// Why: between the layer's four GEMMs a decode step has six small steps; run from Python each
// costs a dispatch, and each first touch after a GEMM (which streamed megabytes of weights
// through the caches) pays cache misses on the interpreter's own state: together a large
// share of a small-batch step. Here Python calls once before the attention and once after it.
//
// Weights are passed as 4-int64 views {format, panels, n_padded, K} (cpu_quant_gemm.h).
// Row strides: GEMM outputs are [T, N padded to 48] (see cpu_gemm.cpp); everything else is
// dense. Built at run time by kernels/cpu_build.py; called by kernels/cpu_layer.py.
//
// LoRA: a step with adapter rows passes `lora_step` (cpu_lora.h LoraStepField) and the layer's
// `lora_layer` (LORA_PROJECTIONS stacks of LoraProjectionField); each adapted projection's
// output gets its rows' deltas right after its GEMM (before bias, RoPE and activation, as a
// delta on the projection's own output must). Both null: the base model.

#include <cstdint>

#include "cpu_lora.h"
#include "cpu_ops.h"
#include "cpu_paged_attention.h"
#include "cpu_quant_gemm.h"
#include "cpu_simd.h"

#if defined(STREAMENGINE_SIMD)

namespace {

// y[i] [T, outs[i] at y_stride] += the deltas of projection which[i] of the layer, all of them
// reading x [T, in at x_stride].
template <int N>
int add_lora(const int64_t* lora_step, const int64_t* lora_layer, const LoraProjection (&which)[N], const float* x,
             int64_t x_stride, int64_t in, float* const (&y)[N], int64_t y_stride, const int64_t (&outs)[N], int64_t T) {
  if (lora_step == nullptr) return 0;
  return streamengine_lora_projections(lora_step, lora_layer, which, N, x, x_stride, in, y, y_stride, outs, T);
}

}  // namespace

// qkv = x @ Wqkv^T (+ LoRA deltas, + bias); RoPE on the q and k heads; k and v into their cache
// slots. x [T, hidden]; qkv [T, qkv_padded]; caches [num_slots, kv_heads * head_dim] of cache_type;
// kv_scales: {k_scale, v_scale} of an 8-bit cache (null: 1, the other types).
extern "C" int streamengine_layer_in(const float* x, int64_t T, int64_t hidden, const int64_t* qkv_weight,
                                     const float* qkv_bias, int64_t heads,
                                     int64_t kv_heads, int64_t head_dim, const float* cos, const float* sin,
                                     const int64_t* slots, void* key_cache, void* value_cache,
                                     int64_t cache_type, const float* kv_scales, const int64_t* lora_step,
                                     const int64_t* lora_layer, float* qkv) {
  const int64_t qkv_n = (heads + 2 * kv_heads) * head_dim, qkv_padded = qkv_weight[WEIGHT_N_PADDED];
  if (qkv_weight[WEIGHT_K] != hidden || streamengine_gemm(qkv_weight, x, T, qkv) != 0) return -1;
  const int64_t q_n = heads * head_dim, kv_n = kv_heads * head_dim;
  if (add_lora(lora_step, lora_layer, {LORA_Q, LORA_K, LORA_V}, x, hidden, hidden,
               {qkv, qkv + q_n, qkv + q_n + kv_n}, qkv_padded, {q_n, kv_n, kv_n}, T) != 0)
    return -1;
  if (qkv_bias != nullptr) streamengine_add_bias(qkv, qkv_padded, T, qkv_n, qkv_bias);
  streamengine_rope(qkv, T, qkv_padded, heads + kv_heads, head_dim, cos, sin);
  const float* k = qkv + heads * head_dim;
  const float* v = k + kv_heads * head_dim;
  return streamengine_store_kv_scaled(k, qkv_padded, v, qkv_padded, slots, T, kv_heads * head_dim, key_cache,
                                      value_cache, cache_type, kv_scales ? kv_scales[0] : 1.0f,
                                      kv_scales ? kv_scales[1] : 1.0f);
}

// After the attention: h += attn @ Wo^T (+ bias); x = RMSNorm(h); h += down(silu(gate) * up);
// each projection with its LoRA deltas;
// x_out = RMSNorm(h) with the next layer's (or the final) norm weight.
// attn [T, attn_width]; h, x_out [T, hidden]; scratch: o [T, o's n_padded], x [T, hidden],
// gate_up [T, gate_up's n_padded], act [T, intermediate], down [T, down's n_padded].
extern "C" int streamengine_layer_out(const float* attn, int64_t T, int64_t attn_width, const int64_t* o_weight,
                                      const float* o_bias, float* h, int64_t hidden, const float* post_norm,
                                      const int64_t* gu_weight, int64_t intermediate, const int64_t* down_weight,
                                      const float* next_norm, float eps, const int64_t* lora_step,
                                      const int64_t* lora_layer, float* o, float* x, float* gate_up,
                                      float* act, float* down, float* x_out) {
  const int64_t o_padded = o_weight[WEIGHT_N_PADDED], gu_padded = gu_weight[WEIGHT_N_PADDED];
  const int64_t down_padded = down_weight[WEIGHT_N_PADDED];
  if (o_weight[WEIGHT_K] != attn_width || gu_weight[WEIGHT_K] != hidden || down_weight[WEIGHT_K] != intermediate)
    return -1;
  if (streamengine_gemm(o_weight, attn, T, o) != 0 ||
      add_lora(lora_step, lora_layer, {LORA_O}, attn, attn_width, attn_width, {o}, o_padded, {hidden}, T) != 0)
    return -1;
  if (o_bias != nullptr) streamengine_add_bias(o, o_padded, T, hidden, o_bias);
  streamengine_add_rms_norm(h, o, o_padded, post_norm, eps, T, hidden, x);
  // gate_up's row: gate's columns, then up's.
  if (streamengine_gemm(gu_weight, x, T, gate_up) != 0 ||
      add_lora(lora_step, lora_layer, {LORA_GATE, LORA_UP}, x, hidden, hidden, {gate_up, gate_up + intermediate},
               gu_padded, {intermediate, intermediate}, T) != 0)
    return -1;
  streamengine_silu_mul(gate_up, gu_padded, T, intermediate, act);
  if (streamengine_gemm(down_weight, act, T, down) != 0 ||
      add_lora(lora_step, lora_layer, {LORA_DOWN}, act, intermediate, intermediate, {down}, down_padded, {hidden}, T) != 0)
    return -1;
  return streamengine_add_rms_norm(h, down, down_padded, next_norm, eps, T, hidden, x_out);
}

// One layer's tensors for streamengine_decode_layers, as addresses (int64) in this order
// (weights: of their 4-int64 views); biases and KV_SCALES (an 8-bit cache's {k_scale, v_scale})
// may be 0 (absent).
enum LayerField { QKV_WEIGHT, QKV_BIAS, O_WEIGHT, O_BIAS, POST_NORM, GU_WEIGHT, DOWN_WEIGHT,
                  NEXT_NORM, KEY_CACHE, VALUE_CACHE, KV_SCALES, NUM_FIELDS };

// A whole decode step through every layer, for steps whose rows all have one query token:
// per layer, layer_in, paged attention straight from the cache, layer_out. Why one call: from
// Python each layer pays dispatch and wrapper work on a cache the weight stream has just
// flushed, which at small batches is a large share of the step.
// x [T, hidden]: the first layer's normed input, overwritten with the final normed output;
// h [T, hidden]: the residual stream, updated in place. Decode plan as in paged_decode (one
// row per sequence, `rows` lists them); caches of cache_type. work: scratch of
// T * (qkv_padded + heads * head_dim + o_padded + hidden + gu_padded + intermediate + down_padded) floats.
// LoRA: lora_step as in layer_in, lora_layers [num_layers, LORA_PROJECTIONS * LORA_PROJECTION_FIELDS]
// (both null without adapter rows).
extern "C" int streamengine_decode_layers(
    const int64_t* layers, int64_t num_layers, int64_t T, int64_t hidden, int64_t heads, int64_t kv_heads,
    int64_t head_dim, int64_t qkv_padded, int64_t o_padded, int64_t gu_padded, int64_t intermediate,
    int64_t down_padded, float eps, float scale, const float* cos, const float* sin, const int64_t* slots,
    int64_t cache_type, int64_t block_size, const int32_t* block_tables, int64_t table_stride,
    const int32_t* seq_lens, const int32_t* query_start_loc, const int64_t* rows, int64_t num_rows,
    const int64_t* lora_step, const int64_t* lora_layers, float* h, float* x, float* work) {
  float* qkv = work;
  float* attn = qkv + T * qkv_padded;
  float* o = attn + T * heads * head_dim;
  float* x_mid = o + T * o_padded;
  float* gate_up = x_mid + T * hidden;
  float* act = gate_up + T * gu_padded;
  float* down = act + T * intermediate;
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* f = layers + l * NUM_FIELDS;
    auto ptr = [&](LayerField i) { return reinterpret_cast<float*>(f[i]); };
    auto weight = [&](LayerField i) { return reinterpret_cast<const int64_t*>(f[i]); };
    auto cache = [&](LayerField i) { return reinterpret_cast<void*>(f[i]); };
    const int64_t* lora_layer =
        lora_step == nullptr ? nullptr : lora_layers + l * LORA_PROJECTIONS * LORA_PROJECTION_FIELDS;
    // The scratch above is laid out for these widths: a layer with others would overrun it.
    if (weight(QKV_WEIGHT)[WEIGHT_N_PADDED] != qkv_padded || weight(O_WEIGHT)[WEIGHT_N_PADDED] != o_padded ||
        weight(GU_WEIGHT)[WEIGHT_N_PADDED] != gu_padded || weight(DOWN_WEIGHT)[WEIGHT_N_PADDED] != down_padded)
      return -1;
    const float* kv_scales = ptr(KV_SCALES);
    if (streamengine_layer_in(x, T, hidden, weight(QKV_WEIGHT), ptr(QKV_BIAS), heads, kv_heads,
                              head_dim, cos, sin, slots, cache(KEY_CACHE), cache(VALUE_CACHE), cache_type,
                              kv_scales, lora_step, lora_layer, qkv) != 0)
      return -1;
    if (streamengine_paged_decode_scaled(qkv, qkv_padded, cache(KEY_CACHE), cache(VALUE_CACHE), cache_type,
                                         block_size, heads, kv_heads, head_dim, block_tables, table_stride,
                                         seq_lens, query_start_loc, rows, num_rows, scale,
                                         kv_scales ? kv_scales[0] : 1.0f, kv_scales ? kv_scales[1] : 1.0f,
                                         attn) != 0)
      return -1;
    // x is free once layer_in has read it: layer_out writes the next layer's input there.
    if (streamengine_layer_out(attn, T, heads * head_dim, weight(O_WEIGHT), ptr(O_BIAS), h, hidden,
                               ptr(POST_NORM), weight(GU_WEIGHT), intermediate, weight(DOWN_WEIGHT),
                               ptr(NEXT_NORM), eps, lora_step, lora_layer, o, x_mid, gate_up, act, down, x) != 0)
      return -1;
  }
  return 0;
}

extern "C" int streamengine_cpu_layer_available() { return 1; }

#else

extern "C" int streamengine_cpu_layer_available() { return 0; }

#endif
