// The batched multi-LoRA kernel of cpu_lora.cpp (C ABI: called from Python through ctypes, and
// per projection from the fused decoder layers of cpu_layer.cpp).
#pragma once

#include <cstdint>

// The adapters' weight types (kernels/cpu_lora.py WEIGHT_TYPES).
enum LoraWeightType { LORA_FLOAT32 = 0, LORA_BFLOAT16 = 1 };

// A step's rows for streamengine_lora_projection, as int64 fields in this order: the address of
// slot [rows] int32, the stacks' slot count S, their rank R, their LoraWeightType.
enum LoraStepField { LORA_SLOT, LORA_SLOTS, LORA_MAX_RANK, LORA_WEIGHT_TYPE, LORA_STEP_FIELDS };
// One projection's stack: addresses of A [S, R, in], Bt [S, R, out], rank [S] int32, scale [S]
// float32; A == 0 where no resident adapter adapts the projection.
enum LoraProjectionField { LORA_A, LORA_BT, LORA_RANK, LORA_SCALE, LORA_PROJECTION_FIELDS };
// A decoder layer's projections, each LORA_PROJECTION_FIELDS wide, in this order.
enum LoraProjection { LORA_Q, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN, LORA_PROJECTIONS };

extern "C" {

// y[t, :] += scale[s] * Bt[s, :rank[s], :]^T @ (A[s, :rank[s], :] @ x[t, :]) for every row t
// with s = slot[t] >= 0. 0, or a negative code (see the definition) without touching y.
int streamengine_lora_shrink_expand(const float* x, int64_t x_stride, float* y, int64_t y_stride,
                                    const int32_t* slot, int64_t rows, const void* a, const void* bt,
                                    const int32_t* rank, const float* scale, int64_t slots, int64_t max_rank,
                                    int64_t in_features, int64_t out_features, int64_t weight_type);

// 1 in a build with AVX-512 or AVX2, else 0.
int streamengine_lora_available();

}  // extern "C"

// The same for `count` projections of a fused layer that read the same x ([rows, in_features]):
// projection which[i] adds into y[i] ([rows, out_features[i]], all at row stride y_stride).
// `step` (LoraStepField) may be null, and a projection of `layer` may have A == 0, both
// meaning no adapter there: y untouched.
int streamengine_lora_projections(const int64_t* step, const int64_t* layer, const LoraProjection* which,
                                  int64_t count, const float* x, int64_t x_stride, int64_t in_features,
                                  float* const* y, int64_t y_stride, const int64_t* out_features, int64_t rows);
