// The paged decode attention of cpu_paged_attention.cpp (C ABI: called from Python through
// ctypes and from cpu_layer.cpp).
#pragma once

#include <cstdint>

extern "C" {

// Whether streamengine_paged_decode_scaled handles this shape (always 0 without AVX-512 or AVX2).
int streamengine_paged_decode_supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                        int64_t block_size);

// One query token per listed row attends to its context through the block tables; 0, or -1 on
// an unsupported shape or cache type. An 8-bit cache's values are its codes times k_scale /
// v_scale (scales of 1 only for the other types). Arguments are described at the definition.
int streamengine_paged_decode_scaled(const float* query, int64_t q_token_stride, const void* key_cache,
                                     const void* value_cache, int64_t cache_type, int64_t block_size,
                                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
                                     const int32_t* query_start_loc, const int64_t* rows, int64_t num_rows,
                                     float scale, float k_scale, float v_scale, float* out);

}  // extern "C"
