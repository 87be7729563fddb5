"""The int8-activation GEMM (kernels/csrc/cpu_quant_gemm.cpp, EngineConfig.int8_activations):
opt-in and not exact. Each row's inputs are quantized per 32 values to int8 and multiplied by
Q4_0, Q4_1 or Q8_0 codes with integer dot products. Held to three things: it computes what it
claims (`int8_activation_reference`, summed exactly in float64, up to float32 rounding: a wrong
code, order or scale is off by orders of magnitude more); its error against the float32 GEMM
stays within what moving each input by half a quantization step can cause; and a row's result
does not depend on the other rows of its batch. Then the engine: greedy tokens of the default
model stay close to the exact ones."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from streamengine.kernels import cpu_build, cpu_quant_linear
from streamengine.kernels.cpu_linear import SMALL_M_MAX
from streamengine.kernels.cpu_quant_linear import (
    QuantLinear,
    dequantize,
    int8_activation_reference,
    quantize_activations,
)

FORMATS = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
SHAPES = [(1, 32), (47, 64), (97, 576), (200, 1536)]  # (out, in): panel tails of 48 columns
ROWS = [0, 1, 2, 3, 4, 5, 7, 9, 33]  # register tiles of 4 rows and their tails

_LIB = cpu_quant_linear.load_library()
needs_kernels = pytest.mark.skipif(_LIB is None, reason="no C++ kernels here (they need AVX-512 or AVX2, and g++)")


def quantized(qtype, n: int, k: int, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return quants.quantize(w, qtype)


def inputs(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows of different scales, one with a block of zeros (its scale is 0) and one outlier."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-2, 1, max(m, 1))[:m, None]
    if m:
        x[0, :32] = 0
        x[-1, k // 2] = 50.0
    return x


def assert_is_the_reference(y: torch.Tensor, x: torch.Tensor, blocks: np.ndarray, qtype, shape) -> None:
    """y equals the exact int8-activation sum up to float32 rounding of the per-block terms."""
    n, k = shape
    ref = int8_activation_reference(x.numpy(), blocks, int(qtype), shape)
    magnitude = x.double().abs() @ dequantize(blocks, int(qtype), shape).double().abs().T  # sum_k |x_k w_k|
    bound = (k // 32 + 8) * 2.0**-23 * magnitude.numpy() + 1e-30
    assert (np.abs(y.double().numpy() - ref) <= bound).all()


@needs_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gemm_is_the_int8_activation_sum(qtype, shape):
    n, k = shape
    blocks = quantized(qtype, n, k, seed=n + k)
    linear = QuantLinear(blocks, int(qtype), shape, None, _LIB, int8_activations=True)
    for m in ROWS:
        x = inputs(m, k, seed=m)
        y = linear(x)
        assert y.shape == (m, n)
        assert_is_the_reference(y, x, blocks, qtype, shape)


@needs_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_error_against_the_float_gemm_is_the_input_rounding(qtype):
    """|y - x @ W^T| <= sum_k |w_k| dx_b / 2 (each input moved by at most half its block's
    step dx_b), plus float32 rounding; and it is not the float32 GEMM (the inputs really were
    quantized)."""
    n, k, m = 97, 576, 9
    blocks = quantized(qtype, n, k, seed=1)
    w = dequantize(blocks, int(qtype), (n, k)).double()
    x = inputs(m, k, seed=2)
    y = QuantLinear(blocks, int(qtype), (n, k), None, _LIB, int8_activations=True)(x).double()
    _, dx = quantize_activations(x.numpy())  # [M, K / 32, 1]
    half_step = torch.from_numpy(np.repeat(dx[..., 0], 32, axis=1)).double() / 2  # [M, K]
    exact = x.double() @ w.T
    bound = half_step @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T)
    assert ((y - exact).abs() <= bound).all()
    assert (y - exact).abs().max() > 1e3 * 2.0**-24 * exact.abs().max()


@needs_kernels
def test_a_rows_result_does_not_depend_on_its_batch():
    """Scales are per row and block, so a row gives the same bits alone, in any batch, and past
    SMALL_M_MAX (where exact weights switch to a float32 matmul, these stay in the kernel)."""
    blocks = quantized(GGMLQuantizationType.Q4_1, 50, 64)
    linear = QuantLinear(blocks, int(GGMLQuantizationType.Q4_1), (50, 64), None, _LIB, int8_activations=True)
    x = inputs(SMALL_M_MAX + 3, 64, seed=5)
    batch = linear(x)
    for r in (0, 5, 6, SMALL_M_MAX + 2):
        assert torch.equal(batch[r], linear(x[r:r + 1])[0])
        assert torch.equal(batch[r], linear(x[r:r + 7])[0])


def test_only_block_formats_take_int8_activations():
    w = torch.randn(4, 64)
    rows = cpu_quant_linear.bfloat16_rows(w.bfloat16().float())
    with pytest.raises(ValueError, match="int8 activations run with Q4_0, Q4_1 or Q8_0 weights, not BF16"):
        QuantLinear(rows, cpu_quant_linear.BF16_TYPE, (4, 64), None, _LIB, int8_activations=True)


OTHER_BUILD = """
import ctypes, sys
import numpy as np, torch
from gguf import GGMLQuantizationType, quants
from streamengine.kernels import cpu_quant_linear as cq
lib = ctypes.CDLL(sys.argv[1])
lib.streamengine_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
worst = 0.0
for qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
    n, k, m = 97, 576, 7
    blocks = quants.quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32), qtype)
    linear = cq.QuantLinear(blocks, int(qtype), (n, k), None, cq.load_library(), int8_activations=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    y = torch.empty(m, linear.padded)
    assert lib.streamengine_gemm(linear.kernel_weight.data_ptr(), x.data_ptr(), m, y.data_ptr()) == 0
    ref = cq.int8_activation_reference(x.numpy(), blocks, int(qtype), (n, k))
    worst = max(worst, float(np.abs(y[:, :n].numpy() - ref).max() / np.abs(ref).max()))
print(worst)
"""


@needs_kernels
@pytest.mark.parametrize("flags, needs", [
    (["-mno-avx512f"], "avx2"),  # the AVX2 build: integer dots through int16 pairs
    (["-mno-avx512vnni"], "avx512_vnni"),  # AVX-512 without VNNI: the same through int16
], ids=["avx2", "avx512-without-vnni"])
def test_every_instruction_set_computes_the_same_sum(flags, needs):
    """The builds this CPU can run besides its own: each computes the int8-activation sum (Q8_0
    codes reach 255, which only the nibble split keeps within int16 on these paths)."""
    if needs == "avx512_vnni" and needs not in cpu_build.cpu_flags():
        pytest.skip("this CPU has no AVX-512 VNNI: its own build already runs without it")
    if needs == "avx2" and not cpu_build.AVX2_FEATURES <= cpu_build.cpu_flags():
        pytest.skip("this CPU cannot run an AVX2 build")
    library = cpu_build.build(extra_flags=flags)
    done = subprocess.run([sys.executable, "-c", OTHER_BUILD, str(library)], capture_output=True, text=True, check=True)
    assert float(done.stdout) < 1e-5
