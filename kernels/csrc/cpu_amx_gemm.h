// The packed-weight GEMM on Intel AMX tiles (cpu_amx_gemm.cpp): what cpu_quant_gemm.cpp calls
// for batches past its register rows, and the switch tests and benchmarks use.
#pragma once

#include <cstdint>

extern "C" {

// Whether the AMX path runs now: the CPU has AMX-BF16, the build has it, the kernel asked the
// OS for the tile state and got it, and it is not switched off (STREAMENGINE_AMX=0 in the
// environment, or streamengine_amx_enable(0)).
int streamengine_amx_active();

// Switches the AMX path on (where it can run) or off; returns streamengine_amx_active().
int streamengine_amx_enable(int on);

}  // extern "C"

namespace streamengine_amx {

// y[M, n_padded] = x[M, K] @ W^T for a Q4_0, Q4_1 or Q8_0 weight (format: the GGUF type id)
// packed as cpu_quant_gemm.cpp lays it out. Returns false, having done nothing, where the AMX
// path is not active or does not take the format; the caller then runs its own kernels.
bool gemm(int64_t format, const float* x, int64_t M, int64_t K, const uint8_t* panels, int64_t n_padded,
          float* y);

}  // namespace streamengine_amx
