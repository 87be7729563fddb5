"""Paged prefill attention on CPU: the C++ kernel in csrc/cpu_prefill_attention.cpp.

`paged_prefill` attends every query token of the listed sequences (prompts, chunks of
prompts, prompts after a prefix-cache hit) causally to its context through the block tables,
straight from the cache, all sequences in one call. A query token at position p sees the keys
at positions 0..p; the step's own K/V must already be in the cache. Decode rows (one query
token) are kernels/cpu_attention.py's business, though this kernel computes them correctly too.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cpu_build
from .cpu_attention import SCALED_ATTENTION_ARGS, SUPPORTED_ARGS, PagedPlan


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    return cpu_build.bind({
        "streamengine_paged_prefill_supported": SUPPORTED_ARGS,
        "streamengine_paged_prefill_scaled": SCALED_ATTENTION_ARGS,
    })


def prefill_available() -> bool:
    """Whether the library holding the kernel loads here (`prefill_supported` then says which
    shapes it takes: none in a build with neither AVX-512 nor AVX2)."""
    return load_library() is not None


@functools.lru_cache(maxsize=64)
def prefill_supported(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the kernel runs here for this shape (float32 queries, a float32, float16 or float8 cache,
    head_dim a multiple of 16 up to 256, up to 64 query heads per KV head, any block size).
    Cached: the engine asks once per layer call."""
    lib = load_library()
    return lib is not None and bool(
        lib.streamengine_paged_prefill_supported(num_heads, num_kv_heads, head_dim, block_size)
    )


class PrefillPlan(PagedPlan):
    """A `paged_prefill` step: every query token of the listed sequences."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 rows: torch.Tensor) -> None:
        super().__init__(load_library(), block_tables, seq_lens, query_start_loc, rows)

    @staticmethod
    def takes(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """Whether `run` handles this layer's shapes: query [T, heads, D], cache [.., block_size, kv_heads, D]."""
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        return query.shape[2] == head_dim and prefill_supported(query.shape[1], num_kv_heads, head_dim, block_size)

    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
            out: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """k_scale / v_scale: an 8-bit cache's scales (kernels/fp8.py); 1 for the other types."""
        kernel = self.lib.streamengine_paged_prefill_scaled
        rc = self._launch(kernel, query, key_cache, value_cache, scale, out, k_scale, v_scale)
        if rc == -2:
            raise ValueError("a listed row has more query tokens (query_start_loc) than context (seq_lens)")
        if rc != 0:
            raise self._unsupported("paged_prefill", query, key_cache)


def paged_prefill(
    query: torch.Tensor,  # [T, num_heads, head_dim], last two dims dense
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's K/V stored
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: context including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    rows: torch.Tensor,  # [R] int64: the sequences to attend
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim] contiguous: rows' query tokens are written
    k_scale: float = 1.0,  # an 8-bit cache's scales
    v_scale: float = 1.0,
) -> None:
    PrefillPlan(block_tables, seq_lens, query_start_loc, rows).run(
        query, key_cache, value_cache, scale, out, k_scale, v_scale)
