"""The argument checks of kernels/paged_attention.py's wrapper: shapes, dtypes, strides and
devices, so a bad call fails with a message instead of reading out of bounds."""

from __future__ import annotations

import torch

from ._launch import check_int_tensor, check_same_device
from .fp8_triton import fp8_code

_NAME = "paged_attention"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    if query.dim() != 3:
        raise ValueError(
            f"{_NAME}: query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"{_NAME}: key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{_NAME}: query dtype {query.dtype} not in {_FLOAT_DTYPES}")
    cache_ok = key_cache.dtype == value_cache.dtype and (key_cache.dtype == query.dtype or fp8_code(key_cache.dtype))
    if not cache_ok:
        raise ValueError(
            f"{_NAME}: query, key_cache, value_cache dtypes differ: "
            f"{query.dtype}, {key_cache.dtype}, {value_cache.dtype}"
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(
            f"{_NAME}: head_dim {head_dim} of query != {key_cache.shape[3]} of the cache"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{_NAME}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    if not 1 <= head_dim <= 256:
        raise ValueError(f"{_NAME}: head_dim {head_dim} outside 1..256")
    for arg, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{_NAME}: {arg} needs a unit stride on head_dim, got {t.stride()}")
    check_int_tensor(_NAME, "block_tables", block_tables, 2)
    check_int_tensor(_NAME, "seq_lens", seq_lens, 1)
    check_int_tensor(_NAME, "query_start_loc", query_start_loc, 1)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"{_NAME}: block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)} and "
            f"query_start_loc {tuple(query_start_loc.shape)} disagree on the number of requests"
        )
    if (
        block_tables.stride(-1) != 1
        or not seq_lens.is_contiguous()
        or not query_start_loc.is_contiguous()
    ):
        raise ValueError(
            f"{_NAME}: block_tables rows, seq_lens and query_start_loc must be contiguous"
        )
    check_same_device(
        _NAME,
        query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )


def check_out(out: torch.Tensor, query: torch.Tensor) -> None:
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"{_NAME}: out must match query ({tuple(query.shape)}, {query.dtype}, {query.device}), "
            f"got ({tuple(out.shape)}, {out.dtype}, {out.device})"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"{_NAME}: out needs a unit stride on head_dim, got {out.stride()}")
