"""The "fair" policy (FairPolicy, a SchedulingPolicy): making room for underserved tenants (who
yields, in what order), running order and victims by tenant share, and admission from the
tenant owed the most service; the step's prefill caps are in fair_caps.py. Functions of the
Scheduler; FairShare (tenancy/fair_share.py) holds the accounting they read."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

from streamengine.kv.free_blocks import KVBlock
from streamengine.sched.fair_caps import count_prefills, fair_chunk, split_pool
from streamengine.sched.groups import cached_blocks
from streamengine.sched.plan import SchedulerOutput
from streamengine.sched.policy import StepCaps
from streamengine.sched.preemption import blocks_freed_by
from streamengine.sequence import Sequence
from streamengine.tenancy.fair_share import FAIRNESS_SLACK, LOOKAHEAD, MAX_YIELDS_PER_STEP

if TYPE_CHECKING:
    from streamengine.sched.scheduler import Scheduler


def free_for_next_tokens(sched: Scheduler, out: SchedulerOutput, admitted: set[Sequence]) -> None:
    """"fair": before any running sequence is scheduled, preempts until the pool holds
    the next token of every one (prompt chunks then shrink to what is left: _fit_chunk),
    the victims chosen among all of them by FairShare.pick_victim. Chosen while
    scheduling, a victim could only be one not scheduled yet: the last in service order,
    which is often a quiet tenant's lone prompt (charged in full as it started), preempted
    for the growth of a busy tenant's many sequences, its blocks then the first evicted."""
    bm = sched.block_manager
    needs = {seq: bm.num_new_blocks(seq, 1) for seq in sched.running
             if seq not in admitted and seq.num_computed_tokens < seq.num_tokens}
    short = sum(needs.values()) - bm.num_free_blocks
    if short <= 0:
        return
    for victim, freed in yield_order(sched, list(needs)):
        sched.running.remove(victim)
        if sched.preemption.should_swap(victim, bm):
            sched._swap_out(victim, out)
        else:
            sched._preempt(victim)
        out.preempted.append(victim)
        short -= freed + needs[victim]
        if short <= 0:
            return


def serve_underserved(sched: Scheduler, out: SchedulerOutput) -> int:
    """"fair": waiting tenants in the order they are owed service (one with nothing
    running first, then the least served; FairShare.first_to_serve) are made room for
    when their next sequence cannot get its blocks (or a running slot), and admitted in
    that same step, before the running sequences grow into the room. Running tenants give
    way, their newest sequences first, up to MAX_YIELDS_PER_STEP in all: those more than
    FAIRNESS_SLACK ahead of the tenant served and, if it has nothing running, those
    holding more than their share of the pool. Returns the tokens it scheduled.

    Recompute preemption: the victims' full blocks stay in the prefix cache, so they
    resume mostly on hits. Without this a tenant that filled the pool keeps it until its
    requests end, and a quiet tenant's first token waits for a busy one's requests; and
    room made for a tenant but left to ordinary admission goes first to the running
    sequences' growth, step after step, while the tenant it was made for waits."""
    if not sched.waiting or sched.swapped or not sched.running:
        return 0
    running = {s.tenant for s in sched.running}
    queues = waiting_by_tenant(sched)
    in_flight: set[bytes] | None = None  # hashed only when some tenant needs room
    yields_left, scheduled = MAX_YIELDS_PER_STEP, 0
    committed = sched.share.committed(sched.running)
    # No check for a free running slot here: give_way makes one too (a tenant holding
    # every slot, with one wide request, gives way like one holding the pool).
    while queues and scheduled < sched.max_num_batched_tokens:
        tenant = sched.share.first_to_serve(queues, running, committed)
        queue, idle = queues.pop(tenant), tenant not in running
        if not owed_room_of(sched, tenant, out.preempted):
            continue  # it yielded for an earlier one this step, or is served more than one that did
        if not idle and sched._has_room(head_need(sched, queue[0])):
            break  # the common case, decided before any hashing: ordinary admission serves it
        if in_flight is None:
            in_flight = sched._blocks_in_flight()
        choice = pick_in_tenant(sched, queue, in_flight)
        if choice is None or not may_admit(sched, choice[0], choice[1]):
            continue  # it cannot start this step whatever the room
        seq, cached, ahead = choice
        need = blocks_to_start(sched, seq, cached)
        yields_left -= give_way(sched, tenant, need, yields_left, out)
        if not sched._has_room(need):
            break  # the room that frees up next is this tenant's, not a later one's
        n = sched._admit_from_waiting(out, seq, cached, sched.max_num_batched_tokens - scheduled)
        if n == 0:
            break
        sched.share.passed_over(ahead)
        commit_admitted(sched, committed, seq)
        in_flight.update(sched._pending_hashes(seq))
        running.add(tenant)
        scheduled += n
    return scheduled


