"""The CPU path with the C++ kernels: every row attends straight from the paged cache.

Decode rows (one query token) go to kernels/cpu_attention.py's kernel, which walks each
sequence's block table with an online softmax: no gather copy of K/V, no padding to the
longest context in the batch. All other rows of the step (prompts, chunks of prompts, prompts
after a prefix-cache hit) go to kernels/cpu_prefill_attention.py's kernel in one call: causal,
flash-style, over the same blocks. Where that kernel cannot run for the shape they take the
PyTorch backend's SDPA path (torch_backend.prefill_row), one request at a time; so do prompts
with no cached context over a float16 cache (see `split_prefill_rows`).

Over an fp8 cache (kernels/fp8.py) the kernels get each layer's scales (models/kv_scales.py);
so do the native model's fused C++ layers, once the scales are set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamengine.kernels import fp8
from streamengine.kernels.cpu_attention import DecodePlan, decode_supported
from streamengine.kernels.cpu_ops import SCALED_CACHE_TYPES, store_kv
from streamengine.kernels.cpu_prefill_attention import PrefillPlan, prefill_available
from streamengine.kv.spec import AttentionShape
from streamengine.models.attention import AttentionMetadata
from streamengine.models.kv_scales import layer_scales, store_scales
from streamengine.models.torch_backend import prefill_row, split_rows


@dataclass(slots=True)
class CpuPlan:
    meta: AttentionMetadata
    decode: DecodePlan | None  # the kernel's plan for the step's decode rows, if any
    other_rows: list[int]
    prefill: PrefillPlan | None  # the prefill kernel's plan for other_rows but sdpa_rows; None: SDPA for all
    sdpa_rows: list[int]  # other rows that take SDPA even when the prefill kernel runs

    @property
    def decode_kernel(self) -> DecodePlan | None:
        return None if self.other_rows else self.decode

    def store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        key_cache, value_cache = self.meta.kv_caches[layer_idx]
        store_kv(k, v, self.meta.slot_mapping, key_cache, value_cache, *store_scales(self.meta.kv_scales, layer_idx, k, v))

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode rows through the decode kernel, the other rows through the prefill kernel (or SDPA)."""
        key_cache, value_cache = self.meta.kv_caches[layer_idx]
        scales = layer_scales(self.meta.kv_scales, layer_idx)
        # Contiguous, as the kernel writes it, even when q is a strided view of qkv rows.
        out = torch.empty((q.shape[0], q.shape[1], key_cache.shape[3]), dtype=q.dtype)  # [T, num_heads, head_dim]
        if self.decode is not None:
            self.decode.run(q, key_cache, value_cache, scale, out, *scales)
        sdpa_rows = self.other_rows
        if self.prefill is not None and self.prefill.takes(q, key_cache):
            self.prefill.run(q, key_cache, value_cache, scale, out, *scales)
            sdpa_rows = self.sdpa_rows
        for i in sdpa_rows:
            prefill_row(self.meta, layer_idx, i, q, k, v, scale, out)
        return out


class CpuPagedAttention:
    fused_cpu_layers = True  # over fp8 too: the native model passes them the scales

    @staticmethod
    def available(shape: AttentionShape, block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether the kernel runs here: a float32 model, a float32, float16 or fp8 cache, a supported shape."""
        return (dtype == torch.float32 and kv_dtype in SCALED_CACHE_TYPES
                and decode_supported(shape.num_heads, shape.num_kv_heads, shape.head_dim, block_size))

    def plan(self, meta: AttentionMetadata) -> CpuPlan:
        decode, other = split_rows(meta)
        tables, lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc
        kernel = DecodePlan(tables, lens, starts, torch.tensor(decode, dtype=torch.int64)) if decode else None
        kernel_rows, sdpa_rows = split_prefill_rows(meta, other)
        prefill = None
        if kernel_rows and prefill_available():
            prefill = PrefillPlan(tables, lens, starts, torch.tensor(kernel_rows, dtype=torch.int64))
        return CpuPlan(meta, kernel, other, prefill, sdpa_rows)


def split_prefill_rows(meta: AttentionMetadata, other: list[int]) -> tuple[list[int], list[int]]:
    """(rows for the prefill kernel, rows for SDPA). Over a float16 cache a prompt with no
    cached context stays on SDPA over its K/V as computed (the kernel reads the rounded cache):
    exactly the PyTorch backend's arithmetic, so both CPU backends write the same caches. Over
    float32 and fp8 caches every row reads the cache (as the PyTorch backend does over fp8)."""
    dtype = meta.kv_caches[0][0].dtype
    if dtype == torch.float32 or fp8.is_fp8(dtype):
        return other, []
    fresh = [i for i in other if meta.query_lens_host[i] == meta.seq_lens_host[i]]
    return [i for i in other if i not in fresh], fresh
