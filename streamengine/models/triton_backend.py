"""The CUDA path: Triton kernels write K/V into their slots and attend through block tables.

Also runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, tests only).
"""

from __future__ import annotations

import torch

from streamengine.models.attention import AttentionMetadata


class TritonPagedAttention:
    @classmethod
    def create(cls, device: torch.device) -> TritonPagedAttention:
        try:
            from streamengine.kernels import triton_interpreted
        except ImportError as exc:  # triton missing or broken
            raise ValueError(f"attention_backend='triton' needs a working triton install: {exc}") from exc
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                "attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 set "
                "before triton is imported, for tests); use 'torch' or 'auto' on CPU"
            )
        return cls()

    def prepare(self, meta: AttentionMetadata) -> None:
        # Upper bounds known on the host: no device sync inside the kernels' wrappers.
        meta.prepared["max_seq_len"] = max(meta.seq_lens_host)

    def forward(self, layer_idx, q, k, v, meta, scale):
        from streamengine.kernels import paged_attention, reshape_and_cache

        key_cache, value_cache = meta.kv_caches[layer_idx]
        reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        return paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale, max_query_len=meta.max_query_len, max_seq_len=meta.prepared["max_seq_len"],
        )
