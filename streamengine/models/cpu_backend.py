"""The CPU path with the C++ kernel: decode rows attend straight from the paged cache.

Decode rows (one query token) go to kernels/cpu_paged_attention.cpp, which walks each
sequence's block table with an online softmax: no gather copy of K/V, no padding to the
longest context in the batch. Prefill rows keep TorchPagedAttention's SDPA path.
"""

from __future__ import annotations

import torch

from streamengine.kernels.cpu_attention import DecodePlan, decode_supported
from streamengine.kernels.cpu_ops import CACHE_TYPES, store_kv
from streamengine.models.attention import AttentionMetadata, TorchPagedAttention


class CpuPagedAttention(TorchPagedAttention):
    @staticmethod
    def available(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                  kv_dtype: torch.dtype) -> bool:
        """Whether the kernel runs here: a float32 model, a float32 or float16 cache, a supported shape."""
        return (dtype == torch.float32 and kv_dtype in CACHE_TYPES
                and decode_supported(num_heads, num_kv_heads, head_dim, block_size))

    def prepare(self, meta: AttentionMetadata) -> None:
        p = meta.prepared
        decode = [i for i, n in enumerate(meta.query_lens_host) if n == 1]
        p["decode"] = DecodePlan(
            meta.block_tables, meta.seq_lens, meta.query_start_loc, torch.tensor(decode, dtype=torch.int64)
        ) if decode else None
        p["other_rows"] = [i for i, n in enumerate(meta.query_lens_host) if n != 1]

    def decode_only_plan(self, meta: AttentionMetadata) -> DecodePlan | None:
        """The step's decode plan when every row is a decode row (a whole-stack step can then
        run the kernel itself), else None."""
        p = meta.prepared
        return None if p["other_rows"] else p["decode"]

    def forward(self, layer_idx, q, k, v, meta, scale):
        key_cache, value_cache = meta.kv_caches[layer_idx]
        store_kv(k, v, meta.slot_mapping, key_cache, value_cache)
        return self.attend(layer_idx, q, k, v, meta, scale)

    def attend(self, layer_idx, q, k, v, meta, scale):
        """Attention for a step whose K/V are already in the cache (the fused layer stores
        them): decode rows through the kernel, prefill rows through SDPA."""
        key_cache, value_cache = meta.kv_caches[layer_idx]
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        p = meta.prepared
        out = torch.empty((q.shape[0], q.shape[1], head_dim), dtype=q.dtype)  # [T, num_heads, head_dim]
        if p["decode"] is not None:
            p["decode"].run(q, key_cache, value_cache, scale, out)
        if p["other_rows"]:
            flat_k = key_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, kv_heads, head_dim]
            flat_v = value_cache.view(-1, num_kv_heads, head_dim)
            for i in p["other_rows"]:
                self._prefill(i, q, k, v, flat_k, flat_v, meta, scale, out)
        return out
