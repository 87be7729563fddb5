"""8-bit float KV-cache conversions for the Triton kernels, on the codes as uint8.

The kernels take an fp8 cache as its uint8 view and convert with integer and bit-cast steps
only, so the same code runs compiled on any GPU and in the CPU interpreter (which has no
float8 type), and gives kernels/fp8.py's codes bit for bit:
  read:  e5m2 is the upper byte of an IEEE half; e4m3fn (bias 7, NaN = S.1111.111) moved into a
         half's exponent/mantissa fields is its value / 256, exactly.
  write: saturate to the format's largest value, then round to nearest even on the float's
         own bits; values below the smallest normal round by one float add (x + 2^k, whose
         ulp is the format's subnormal step), read back from its mantissa bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# FP8 constexpr codes the kernels take: 0 for a cache that is not 8-bit.
NOT_FP8, E4M3, E5M2 = 0, 1, 2


def fp8_code(dtype: torch.dtype) -> int:
    return {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}.get(dtype, NOT_FP8)


def kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """What the kernels are handed: an fp8 cache's bytes, any other cache as it is."""
    return cache.view(torch.uint8) if fp8_code(cache.dtype) else cache


@triton.jit
def to_cache(x, inv_scale, FP8: tl.constexpr):
    """Values as the cache stores them: x itself, or with FP8 the codes of x * inv_scale.
    (A function, not an `if` in the kernel: there a variable may not change type.)"""
    if FP8:
        out = float_to_fp8(x.to(tl.float32) * inv_scale, FP8)
    else:
        out = x
    return out


@triton.jit
def from_cache(x, dtype: tl.constexpr, FP8: tl.constexpr):
    """Values read from the cache, as `dtype` with FP8 (before the tensor's scale); else as read."""
    if FP8:
        out = fp8_to_float(x, FP8).to(dtype)
    else:
        out = x
    return out


@triton.jit
def fp8_to_float(codes, FP8: tl.constexpr):
    """uint8 codes -> their float32 values (before the tensor's scale)."""
    b = codes.to(tl.uint16)
    if FP8 == 2:  # e5m2; a NaN gets its quiet bit, as F16C and torch give it
        half = tl.where(((b & 0x7C) == 0x7C) & ((b & 0x03) != 0), (b << 8) | 0x0200, b << 8)
        unit = 1.0
    else:  # e4m3fn, at 2^-8 of its value; NaN gets torch's float32 NaN pattern
        low7 = b & 0x7F
        half = ((b & 0x80) << 8) | (low7 << 7)
        half = tl.where(low7 == 0x7F, half | 0x7F80, half)
        unit = 256.0
    return half.to(tl.float16, bitcast=True).to(tl.float32) * unit


@triton.jit
def float_to_fp8(x, FP8: tl.constexpr):
    """float32 values (already divided by the tensor's scale) -> uint8 codes, saturated, RNE."""
    if FP8 == 2:  # e5m2: 2 mantissa bits, bias 15, subnormal step 2^-16 (the ulp of 2^7)
        codes = _encode(x, 2, 15, 57344.0, 6.103515625e-05, 128.0, 0x43000000)
    else:  # e4m3fn: 3 mantissa bits, bias 7, step 2^-9 (the ulp of 2^14)
        codes = _encode(x, 3, 7, 448.0, 0.015625, 16384.0, 0x46800000)
    return codes


@triton.jit
def _encode(x, MANT: tl.constexpr, BIAS: tl.constexpr, LIMIT: tl.constexpr, MIN_NORMAL: tl.constexpr,
            MAGIC: tl.constexpr, MAGIC_BITS: tl.constexpr):
    """The codes of a format with MANT mantissa bits and exponent bias BIAS; MAGIC is the power
    of two whose float32 ulp is the format's subnormal step (MAGIC_BITS: its bits)."""
    SHIFT: tl.constexpr = 23 - MANT
    sign = (x.to(tl.uint32, bitcast=True) >> 24) & 0x80
    ax = tl.abs(x)
    ax = tl.where(ax > LIMIT, LIMIT, ax)  # saturate (NaN compares false: handled below)
    u = ax.to(tl.uint32, bitcast=True)
    normal = ((u + ((1 << (SHIFT - 1)) - 1) + ((u >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANT)
    subnormal = (ax + MAGIC).to(tl.uint32, bitcast=True) - MAGIC_BITS  # the add rounds to the step
    code = tl.where(ax < MIN_NORMAL, subnormal, normal)
    code = tl.where(x != x, 0x7F, code)
    return (code | sign).to(tl.uint8)
