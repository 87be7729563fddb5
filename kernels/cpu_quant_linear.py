"""Linear layers whose weights stay in GGUF block formats (Q4_0, Q4_1, Q8_0) or bfloat16,
multiplied by csrc/cpu_quant_gemm.cpp with the dequantization fused into the GEMM.

`QuantLinear(blocks, quant_type, shape)` takes a weight as the file stores it (rows of GGUF
blocks, `blocks[n]` the bytes of output row n) and repacks it once into the kernel's panels:
48 output columns per panel, per 32-weight block the columns' float16 scales (and minimums),
then their codes (see the C++ file for the order). The result equals `F.linear` over the
dequantized weight up to summation order; with the packed float32 kernel it is bit-identical.

`dequantize(blocks, quant_type, shape)` is the plain PyTorch dequantization, used for
embedding rows and where the kernels do not run.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from . import cpu_build
from .cpu_build import I64, PTR
from .cpu_linear import PanelLinear

QK = 32  # weights per GGUF block


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str
    type_id: int  # the GGUF (ggml) type id, also the kernel's format code
    block_bytes: int  # bytes per 32 weights in the file
    has_min: bool  # Q4_1: w = d * q + m
    code_bits: int


FORMATS = {f.type_id: f for f in (
    BlockFormat("Q4_0", 2, 18, False, 4),
    BlockFormat("Q4_1", 3, 20, True, 4),
    BlockFormat("Q8_0", 8, 34, False, 8),
    BlockFormat("BF16", 30, 64, False, 16),  # no scales: each weight is the upper half of a float32
)}
FORMAT_NAMES = frozenset(f.name for f in FORMATS.values())
Q8_0_TYPE = 8  # the GGUF type id of Q8_0: the int8 weight-only mode's blocks
INT8_ACTIVATIONS = 0x100  # added to a Q4_0, Q4_1 or Q8_0 format code: the kernel quantizes the inputs (cpu_quant_gemm.h)
BF16_TYPE = 30


def block_format(quant_type: int) -> BlockFormat:
    try:
        return FORMATS[int(quant_type)]
    except KeyError:
        names = ", ".join(f.name for f in FORMATS.values())
        raise ValueError(f"GGUF type {int(quant_type)} has no packed kernel (supported: {names})") from None


def _fields(blocks: np.ndarray, fmt: BlockFormat, k: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """A weight's blocks split into scales d [N, nb] f16, minimums m (Q4_1) and codes
    [N, nb, 32] in k order (unsigned nibbles for Q4, int8 for Q8)."""
    n = blocks.shape[0]
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, k // QK, fmt.block_bytes)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]
    m = raw[..., 2:4].copy().view(np.float16)[..., 0] if fmt.has_min else None
    qs = raw[..., 4 if fmt.has_min else 2:]
    if fmt.code_bits == 8:
        return d, m, qs.view(np.int8)
    # A Q4 block's byte t holds weight t (low nibble) and weight t + 16 (high nibble).
    return d, m, np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def dequantize(blocks: np.ndarray | torch.Tensor, quant_type: int, shape: tuple[int, int]) -> torch.Tensor:
    """[N, K] float32 weights of GGUF blocks, computed as GGUF defines them."""
    fmt, (n, k) = block_format(quant_type), shape
    if fmt.code_bits == 16:
        bits = np.ascontiguousarray(blocks, dtype=np.uint8).view(np.uint16).astype(np.int32) << 16
        return torch.from_numpy(bits.view(np.float32)).reshape(n, k)
    d, m, q = _fields(np.asarray(blocks), fmt, k)
    scale = torch.from_numpy(d.astype(np.float32))[..., None]  # [N, nb, 1]
    codes = torch.from_numpy(q.astype(np.float32))  # [N, nb, 32]
    if fmt.has_min:
        w = scale * codes + torch.from_numpy(m.astype(np.float32))[..., None]
    elif fmt.code_bits == 4:
        w = scale * (codes - 8)
    else:
        w = scale * codes
    return w.reshape(n, k)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[M, K] float32 inputs as the int8-activation kernel quantizes them: per 32 values
    dx = max |x| / 127 and xq = round(x / dx) (ties to even). Returns xq [M, K / 32, 32]
    (float32 holding integers) and dx [M, K / 32, 1]."""
    m, k = x.shape
    blocks = np.asarray(x, dtype=np.float32).reshape(m, k // QK, QK)
    dx = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inverse = np.divide(np.float32(1), dx, out=np.zeros_like(dx), where=dx != 0)
    return np.rint(blocks * inverse), dx


def int8_activation_reference(x: np.ndarray, blocks: np.ndarray, quant_type: int, shape: tuple[int, int]) -> np.ndarray:
    """y [M, N] float64 as the int8-activation kernel defines it, summed exactly: per block
    d * dx * sum(q * xq) + m * dx * sum(xq), m = -8 d for Q4_0 and 0 for Q8_0."""
    fmt, k = require_int8_activations(quant_type), shape[1]
    d, m, q = _fields(np.asarray(blocks), fmt, k)
    d64 = d.astype(np.float64)
    m64 = m.astype(np.float64) if m is not None else (-8 if fmt.code_bits == 4 else 0) * d64
    xq, dx = (a.astype(np.float64) for a in quantize_activations(x))  # [M, nb, 32], [M, nb, 1]
    dots = np.einsum("mbk,nbk->mnb", xq, q.astype(np.float64))  # [M, N, nb]
    scaled = dx[..., 0][:, None, :]  # [M, 1, nb]
    return (dots * d64[None] * scaled + m64[None] * scaled * xq.sum(-1)[:, None, :]).sum(-1)


def quantize_q8_0(weight: torch.Tensor) -> np.ndarray:
    """[N, K] float weights as Q8_0 blocks [N, K / 32 * 34] (the int8 weight-only mode): per 32
    weights one float16 scale d = max |w| / 127 and codes round(w / d). Not exact: each weight
    moves by up to d / 2."""
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"in_features {k} is not a multiple of {QK}")
    w = weight.detach().float().cpu().numpy().reshape(n, k // QK, QK)
    d = (np.abs(w).max(axis=-1, keepdims=True) / 127).astype(np.float16)  # [N, nb, 1]
    scale = d.astype(np.float32)
    inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    codes = np.clip(np.rint(w * inverse), -127, 127).astype(np.int8)
    return np.concatenate([d.view(np.uint8), codes.view(np.uint8)], axis=-1).reshape(n, -1)


def bfloat16_rows(weight: torch.Tensor) -> np.ndarray | None:
    """A float32 weight's bfloat16 bytes [N, 2K] when every value is exactly a bfloat16 (a
    bfloat16 checkpoint loaded as float32), else None."""
    bits = weight.detach().float().contiguous().view(torch.int32)
    if bool((bits & 0xFFFF).any()):
        return None
    return (bits >> 16).to(torch.int16).numpy().view(np.uint8).reshape(weight.shape[0], -1)


def pack_blocks(blocks: np.ndarray, quant_type: int, shape: tuple[int, int], width: int,
                int8_layout: bool = False) -> np.ndarray:
    """The kernel's panels (uint8, flat) of a weight given as GGUF blocks [N, bytes per row];
    `int8_layout`: Q8_0 codes as the int8-activation kernel reads them (per 8 k, a column's
    codes for the even k, then the odd k, 4 bytes each, stored plus 128)."""
    fmt, (n, k) = block_format(quant_type), shape
    if k % QK:
        raise ValueError(f"in_features {k} is not a multiple of {QK}")
    padded, nb = -(-n // width) * width, k // QK

    def by_panel(a: np.ndarray) -> np.ndarray:  # [N, nb, ...] -> [P, 48, nb, ...], zero columns past N
        a = np.concatenate([a, np.zeros((padded - n, *a.shape[1:]), a.dtype)]) if padded != n else a
        return a.reshape(padded // width, width, *a.shape[1:])

    if fmt.code_bits == 16:  # [P, 48, nb, 32] -> [P, nb, 32, 48] bfloat16, no scales
        halves = np.ascontiguousarray(blocks, dtype=np.uint8).view(np.uint16).reshape(n, nb, QK)
        return np.ascontiguousarray(by_panel(halves).transpose(0, 2, 3, 1)).view(np.uint8).reshape(-1)
    d, m, q = _fields(blocks, fmt, k)
    if fmt.code_bits == 4:  # byte i of a block: weights 2i (low nibble) and 2i + 1 (high)
        q = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # [N, nb, 16]
    scales = [by_panel(s).transpose(0, 2, 1).copy().view(np.uint8) for s in (d, m) if s is not None]  # [P, nb, 96]
    if fmt.code_bits == 4:  # [P, 48, nb, 4 units, 4 bytes] -> [P, nb, units, 48, bytes]: a column's unit is one int32
        codes = by_panel(q.reshape(n, nb, 4, 4)).transpose(0, 2, 3, 1, 4)
    elif int8_layout:  # [P, 48, nb, 4 units, 4 k, 2 (even, odd)] -> [P, nb, units, 2, 48, 4 k]
        shifted = (q.astype(np.int16) + 128).astype(np.uint8)
        codes = by_panel(shifted.reshape(n, nb, 4, 4, 2)).transpose(0, 2, 3, 5, 1, 4)
    else:  # [P, 48, nb, 32] -> [P, nb, 32, 48]
        codes = by_panel(q.view(np.uint8)).transpose(0, 2, 3, 1)
    codes = codes.reshape(padded // width, nb, -1)
    return np.ascontiguousarray(np.concatenate([*scales, codes], axis=2)).reshape(-1)


class QuantLinear(PanelLinear):
    """y = x @ W^T + b with W in a GGUF block format, packed for csrc/cpu_quant_gemm.cpp.

    With `int8_activations` (Q4_0, Q4_1, Q8_0) the inputs are quantized to int8 per 32 values
    and multiplied with integer dot products at every batch size, as llama.cpp runs its Q4
    formats: faster where the GEMM is compute-bound, and not exact (see
    `int8_activation_reference`)."""

    def __init__(self, blocks: np.ndarray, quant_type: int, shape: tuple[int, int], bias: torch.Tensor | None,
                 lib: ctypes.CDLL, int8_activations: bool = False) -> None:
        self.format = require_int8_activations(quant_type) if int8_activations else block_format(quant_type)
        self.int8_activations = int8_activations
        self.out_features, self.in_features = shape
        self.width = lib.streamengine_panel_width()
        self.padded = -(-self.out_features // self.width) * self.width
        self.panels = torch.from_numpy(pack_blocks(blocks, quant_type, shape, self.width, int8_activations))
        expected = self.padded // self.width * (self.in_features // QK) * lib.streamengine_quant_block_bytes(
            self.format.type_id)
        if self.panels.numel() != expected:
            raise RuntimeError(f"{self.format.name} panels of {self.panels.numel()} bytes, kernel expects {expected}")
        self.bias = bias
        flag = INT8_ACTIVATIONS if int8_activations else 0
        self.kernel_weight = self._view(self.format.type_id | flag, self.panels)
        self._lib = lib

    @property
    def kernel_only(self) -> bool:
        return self.int8_activations  # the float32 matmul of large batches would be exact

    @property
    def nbytes(self) -> int:
        return self.panels.numel()

    def float_panels(self) -> torch.Tensor:
        """Unpacked for this call only (prefill-sized batches run as one float32 matmul)."""
        out = torch.empty((self.padded // self.width, self.in_features, self.width), dtype=torch.float32)
        if self._lib.streamengine_dequant_panels(self.kernel_weight.data_ptr(), out.data_ptr()) != 0:
            raise RuntimeError("dequantizing panels failed")
        return out


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The CPU library with the packed-weight GEMM bound, or None where it cannot run."""
    lib = cpu_build.bind({
        "streamengine_gemm": [PTR, PTR, I64, PTR],
        "streamengine_dequant_panels": [PTR, PTR],
        "streamengine_quant_block_bytes": [I64],
        "streamengine_amx_active": [],
        "streamengine_amx_enable": [ctypes.c_int],
    }, probe="streamengine_panel_width")
    if lib is not None:
        lib.streamengine_quant_block_bytes.restype = ctypes.c_int64
    return lib


def amx_active() -> bool:
    """Whether batches past the register rows of Q4_0, Q4_1 and Q8_0 weights run on AMX tiles
    (csrc/cpu_amx_gemm.cpp): the float32 GEMM up to float32 rounding, not bit for bit the
    dequantizing kernel. On where the CPU and OS allow it, unless STREAMENGINE_AMX=0."""
    lib = load_library()
    return lib is not None and bool(lib.streamengine_amx_active())


@contextlib.contextmanager
def amx_enabled(on: bool) -> Iterator[bool]:
    """Runs the block with the AMX path switched on (where it can run) or off, process-wide;
    yields whether it is active. For tests and A/B benchmarks."""
    lib = load_library()
    before = amx_active()
    active = bool(lib.streamengine_amx_enable(int(on))) if lib is not None else False
    try:
        yield active
    finally:
        if lib is not None:
            lib.streamengine_amx_enable(int(before))


def takes_int8_activations(quant_type: int) -> bool:
    """Whether a weight of this GGUF type can multiply int8-quantized inputs (Q4_0, Q4_1, Q8_0)."""
    return int(quant_type) in FORMATS and FORMATS[int(quant_type)].code_bits in (4, 8)


def require_int8_activations(quant_type: int) -> BlockFormat:
    """The block format of `quant_type`; a ValueError unless it takes int8 activations."""
    fmt = block_format(quant_type)
    if not takes_int8_activations(quant_type):
        raise ValueError(f"int8 activations run with Q4_0, Q4_1 or Q8_0 weights, not {fmt.name}")
    return fmt


def supported(quant_type: int) -> bool:
    """Whether this GGUF type runs packed here."""
    lib = load_library()
    return lib is not None and int(quant_type) in FORMATS and lib.streamengine_quant_block_bytes(int(quant_type)) > 0
