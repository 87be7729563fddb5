"""Fused element-wise layer steps (kernels/csrc/cpu_ops.cpp) with PyTorch fallbacks.

Every function takes and returns float32 CPU tensors whose last dimension is dense (the KV
cache may also be float16, or an 8-bit float with per-tensor scales: kernels/fp8.py). With the C++ library they run as one call each; without it (neither
AVX-512 nor AVX2, no compiler, other dtypes or devices) the same math runs as PyTorch ops, in
transformers' order of operations.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from . import cpu_build, fp8
from .cpu_build import F32, I64, PTR


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    return cpu_build.bind({
        "streamengine_add_rms_norm": [PTR, PTR, I64, PTR, F32, I64, I64, PTR],
        "streamengine_rope": [PTR, I64, I64, I64, I64, PTR, PTR],
        "streamengine_silu_mul": [PTR, I64, I64, I64, PTR],
        "streamengine_store_kv_scaled": [PTR, I64, PTR, I64, PTR, I64, I64, PTR, PTR, I64, F32, F32],
        "streamengine_fp8_to_float": [PTR, I64, I64, PTR],
    }, probe="streamengine_cpu_ops_available")


CACHE_TYPES = {torch.float32: 0, torch.float16: 1}
"""KV-cache element types the C++ kernels read and write without scales, by their CacheType
code (csrc/cpu_vec_math.h)."""
SCALED_CACHE_TYPES = {**CACHE_TYPES, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
"""Those and the 8-bit formats, which the kernels take with their scales (the `*_scaled` entry
points, and the fused layers given `kv_scales`)."""


def _cache_code(key_cache: torch.Tensor, value_cache: torch.Tensor, types: dict[torch.dtype, int]) -> int | None:
    """The code in `types` of a cache pair (same dtype, both on CPU), else None."""
    on_cpu = key_cache.device.type == value_cache.device.type == "cpu"
    return types.get(key_cache.dtype) if on_cpu and key_cache.dtype == value_cache.dtype else None


def cache_type(key_cache: torch.Tensor, value_cache: torch.Tensor, scaled: bool = False) -> int:
    """The CacheType code of a cache pair on CPU; ValueError for any other pair. `scaled`: the
    caller passes scales, so an 8-bit pair is taken too."""
    code = _cache_code(key_cache, value_cache, SCALED_CACHE_TYPES if scaled else CACHE_TYPES)
    if code is None:
        kinds = "float32 or float16 caches" + (", or float8 ones with scales," if scaled else "")
        raise ValueError(f"the CPU kernels take {kinds} on CPU, got {key_cache.dtype}/{value_cache.dtype}")
    return code


def fp8_to_float(codes: torch.Tensor) -> torch.Tensor:
    """A float8 tensor (numel a multiple of 16) widened to float32 by the kernels' own load (tests);
    torch's `.float()` without the library."""
    lib = load_library()
    code = SCALED_CACHE_TYPES[codes.dtype]
    if lib is None:
        return codes.float()
    src = codes.contiguous()
    out = torch.empty(src.shape, dtype=torch.float32)
    if lib.streamengine_fp8_to_float(src.data_ptr(), src.numel(), code, out.data_ptr()) != 0:
        raise ValueError(f"fp8_to_float takes float8 tensors of a multiple of 16 values, got {codes.numel()}")
    return out


def _native(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library when every tensor suits it: float32 on CPU, rows with a dense last dim."""
    lib = load_library()
    if lib is None:
        return None
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            return None
    return lib


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (in place, when given); returns RMSNorm(h) * weight as a new tensor.
    h: [rows, n] contiguous; delta: [rows, n]."""
    rows, n = h.shape
    if delta is not None:
        delta = delta.contiguous()
    lib = _native(h, weight, *(() if delta is None else (delta,)))
    if lib is None or not h.is_contiguous():
        if delta is not None:
            h.add_(delta)
        hf = h.float()
        return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    out = torch.empty_like(h)
    lib.streamengine_add_rms_norm(
        h.data_ptr(), None if delta is None else delta.data_ptr(), n, weight.data_ptr(), eps, rows, n, out.data_ptr()
    )
    return out


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates, in place, the first `heads` heads of each row of x [rows, >= heads * head_dim]
    by cos/sin [rows, head_dim / 2] (transformers' rotate-half convention)."""
    rows = x.shape[0]
    cos, sin = cos.contiguous(), sin.contiguous()
    lib = _native(x, cos, sin)
    if lib is None:
        view = x[:, : heads * head_dim].view(rows, heads, head_dim)
        half = head_dim // 2
        x1, x2 = view[..., :half], view[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        view.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        return
    lib.streamengine_rope(x.data_ptr(), rows, x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2n] -> silu(gate) * up, [rows, n]."""
    rows, width = gate_up.shape
    n = width // 2
    gate_up = gate_up.contiguous()
    lib = _native(gate_up)
    if lib is None:
        return F.silu(gate_up[:, :n]) * gate_up[:, n:]
    out = torch.empty((rows, n), dtype=gate_up.dtype)
    lib.streamengine_silu_mul(gate_up.data_ptr(), width, rows, n, out.data_ptr())
    return out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """key_cache/value_cache [num_blocks, block_size, kv_heads, head_dim] at the slots of this
    step's k/v [tokens, kv_heads, head_dim] (each head's head_dim dense, heads adjacent),
    converted to the caches' dtype; an 8-bit cache stores k / k_scale and v / v_scale
    (kernels/fp8.py), the others take scales of 1."""
    tokens, kv_heads, head_dim = k.shape
    width = kv_heads * head_dim
    dense = all(t.stride(1) == head_dim and t.stride(2) == 1 for t in (k, v))
    lib = _native(k, v) if dense and slot_mapping.dtype == torch.int64 else None
    code = _cache_code(key_cache, value_cache, SCALED_CACHE_TYPES)
    if lib is None or code is None or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        # index_copy_ needs the cache's dtype: a lower-precision cache rounds (or quantizes) here.
        fp8.store_slots(key_cache.view(-1, kv_heads, head_dim), slot_mapping, k, k_scale)
        fp8.store_slots(value_cache.view(-1, kv_heads, head_dim), slot_mapping, v, v_scale)
        return
    rc = lib.streamengine_store_kv_scaled(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), tokens, width,
        key_cache.data_ptr(), value_cache.data_ptr(), code, k_scale, v_scale,
    )
    if rc != 0:
        raise ValueError(f"store_kv: scales ({k_scale}, {v_scale}) must be > 0, and 1 for a {key_cache.dtype} cache")

