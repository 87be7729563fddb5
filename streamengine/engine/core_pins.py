"""Core pins: how EngineCore handles pinned prefixes and the salt segments they decide.

A request's salt segments (a shared pin's blocks are hashed unsalted), its max_tokens fitted
to the pool beside the pinned blocks, the queued requests that pins made unfittable, the
block hashes a prompt would get, and pinning a finished prompt's cached blocks. Functions
over the `EngineCore`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamengine.kv.block_hash import prompt_block_hashes
from streamengine.lora.adapter import with_adapter
from streamengine.sequence import Sequence
from streamengine.tenancy.pinning import Pin
from streamengine.tenancy.tenants import DEFAULT_TENANT, TenantConfig

if TYPE_CHECKING:
    from streamengine.engine.core import EngineCore
    from streamengine.lora.adapter import LoRAAdapter


def fit_beside_pins(core: EngineCore, prompt_ids: list[int], segments: tuple, max_tokens: int, explicit: bool,
                     reads_cache: bool = True) -> int:
    """The request's max_tokens, fitted to the pool beside the pinned prefixes (plus the
    pinned blocks it hits): intake checks lengths against the whole pool, and a request
    needing more would wait, or preempt itself, forever. An implicit max_tokens (None:
    the room left in the context) shrinks to what fits; an explicit one that does not
    fit, or a prompt that does not, is refused."""
    bm, bs = core.block_manager, core.block_manager.block_size
    room = core.scheduler.room_for_one()
    if not bm.retention.num_pinned_blocks or bm.blocks_needed(len(prompt_ids) + max_tokens) <= room:
        return max_tokens  # hits on pinned blocks can only lower the need
    # The last prompt token is always computed; a request wanting its prompt's logprobs
    # computes them all (Sequence.reads_prefix_cache).
    max_hits = (len(prompt_ids) - 1) // bs if reads_cache else 0
    hits = bm.retention.num_pinned_hits(prompt_block_hashes(prompt_ids[: max_hits * bs], bs, segments, seq_salt(segments)))
    fits = (room + hits) * bs - len(prompt_ids)
    if fits >= max_tokens or (not explicit and fits >= 1):
        return min(max_tokens, fits)
    raise ValueError(
        f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) needs "
        f"{bm.blocks_needed(len(prompt_ids) + max_tokens) - hits} KV blocks of {bs} tokens, but only {room} "
        f"of the pool's {bm.num_blocks} blocks are free of pinned prefixes"
    )


def fail_unfittable(core: EngineCore) -> bool:
    """Fails, each alone, the queued requests that cannot start even in a pool holding
    nothing else: prefixes pinned after they arrived took the room they need. What the
    engine does with a step that schedules nothing while work is pending; False if no
    request is in that case (the step was empty for some other reason)."""
    stuck = {seq.request_id for seq in core.scheduler.unfittable()}
    bm = core.block_manager
    for request_id in stuck:
        core.fail_request(request_id, f"the request no longer fits in the KV pool: "
                                      f"{bm.retention.num_pinned_blocks} of its {bm.num_blocks} blocks are pinned")
    return bool(stuck)


def salt_segments(core: EngineCore, prompt_ids: list[int], tenant: str, user_salt: str | None, pin: Pin | None,
                  adapter: LoRAAdapter | None = None):
    """The request's salts by token range; under a LoRA adapter every one also names the
    adapter, so its blocks (K/V the adapter computed) are hit by requests of that adapter only."""
    if pin is not None and pin.info.shared:
        segments = ((0, None),)  # a shared prefix: hashed without any salt
    else:
        segments = core.pins.segments(prompt_ids, tenant, core.tenants.get(tenant).salt, user_salt)
    return segments if adapter is None else with_adapter(segments, adapter.identity)


def block_hashes(core: EngineCore, prompt: str | list[int], tenant: str | None = None, cache_salt: str | None = None,
                 lora: str | None = None) -> list[bytes]:
    """The hashes of every full block of `prompt` as a request of `tenant` with this
    per-user `cache_salt`, run under the LoRA adapter `lora` (None: the tenant's, as in
    generate), would compute them now (the pins in place decide its salt segments, as in
    add_request). Registers no tenant; LoRAError for an adapter that is not loaded."""
    tenant = tenant if tenant is not None else DEFAULT_TENANT
    prompt_ids = core.intake.prompt_ids(prompt)
    config = core.tenants.get(tenant) if tenant in core.tenants else TenantConfig(tenant)
    lora = lora if lora is not None else config.lora
    adapter = core.loras.get(lora) if lora is not None else None
    segments = core.pins.segments(prompt_ids, tenant, config.salt, cache_salt)
    segments = segments if adapter is None else with_adapter(segments, adapter.identity)
    return prompt_block_hashes(prompt_ids, core.config.block_size, segments, seq_salt(segments))


def pin_prefix(core: EngineCore, pin: Pin, seq: Sequence) -> None:
    """Pins the cached blocks of `seq`'s prompt (computed by now) for `pin`. They are
    found by hash: a prompt already cached computes its last block again in a block of
    its own, which is not the cached one."""
    bm, n = core.block_manager, pin.info.num_blocks
    block_ids = bm.retention.cached_block_ids(bm.compute_block_hashes(seq)[:n])
    if len(block_ids) != n:
        raise RuntimeError(f"pinned prefix {pin.info.pin_id}: only {len(block_ids)} of its {n} blocks are cached")
    bm.retention.pin_blocks(block_ids, owner="*" if pin.info.shared else pin.info.tenant)
    pin.block_ids = block_ids
    # The segments its blocks were hashed with: a shared pin made while this one computed
    # (pins made concurrently) must not change which hashes its tenant's requests look up.
    core.pins.add(pin, seq.salt_segments)


def seq_salt(segments: tuple[tuple[int, str | None], ...]) -> str | None:
    """A sequence's `cache_salt`: its last segment's (what a block past every segment gets)."""
    return segments[-1][1] if segments else None
