"""Paged decode attention on CPU: the C++ kernel in csrc/cpu_paged_attention.cpp.

`paged_decode` attends one query token per listed sequence through the block tables, straight
from the cache (no gather copy, no padding to the longest context). Prefill rows are
kernels/cpu_prefill_attention.py's. `PagedPlan`, the per-step part both kernels share, lives
here.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cpu_build
from .cpu_build import F32, I64, PTR
from .cpu_ops import cache_type

# The C signature both paged-attention kernels share (decode here, prefill in
# cpu_prefill_attention.py; `PagedPlan._launch`'s order: k_scale and v_scale after the softmax
# scale), and that of their shape probes.
SCALED_ATTENTION_ARGS = [PTR, I64, PTR, PTR, I64, I64, I64, I64, I64, PTR, I64, PTR, PTR, PTR, I64, F32, F32, F32, PTR]
SUPPORTED_ARGS = [I64, I64, I64, I64]


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    return cpu_build.bind({
        "streamengine_paged_decode_supported": SUPPORTED_ARGS,
        "streamengine_paged_decode_scaled": SCALED_ATTENTION_ARGS,
    })


def decode_supported(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the kernel runs here for this shape (float32 queries, a float32, float16 or float8 cache,
    head_dim a multiple of 16 up to 256, up to 16 query heads per KV head, block size a
    multiple of 8)."""
    lib = load_library()
    return lib is not None and bool(
        lib.streamengine_paged_decode_supported(num_heads, num_kv_heads, head_dim, block_size)
    )


class PagedPlan:
    """The per-step part of a paged-attention kernel call (decode here, prefill in
    cpu_prefill_attention.py), checked once per step and reused by every layer: the per-layer
    call then passes only the query, the layer's caches and `out`. The C++ side trusts every
    address, so what it would read or write out of bounds for is refused here."""

    def __init__(self, lib: ctypes.CDLL | None, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, rows: torch.Tensor) -> None:
        if lib is None:
            raise RuntimeError(f"the CPU {type(self).__name__} kernel is not available here")
        self.lib = lib
        for name, t, dtype in (("block_tables", block_tables, torch.int32), ("seq_lens", seq_lens, torch.int32),
                               ("query_start_loc", query_start_loc, torch.int32), ("rows", rows, torch.int64)):
            if t.dtype != dtype or t.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        num_seqs = block_tables.shape[0]
        if seq_lens.numel() != num_seqs or query_start_loc.numel() != num_seqs + 1:
            raise ValueError("seq_lens needs one entry per block-table row, query_start_loc one more")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_seqs):
            raise ValueError(f"rows must index the {num_seqs} sequences")
        self.num_query_tokens = int(query_start_loc[-1]) if num_seqs else 0
        self.max_seq_len = int(seq_lens.max()) if num_seqs else 0
        self.max_block = int(block_tables.max()) if block_tables.numel() else -1
        self.table_width = block_tables.shape[1]
        self._keep = (block_tables, seq_lens, query_start_loc, rows)  # the pointers below stay valid
        self.tables, self.table_stride = block_tables.data_ptr(), block_tables.stride(0)
        self.seq_lens, self.query_start_loc = seq_lens.data_ptr(), query_start_loc.data_ptr()
        self.rows, self.num_rows = rows.data_ptr(), rows.numel()

    def _launch(self, kernel, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                scale: float, out: torch.Tensor, k_scale: float, v_scale: float) -> int:
        """Checks this layer's tensors against the plan and calls `kernel` (a `_scaled` entry
        point); its return code."""
        _, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, cache_dim = key_cache.shape
        if query.stride(2) != 1 or query.stride(1) != head_dim:
            query = query.contiguous()
        for name, t in (("query", query), ("out", out)):
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU torch.float32 tensor, got {t.dtype} on {t.device}")
        code = cache_type(key_cache, value_cache, scaled=True)
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"k_scale and v_scale must be > 0, got {k_scale}, {v_scale}")
        if not (key_cache.is_contiguous() and value_cache.is_contiguous() and out.is_contiguous()):
            raise ValueError("key_cache, value_cache and out must be contiguous")
        if cache_dim != head_dim:
            raise ValueError(f"the query's head_dim {head_dim} is not the cache's {cache_dim}")
        if out.shape != query.shape or query.shape[0] < self.num_query_tokens:
            raise ValueError(f"query and out must both be [{self.num_query_tokens}+, heads, head_dim]")
        if self.max_block >= key_cache.shape[0] or self.table_width * block_size < self.max_seq_len:
            raise ValueError("the block tables point past the cache or cannot hold the longest context")
        return kernel(
            query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), code,
            block_size, num_heads, num_kv_heads, head_dim, self.tables, self.table_stride, self.seq_lens,
            self.query_start_loc, self.rows, self.num_rows, scale, k_scale, v_scale, out.data_ptr(),
        )

    @staticmethod
    def _unsupported(kind: str, query: torch.Tensor, key_cache: torch.Tensor) -> ValueError:
        _, block_size, num_kv_heads, _ = key_cache.shape
        return ValueError(f"{kind} does not support heads={query.shape[1]} kv_heads={num_kv_heads} "
                          f"head_dim={query.shape[2]} block_size={block_size}, or scales other than 1 "
                          f"for a {key_cache.dtype} cache")


class DecodePlan(PagedPlan):
    """A `paged_decode` step: one query token per listed sequence."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 rows: torch.Tensor) -> None:
        super().__init__(load_library(), block_tables, seq_lens, query_start_loc, rows)

    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
            out: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """k_scale / v_scale: an 8-bit cache's scales (kernels/fp8.py); 1 for the other types."""
        kernel = self.lib.streamengine_paged_decode_scaled
        if self._launch(kernel, query, key_cache, value_cache, scale, out, k_scale, v_scale) != 0:
            raise self._unsupported("paged_decode", query, key_cache)


def paged_decode(
    query: torch.Tensor,  # [T, num_heads, head_dim], last two dims dense
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    rows: torch.Tensor,  # [R] int64: the decode sequences
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim] contiguous: rows' query tokens are written
    k_scale: float = 1.0,  # an 8-bit cache's scales
    v_scale: float = 1.0,
) -> None:
    DecodePlan(block_tables, seq_lens, query_start_loc, rows).run(
        query, key_cache, value_cache, scale, out, k_scale, v_scale)
