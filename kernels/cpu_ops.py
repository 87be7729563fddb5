"""Fused element-wise layer steps (kernels/csrc/cpu_ops.cpp) with PyTorch fallbacks.

Every function takes and returns float32 CPU tensors whose last dimension is dense (the KV
cache may also be float16). With the C++ library they run as one call each; without it (neither
AVX-512 nor AVX2, no compiler, other dtypes or devices) the same math runs as PyTorch ops, in
transformers' order of operations.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from . import cpu_build
from .cpu_build import F32, I64, PTR


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    return cpu_build.bind({
        "streamengine_add_rms_norm": [PTR, PTR, I64, PTR, F32, I64, I64, PTR],
        "streamengine_rope": [PTR, I64, I64, I64, I64, PTR, PTR],
        "streamengine_silu_mul": [PTR, I64, I64, I64, PTR],
        "streamengine_store_kv": [PTR, I64, PTR, I64, PTR, I64, I64, PTR, PTR, I64],
    }, probe="streamengine_cpu_ops_available")


CACHE_TYPES = {torch.float32: 0, torch.float16: 1}
"""KV-cache element types the C++ kernels read and write, by their CacheType code (csrc/cpu_vec_math.h)."""


def _cache_code(key_cache: torch.Tensor, value_cache: torch.Tensor) -> int | None:
    """The CacheType code of a cache pair the kernels take (same dtype, both on CPU), else None."""
    on_cpu = key_cache.device.type == value_cache.device.type == "cpu"
    return CACHE_TYPES.get(key_cache.dtype) if on_cpu and key_cache.dtype == value_cache.dtype else None


def cache_type(key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """The CacheType code of a cache pair on CPU; ValueError for any other pair."""
    code = _cache_code(key_cache, value_cache)
    if code is None:
        raise ValueError(
            f"the CPU kernels take float32 or float16 caches on CPU, got {key_cache.dtype}/{value_cache.dtype}"
        )
    return code


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
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> None:
    """key_cache/value_cache [num_blocks, block_size, kv_heads, head_dim] at the slots of this
    step's k/v [tokens, kv_heads, head_dim] (each head's head_dim dense, heads adjacent),
    converted to the caches' dtype."""
    tokens, kv_heads, head_dim = k.shape
    width = kv_heads * head_dim
    dense = all(t.stride(1) == head_dim and t.stride(2) == 1 for t in (k, v))
    lib = _native(k, v) if dense and slot_mapping.dtype == torch.int64 else None
    code = _cache_code(key_cache, value_cache)
    if lib is None or code is None or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        # index_copy_ needs the cache's dtype: a lower-precision cache rounds here.
        key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(key_cache.dtype))
        value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(value_cache.dtype))
        return
    lib.streamengine_store_kv(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), tokens, width,
        key_cache.data_ptr(), value_cache.data_ptr(), code,
    )
