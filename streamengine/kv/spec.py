"""KV-cache sizing: how many blocks the device and host pools hold, and what one block costs.

Worked out once from the engine config and the model's config, before anything is allocated:
the core builds its block manager from the counts, the model runner allocates tensors of the
shape, and the preemption policy prices a swap by `bytes_per_block`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamengine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """The attention geometry of a Hugging Face decoder config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_config) -> AttentionShape:
        heads = model_config.num_attention_heads
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        return cls(model_config.num_hidden_layers, heads, kv_heads, head_dim)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The paged KV cache of one engine: per layer, a K and a V tensor of
    [num_blocks, block_size, num_kv_heads, head_dim] on the device, and as many host blocks
    (`num_cpu_blocks`) for swapping. With a draft model (speculative decoding), a block holds
    the draft's K and V of its tokens too, in tensors of the draft's shape (`draft`)."""

    shape: AttentionShape
    block_size: int
    dtype: torch.dtype
    num_blocks: int
    num_cpu_blocks: int
    draft_shape: AttentionShape | None = None

    @property
    def bytes_per_block(self) -> int:
        draft = _block_bytes(self.draft_shape, self.block_size, self.dtype) if self.draft_shape else 0
        return _block_bytes(self.shape, self.block_size, self.dtype) + draft

    def draft(self) -> KVCacheSpec:
        """The draft model's part of the same blocks."""
        assert self.draft_shape is not None
        return KVCacheSpec(self.draft_shape, self.block_size, self.dtype, self.num_blocks, self.num_cpu_blocks)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """[block_size, num_kv_heads, head_dim] of one block of one layer's K (or V)."""
        return (self.block_size, self.shape.num_kv_heads, self.shape.head_dim)


def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block's K and V across all layers of a Hugging Face decoder config."""
    return _block_bytes(AttentionShape.of(model_config), block_size, dtype)


def _block_bytes(shape: AttentionShape, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * elem  # K and V


FP8_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""The torch dtypes of EngineConfig's 8-bit cache names (FP8_KV_CACHE_DTYPES)."""


def kv_cache_dtype(config: EngineConfig) -> torch.dtype:
    """The cache's element type: the model's dtype unless `kv_cache_dtype` names another."""
    if config.kv_cache_dtype in FP8_TORCH_DTYPES:
        return FP8_TORCH_DTYPES[config.kv_cache_dtype]
    name = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    return getattr(torch, name)


def plan_kv_cache(config: EngineConfig, model_config, draft_config=None) -> KVCacheSpec:
    """Device blocks from `num_gpu_blocks`, else from `kv_cache_bytes` (default
    DEFAULT_KV_CACHE_BYTES); host blocks from `swap_space_bytes`. A draft model's K and V
    (`draft_config`) share the blocks, and their bytes."""
    shape = AttentionShape.of(model_config)
    draft_shape = AttentionShape.of(draft_config) if draft_config is not None else None
    dtype = kv_cache_dtype(config)
    per_block = KVCacheSpec(shape, config.block_size, dtype, 0, 0, draft_shape).bytes_per_block
    if config.num_gpu_blocks is not None:
        num_blocks = config.num_gpu_blocks
    else:
        budget = config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"EngineConfig.kv_cache_bytes={budget} cannot hold a single block of this model "
                f"({per_block} bytes)"
            )
    return KVCacheSpec(shape, config.block_size, dtype, num_blocks, config.swap_space_bytes // per_block, draft_shape)
