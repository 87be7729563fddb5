"""Core stats: the figures EngineCore reports about its pool, queues and tenants.

`stats` (blocks, cache, queues, preemptions, per tenant figures), `tenant_stats`,
`num_tokens_to_compute` (the work a router weighs) and `kv_state` (every block's state and
owners). Functions over the `EngineCore`; they read its bookkeeping and change nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from streamengine.sequence import Sequence

if TYPE_CHECKING:
    from streamengine.engine.core import EngineCore


def stats(core: EngineCore) -> dict[str, int | float]:
    bm, sched = core.block_manager, core.scheduler
    return {
        "num_total_blocks": bm.num_blocks,
        "num_free_blocks": bm.num_free_blocks,
        "num_cached_blocks": len(bm.pool.cached),
        # Sharing: physical blocks in use vs the block-table entries that point at them.
        "num_used_blocks": bm.num_blocks - bm.num_free_blocks,
        "num_logical_blocks": sum(len(s.block_table) for s in live_seqs(core)),
        "num_tokens_to_compute": num_tokens_to_compute(core),
        "kv_cache_usage": bm.usage(),
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting),
        "num_requests": len(core.requests),
        "prefix_cache_queries": bm.stats.queries,
        "prefix_cache_hits": bm.stats.hits,
        "num_preemptions": sched.num_preemptions,
        "num_swapped": len(sched.swapped),
        "num_swap_outs": sched.num_swap_outs,
        "num_swap_blocks": bm.num_cpu_blocks,
        "num_swap_blocks_free": bm.num_free_cpu_blocks,
        "block_size": bm.block_size,
        "max_model_len": core.max_model_len,
        "num_pinned_blocks": bm.retention.num_pinned_blocks,
        # Speculative decoding, as vLLM counts it (zeros while off).
        "spec_decode_num_drafts": core.spec_stats.num_drafts,
        "spec_decode_num_draft_tokens": core.spec_stats.num_draft_tokens,
        "spec_decode_num_accepted_tokens": core.spec_stats.num_accepted_tokens,
        "spec_decode_num_accepted_tokens_per_pos": list(core.spec_stats.accepted_per_pos),
        "spec_decode_mean_accepted_length": core.spec_stats.mean_accepted_length,
        "tenants": tenant_stats(core),
    }


def tenant_stats(core: EngineCore) -> dict[str, dict[str, int | float | str]]:
    """Per tenant: the scheduler's share and service figures, plus its weight, requests in
    flight, pinned blocks, requests refused by its rate limit, the seconds its grammar masks
    took, and its LoRA adapter's name where its config names one."""
    figures = core.scheduler.tenant_stats()
    live: dict[str, int] = {}
    for req in core.requests.values():
        live[req.tenant] = live.get(req.tenant, 0) + 1
    pinned: dict[str | None, int] = {}
    for pin in core.pins.all():
        pinned[pin.info.tenant] = pinned.get(pin.info.tenant, 0) + len(pin.block_ids)
    for name in core.tenants.names():
        row = figures.setdefault(name, {})
        row["weight"] = core.tenants.get(name).weight
        row["num_requests"] = live.get(name, 0)
        row["num_pinned_blocks"] = pinned.get(name, 0)
        row["num_rejected"] = core.tenants.num_rejected.get(name, 0)
        if core.tenants.get(name).lora is not None:
            row["lora"] = core.tenants.get(name).lora
    mask_seconds = core.runner.masker.seconds_by_tenant.copy()  # the step thread adds to it
    for name, row in figures.items():
        row["grammar_mask_seconds"] = mask_seconds.get(name, 0.0)
    return figures


def num_tokens_to_compute(core: EngineCore) -> int:
    """Tokens still to run through the model for the requests held: a waiting prompt net
    of its cached prefix, the rest of a prompt prefilled in chunks, one per decoding
    sequence. A replica reports it so a router can weigh the work queued there."""
    bm = core.block_manager
    total = 0
    for seq in live_seqs(core):
        computed = seq.num_computed_tokens or len(bm.find_cached_blocks(seq)) * bm.block_size
        total += seq.num_tokens - computed
    return total


def live_seqs(core: EngineCore) -> Iterator[Sequence]:
    """Sequences holding or about to compute blocks. Samples still waiting to fork sample
    0's prompt are left out: they will share its blocks, not compute the prompt again."""
    for req in core.requests.values():
        forking = {child.seq.seq_id for child in req.pending_children}
        for seq in req.seqs:
            if not seq.is_finished and seq.seq_id not in forking:
                yield seq


def kv_state(core: EngineCore) -> dict:
    bm = core.block_manager
    return {
        "block_size": bm.block_size, "num_blocks": bm.num_blocks, "blocks": bm.pool.block_states(),
        "tenants": bm.pool.block_tenants(),
    }
