"""The packed-weight GEMM (kernels/csrc/cpu_quant_gemm.cpp) per GGUF format (Q4_0, Q4_1, Q8_0,
BF16), against gguf-py's own NumPy dequantization: odd shapes, panel tails, every row-count path (in registers, one
group at a time, through an unpacked panel, and past SMALL_M_MAX through a float32 matmul).
Past REGISTER_ROWS rows (and for bfloat16 at any batch) the kernel claims more than closeness:
it is the float32 GEMM over the dequantized weights, so it must equal the packed float32
kernel on those weights bit for bit. Up to REGISTER_ROWS rows each block's scale is factored
out of its 32-term sum: the same GEMM up to float32 rounding, held to a rounding-error bound
that a wrong code, scale or minimum would exceed by orders of magnitude."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from streamengine.kernels import cpu_build, cpu_quant_linear
from streamengine.kernels.cpu_linear import SMALL_M_MAX, make_linear
from streamengine.kernels.cpu_quant_linear import (
    Q8_0_TYPE,
    QuantLinear,
    amx_active,
    amx_enabled,
    dequantize,
    pack_blocks,
    quantize_q8_0,
)

FORMATS = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.BF16]
SHAPES = [(1, 32), (47, 64), (49, 96), (97, 576), (200, 1536)]  # (out, in): panel tails of 48 columns
ROWS = [0, 1, 2, 3, 4, 5, 7, 8, 9, 17, 33]
# csrc/cpu_quant_gemm.cpp: up to here the factored kernels (8 with AVX-512, 6 with AVX2), from
# the build itself, so each build's exact rows are held to bit equality.
_LIB = cpu_quant_linear.load_library()
REGISTER_ROWS = _LIB.streamengine_quant_register_rows() if _LIB is not None else 0
FACTORED = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}

needs_kernels = pytest.mark.skipif(_LIB is None, reason="no C++ kernels here (they need AVX-512 or AVX2, and g++)")


def quantized(qtype, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Random weights quantized by gguf-py, and their dequantization by gguf-py."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = quants.quantize(w, qtype)
    return blocks, torch.from_numpy(quants.dequantize(blocks, qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype):
    blocks, reference = quantized(qtype, 97, 576)
    assert torch.equal(dequantize(blocks, int(qtype), (97, 576)), reference)


@needs_kernels
@pytest.mark.parametrize("amx", [False, True], ids=["dequantizing", "amx"])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gemm_is_the_float32_gemm_over_dequantized_weights(qtype, shape, amx):
    """Past REGISTER_ROWS the dequantizing kernel is bit for bit the float32 one; the AMX path
    (csrc/cpu_amx_gemm.cpp, Q4_0, Q4_1, Q8_0) sums each block in the tile unit's order and is
    held to the factored kernel's rounding bound."""
    n, k = shape
    blocks, reference = quantized(qtype, n, k, seed=n + k)
    packed = QuantLinear(blocks, int(qtype), shape, None, cpu_quant_linear.load_library())
    float32 = make_linear(reference)
    with amx_enabled(amx) as active:
        if amx and not active:
            pytest.skip("no AMX-BF16 on this CPU (or the OS refused the tile state)")
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            y = packed(x)
            assert y.shape == (m, n)
            if qtype in FACTORED and (m <= REGISTER_ROWS or amx):
                assert_within_rounding(y, x, reference)
            else:
                assert torch.equal(y, float32(x)), f"M={m}"
            if m:
                torch.testing.assert_close(y, x @ reference.T, rtol=1e-4, atol=1e-4 * k**0.5)


