"""Batched multi-LoRA for one target projection of a step whose rows use different adapters
(kernels/csrc/cpu_lora.cpp), with the PyTorch reference as its fallback:

    y[t] += scale[s] * B[s, :, :rank[s]] @ (A[s, :rank[s]] @ x[t])    for each row t, s = slot[t] >= 0

Adapters are stacked: A [S, R, in], B [S, out, R] (R the stack's largest rank, a smaller
adapter's entries past its rank are never read), rank [S], scale [S] (alpha / rank, say).
Rows with slot -1 have no adapter and are left untouched. y is updated in place and may be a
column slice of a wider output (the q part of a fused qkv, say); x may be a row-strided view.

`lora_shrink_expand` runs the C++ kernel on CPU tensors (x and y float32; A and B float32 or
bfloat16) when the library loads, else `ref_lora_shrink_expand` (one pair of matmuls per
adapter present). The kernel reads B rank-major: a B that is the transposed view of a
contiguous [S, R, out] (as the engine keeps its stacks) is passed as it is, any other is
transposed into a copy first. `check_lora_args` is the shape and dtype check that the Triton
version (kernels/lora_triton.py) shares.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cpu_build
from .cpu_build import I64, PTR
from .reference import ref_lora_shrink_expand

__all__ = ["check_lora_args", "lora_shrink_expand", "ref_lora_shrink_expand", "supported", "weight_type"]

_NAME = "lora_shrink_expand"
MAX_RANK = 256  # csrc/cpu_lora.cpp
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1}  # LoraWeightType in csrc/cpu_lora.h
_ERRORS = {
    -1: "sizes or strides the kernel cannot take",
    -2: "a slot outside [-1, S)",
    -3: "a rank outside [0, R]",
    -4: "a build without AVX-512 or AVX2",
    -5: "an adapter weight type it does not know",
}


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    return cpu_build.bind({
        "streamengine_lora_shrink_expand": [PTR, I64, PTR, I64, PTR, I64, PTR, PTR, PTR, PTR, I64, I64, I64, I64, I64],
    }, probe="streamengine_lora_available")


def supported() -> bool:
    """Whether the C++ kernel runs here (else `lora_shrink_expand` runs the reference)."""
    return load_library() is not None


def weight_type(dtype: torch.dtype) -> int:
    """The C++ code of an adapter weight dtype; ValueError for one the kernel does not read."""
    code = WEIGHT_TYPES.get(dtype)
    if code is None:
        raise ValueError(f"{_NAME}: adapter weights must be float32 or bfloat16 on CPU, got {dtype}")
    return code


def check_lora_args(
    name: str,
    x: torch.Tensor,
    y: torch.Tensor,
    slot: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    rank: torch.Tensor,
    scale: torch.Tensor,
    float_dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> None:
    """A ValueError naming the first argument whose shape, dtype or device is wrong. Values
    (slots, ranks) are not read here: that would be a device sync on CUDA."""
    # One combined test first: the engine calls this per projection and layer of every step,
    # and the argument-by-argument walk below costs a few microseconds more.
    if x.dim() == 2 and y.dim() == 2 and A.dim() == 3:
        (rows, in_features), out_features, (S, R, a_in) = x.shape, y.shape[1], A.shape
        if (y.shape[0] == rows and a_in == in_features and slot.shape == (rows,) and B.shape == (S, out_features, R)
                and rank.shape == (S,) and scale.shape == (S,)
                and x.dtype in float_dtypes and y.dtype in float_dtypes and A.dtype in float_dtypes
                and B.dtype in float_dtypes and scale.dtype in float_dtypes
                and slot.dtype in _INDEX_DTYPES and rank.dtype in _INDEX_DTYPES
                and x.device == y.device == slot.device == A.device == B.device == rank.device == scale.device):
            return
    _explain_bad_args(name, x, y, slot, A, B, rank, scale, float_dtypes)


_INDEX_DTYPES = (torch.int32, torch.int64)


def _explain_bad_args(
    name: str,
    x: torch.Tensor,
    y: torch.Tensor,
    slot: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    rank: torch.Tensor,
    scale: torch.Tensor,
    float_dtypes: tuple[torch.dtype, ...],
) -> None:
    """Raises the ValueError for the first wrong argument of `check_lora_args`."""
    for arg, t, dims in (("x", x, 2), ("y", y, 2), ("slot", slot, 1), ("A", A, 3), ("B", B, 3),
                         ("rank", rank, 1), ("scale", scale, 1)):
        if t.dim() != dims:
            raise ValueError(f"{name}: {arg} must have {dims} dims, got shape {tuple(t.shape)}")
    rows, in_features = x.shape
    out_features = y.shape[1]
    S, R = A.shape[0], A.shape[1]
    expect = {"y": (rows, out_features), "slot": (rows,), "A": (S, R, in_features), "B": (S, out_features, R),
              "rank": (S,), "scale": (S,)}
    for arg, t in (("y", y), ("slot", slot), ("A", A), ("B", B), ("rank", rank), ("scale", scale)):
        if tuple(t.shape) != expect[arg]:
            raise ValueError(
                f"{name}: {arg} must be {expect[arg]} for x {tuple(x.shape)}, y {tuple(y.shape)} and A "
                f"{tuple(A.shape)} ([T, in], [T, out], [S, R, in]), got {tuple(t.shape)}"
            )
    for arg, t in (("x", x), ("y", y), ("A", A), ("B", B), ("scale", scale)):
        if t.dtype not in float_dtypes:
            allowed = ", ".join(str(d) for d in float_dtypes)
            raise ValueError(f"{name}: {arg} must be {allowed}, got {t.dtype}")
    for arg, t in (("slot", slot), ("rank", rank)):
        if t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name}: {arg} must be int32 or int64, got {t.dtype}")
    for arg, t in (("y", y), ("slot", slot), ("A", A), ("B", B), ("rank", rank), ("scale", scale)):
        if t.device != x.device:
            raise ValueError(f"{name}: {arg} is on {t.device}, expected {x.device} (x's)")
    raise AssertionError(f"{name}: check_lora_args found no wrong argument to report")


def check_lora_values(name: str, slot: torch.Tensor, rank: torch.Tensor, S: int, R: int) -> None:
    """A ValueError for a slot outside [-1, S) or a rank outside [0, R] (reads the tensors)."""
    if slot.numel() and (int(slot.min()) < -1 or int(slot.max()) >= S):
        raise ValueError(f"{name}: slots must be in [-1, {S}), got {sorted(set(slot.tolist()))}")
    if rank.numel() and (int(rank.min()) < 0 or int(rank.max()) > R):
        raise ValueError(f"{name}: ranks must be in [0, {R}] (R = A.shape[1]), got {rank.tolist()}")


def lora_shrink_expand(
    x: torch.Tensor,
    y: torch.Tensor,
    slot: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    rank: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """y[t] += scale[s] * B[s, :, :rank[s]] @ (A[s, :rank[s]] @ x[t]) for every row t with
    s = slot[t] >= 0, in place. x [T, in], y [T, out] float32 (each with a dense last dim for
    the kernel; any strides for the fallback); slot [T], rank [S] int32 (int64 converted);
    A [S, R, in], B [S, out, R] float32 or bfloat16 (both alike), scale [S] float32. ValueError
    on a wrong shape, dtype, slot (outside [-1, S)) or rank (outside [0, R]), with y untouched."""
    check_lora_args(_NAME, x, y, slot, A, B, rank, scale, float_dtypes=(torch.float32, torch.bfloat16))
    S, R, in_features = A.shape
    lib = _native(x, y, A, B, R)
    if lib is None:
        check_lora_values(_NAME, slot, rank, S, R)
        ref_lora_shrink_expand(x, y, slot, A, B, rank, scale)
        return
    if slot.dtype != torch.int32 or not slot.is_contiguous():
        slot = slot.to(torch.int32).contiguous()
    if rank.dtype != torch.int32 or not rank.is_contiguous():
        rank = rank.to(torch.int32).contiguous()
    # No copies for the engine's stacks: their A is contiguous and their B a view of a rank-major one.
    A, Bt, scale = A.contiguous(), B.transpose(1, 2).contiguous(), scale.contiguous()
    code = lib.streamengine_lora_shrink_expand(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), slot.data_ptr(), x.shape[0],
        A.data_ptr(), Bt.data_ptr(), rank.data_ptr(), scale.data_ptr(), S, R, in_features, y.shape[1],
        WEIGHT_TYPES[A.dtype],
    )
    if code != 0:
        check_lora_values(_NAME, slot, rank, S, R)  # names the bad values, when it is those
        raise ValueError(f"{_NAME}: the C++ kernel rejected the call: {_ERRORS.get(code, f'error {code}')}")


def _native(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor, R: int) -> ctypes.CDLL | None:
    """The library when the call suits the kernel: CPU tensors, float32 activations, weights of
    one type it reads, dense last dims, rows that do not overlap, a rank it holds (the rest runs
    the reference)."""
    lib = load_library()
    if (lib is None or x.device.type != "cpu" or R > MAX_RANK or x.dtype != torch.float32
            or y.dtype != torch.float32 or A.dtype != B.dtype or A.dtype not in WEIGHT_TYPES):
        return None
    rows, in_features = x.shape
    out_features = y.shape[1]
    if x.stride(1) != 1 or y.stride(1) != 1 or in_features == 0 or out_features == 0:
        return None
    if rows > 1 and (x.stride(0) < in_features or y.stride(0) < out_features):
        return None
    return lib
