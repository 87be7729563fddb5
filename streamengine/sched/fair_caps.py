"""The "fair" policy's limits on a step's prompt tokens (policy.StepCaps): each tenant's
prompts share its prefill chunks, and when the token budget or the free blocks cannot hold
every running prompt's chunk, each tenant prefilling gets its weighted slice. Functions of the
Scheduler; fair.py's FairPolicy calls them."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from streamengine.sched.policy import StepCaps
from streamengine.sequence import Sequence, SequenceStatus
from streamengine.tenancy.fair_share import TENANT_PREFILL_CHUNKS, weighted_split

if TYPE_CHECKING:
    from streamengine.sched.scheduler import Scheduler


def tenant_chunk(sched: Scheduler, tenant: str, slice_size: int = 0) -> int:
    chunk = sched.max_prefill_chunk
    share = max(TENANT_PREFILL_CHUNKS * chunk, slice_size)
    return max(chunk, share // max(1, sched.caps.prefills.get(tenant, 0)))


def count_prefills(sched: Scheduler, caps: StepCaps) -> None:
    """Each tenant's prompts still to prefill and the most prompt tokens each may compute
    this step: its weighted slice when the step's budget cannot hold every prompt's chunk,
    and its chunk share when other tenants are in the step."""
    if sched.max_prefill_chunk is None:
        return
    left: dict[str, list[int]] = {}  # prompt tokens left of each tenant's running prompts
    waiting: list[tuple[str, int]] = []
    num_decodes = 0
    for seq in itertools.chain(sched.running, sched.waiting):
        n = seq.num_tokens - seq.num_computed_tokens
        if n > 1:
            caps.prefills[seq.tenant] = caps.prefills.get(seq.tenant, 0) + 1
            if seq.status is SequenceStatus.RUNNING:
                left.setdefault(seq.tenant, []).append(n)
            else:
                waiting.append((seq.tenant, n))
        elif seq.status is SequenceStatus.RUNNING:
            num_decodes += 1
    caps.num_prefilling_tenants = len(left)
    if len(left) >= 2:
        split_full_step(sched, caps, left, waiting, num_decodes)
    if caps.prefills:  # a decode-only step has nothing to cap (and no tenant set to build)
        present = {seq.tenant for seq in itertools.chain(sched.running, sched.waiting)}
        if len(present) >= 2:
            cap_tenant_prefills(sched, caps, present)


def split_full_step(
    sched: Scheduler, caps: StepCaps, left: dict[str, list[int]], waiting: list[tuple[str, int]], num_decodes: int
) -> None:
    """When the chunks of the running prompts (`left`: tokens left of each, per tenant), the
    decodes and the waiting prompts the pool could start overflow the budget: each tenant
    prefilling gets its weighted slice of the step's prefill tokens."""
    # Waiting prompts count only as far as the free blocks could hold their chunks: when
    # the pool holds them back, the step is not full, and a slice would only slow a quiet
    # tenant's lone prompt for nothing.
    admissible = min(sum(min(n, tenant_chunk(sched, t)) for t, n in waiting),
                     sched.block_manager.num_free_blocks * sched.block_manager.block_size)
    demand = num_decodes + admissible + sum(min(n, tenant_chunk(sched, t)) for t, ns in left.items() for n in ns)
    if demand <= sched.max_num_batched_tokens:
        return  # every chunk fits: the step stays as short as the chunks make it
    # The step is full whatever the split: split its prefill tokens by weight between the
    # tenants whose prompts run (a waiting one may not start this step; its slice would
    # go unused), each taking no more than its slice.
    running = {tenant: sum(ns) for tenant, ns in left.items()}
    weights = {tenant: sched.share.tenants.get(tenant).weight for tenant in running}
    split = weighted_split(max(0, sched.max_num_batched_tokens - num_decodes), running, weights)
    caps.slice_sizes.update(split)
    caps.prefill_slices.update(split)  # counts down as the step hands tokens out


def cap_tenant_prefills(sched: Scheduler, caps: StepCaps, present: set[str]) -> None:
    """With other tenants' sequences in the step, a tenant's prompts compute at most
    TENANT_PREFILL_CHUNKS chunks in all (times its weight over the least weight `present`),
    however many it has in flight; a full step's slice (split_full_step) can only lower
    that: otherwise each of a busy tenant's prompts takes a chunk, and a burst of its queued
    turns admitted together makes one long step that every other tenant's stream and first
    token waits for. A tenant alone keeps the whole budget."""
    weight = sched.share.tenants.get
    least = min(weight(tenant).weight for tenant in present)
    for tenant in caps.prefills:
        cap = round(TENANT_PREFILL_CHUNKS * sched.max_prefill_chunk * weight(tenant).weight / least)
        caps.prefill_slices[tenant] = min(caps.prefill_slices.get(tenant, cap), cap)


def split_pool(sched: Scheduler, budget: int, admitted: set[Sequence], over_share: set[str]) -> None:
    """"fair": when the free blocks cannot hold the chunks of the prompts running (those
    not `admitted` this step), each tenant prefilling gets its weighted slice of the
    prompt tokens they can hold, as when the token budget runs out (count_prefills);
    the tenants `over_share` of the pool split what the others leave, as they come last
    in the step's order (a busy tenant's many prompts must not halve a quiet tenant's
    lone one when the pool is short). Handed out in service order, the least-served
    tenant, however slightly, took every block for its chunks while its peers waited a
    step: a lurch that the counters undid in the steps after, and that a window of a few
    steps saw as unfair."""
    caps = sched.caps
    if caps.num_prefilling_tenants < 2:
        return  # a decode-only step, or one tenant prefilling: nothing to split (no scan)
    bm = sched.block_manager
    prompts: dict[str, list[int]] = {}  # tokens left of each tenant's running prompts
    chunks = decode_blocks = own_room = 0
    for seq in sched.running:
        n = seq.num_tokens - seq.num_computed_tokens
        if seq in admitted or n < 1:
            continue
        if n == 1:
            decode_blocks += len(seq.block_table) < bm.blocks_needed(seq.num_tokens)
            continue
        prompts.setdefault(seq.tenant, []).append(n)
        chunks += min(n, fair_chunk(sched, seq), caps.prefill_slices.get(seq.tenant, n))
        own_room += len(seq.block_table) * bm.block_size - seq.num_computed_tokens
    # The prompt tokens the pool holds: what is left in the prompts' own last blocks and
    # the free blocks that the decodes' next tokens do not take.
    room = own_room + max(0, bm.num_free_blocks - decode_blocks) * bm.block_size
    if len(prompts) < 2 or chunks <= room or room <= 0:
        return  # every chunk fits, or someone must yield first (_make_room picks whom)
    capacity = min(budget, room)
    # What each tenant's prompts could take this step, chunked as a slice of all of it
    # would make them: no slice larger, or the room it leaves would go unused.
    takes = {tenant: sum(min(n, tenant_chunk(sched, tenant, capacity)) for n in ns)
             for tenant, ns in prompts.items()}
    for last in (False, True):
        tier = {tenant: n for tenant, n in takes.items() if (tenant in over_share) == last}
        weights = {tenant: sched.share.tenants.get(tenant).weight for tenant in tier}
        for tenant, size in weighted_split(capacity, tier, weights).items():
            caps.slice_sizes[tenant] = max(caps.slice_sizes.get(tenant, 0), size)
            caps.prefill_slices[tenant] = min(caps.prefill_slices.get(tenant, size), size)
            capacity -= size


def fair_chunk(sched: Scheduler, seq: Sequence) -> int:
    """The tenant's TENANT_PREFILL_CHUNKS chunks (or, in a full step, its slice) shared by its
    prompts in flight or waiting (`seq` among them), never less than one chunk each."""
    return tenant_chunk(sched, seq.tenant, sched.caps.slice_sizes.get(seq.tenant, 0))
