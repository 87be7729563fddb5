// A Llama-family decoder layer in two calls, around the attention: the packed GEMM
// (cpu_gemm.cpp) and the fused element-wise steps (cpu_ops.cpp) composed in C++.
//
// Why: between the layer's four GEMMs a decode step has six small steps; run from Python each
// costs a dispatch, and each first touch after a GEMM (which streamed megabytes of weights
// through the caches) pays cache misses on the interpreter's own state. Measured on SmolLM2,
// 2 cores: ~9 ms of a ~37 ms batch-2 step. Here Python calls once before the attention and
// once after it.
//
// Row strides: GEMM outputs are [T, N padded to 48] (see cpu_gemm.cpp); everything else is
// dense. Built at run time by kernels/cpu_build.py; called by kernels/cpu_layer.py.

#include "cpu_gemm.cpp"
#include "cpu_ops.cpp"

#if defined(__AVX512F__)

// qkv = x @ Wqkv^T (+ bias); RoPE on the q and k heads; k and v into their cache slots.
// x [T, hidden]; qkv [T, qkv_padded]; caches [num_slots, kv_heads * head_dim].
extern "C" int streamengine_layer_in(const float* x, int64_t T, int64_t hidden, const float* qkv_panels,
                                     int64_t qkv_padded, const float* qkv_bias, int64_t heads,
                                     int64_t kv_heads, int64_t head_dim, const float* cos, const float* sin,
                                     const int64_t* slots, float* key_cache, float* value_cache, float* qkv) {
  const int64_t qkv_n = (heads + 2 * kv_heads) * head_dim;
  if (streamengine_sgemm_packed(x, T, hidden, qkv_panels, qkv_padded, qkv) != 0) return -1;
  if (qkv_bias != nullptr) streamengine_add_bias(qkv, qkv_padded, T, qkv_n, qkv_bias);
  streamengine_rope(qkv, T, qkv_padded, heads + kv_heads, head_dim, cos, sin);
  const float* k = qkv + heads * head_dim;
  const float* v = k + kv_heads * head_dim;
  return streamengine_store_kv(k, qkv_padded, v, qkv_padded, slots, T, kv_heads * head_dim, key_cache,
                               value_cache);
}

// After the attention: h += attn @ Wo^T (+ bias); x = RMSNorm(h); h += down(silu(gate) * up);
// x_out = RMSNorm(h) with the next layer's (or the final) norm weight.
// attn [T, attn_width]; h, x_out [T, hidden]; scratch: o [T, o_padded], x [T, hidden],
// gate_up [T, gu_padded], act [T, intermediate], down [T, down_padded].
extern "C" int streamengine_layer_out(const float* attn, int64_t T, int64_t attn_width, const float* o_panels,
                                      int64_t o_padded, const float* o_bias, float* h, int64_t hidden,
                                      const float* post_norm, const float* gu_panels, int64_t gu_padded,
                                      int64_t intermediate, const float* down_panels, int64_t down_padded,
                                      const float* next_norm, float eps, float* o, float* x, float* gate_up,
                                      float* act, float* down, float* x_out) {
  if (streamengine_sgemm_packed(attn, T, attn_width, o_panels, o_padded, o) != 0) return -1;
  if (o_bias != nullptr) streamengine_add_bias(o, o_padded, T, hidden, o_bias);
  streamengine_add_rms_norm(h, o, o_padded, post_norm, eps, T, hidden, x);
  if (streamengine_sgemm_packed(x, T, hidden, gu_panels, gu_padded, gate_up) != 0) return -1;
  streamengine_silu_mul(gate_up, gu_padded, T, intermediate, act);
  if (streamengine_sgemm_packed(act, T, intermediate, down_panels, down_padded, down) != 0) return -1;
  return streamengine_add_rms_norm(h, down, down_padded, next_norm, eps, T, hidden, x_out);
}

extern "C" int streamengine_cpu_layer_available() { return 1; }

#else

extern "C" int streamengine_cpu_layer_available() { return 0; }

#endif