def assert_within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|y - x @ w^T| within a float32 summation bound: K units of roundoff on sum_k |x_k w_jk|,
    against the exact product computed in float64."""
    exact = x.double() @ w.double().T
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    assert ((y.double() - exact).abs() <= bound).all()


@needs_kernels
@pytest.mark.parametrize("qtype", sorted(FACTORED), ids=lambda t: t.name)
def test_amx_row_chunks_and_panel_groups(qtype):
    """Batches over one 256-row chunk take the AMX path's other schedule (panels unpacked in
    groups of about 1 MB, each row chunk run against a whole group): 300 rows x 9 panels of
    K = 1536 spans two chunks and two groups; ragged rows and a panel tail included."""
    with amx_enabled(True) as active:
        if not active:
            pytest.skip("no AMX-BF16 on this CPU (or the OS refused the tile state)")
        blocks, reference = quantized(qtype, 400, 1536, seed=7)
        packed = QuantLinear(blocks, int(qtype), (400, 1536), None, cpu_quant_linear.load_library())
        x = torch.randn(300, 1536, generator=torch.Generator().manual_seed(3))
        x[5] = 0.0  # a zero row: every part and sum zero
        x[7] *= 1e-20  # tiny inputs: their lowest bfloat16 parts are still normal
        y = packed(x)
        assert_within_rounding(y, x, reference)
        assert torch.equal(y[5], torch.zeros(400))
        assert torch.equal(packed(x[:17]), y[:17])  # a row's result does not depend on the batch
        # The tiles ran: their per-block order of additions differs from the dequantizing
        # kernel's somewhere among these 120,000 sums of 1,536 terms.
        with amx_enabled(False):
            assert not torch.equal(packed(x), y)


@needs_kernels
def test_amx_switch():
    """STREAMENGINE_AMX=0 and amx_enabled(False) keep the dequantizing kernel; the switch is
    restored on leaving."""
    before = amx_active()
    if not before:
        pytest.skip("no AMX-BF16 on this CPU (or the OS refused the tile state): nothing to switch off")
    with amx_enabled(False) as active:
        assert not active and not amx_active()
    assert amx_active() == before
    code = "from streamengine.kernels import cpu_quant_linear as q; print(q.amx_active())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "STREAMENGINE_AMX": "0"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@needs_kernels
def test_large_batches_and_bias():
    """Past SMALL_M_MAX rows the panels are unpacked once for a float32 matmul; a bias is added."""
    blocks, reference = quantized(GGMLQuantizationType.Q4_1, 50, 64)
    bias = torch.randn(50)
    packed = QuantLinear(blocks, int(GGMLQuantizationType.Q4_1), (50, 64), bias, cpu_quant_linear.load_library())
    x = torch.randn(SMALL_M_MAX + 3, 64)
    assert torch.equal(packed(x), make_linear(reference, bias)(x))
    assert_within_rounding(packed(x[:5]) - bias, x[:5], reference)


@needs_kernels
def test_packed_size_is_the_files():
    """Repacked for the kernel, a weight takes the bytes it takes in the file (plus zero columns
    up to the 48-column panel)."""
    for qtype, n in [(GGMLQuantizationType.Q4_1, 96), (GGMLQuantizationType.Q8_0, 48)]:
        blocks, _ = quantized(qtype, n, 576)
        assert pack_blocks(blocks, int(qtype), (n, 576), 48).nbytes == blocks.nbytes


def test_bad_weights_are_refused_clearly():
    blocks, _ = quantized(GGMLQuantizationType.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="GGUF type 12 has no packed kernel .*Q4_0, Q4_1, Q8_0"):
        pack_blocks(blocks, 12, (4, 64), 48)  # Q4_K
    with pytest.raises(ValueError, match="not a multiple of 32"):
        pack_blocks(blocks, int(GGMLQuantizationType.Q8_0), (4, 48), 48)


@needs_kernels
def test_wrong_input_is_refused():
    blocks, _ = quantized(GGMLQuantizationType.Q4_0, 8, 64)
    packed = QuantLinear(blocks, int(GGMLQuantizationType.Q4_0), (8, 64), None, cpu_quant_linear.load_library())
    with pytest.raises(ValueError, match=r"float32 CPU \[M, 64\]"):
        packed(torch.randn(2, 32))
    with pytest.raises(ValueError, match=r"float32 CPU \[M, 64\]"):
        packed(torch.randn(2, 64, dtype=torch.float64))


PROBE = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.streamengine_quant_block_bytes.restype = ctypes.c_int64
print(lib.streamengine_panel_width(), lib.streamengine_quant_block_bytes(3), lib.streamengine_cpu_layer_available())
"""


@pytest.mark.parametrize("march, probes", [
    ("x86-64-v2", ["0", "0", "0"]),  # SSE4.2, no AVX: every probe says "unsupported"
    ("x86-64-v3", ["48", str(2 * 96 + 16 * 48), "1"]),  # AVX2 + FMA + F16C: the kernels
])
def test_builds_for_older_cpus_report_what_they_run(tmp_path, monkeypatch, march, probes):
    """The same sources build for an instruction set below AVX-512: with AVX2 every kernel is
    there (48-column panels, Q4_1 blocks of 48 columns); below it every probe says
    "unsupported", which is what sends Python to the PyTorch path."""
    if march == "x86-64-v3" and not cpu_build.AVX2_FEATURES <= cpu_build.cpu_flags():
        pytest.skip("this CPU cannot run an AVX2 build")
    flags = [f for f in cpu_build.COMPILE_FLAGS if f != "-march=native"] + [f"-march={march}"]
    monkeypatch.setattr(cpu_build, "COMPILE_FLAGS", flags)
    try:
        library = cpu_build.build(out_dir=tmp_path)
    except OSError as exc:  # no compiler here: nothing to check
        pytest.skip(str(exc))
    done = subprocess.run([sys.executable, "-c", PROBE, str(library)], capture_output=True, text=True, check=True)
    assert done.stdout.split() == probes


def test_int8_quantization_moves_each_weight_by_at_most_half_a_step():
    """The int8 weight-only mode's quantizer: Q8_0 blocks whose dequantized weights sit within
    half a step (d / 2, d the block's float16 scale) of the float weights; zero blocks stay zero."""
    w = torch.randn(50, 96, generator=torch.Generator().manual_seed(3)) * 0.05
    w[7, 32:64] = 0
    blocks = quantize_q8_0(w)
    assert blocks.shape == (50, 96 // 32 * 34)
    got = dequantize(blocks, Q8_0_TYPE, (50, 96))
    step = torch.from_numpy(blocks.reshape(50, 3, 34)[..., :2].copy().view(np.float16).astype(np.float32))  # [50, 3, 1]
    error = (got - w).abs().reshape(50, 3, 32)
    assert (error <= step * 0.5 + 1e-7).all()
    assert torch.equal(got[7, 32:64], torch.zeros(32))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize_q8_0(torch.randn(4, 40))
