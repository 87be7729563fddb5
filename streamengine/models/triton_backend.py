"""The CUDA path: Triton kernels write K/V into their slots and attend through block tables.

Also runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, tests only). The
cache is in the model's dtype, or fp8 with per-layer scales (models/kv_scales.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamengine.kernels import fp8
from streamengine.models.attention import AttentionMetadata
from streamengine.models.kv_scales import layer_scales, store_scales


def triton_interpreted() -> bool:
    """Whether the kernels run in the Triton interpreter, so on CPU tensors too. Looked up
    through this module when a backend is created, so a test can patch it."""
    from streamengine.kernels import triton_interpreted as interpreted  # needs triton

    return interpreted()


@dataclass(slots=True)
class TritonPlan:
    meta: AttentionMetadata
    # Upper bound known on the host: no device sync inside the kernels' wrappers.
    max_seq_len: int
    decode_kernel: None = None  # the C++ decode kernel is the CPU backend's

    def store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        from streamengine.kernels import reshape_and_cache

        key_cache, value_cache = self.meta.kv_caches[layer_idx]
        k_scale, v_scale = store_scales(self.meta.kv_scales, layer_idx, k, v)
        reshape_and_cache(k, v, key_cache, value_cache, self.meta.slot_mapping, k_scale, v_scale)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        from streamengine.kernels import paged_attention

        meta = self.meta
        key_cache, value_cache = meta.kv_caches[layer_idx]
        k_scale, v_scale = layer_scales(meta.kv_scales, layer_idx)
        return paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale, max_query_len=meta.max_query_len, max_seq_len=self.max_seq_len, k_scale=k_scale, v_scale=v_scale,
        )


class TritonPagedAttention:
    fused_cpu_layers = False

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> TritonPagedAttention:
        """The backend, or a ValueError saying why it cannot run here."""
        if kv_dtype != dtype and not fp8.is_fp8(kv_dtype):
            raise ValueError(
                f"attention_backend='triton' keeps the KV cache in the model's dtype ({dtype}) or fp8; "
                f"kv_cache_dtype={kv_dtype} runs on CPU only"
            )
        try:
            interpreted = triton_interpreted()
        except ImportError as exc:  # triton missing or broken
            raise ValueError(f"attention_backend='triton' needs a working triton install: {exc}") from exc
        if device.type != "cuda" and not interpreted:
            raise ValueError(
                "attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 set "
                "before triton is imported, for tests); use 'torch' or 'auto' on CPU"
            )
        return cls()

    def plan(self, meta: AttentionMetadata) -> TritonPlan:
        return TritonPlan(meta, max_seq_len=max(meta.seq_lens_host))