def owed_room_of(sched: Scheduler, tenant: str, yielded: list[Sequence]) -> bool:
    """Whether `tenant` may take room that the tenants of `yielded` gave this step: not
    if it is one of them, nor if it is served more than any of them. (Room a tenant gave
    for one owed more service went, in the same step, to a tenant served more than the
    one that gave it.)"""
    if any(victim.tenant == tenant for victim in yielded):
        return False
    vt = sched.share.usage_of(tenant).virtual_time
    return all(vt <= sched.share.usage_of(victim.tenant).virtual_time for victim in yielded)


def give_way(sched: Scheduler, tenant: str, need: int, limit: int, out: SchedulerOutput) -> int:
    """Preempts up to `limit` running sequences that owe `tenant` room until `need` free
    blocks (and a running slot) are there; returns how many it preempted. Preempts none
    when those `limit` would not free enough: the room would not be made, and the
    victims, readmitted next step, would yield again the step after (a thrash that
    serves nobody)."""
    if sched._has_room(need):
        return 0
    started = {item.seq for item in out.scheduled}  # admitted earlier this step: kept
    victims = victims_for(sched, tenant, started, limit)
    if sched.block_manager.num_free_blocks + blocks_freed_by(sched.block_manager, *victims) < need:
        return 0
    for count, victim in enumerate(victims):
        if sched._has_room(need):
            return count
        sched.running.remove(victim)
        sched._preempt(victim)
        out.preempted.append(victim)
    return len(victims)


def victims_for(sched: Scheduler, tenant: str, kept: set[Sequence], limit: int) -> list[Sequence]:
    """Up to `limit` running sequences owing `tenant` room (none of `kept`), in the order
    they would yield."""
    owing = [s for s in owing_room(sched, tenant) if s not in kept]
    if not owing:  # the common case with every slot taken: no scan of the block tables
        return []
    return [victim for victim, _ in itertools.islice(yield_order(sched, owing), limit)]


def yield_order(sched: Scheduler, candidates: list[Sequence]) -> Iterator[tuple[Sequence, int]]:
    """`candidates` in the order they yield (FairShare.pick_victim), each with the blocks
    its preemption frees; each pick sees its tenant's holdings without those picked
    before it. Lazy: each pair is computed as it is taken, after the previous victim's
    preemption, if the caller preempts as it goes."""
    held = blocks_by_tenant(sched)
    left = list(candidates)
    while left:
        victim = sched.share.pick_victim(left, held, sched.block_manager.enable_prefix_caching)
        left.remove(victim)
        freed = blocks_freed_by(sched.block_manager, victim)
        num_seqs, num_blocks = held[victim.tenant]
        held[victim.tenant] = (num_seqs - 1, num_blocks - freed)
        yield victim, freed


def over_block_share(sched: Scheduler) -> set[str]:
    bm = sched.block_manager
    return sched.share.over_block_share(blocks_by_tenant(sched), sched.waiting, bm.num_blocks - bm.retention.num_pinned_blocks)


