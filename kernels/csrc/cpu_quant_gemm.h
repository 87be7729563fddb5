// GEMM over weights kept in GGUF block formats (cpu_quant_gemm.cpp), and the one entry point
// that multiplies by any packed weight, float32 or quantized (C ABI: called from Python through
// ctypes and from cpu_layer.cpp).
#pragma once

#include <cstdint>

extern "C" {

// A packed weight as four int64: {format, address of its panels, n_padded, K}. format is the
// GGUF type id: 0 float32 panels (cpu_gemm.h), 2 Q4_0, 3 Q4_1, 8 Q8_0, 30 BF16; Q4_0, Q4_1
// or Q8_0 (in its own layout) with STREAMENGINE_INT8_ACTIVATIONS added runs with its inputs
// quantized to int8 (opt-in, not exact: cpu_quant_gemm.cpp).
#define STREAMENGINE_INT8_ACTIVATIONS 0x100
enum WeightField { WEIGHT_FORMAT, WEIGHT_DATA, WEIGHT_N_PADDED, WEIGHT_K, WEIGHT_FIELDS };

// y[M, n_padded] = x[M, K] @ W^T for any packed weight; 0, or -1 on a format or shape it
// cannot handle.
int streamengine_gemm(const int64_t* weight, const float* x, int64_t M, float* y);

// Bytes of one 32-weight block of 48 columns in `format`'s panel layout, or 0 where the format is
// not supported (or the build has neither AVX-512 nor AVX2).
int64_t streamengine_quant_block_bytes(int64_t format);

// Rows up to which a step factors each block's scale out of its sum (8 with AVX-512, 6 with
// AVX2); larger steps dequantize exactly. 0 in a build without either.
int streamengine_quant_register_rows();

// The float32 panels [n_padded / 48][K][48] of a quantized weight (for large batches, which
// run through a float32 matmul, and for tests); 0, or -1.
int streamengine_dequant_panels(const int64_t* weight, float* out);

}  // extern "C"
