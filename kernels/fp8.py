"""8-bit float KV caches: the formats, and their quantization as plain PyTorch.

A cache of `torch.float8_e4m3fn` or `torch.float8_e5m2` holds each K (V) value as
`x * (1 / k_scale)` rounded to nearest even and saturated to the format's largest finite value
(448 or 57344; NaN stays NaN); reading it back gives `code * k_scale`. One scale per tensor
(per layer's K, per layer's V), as vLLM's `k_scale` / `v_scale`. The C++ and Triton kernels
convert in registers and must agree with these functions bit for bit on the stored codes.

torch has the float8 dtypes on CPU for conversion, not for indexing (`index_copy_` is not
implemented for them): the byte views (`as_bytes`) carry such copies.
"""

from __future__ import annotations

import torch


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """The format's largest finite value (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def inverse_scale(scale: float) -> float:
    """1 / scale in float32, as every kernel computes it once per call: stores multiply by it."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32))


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x (any float dtype) -> codes of `dtype`: float32 x * (1 / scale), saturated, RNE."""
    limit = fp8_max(dtype)
    return (x.float() * inverse_scale(scale)).clamp(-limit, limit).to(dtype)


def dequantize(codes: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes -> codes * scale, computed in float32, returned as `dtype`."""
    return (codes.float() * scale).to(dtype)


def widen(cache_rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache, as `dtype` values: dequantized when 8-bit, else converted."""
    return dequantize(cache_rows, scale, dtype) if is_fp8(cache_rows.dtype) else cache_rows.to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor's uint8 view (same storage), for copies torch does not implement on float8."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def store_slots(flat_cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """flat_cache[slot_mapping] = x ([num_slots, ...] and [tokens, ...]) in the cache's type:
    quantized with `scale` when 8-bit (scale 1 otherwise), rounded by `.to` when narrower."""
    if is_fp8(flat_cache.dtype):
        as_bytes(flat_cache).index_copy_(0, slot_mapping, as_bytes(quantize(x, scale, flat_cache.dtype)))
    else:
        flat_cache.index_copy_(0, slot_mapping, x.to(flat_cache.dtype))