def owing_room(sched: Scheduler, tenant: str) -> list[Sequence]:
    """The running sequences (samples and beams of a wide request too) that owe `tenant`
    room: of tenants more than FAIRNESS_SLACK ahead of it, and, when it runs nothing, of
    tenants over their share of the pool, or of the running slots while every slot is
    taken, that are served at least as much as it is (a tenant owed more service than the
    one arriving does not give way to it: with the slack there too, the least-served bot
    of a busy trace still yielded, mid-prompt, to quiet ones)."""
    served = sched.share.usage_of(tenant).virtual_time
    over_share = set()
    if all(s.tenant != tenant for s in sched.running):
        over_share = over_block_share(sched)
        if len(sched.running) >= sched.max_num_seqs:
            over_share |= sched.share.over_slot_share(sched.running, sched.waiting, sched.max_num_seqs)

    def owes(other: str) -> bool:
        vt = sched.share.usage_of(other).virtual_time
        return vt > served + FAIRNESS_SLACK or (other in over_share and vt >= served)

    return [s for s in sched.running if owes(s.tenant)]


def head_need(sched: Scheduler, seq: Sequence) -> int:
    return blocks_to_start(sched, seq, cached_blocks(sched, seq))


def blocks_to_start(sched: Scheduler, seq: Sequence, cached: list[KVBlock]) -> int:
    """Free blocks `seq` takes for its first step (with the watermark): new ones and its
    hits on free cached blocks. (Counting only the new ones, a tenant whose history sat
    free in the cache was never made room for: its own hits looked like room, admission
    then failed, and it waited for other tenants' requests to end while their growth
    evicted that history.)"""
    bm = sched.block_manager
    start = len(cached) * bm.block_size
    n = sched._num_new_tokens(seq, start, sched.max_num_batched_tokens)
    return bm.num_new_blocks(seq, n, cached) + bm.num_free_hits(cached) + sched.watermark_blocks


def blocks_by_tenant(sched: Scheduler) -> dict[str, tuple[int, int]]:
    """Per tenant, its running sequences and the distinct unpinned blocks they hold: what
    its preemption could free (pinned blocks stay)."""
    held: dict[str, set[int]] = {}
    count: dict[str, int] = {}
    blocks = sched.block_manager.pool.blocks
    for seq in sched.running:
        held.setdefault(seq.tenant, set()).update(b for b in seq.block_table if not blocks[b].pins)
        count[seq.tenant] = count.get(seq.tenant, 0) + 1
    return {tenant: (count[tenant], len(ids)) for tenant, ids in held.items()}


def schedule_waiting_fair(sched: Scheduler, out: SchedulerOutput, budget: int, yielded: list[Sequence]) -> None:
    """Admits from the tenant owed the most service, among those that may take the room
    the `yielded` sequences gave this step (owed_room_of). A tenant over
    its own quota is passed (its limit must not hold back the others); when the chosen
    sequence does not fit the pool, admission stops: the room that frees up goes to the
    tenant owed the most, as in FCFS it goes to the head of the line, so a large request
    cannot starve."""
    in_flight = sched._blocks_in_flight()
    queues = waiting_by_tenant(sched)
    for tenant in [t for t in queues if not owed_room_of(sched, t, yielded)]:
        del queues[tenant]
    committed = sched.share.committed(sched.running) if queues else {}
    while queues and budget > 0 and len(sched.running) < sched.max_num_seqs:
        tenant = sched.share.least_served(queues, committed)
        if sched.caps.prefill_slices.get(tenant, 1) <= 0:
            del queues[tenant]  # its slice of this full step is spent
            continue
        choice = pick_in_tenant(sched, queues[tenant], in_flight)
        if choice is None or not may_admit(sched, choice[0], choice[1]):
            del queues[tenant]  # all wait for a prefix in flight, or over its quota
            continue
        seq, cached, ahead = choice
        n = sched._admit_from_waiting(out, seq, cached, budget)
        if n == 0:
            return
        sched.share.passed_over(ahead)
        commit_admitted(sched, committed, seq)
        queues[tenant].remove(seq)
        if not queues[tenant]:
            del queues[tenant]
        in_flight.update(sched._pending_hashes(seq))
        budget -= n


def commit_admitted(sched: Scheduler, committed: dict[str, float], seq: Sequence) -> None:
    """Adds `seq`'s prompt tokens still to charge (it was just admitted) to `committed`."""
    for tenant, cost in sched.share.committed([seq]).items():
        committed[tenant] = committed.get(tenant, 0.0) + cost


def waiting_by_tenant(sched: Scheduler) -> dict[str, list[Sequence]]:
    """Each tenant's waiting sequences in order; tenants in order of their first one."""
    queues: dict[str, list[Sequence]] = {}
    for seq in sched.waiting:
        queues.setdefault(seq.tenant, []).append(seq)
    return queues


def pick_in_tenant(
    sched: Scheduler, queue: list[Sequence], in_flight: set[bytes]
) -> tuple[Sequence, list[KVBlock], list[Sequence]] | None:
    """The tenant's next sequence with its cache hits and the eligible ones it passes over;
    those waiting for a prefix in flight keep their place and are not passed over."""
    candidates = []
    for seq in queue[:LOOKAHEAD]:
        cached = cached_blocks(sched, seq)
        if not sched._waits_for_prefix(seq, len(cached), in_flight):
            candidates.append((seq, cached))
    if not candidates:
        return None
    i = sched.share.pick([(seq, len(cached)) for seq, cached in candidates], len(queue))
    return candidates[i][0], candidates[i][1], [seq for seq, _ in candidates[:i]]


def may_admit(sched: Scheduler, seq: Sequence, cached: list[KVBlock]) -> bool:
    """Within the tenant's quotas, counting the blocks its known tokens will hold, and with
    a slot for its LoRA adapter."""
    if not sched.lora_fits(seq):
        return False
    bm = sched.block_manager
    num_new = bm.blocks_needed(seq.num_tokens) - len(cached)
    return sched.share.within_quota(seq, sched.running, [b.block_id for b in cached], num_new, bm.num_blocks)

class FairPolicy:
    """Tenants by share (the functions above); a SchedulingPolicy."""

    def begin_step(self, sched: Scheduler, caps: StepCaps) -> None:
        count_prefills(sched, caps)

    def serve_first(self, sched: Scheduler, out: SchedulerOutput) -> int:
        return serve_underserved(sched, out)

    def running_order(self, sched: Scheduler, out: SchedulerOutput, budget: int, admitted: set[Sequence]) -> list[Sequence]:
        """The tenants within their share of the pool first, then those over it, least served
        first in each: the tenants owed service get their prompts computed, and the victims,
        taken among the sequences still unscheduled, are of the tenants holding the most
        memory (by service alone, a quiet tenant's lone prompt, charged in full as it starts,
        was preempted step after step for a busy tenant's growth)."""
        free_for_next_tokens(sched, out, admitted)
        # One tenant running: its being over its share moves all or none (no block-table scan).
        several = len({s.tenant for s in sched.running}) > 1
        over = over_block_share(sched) if several else set()
        split_pool(sched, budget, admitted, over)
        return sched.share.service_order(sched.running, over)

    def prefill_chunk(self, sched: Scheduler, seq: Sequence) -> int:
        return fair_chunk(sched, seq)

    def take_victim(self, sched: Scheduler, out: SchedulerOutput, tenant: str | None) -> Sequence:
        """The newest of the tenant furthest over its share (of `tenant`, if given) among the
        sequences this step has not scheduled yet."""
        scheduled = {item.seq for item in out.scheduled}
        candidates = [s for s in sched.running if s not in scheduled and tenant in (None, s.tenant)]
        victim = sched.share.pick_victim(candidates, blocks_by_tenant(sched), sched.block_manager.enable_prefix_caching)
        sched.running.remove(victim)
        return victim

    def may_grow(self, sched: Scheduler, seq: Sequence, n: int) -> bool:
        bm = sched.block_manager
        num_new = bm.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_table)
        return num_new <= 0 or sched.share.within_quota(seq, sched.running, (), num_new, bm.num_blocks)

    def schedule_waiting(self, sched: Scheduler, out: SchedulerOutput, budget: int, yielded: list[Sequence]) -> None:
        schedule_waiting_fair(sched, out, budget, yielded)
