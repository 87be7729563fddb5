"""Core setup: what EngineCore derives from its config and model when it starts.

The device, the draft model of speculative decoding, the end-of-sequence ids, the longest sequence the pool and model allow, the
preemption costs, and the empty block manager and scheduler it starts with (and restarts
with after a fault). Functions over the `EngineCore` or its parts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from streamengine.config import EngineConfig
from streamengine.kv.block_manager import BlockManager
from streamengine.kv.spec import KVCacheSpec
from streamengine.models import LoadedModel
from streamengine.models.draft import DraftModel, check_draft
from streamengine.models.loader import load_model
from streamengine.sched.scheduler import PreemptionPolicy, Scheduler

if TYPE_CHECKING:
    from streamengine.engine.core import EngineCore


def load_draft(config: EngineConfig, target: LoadedModel, device: torch.device) -> LoadedModel | None:
    """Speculative decoding's draft model (method "draft"), checked against the target."""
    spec = config.speculative
    if spec is None or spec.method != "draft":
        return None
    draft = load_model(spec.model, config.dtype, str(device), config.cache_dir)
    check_draft(draft, target)
    return draft


def draft_model(config: EngineConfig, draft: LoadedModel | None, device: torch.device, kv: KVCacheSpec,
                vocab_size: int) -> DraftModel | None:
    return DraftModel(draft, config, device, kv, vocab_size) if draft is not None else None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def fresh_bookkeeping(core: EngineCore) -> tuple[BlockManager, Scheduler]:
    """An empty block manager (no cached prefixes) and scheduler over the KV pool."""
    config, kv = core.config, core.kv_spec
    block_manager = BlockManager(
        kv.num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks=kv.num_cpu_blocks,
        weight_of=core._tenant_weight, tenant_fair_eviction=config.tenant_fair_eviction,
    )
    scheduler = Scheduler(
        block_manager, config.max_num_seqs, config.max_num_batched_tokens,
        preemption_policy(core), max_prefill_chunk=config.max_prefill_chunk,
        policy=config.scheduling_policy, tenants=core.tenants,
        prompt_token_weight=config.fair_prompt_token_weight,
        output_token_weight=config.fair_output_token_weight,
        retain_waiting_prefixes=config.retain_waiting_prefixes, max_loras=config.max_loras,
    )
    return block_manager, scheduler


def preemption_policy(core: EngineCore) -> PreemptionPolicy:
    """Rough per-device costs for "auto": recompute = 2 FLOPs per parameter per token,
    swap = a block's bytes over the host link. Only their ratio matters."""
    params = sum(p.numel() for p in core.loaded.model.parameters())
    flops, link_bytes_s = (50e12, 20e9) if core.device.type == "cuda" else (80e9, 10e9)
    return PreemptionPolicy(
        mode=core.config.preemption_mode,
        recompute_cost_per_token=2 * params / flops,
        swap_cost_per_block=core.kv_spec.bytes_per_block / link_bytes_s,
    )


def max_model_len(core: EngineCore) -> int:
    pool = core.kv_spec.num_blocks * core.config.block_size
    model = getattr(core.loaded.model.config, "max_position_embeddings", None) or pool
    limit = min(pool, model)
    return min(limit, core.config.max_model_len) if core.config.max_model_len else limit


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """End-of-sequence ids from the model's generation config and its tokenizer."""
    ids: set[int] = set()
    gen = getattr(loaded.model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), loaded.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids
