"""Whole-block copies: copy-on-write inside the pool, and swaps between device and host pools.

`copy_blocks` is a Triton kernel launched once per layer (keys and values together): program
(pair, chunk) copies CHUNK elements of block src into block dst. The pairs must not overlap
(no dst repeated, no dst that is also a src), since programs run in any order; copy-on-write
always copies into freshly allocated blocks, so that holds.

`swap_blocks` moves blocks between pools on different devices with plain torch copies, one
per run of consecutive block ids, so a swap of n contiguous blocks is one memcpy. On CUDA the
copies are asynchronous on the caller's stream (host pool pinned): the caller orders them
against compute with events.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, check_launchable
from .fp8 import as_bytes

_NAME = "copy_blocks"
_CHUNK = 4096


@triton.jit
def _copy_blocks_kernel(
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], each block contiguous
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], each block contiguous
    block_mapping_ptr,  # [num_pairs, 2] int64: (src block, dst block)
    block_numel,  # elements in one block: block_size * num_kv_heads * head_dim
    stride_kb,  # key cache block stride
    stride_vb,  # value cache block stride
    stride_mp,  # block_mapping strides: pair, column
    stride_mc,
    CHUNK: tl.constexpr,  # elements per program
):
    pair = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    src = tl.load(block_mapping_ptr + pair * stride_mp).to(tl.int64)
    dst = tl.load(block_mapping_ptr + pair * stride_mp + stride_mc).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] within the block
    ok = offs < block_numel
    k = tl.load(key_cache_ptr + src * stride_kb + offs, mask=ok)
    tl.store(key_cache_ptr + dst * stride_kb + offs, k, mask=ok)
    v = tl.load(value_cache_ptr + src * stride_vb + offs, mask=ok)
    tl.store(value_cache_ptr + dst * stride_vb + offs, v, mask=ok)


def _block_is_contiguous(cache: torch.Tensor) -> bool:
    """Whether each cache[b] is one contiguous run of memory."""
    return cache.dim() >= 2 and cache[0].is_contiguous() and cache.stride(-1) == 1


def _check_mapping(name: str, block_mapping: torch.Tensor) -> None:
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(
            f"{name}: block_mapping must be [num_pairs, 2], got {tuple(block_mapping.shape)}"
        )
    if block_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: block_mapping must be int32 or int64, got {block_mapping.dtype}")


def _check_no_overlap(block_mapping: torch.Tensor) -> None:
    """Overlapping pairs would race; checked only where it costs no device sync."""
    if block_mapping.device.type != "cpu":
        return
    src = set(block_mapping[:, 0].tolist())
    dst = block_mapping[:, 1].tolist()
    if len(set(dst)) != len(dst) or src.intersection(dst):
        raise ValueError(f"{_NAME}: block_mapping pairs overlap (a dst repeats or is also a src)")


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy block src -> dst for every (src, dst) row of block_mapping, in every layer.

    key_caches[i]/value_caches[i]: layer i's [num_blocks, block_size, num_kv_heads, head_dim]
    caches; block_mapping: [num_pairs, 2] int64, moved to the caches' device if needed.
    """
    _check_mapping(_NAME, block_mapping)
    if len(key_caches) != len(value_caches):
        raise ValueError(
            f"{_NAME}: {len(key_caches)} key caches but {len(value_caches)} value caches"
        )
    _check_no_overlap(block_mapping)
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    for layer, (k_cache, v_cache) in enumerate(zip(key_caches, value_caches, strict=True)):
        if (
            k_cache.shape != v_cache.shape
            or k_cache.dtype != v_cache.dtype
            or k_cache.device != v_cache.device
        ):
            raise ValueError(
                f"{_NAME}: layer {layer} key and value caches differ in shape, dtype or device"
            )
        if not (_block_is_contiguous(k_cache) and _block_is_contiguous(v_cache)):
            raise ValueError(f"{_NAME}: layer {layer} cache blocks must each be contiguous")
        check_launchable(_NAME, _copy_blocks_kernel, k_cache.device)
        k_cache, v_cache = as_bytes(k_cache), as_bytes(v_cache)  # an fp8 cache copies as bytes
        mapping = block_mapping.to(k_cache.device, non_blocking=True)
        block_numel = k_cache[0].numel()
        grid = (num_pairs, cdiv(block_numel, _CHUNK))
        _copy_blocks_kernel[grid](
            key_cache_ptr=k_cache,
            value_cache_ptr=v_cache,
            block_mapping_ptr=mapping,
            block_numel=block_numel,
            stride_kb=k_cache.stride(0),
            stride_vb=v_cache.stride(0),
            stride_mp=mapping.stride(0),
            stride_mc=mapping.stride(1),
            CHUNK=_CHUNK,
            num_warps=4,
        )


def _runs(pairs: list[list[int]]) -> list[tuple[int, int, int]]:
    """(src, dst, length) runs where consecutive pairs continue both block ranges."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            s, d, n = runs[-1]
            runs[-1] = (s, d, n + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def swap_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    block_mapping: torch.Tensor,
    *,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Copy src[s] -> dst[d] for each (s, d) row of block_mapping; pools may differ in device.

    src/dst: [num_blocks, ...] caches of one layer with equal per-block shape and dtype (their
    block counts may differ). block_mapping: [num_pairs, 2], read on the host (keep it on CPU:
    a device tensor costs a sync). With CUDA involved the copies are non_blocking and issued
    on `stream` (default: the current stream); a host pool should be pinned, and the caller
    must wait on that stream before reading dst or reusing src.
    """
    name = "swap_blocks"
    _check_mapping(name, block_mapping)
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"{name}: block shapes/dtypes differ: {tuple(src.shape)} {src.dtype} vs {tuple(dst.shape)} {dst.dtype}"
        )
    pairs = block_mapping.tolist()
    if not pairs:
        return
    for s, d in pairs:
        if not (0 <= s < src.shape[0] and 0 <= d < dst.shape[0]):
            raise ValueError(
                f"{name}: pair ({s}, {d}) outside pools of {src.shape[0]} and {dst.shape[0]} blocks"
            )
    uses_cuda = src.device.type == "cuda" or dst.device.type == "cuda"
    if uses_cuda and stream is not None:
        with torch.cuda.stream(stream):
            _copy_runs(src, dst, pairs, non_blocking=True)
    else:
        _copy_runs(src, dst, pairs, non_blocking=uses_cuda)


def _copy_runs(
    src: torch.Tensor, dst: torch.Tensor, pairs: list[list[int]], non_blocking: bool
) -> None:
    for s, d, n in _runs(pairs):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)
