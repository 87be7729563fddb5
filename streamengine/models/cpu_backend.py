"""The CPU path with the C++ kernel: decode rows attend straight from the paged cache.

Decode rows (one query token) go to kernels/cpu_attention.py's kernel, which walks each
sequence's block table with an online softmax: no gather copy of K/V, no padding to the
longest context in the batch. Prefill rows take the PyTorch backend's SDPA path
(torch_backend.prefill_row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamengine.kernels.cpu_attention import DecodePlan, decode_supported
from streamengine.kernels.cpu_ops import CACHE_TYPES, store_kv
from streamengine.kv_cache import AttentionShape
from streamengine.models.attention import AttentionMetadata
from streamengine.models.torch_backend import prefill_row, split_rows


@dataclass(slots=True)
class CpuPlan:
    meta: AttentionMetadata
    decode: DecodePlan | None  # the kernel's plan for the step's decode rows, if any
    other_rows: list[int]

    @property
    def decode_kernel(self) -> DecodePlan | None:
        return None if self.other_rows else self.decode

    def store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        key_cache, value_cache = self.meta.kv_caches[layer_idx]
        store_kv(k, v, self.meta.slot_mapping, key_cache, value_cache)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode rows through the kernel, prefill rows through SDPA."""
        key_cache, value_cache = self.meta.kv_caches[layer_idx]
        # Contiguous, as the kernel writes it, even when q is a strided view of qkv rows.
        out = torch.empty((q.shape[0], q.shape[1], key_cache.shape[3]), dtype=q.dtype)  # [T, num_heads, head_dim]
        if self.decode is not None:
            self.decode.run(q, key_cache, value_cache, scale, out)
        for i in self.other_rows:
            prefill_row(self.meta, layer_idx, i, q, k, v, scale, out)
        return out


class CpuPagedAttention:
    fused_cpu_layers = True

    @staticmethod
    def available(shape: AttentionShape, block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether the kernel runs here: a float32 model, a float32 or float16 cache, a supported shape."""
        return (dtype == torch.float32 and kv_dtype in CACHE_TYPES
                and decode_supported(shape.num_heads, shape.num_kv_heads, shape.head_dim, block_size))

    def plan(self, meta: AttentionMetadata) -> CpuPlan:
        decode, other = split_rows(meta)
        rows = torch.tensor(decode, dtype=torch.int64)
        kernel = DecodePlan(meta.block_tables, meta.seq_lens, meta.query_start_loc, rows) if decode else None
        return CpuPlan(meta, kernel, other)
