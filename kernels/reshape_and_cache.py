"""Write the new tokens' keys and values into their slots of the paged KV cache.

Each program moves BLOCK_T tokens; a token's heads and head dims are flattened into one row
of BLOCK_E (a power of two, masked) so any num_kv_heads * head_dim works. Slot -1 marks a
padding token and is skipped. An fp8 cache (kernels/fp8.py) is written as its bytes: each value
divided by the tensor's scale and converted in registers (kernels/fp8_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, check_int_tensor, check_launchable, check_same_device, next_power_of_2
from .fp8 import inverse_scale
from .fp8_triton import fp8_code, kernel_view, to_cache

_NAME = "reshape_and_cache"
_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64 (or int32), -1 = skip
    num_tokens,
    k_inv_scale,  # float: 1 / k_scale of an fp8 cache (1 otherwise)
    v_inv_scale,
    stride_kt,  # key strides: token, head (head_dim stride is 1)
    stride_kh,
    stride_vt,  # value strides: token, head
    stride_vh,
    stride_kcb,  # key cache strides: block, slot in block, head
    stride_kcs,
    stride_kch,
    stride_vcb,  # value cache strides: block, slot in block, head
    stride_vcs,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_E: tl.constexpr,  # ROW rounded up to a power of two
    FP8: tl.constexpr,  # fp8_triton's code of the cache format; 0: store as loaded
):
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    tok_ok = toks < num_tokens
    slots = tl.load(slot_mapping_ptr + toks, mask=tok_ok, other=-1).to(tl.int64)
    keep = tok_ok & (slots >= 0)
    block = tl.where(keep, slots, 0) // BLOCK_SIZE
    offset = tl.where(keep, slots, 0) % BLOCK_SIZE

    elems = tl.arange(0, BLOCK_E)  # [BLOCK_E] flattened (head, dim)
    head = (elems // HEAD_DIM).to(tl.int64)
    dim = elems % HEAD_DIM
    mask = keep[:, None] & (elems < ROW)[None, :]  # [BLOCK_T, BLOCK_E]

    k_src = toks[:, None] * stride_kt + head[None, :] * stride_kh + dim[None, :]
    k_dst = (
        (block * stride_kcb + offset * stride_kcs)[:, None]
        + head[None, :] * stride_kch
        + dim[None, :]
    )
    k = to_cache(tl.load(key_ptr + k_src, mask=mask), k_inv_scale, FP8)
    tl.store(key_cache_ptr + k_dst, k, mask=mask)

    v_src = toks[:, None] * stride_vt + head[None, :] * stride_vh + dim[None, :]
    v_dst = (
        (block * stride_vcb + offset * stride_vcs)[:, None]
        + head[None, :] * stride_vch
        + dim[None, :]
    )
    v = to_cache(tl.load(value_ptr + v_src, mask=mask), v_inv_scale, FP8)
    tl.store(value_cache_ptr + v_dst, v, mask=mask)


def _check_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"{_NAME}: key and value must both be [num_tokens, num_kv_heads, head_dim], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"{_NAME}: key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"{_NAME}: key heads/head_dim {tuple(key.shape[1:])} != cache {tuple(key_cache.shape[2:])}"
        )
    same = key.dtype == value.dtype and key_cache.dtype == value_cache.dtype
    if not same or (key.dtype != key_cache.dtype and not fp8_code(key_cache.dtype)):
        raise ValueError(f"{_NAME}: key, value and the caches must share one dtype (or the caches one fp8 "
                         f"dtype), got {key.dtype}, {value.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    check_int_tensor(_NAME, "slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"{_NAME}: slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens"
        )
    for arg, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
    ):
        if t.stride(-1) != 1:
            raise ValueError(f"{_NAME}: {arg} needs a unit stride on head_dim, got {t.stride()}")
    if not slot_mapping.is_contiguous():
        raise ValueError(f"{_NAME}: slot_mapping must be contiguous")
    check_same_device(
        _NAME,
        key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slot_mapping,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] -> cache slot slot_mapping[t] (-1: skip).

    key_cache/value_cache [num_blocks, block_size, num_kv_heads, head_dim] are written in
    place; an fp8 pair stores key / k_scale and value / v_scale (scales of 1 for other caches).
    Slots are trusted to lie inside the cache (checking would need a device sync).
    """
    _check_inputs(key, value, key_cache, value_cache, slot_mapping)
    fp8 = fp8_code(key_cache.dtype)
    if not (k_scale > 0 and v_scale > 0) or (not fp8 and (k_scale, v_scale) != (1.0, 1.0)):
        raise ValueError(f"{_NAME}: scales ({k_scale}, {v_scale}) must be > 0, and 1 for a {key_cache.dtype} cache")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    check_launchable(_NAME, _reshape_and_cache_kernel, key.device)
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    row = num_kv_heads * head_dim
    block_e = next_power_of_2(row)
    block_t = min(max(1, _ELEMENTS_PER_PROGRAM // block_e), next_power_of_2(num_tokens))
    grid = (cdiv(num_tokens, block_t),)
    _reshape_and_cache_kernel[grid](
        key_ptr=key,
        value_ptr=value,
        key_cache_ptr=kernel_view(key_cache),
        value_cache_ptr=kernel_view(value_cache),
        slot_mapping_ptr=slot_mapping,
        num_tokens=num_tokens,
        k_inv_scale=inverse_scale(k_scale),
        v_inv_scale=inverse_scale(v_scale),
        stride_kt=key.stride(0),
        stride_kh=key.stride(1),
        stride_vt=value.stride(0),
        stride_vh=value.stride(1),
        stride_kcb=key_cache.stride(0),
        stride_kcs=key_cache.stride(1),
        stride_kch=key_cache.stride(2),
        stride_vcb=value_cache.stride(0),
        stride_vcs=value_cache.stride(1),
        stride_vch=value_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        ROW=row,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        FP8=fp8,
        num_warps=4,
    )
