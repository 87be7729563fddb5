"""The attention hook: transformers computes Q/K/V (with RoPE), we store K/V in the paged cache
and attend through block tables.

Any HF decoder whose attention goes through `ALL_ATTENTION_FUNCTIONS` runs unchanged: the
packed batch is one "sequence" of T tokens (`input_ids` [1, T]); the per-request structure
arrives as the `attn_plan` keyword that the model passes down to every layer. The mask
function returns None, so transformers never builds a T x T mask over the packed batch.

A backend is chosen once per engine (`AttentionBackend`); each step it turns the step's
`AttentionMetadata` into its own typed plan (`AttentionPlan`), worked out once and used by
every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

if TYPE_CHECKING:
    from streamengine.kernels.cpu_attention import DecodePlan
    from streamengine.models.kv_scales import KVScales

ATTN_IMPLEMENTATION = "streamengine_paged"

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_blocks, block_size, kv_heads, head_dim]


@dataclass(slots=True)
class AttentionMetadata:
    """Where every token of one packed step lives. Built once per step by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context incl. this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_lens_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    kv_caches: KVCaches
    kv_scales: KVScales | None = None  # an fp8 cache's per-layer scales; None for other caches


class AttentionPlan(Protocol):
    """One step's attention in one backend's terms, shared by every layer of the step."""

    meta: AttentionMetadata

    @property
    def decode_kernel(self) -> DecodePlan | None:
        """The C++ decode kernel's plan when every row of the step decodes and the backend
        attends with that kernel, so a native model may run its whole layer stack in one
        call; None otherwise (always, for backends without `fused_cpu_layers`)."""
        ...

    def store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes this step's K/V ([T, kv_heads, head_dim] each) into the layer's cache slots."""
        ...

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """q [T, heads, D] -> [T, heads, D], with this step's K/V already in the cache; `k`/`v`
        are the same K/V, which rows without cached context may read directly."""
        ...


class AttentionBackend(Protocol):
    # Declared once per backend: whether the native model may run its fused C++ layers with
    # it. Those layers store K/V themselves (the same store as this backend's) and then call
    # `attend`; other backends get the op-by-op layers, which call `store_and_attend`.
    fused_cpu_layers: bool

    def plan(self, meta: AttentionMetadata) -> AttentionPlan: ...


def store_and_attend(
    plan: AttentionPlan, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One layer's attention: its new K/V into the cache, then attention through the block tables."""
    plan.store(layer_idx, k, v)
    return plan.attend(layer_idx, q, k, v, scale)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_heads, T, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    value: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    attn_plan: AttentionPlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if attn_plan is None:
        raise RuntimeError("streamengine paged attention called without attn_plan")
    q = query[0].transpose(0, 1)  # [T, num_heads, head_dim]
    k = key[0].transpose(0, 1)  # [T, num_kv_heads, head_dim]
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = store_and_attend(attn_plan, module.layer_idx, q, k, v, scale)
    return out.unsqueeze(0), None  # [1, T, num_heads, head_dim], as transformers expects


def _no_mask(*args, **kwargs) -> None:
    return None


def register_paged_attention() -> None:
    """Registers the hook under ATTN_IMPLEMENTATION (idempotent; the function is stateless:
    everything per engine travels in `attn_plan`)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
