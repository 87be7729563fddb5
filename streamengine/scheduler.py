"""Iteration-level continuous batching under a token budget, with preemption by swap or
recompute.

Each step the scheduler decides, for every sequence it runs, how many of its tokens to compute
(`num_new_tokens`). One rule covers every phase: `num_computed_tokens` catches up to
`num_tokens`. A fresh prompt computes up to the budget (chunked prefill), a decoding sequence
computes its one new token, a prefix-cache hit starts with `num_computed_tokens` > 0.
`max_prefill_chunk` caps the tokens one sequence computes per step, so a long prompt takes
several steps and the decode streams batched with it keep getting a token every step.

Two admission policies: "fcfs" admits in arrival order across everyone; "fair" admits from the
tenant owed the most service, within its quotas, and inside a tenant prefers cached prefixes
(fair_share.py holds that policy; this module keeps the queues and the blocks).
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from streamengine.block_manager import BlockManager
from streamengine.config import SCHEDULING_POLICIES
from streamengine.fair_share import (
    FAIRNESS_SLACK,
    LOOKAHEAD,
    MAX_YIELDS_PER_STEP,
    TENANT_PREFILL_CHUNKS,
    FairShare,
    weighted_split,
)
from streamengine.free_blocks import KVBlock
from streamengine.sequence import Sequence, SequenceStatus
from streamengine.tenants import Tenants


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # compute positions [num_computed_tokens, num_computed_tokens + this)
    samples: bool = False  # reaches the last known token, whose logits give the next one
    # The first this many positions computed give prompt logprobs: position p's logits give
    # prompt token p + 1's (only while `seq.prompt_logprobs` asks for them).
    num_prompt_logprobs: int = 0

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        prompt_rows = 0
        if seq.prompt_logprobs is not None:
            prompt_rows = max(0, min(end, seq.num_prompt_tokens - 1) - start)
        return cls(seq, num_new_tokens, end == seq.num_tokens, prompt_rows)


@dataclass(slots=True)
class SchedulerOutput:
    """A plain plan for one step: what to compute, which blocks to copy first."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class PreemptionPolicy:
    """How to preempt: "recompute", "swap" (recompute when the host pool is full) or "auto".

    "auto" compares estimated costs per victim: recomputing redoes the forward pass of its
    computed tokens; swapping moves its blocks out and back. Multi-sequence groups are always
    swapped when possible, since recomputing them would re-prefill each sample separately.
    """

    mode: str = "recompute"
    recompute_cost_per_token: float = 1.0  # seconds, estimated by the engine for its device
    swap_cost_per_block: float = 0.0

    def should_swap(self, seq: Sequence, block_manager: BlockManager) -> bool:
        if self.mode == "recompute" or not block_manager.can_swap_out(seq):
            return False
        if self.mode == "swap" or seq.group_size > 1:
            return True
        moved = len(seq.block_table) - block_manager.num_kept_on_swap(seq)  # shared ones stay
        swap = 2 * moved * self.swap_cost_per_block  # out and back in
        return swap < seq.num_computed_tokens * self.recompute_cost_per_token


class Scheduler:
    """Running sequences first (oldest first), then swapped ones (in arrival order), then
    waiting ones: in arrival order ("fcfs"), or by tenant share ("fair").

    `waiting` keeps arrival order under both policies (a preempted sequence at the front), so
    "fair" reads each tenant's own FCFS order from it. Per-tenant service is counted under
    both (tenant_stats); quotas apply only under "fair".
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption: PreemptionPolicy | None = None,
        max_prefill_chunk: int | None = None,
        policy: str = "fcfs",
        tenants: Tenants | None = None,
        prompt_token_weight: float = 1.0,
        output_token_weight: float = 2.0,
        retain_waiting_prefixes: bool = True,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.policy = policy
        self.share = FairShare(tenants if tenants is not None else Tenants(), prompt_token_weight, output_token_weight)
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk  # None: a sequence may take the whole budget
        # Waiting sequences' cached prefixes are evicted last (BlockManager.want).
        self.retain_waiting_prefixes = retain_waiting_prefixes
        self.preemption = preemption or PreemptionPolicy()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # arrival order
        self.num_preemptions = 0
        self.num_swap_outs = 0
        # Admission keeps ~1% of the pool free so a new prompt does not force the very next
        # decode step to preempt (the same watermark vLLM uses).
        self.watermark_blocks = block_manager.num_blocks // 100
        # "fair": each tenant's prompts in flight or waiting this step, for its chunk size.
        self._prefills: dict[str, int] = {}
        # "fair", when the step is full: each tenant's weighted slice of its prefill tokens
        # (weighted_split), and what is left of it as the step hands tokens out.
        self._slice_sizes: dict[str, int] = {}
        # "fair": tenants with prompts running as the step began; fewer than two, and the
        # step has no pool to split between them (_split_pool skips its scan).
        self._num_prefilling_tenants = 0
        self._prefill_slices: dict[str, int] = {}
        # The waiting sequence whose admission the pool refused last this step (unfittable).
        self._refused: Sequence | None = None

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.share.on_arrival(seq, waiting=(s.tenant for s in self.waiting))
        self.waiting.append(seq)
        self._want(seq, first=False)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that starts with computed blocks already (a fork of a running one)."""
        seq.status = SequenceStatus.RUNNING
        self.share.on_arrival(seq, charged_upto=seq.num_computed_tokens)  # its parent paid for them
        bisect.insort(self.running, seq, key=_arrival)

    def add_preempted(self, seq: Sequence) -> None:
        """A sequence that must (re)compute from scratch, ahead of later arrivals."""
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.share.on_arrival(seq, charged_upto=seq.num_tokens)  # a beam whose parent paid for them
        self.waiting.appendleft(seq)
        self._want(seq, first=True)

    def _want(self, seq: Sequence, first: bool) -> None:
        if self.retain_waiting_prefixes:
            self.block_manager.want(seq, first)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the queues and returns its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.unwant(seq)
        self.block_manager.free(seq)
        self.share.on_leave(seq)
        seq.status = SequenceStatus.FINISHED

    def tenant_stats(self) -> dict[str, dict[str, float | int]]:
        """Per tenant: service counter, queue lengths, tokens, prefix-cache figures, blocks held."""
        return self.share.stats(self.running, self.waiting)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._refused = None
        self.share.start_step()
        self._count_prefills()
        budget = self.max_num_batched_tokens - self._serve_underserved(out)
        # Tenants that gave way this step admit nothing in it (that would undo the yield), nor
        # does anyone served more than one of them: the room is lent only to those it owes.
        yielded = list(out.preempted)
        num_yielded = len(yielded)
        budget = self._schedule_running(out, budget)
        pressed = len(out.preempted) > num_yielded  # memory pressure: admit nobody this step
        if not pressed:
            budget = self._schedule_swapped(out, budget)
        if not pressed and not self.swapped:
            self._schedule_waiting(out, budget, yielded)
        while not out.scheduled and self.running and (self.waiting or self.swapped):
            # Every running sequence is idle (beams waiting for a sibling's logits) while the
            # sibling cannot get blocks: recompute the newest idle one later, behind the
            # blocked one (ahead of it, it would take the same blocks back: a livelock).
            victim = self._take_victim(out)
            self._preempt(victim, front=False)
            out.preempted.append(victim)
            self._prefill_slices.clear()  # split for a step that scheduled nothing
            budget = self._schedule_swapped(out, self.max_num_batched_tokens)
            if not self.swapped:
                self._schedule_waiting(out, budget, yielded)
        if not out.scheduled and not self.running and self.swapped:
            self._recompute_swapped(out, yielded)
        out.blocks_to_copy = self.block_manager.take_pending_copies()
        return out

    def _recompute_swapped(self, out: SchedulerOutput, yielded: list[Sequence]) -> None:
        """Nothing runs, so no block frees up for the swapped head: the swapped sequences
        holding the blocks it lacks (shared blocks they kept on the device) recompute instead,
        newest first, until it swaps in; if it still cannot, it recomputes too, and admission
        then starts it or `unfittable` names it (its request fails alone). An empty step
        with work pending is a bookkeeping fault to the engine: it restarts the core."""
        while not out.scheduled and self.swapped:
            self._preempt(self.swapped.pop())  # to the head of the line: arrival order kept
            budget = self._schedule_swapped(out, self.max_num_batched_tokens)
            if not self.swapped:
                self._schedule_waiting(out, budget, yielded)

    def room_for_one(self) -> int:
        """The blocks one sequence may hold with nothing else running (admission then keeps
        no watermark): those no pin holds."""
        return self.block_manager.num_blocks - self.block_manager.num_pinned_blocks

    def unfittable(self) -> list[Sequence]:
        """Queued sequences that cannot start even in a pool holding nothing else: the blocks
        their tokens need, less the pinned blocks they hit (waiting) or hold (swapped: those
        stay on the device, BlockManager.num_kept_on_swap), pass `room_for_one`. Only pins
        made after they arrived leave a sequence so (EngineCore refuses it otherwise)."""
        bm = self.block_manager
        room = self.room_for_one()
        stuck = []
        for seq in [*self.waiting, *self.swapped]:
            if bm.blocks_needed(seq.num_tokens) - self._num_pinned_held(seq) > room:
                stuck.append(seq)
        if not stuck and self._refused in self.waiting and not (self.running or self.swapped):
            # The pool held nothing but pins and free cached blocks, and still refused it: it
            # cannot start, whatever the count above says (a safety net: failing it alone
            # beats an empty step, which restarts the core and fails every request).
            stuck.append(self._refused)
        return stuck

    def _num_pinned_held(self, seq: Sequence) -> int:
        """Pinned blocks that queued `seq` holds (swapped) or will hit (waiting)."""
        bm = self.block_manager
        if seq.status is SequenceStatus.SWAPPED:
            return sum(1 for block_id in seq.block_table if bm.blocks[block_id].pins)
        return sum(1 for block in bm.find_cached_blocks(seq) if block.pins)

    def _num_new_tokens(self, seq: Sequence, num_computed: int, budget: int) -> int:
        """How many of `seq`'s tokens past `num_computed` to compute this step."""
        n = min(seq.num_tokens - num_computed, budget)
        if self.max_prefill_chunk is None:
            return n
        n = min(n, self._prefill_chunk(seq))
        if n > 1 and seq.tenant in self._prefill_slices:
            n = min(n, max(0, self._prefill_slices[seq.tenant]))
        return n

    def _prefill_chunk(self, seq: Sequence) -> int:
        """max_prefill_chunk; under "fair", the tenant's TENANT_PREFILL_CHUNKS chunks (or, in a
        full step, its slice) shared by its prompts in flight or waiting (`seq` among them),
        never less than one chunk each."""
        if self.policy != "fair":
            return self.max_prefill_chunk
        return self._tenant_chunk(seq.tenant, self._slice_sizes.get(seq.tenant, 0))

    def _tenant_chunk(self, tenant: str, slice_size: int = 0) -> int:
        chunk = self.max_prefill_chunk
        share = max(TENANT_PREFILL_CHUNKS * chunk, slice_size)
        return max(chunk, share // max(1, self._prefills.get(tenant, 0)))

    def _count_prefills(self) -> None:
        """"fair": each tenant's prompts still to prefill and the most prompt tokens each may
        compute this step: its weighted slice when the step's budget cannot hold every
        prompt's chunk, and its chunk share when other tenants are in the step."""
        self._prefills.clear()
        self._prefill_slices.clear()
        self._slice_sizes.clear()
        self._num_prefilling_tenants = 0
        if self.policy != "fair" or self.max_prefill_chunk is None:
            return
        left: dict[str, list[int]] = {}  # prompt tokens left of each tenant's running prompts
        waiting: list[tuple[str, int]] = []
        num_decodes = 0
        for seq in itertools.chain(self.running, self.waiting):
            n = seq.num_tokens - seq.num_computed_tokens
            if n > 1:
                self._prefills[seq.tenant] = self._prefills.get(seq.tenant, 0) + 1
                if seq.status is SequenceStatus.RUNNING:
                    left.setdefault(seq.tenant, []).append(n)
                else:
                    waiting.append((seq.tenant, n))
            elif seq.status is SequenceStatus.RUNNING:
                num_decodes += 1
        self._num_prefilling_tenants = len(left)
        if len(left) >= 2:
            self._split_full_step(left, waiting, num_decodes)
        if self._prefills:  # a decode-only step has nothing to cap (and no tenant set to build)
            present = {seq.tenant for seq in itertools.chain(self.running, self.waiting)}
            if len(present) >= 2:
                self._cap_tenant_prefills(present)

    def _split_full_step(self, left: dict[str, list[int]], waiting: list[tuple[str, int]], num_decodes: int) -> None:
        """When the chunks of the running prompts (`left`: tokens left of each, per tenant), the
        decodes and the waiting prompts the pool could start overflow the budget: each tenant
        prefilling gets its weighted slice of the step's prefill tokens."""
        # Waiting prompts count only as far as the free blocks could hold their chunks: when
        # the pool holds them back, the step is not full, and a slice would only slow a quiet
        # tenant's lone prompt for nothing.
        admissible = min(sum(min(n, self._tenant_chunk(t)) for t, n in waiting),
                         self.block_manager.num_free_blocks * self.block_manager.block_size)
        demand = num_decodes + admissible + sum(min(n, self._tenant_chunk(t)) for t, ns in left.items() for n in ns)
        if demand <= self.max_num_batched_tokens:
            return  # every chunk fits: the step stays as short as the chunks make it
        # The step is full whatever the split: split its prefill tokens by weight between the
        # tenants whose prompts run (a waiting one may not start this step; its slice would
        # go unused), each taking no more than its slice.
        running = {tenant: sum(ns) for tenant, ns in left.items()}
        weights = {tenant: self.share.tenants.get(tenant).weight for tenant in running}
        split = weighted_split(max(0, self.max_num_batched_tokens - num_decodes), running, weights)
        self._slice_sizes.update(split)
        self._prefill_slices.update(split)  # counts down as the step hands tokens out

    def _cap_tenant_prefills(self, present: set[str]) -> None:
        """With other tenants' sequences in the step, a tenant's prompts compute at most
        TENANT_PREFILL_CHUNKS chunks in all (times its weight over the least weight `present`),
        however many it has in flight; a full step's slice (_split_full_step) can only lower
        that. Without the cap each of a busy tenant's prompts took a chunk, so a burst of its
        queued turns admitted together made one long step, and every other tenant's stream and
        first token waited for it (docs/performance.md). A tenant alone keeps the whole
        budget."""
        weight = self.share.tenants.get
        least = min(weight(tenant).weight for tenant in present)
        for tenant in self._prefills:
            cap = round(TENANT_PREFILL_CHUNKS * self.max_prefill_chunk * weight(tenant).weight / least)
            self._prefill_slices[tenant] = min(self._prefill_slices.get(tenant, cap), cap)

    def _append(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        if n > 1 and seq.tenant in self._prefill_slices:
            self._prefill_slices[seq.tenant] -= n
        item = ScheduledSeq.of(seq, n)
        out.scheduled.append(item)
        self.share.charge(seq, seq.num_computed_tokens, n, item.samples)
        # Full blocks this step will compute become hits for requests admitted after it.
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + n)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Oldest first ("fcfs"). "fair": the tenants within their share of the pool first,
        then those over it, least served first in each: when prompts in flight exceed the
        budget, the tenants owed service get theirs computed, and when the pool runs out, the
        sequences still unscheduled, among whom the victims are taken, are those of the
        tenants holding the most memory. (By service alone, a quiet tenant's lone prompt,
        charged in full as it starts, came last and was preempted step after step for the
        growth of a busy tenant's many sequences.)"""
        admitted = {item.seq for item in out.scheduled}  # this step's, scheduled already
        if self.policy == "fair":
            self._free_for_next_tokens(out, admitted)
            # With one tenant running, its being over its share would move all or none: the
            # order is the service order, without scanning every block table each step.
            several = len({s.tenant for s in self.running}) > 1
            over = self._over_block_share() if several else set()
            self._split_pool(budget, admitted, over)
            order = self.share.service_order(self.running, over)
        else:
            order = list(self.running)
        for seq in order:
            if seq in admitted:
                continue
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for an earlier one this step ("fcfs": all after it are too)
            n = self._num_new_tokens(seq, seq.num_computed_tokens, budget)
            if n == 0:  # a beam waiting for its siblings' logits, or its tenant's slice is spent
                continue
            if n > 1:
                n = self._fit_chunk(seq, n)
            if self._make_room(seq, n, out):
                self._append(out, seq, n)
                budget -= n
        return budget

    def _split_pool(self, budget: int, admitted: set[Sequence], over_share: set[str]) -> None:
        """"fair": when the free blocks cannot hold the chunks of the prompts running (those
        not `admitted` this step), each tenant prefilling gets its weighted slice of the
        prompt tokens they can hold, as when the token budget runs out (_count_prefills);
        the tenants `over_share` of the pool split what the others leave, as they come last
        in the step's order (a busy tenant's many prompts must not halve a quiet tenant's
        lone one when the pool is short). Handed out in service order, the least-served
        tenant, however slightly, took every block for its chunks while its peers waited a
        step: a lurch that the counters undid in the steps after, and that a window of a few
        steps saw as unfair."""
        if self._num_prefilling_tenants < 2:
            return  # a decode-only step, or one tenant prefilling: nothing to split (no scan)
        bm = self.block_manager
        prompts: dict[str, list[int]] = {}  # tokens left of each tenant's running prompts
        chunks = decode_blocks = own_room = 0
        for seq in self.running:
            n = seq.num_tokens - seq.num_computed_tokens
            if seq in admitted or n < 1:
                continue
            if n == 1:
                decode_blocks += len(seq.block_table) < bm.blocks_needed(seq.num_tokens)
                continue
            prompts.setdefault(seq.tenant, []).append(n)
            chunks += min(n, self._prefill_chunk(seq), self._prefill_slices.get(seq.tenant, n))
            own_room += len(seq.block_table) * bm.block_size - seq.num_computed_tokens
        # The prompt tokens the pool holds: what is left in the prompts' own last blocks and
        # the free blocks that the decodes' next tokens do not take.
        room = own_room + max(0, bm.num_free_blocks - decode_blocks) * bm.block_size
        if len(prompts) < 2 or chunks <= room or room <= 0:
            return  # every chunk fits, or someone must yield first (_make_room picks whom)
        capacity = min(budget, room)
        # What each tenant's prompts could take this step, chunked as a slice of all of it
        # would make them: no slice larger, or the room it leaves would go unused.
        takes = {tenant: sum(min(n, self._tenant_chunk(tenant, capacity)) for n in ns)
                 for tenant, ns in prompts.items()}
        for last in (False, True):
            tier = {tenant: n for tenant, n in takes.items() if (tenant in over_share) == last}
            weights = {tenant: self.share.tenants.get(tenant).weight for tenant in tier}
            for tenant, size in weighted_split(capacity, tier, weights).items():
                self._slice_sizes[tenant] = max(self._slice_sizes.get(tenant, 0), size)
                self._prefill_slices[tenant] = min(self._prefill_slices.get(tenant, size), size)
                capacity -= size

    def _free_for_next_tokens(self, out: SchedulerOutput, admitted: set[Sequence]) -> None:
        """"fair": before any running sequence is scheduled, preempts until the pool holds
        the next token of every one (prompt chunks then shrink to what is left: _fit_chunk),
        the victims chosen among all of them by FairShare.pick_victim. Chosen while
        scheduling, a victim could only be one not scheduled yet: the last in service order,
        which is often a quiet tenant's lone prompt (charged in full as it started), preempted
        for the growth of a busy tenant's many sequences, its blocks then the first evicted."""
        bm = self.block_manager
        needs = {seq: bm.num_new_blocks(seq, 1) for seq in self.running
                 if seq not in admitted and seq.num_computed_tokens < seq.num_tokens}
        short = sum(needs.values()) - bm.num_free_blocks
        if short <= 0:
            return
        for victim, freed in self._yield_order(list(needs)):
            self.running.remove(victim)
            if self.preemption.should_swap(victim, bm):
                self._swap_out(victim, out)
            else:
                self._preempt(victim)
            out.preempted.append(victim)
            short -= freed + needs[victim]
            if short <= 0:
                return

    def _fit_chunk(self, seq: Sequence, n: int) -> int:
        """A running prompt's chunk of `n` tokens, shrunk to what its blocks and the free ones
        hold (at least one token). Chunked prefill can always go on with fewer tokens, so a
        full pool slows the prompt down instead of preempting a sequence for it, or the prompt
        itself, whose cached blocks, once freed, may be evicted before it resumes."""
        bm = self.block_manager
        room = len(seq.block_table) * bm.block_size - seq.num_computed_tokens + bm.num_free_blocks * bm.block_size
        return max(1, min(n, room))

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Allocates for `seq`, preempting until it fits; False if `seq` itself yielded.

        A tenant at its KV quota makes room among its own sequences ("fair")."""
        while True:
            over_quota = not self._may_grow(seq, n)
            if not over_quota and self.block_manager.allocate_slots(seq, n):
                return True
            victim = self._take_victim(out, seq.tenant if over_quota else None)
            if self.preemption.should_swap(victim, self.block_manager):
                self._swap_out(victim, out)
            else:
                self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False

    def _serve_underserved(self, out: SchedulerOutput) -> int:
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
        if self.policy != "fair" or not self.waiting or self.swapped or not self.running:
            return 0
        running = {s.tenant for s in self.running}
        queues = self._waiting_by_tenant()
        in_flight: set[bytes] | None = None  # hashed only when some tenant needs room
        yields_left, scheduled = MAX_YIELDS_PER_STEP, 0
        committed = self.share.committed(self.running)
        # No check for a free running slot here: _give_way makes one too (a tenant holding
        # every slot, with one wide request, gives way like one holding the pool).
        while queues and scheduled < self.max_num_batched_tokens:
            tenant = self.share.first_to_serve(queues, running, committed)
            queue, idle = queues.pop(tenant), tenant not in running
            if not self._owed_room_of(tenant, out.preempted):
                continue  # it yielded for an earlier one this step, or is served more than one that did
            if not idle and self._has_room(self._head_need(queue[0])):
                break  # the common case, decided before any hashing: ordinary admission serves it
            if in_flight is None:
                in_flight = self._blocks_in_flight()
            choice = self._pick_in_tenant(queue, in_flight)
            if choice is None or not self._may_admit(choice[0], choice[1]):
                continue  # it cannot start this step whatever the room
            seq, cached, ahead = choice
            need = self._blocks_to_start(seq, cached)
            yields_left -= self._give_way(tenant, need, yields_left, out)
            if not self._has_room(need):
                break  # the room that frees up next is this tenant's, not a later one's
            n = self._admit_from_waiting(out, seq, cached, self.max_num_batched_tokens - scheduled)
            if n == 0:
                break
            self.share.passed_over(ahead)
            self._commit(committed, seq)
            in_flight.update(self._pending_hashes(seq))
            running.add(tenant)
            scheduled += n
        return scheduled

    def _owed_room_of(self, tenant: str, yielded: list[Sequence]) -> bool:
        """Whether `tenant` may take room that the tenants of `yielded` gave this step: not
        if it is one of them, nor if it is served more than any of them. (Room a tenant gave
        for one owed more service went, in the same step, to a tenant served more than the
        one that gave it.)"""
        if any(victim.tenant == tenant for victim in yielded):
            return False
        vt = self.share.usage_of(tenant).virtual_time
        return all(vt <= self.share.usage_of(victim.tenant).virtual_time for victim in yielded)

    def _give_way(self, tenant: str, need: int, limit: int, out: SchedulerOutput) -> int:
        """Preempts up to `limit` running sequences that owe `tenant` room until `need` free
        blocks (and a running slot) are there; returns how many it preempted. Preempts none
        when those `limit` would not free enough: the room would not be made, and the
        victims, readmitted next step, would yield again the step after (a thrash that
        serves nobody)."""
        if self._has_room(need):
            return 0
        started = {item.seq for item in out.scheduled}  # admitted earlier this step: kept
        victims = self._victims(tenant, started, limit)
        if self.block_manager.num_free_blocks + self._blocks_freed_by(*victims) < need:
            return 0
        for count, victim in enumerate(victims):
            if self._has_room(need):
                return count
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
        return len(victims)

    def _victims(self, tenant: str, kept: set[Sequence], limit: int) -> list[Sequence]:
        """Up to `limit` running sequences owing `tenant` room (none of `kept`), in the order
        they would yield."""
        owing = [s for s in self._owing(tenant) if s not in kept]
        if not owing:  # the common case with every slot taken: no scan of the block tables
            return []
        return [victim for victim, _ in itertools.islice(self._yield_order(owing), limit)]

    def _yield_order(self, candidates: list[Sequence]) -> Iterator[tuple[Sequence, int]]:
        """`candidates` in the order they yield (FairShare.pick_victim), each with the blocks
        its preemption frees; each pick sees its tenant's holdings without those picked
        before it. Lazy: each pair is computed as it is taken, after the previous victim's
        preemption, if the caller preempts as it goes."""
        held = self._blocks_by_tenant()
        left = list(candidates)
        while left:
            victim = self.share.pick_victim(left, held, self.block_manager.enable_prefix_caching)
            left.remove(victim)
            freed = self._blocks_freed_by(victim)
            num_seqs, num_blocks = held[victim.tenant]
            held[victim.tenant] = (num_seqs - 1, num_blocks - freed)
            yield victim, freed

    def _blocks_freed_by(self, *seqs: Sequence) -> int:
        """Blocks that only `seqs` hold (no pin, no other sequence): what preempting them
        all frees."""
        blocks = self.block_manager.blocks
        entries = Counter(b for seq in seqs for b in seq.block_table)
        return sum(1 for b, n in entries.items() if blocks[b].ref_cnt == n)

    def _over_block_share(self) -> set[str]:
        bm = self.block_manager
        return self.share.over_block_share(self._blocks_by_tenant(), self.waiting, bm.num_blocks - bm.num_pinned_blocks)

    def _admit_from_waiting(self, out: SchedulerOutput, seq: Sequence, cached: list[KVBlock], budget: int) -> int:
        """Starts waiting `seq` on its cache hits, up to `budget` tokens; the tokens it
        scheduled, 0 if the pool cannot hold them (nothing changed then)."""
        bm = self.block_manager
        start = len(cached) * bm.block_size
        n = self._num_new_tokens(seq, start, budget)
        if not bm.allocate_slots(seq, n, cached, reserve=self.watermark_blocks if self.running else 0):
            self._refused = seq
            return 0
        self.waiting.remove(seq)
        self._admit(out, seq, n, start)
        return n

    def _owing(self, tenant: str) -> list[Sequence]:
        """The running sequences (samples and beams of a wide request too) that owe `tenant`
        room: of tenants more than FAIRNESS_SLACK ahead of it, and, when it runs nothing, of
        tenants over their share of the pool, or of the running slots while every slot is
        taken, that are served at least as much as it is (a tenant owed more service than the
        one arriving does not give way to it: with the slack there too, the least-served bot
        of a busy trace still yielded, mid-prompt, to quiet ones)."""
        served = self.share.usage_of(tenant).virtual_time
        over_share = set()
        if all(s.tenant != tenant for s in self.running):
            over_share = self._over_block_share()
            if len(self.running) >= self.max_num_seqs:
                over_share |= self.share.over_slot_share(self.running, self.waiting, self.max_num_seqs)

        def owes(other: str) -> bool:
            vt = self.share.usage_of(other).virtual_time
            return vt > served + FAIRNESS_SLACK or (other in over_share and vt >= served)

        return [s for s in self.running if owes(s.tenant)]

    def _head_need(self, seq: Sequence) -> int:
        return self._blocks_to_start(seq, self.block_manager.find_cached_blocks(seq))

    def _blocks_to_start(self, seq: Sequence, cached: list[KVBlock]) -> int:
        """Free blocks `seq` takes for its first step (with the watermark): new ones and its
        hits on free cached blocks. (Counting only the new ones, a tenant whose history sat
        free in the cache was never made room for: its own hits looked like room, admission
        then failed, and it waited for other tenants' requests to end while their growth
        evicted that history.)"""
        bm = self.block_manager
        start = len(cached) * bm.block_size
        n = self._num_new_tokens(seq, start, self.max_num_batched_tokens)
        return bm.num_new_blocks(seq, n, cached) + bm.num_free_hits(cached) + self.watermark_blocks

    def _has_room(self, need: int) -> bool:
        return self.block_manager.num_free_blocks >= need and len(self.running) < self.max_num_seqs

    def _take_victim(self, out: SchedulerOutput, tenant: str | None = None) -> Sequence:
        """Takes out of `running` the sequence to preempt: the newest ("fcfs"), or the newest of
        the tenant furthest over its share (of `tenant`, if given) among those this step has
        not scheduled yet ("fair")."""
        if self.policy == "fcfs":
            return self.running.pop()
        scheduled = {item.seq for item in out.scheduled}
        candidates = [s for s in self.running if s not in scheduled and tenant in (None, s.tenant)]
        victim = self.share.pick_victim(candidates, self._blocks_by_tenant(), self.block_manager.enable_prefix_caching)
        self.running.remove(victim)
        return victim

    def _blocks_by_tenant(self) -> dict[str, tuple[int, int]]:
        """Per tenant, its running sequences and the distinct unpinned blocks they hold: what
        its preemption could free (pinned blocks stay)."""
        held: dict[str, set[int]] = {}
        count: dict[str, int] = {}
        blocks = self.block_manager.blocks
        for seq in self.running:
            held.setdefault(seq.tenant, set()).update(b for b in seq.block_table if not blocks[b].pins)
            count[seq.tenant] = count.get(seq.tenant, 0) + 1
        return {tenant: (count[tenant], len(ids)) for tenant, ids in held.items()}

    def _may_grow(self, seq: Sequence, n: int) -> bool:
        if self.policy == "fcfs":
            return True
        bm = self.block_manager
        num_new = bm.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_table)
        return num_new <= 0 or self.share.within_quota(seq, self.running, (), num_new, bm.num_blocks)

    def _preempt(self, seq: Sequence, front: bool = True) -> None:
        """Recompute preemption: drop the blocks, keep the tokens, go back to the head of the
        line (ahead of everything that arrived later, so no request starves)."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        (self.waiting.appendleft if front else self.waiting.append)(seq)
        self._want(seq, first=front)  # its blocks, just freed, are what it resumes on

    def _swap_out(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap preemption: the blocks go to the host pool; the sequence keeps its computed
        tokens and resumes, ahead of every waiting request, once blocks free up."""
        out.blocks_to_swap_out.extend(self.block_manager.swap_out(seq))
        seq.status = SequenceStatus.SWAPPED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.num_swap_outs += 1
        bisect.insort(self.swapped, seq, key=_arrival)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            n = self._num_new_tokens(seq, seq.num_computed_tokens, budget)
            # Beside its host blocks: the blocks its known tokens grow into, and a copy of a
            # kept partial block that another holder shares (the first write copies it).
            grow = bm.blocks_needed(seq.num_tokens) - len(seq.block_table) - len(seq.cpu_block_table)
            need = max(0, grow) + bm.needs_copy_on_write(seq, n)
            reserve = need + (self.watermark_blocks if self.running else 0)
            if not bm.can_swap_in(seq, reserve=reserve):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(bm.swap_in(seq))
            if not bm.allocate_slots(seq, n):  # cannot fail: room was checked above
                raise RuntimeError("swap-in left no room for the next token")
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            if n:
                self._append(out, seq, n)
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, yielded: list[Sequence] | None = None) -> None:
        if self.policy == "fair":
            self._schedule_waiting_fair(out, budget, yielded or [])
        else:
            self._schedule_waiting_fcfs(out, budget)

    def _schedule_waiting_fcfs(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        in_flight = self._blocks_in_flight()
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            cached = bm.find_cached_blocks(seq)
            if self._waits_for_prefix(seq, len(cached), in_flight):
                i += 1  # it keeps its place; those behind it that share nothing may start
                continue
            n = self._num_new_tokens(seq, len(cached) * bm.block_size, budget)
            reserve = self.watermark_blocks if self.running else 0
            if not bm.allocate_slots(seq, n, cached, reserve=reserve):
                self._refused = seq
                break  # FCFS: nobody overtakes the head of the line for blocks
            del self.waiting[i]
            self._admit(out, seq, n, len(cached) * bm.block_size)
            in_flight.update(self._pending_hashes(seq))
            budget -= n

    def _schedule_waiting_fair(self, out: SchedulerOutput, budget: int, yielded: list[Sequence]) -> None:
        """Admits from the tenant owed the most service, among those that may take the room
        the `yielded` sequences gave this step (_owed_room_of). A tenant over
        its own quota is passed (its limit must not hold back the others); when the chosen
        sequence does not fit the pool, admission stops: the room that frees up goes to the
        tenant owed the most, as in FCFS it goes to the head of the line, so a large request
        cannot starve."""
        in_flight = self._blocks_in_flight()
        queues = self._waiting_by_tenant()
        for tenant in [t for t in queues if not self._owed_room_of(t, yielded)]:
            del queues[tenant]
        committed = self.share.committed(self.running) if queues else {}
        while queues and budget > 0 and len(self.running) < self.max_num_seqs:
            tenant = self.share.least_served(queues, committed)
            if self._prefill_slices.get(tenant, 1) <= 0:
                del queues[tenant]  # its slice of this full step is spent
                continue
            choice = self._pick_in_tenant(queues[tenant], in_flight)
            if choice is None or not self._may_admit(choice[0], choice[1]):
                del queues[tenant]  # all wait for a prefix in flight, or over its quota
                continue
            seq, cached, ahead = choice
            n = self._admit_from_waiting(out, seq, cached, budget)
            if n == 0:
                return
            self.share.passed_over(ahead)
            self._commit(committed, seq)
            queues[tenant].remove(seq)
            if not queues[tenant]:
                del queues[tenant]
            in_flight.update(self._pending_hashes(seq))
            budget -= n

    def _commit(self, committed: dict[str, float], seq: Sequence) -> None:
        """Adds `seq`'s prompt tokens still to charge (it was just admitted) to `committed`."""
        for tenant, cost in self.share.committed([seq]).items():
            committed[tenant] = committed.get(tenant, 0.0) + cost

    def _waiting_by_tenant(self) -> dict[str, list[Sequence]]:
        """Each tenant's waiting sequences in order; tenants in order of their first one."""
        queues: dict[str, list[Sequence]] = {}
        for seq in self.waiting:
            queues.setdefault(seq.tenant, []).append(seq)
        return queues

    def _pick_in_tenant(
        self, queue: list[Sequence], in_flight: set[bytes]
    ) -> tuple[Sequence, list[KVBlock], list[Sequence]] | None:
        """The tenant's next sequence with its cache hits and the eligible ones it passes over;
        those waiting for a prefix in flight keep their place and are not passed over."""
        candidates = []
        for seq in queue[:LOOKAHEAD]:
            cached = self.block_manager.find_cached_blocks(seq)
            if not self._waits_for_prefix(seq, len(cached), in_flight):
                candidates.append((seq, cached))
        if not candidates:
            return None
        i = self.share.pick([(seq, len(cached)) for seq, cached in candidates], len(queue))
        return candidates[i][0], candidates[i][1], [seq for seq, _ in candidates[:i]]

    def _may_admit(self, seq: Sequence, cached: list[KVBlock]) -> bool:
        """Within the tenant's quotas, counting the blocks its known tokens will hold."""
        bm = self.block_manager
        num_new = bm.blocks_needed(seq.num_tokens) - len(cached)
        return self.share.within_quota(seq, self.running, [b.block_id for b in cached], num_new, bm.num_blocks)

    def _admit(self, out: SchedulerOutput, seq: Sequence, n: int, num_hit_tokens: int) -> None:
        bm = self.block_manager
        if seq.num_preemptions == 0:
            bm.stats.queries += seq.num_tokens
            bm.stats.hits += num_hit_tokens
            self.share.count_admission(seq, num_hit_tokens)
            seq.num_cached_tokens = num_hit_tokens
        seq.status = SequenceStatus.RUNNING
        self.share.on_admit(seq)
        bm.unwant(seq)
        # Running stays in arrival order: preemption takes the newest (least work lost),
        # so a re-admitted old request is not the next victim again (no thrash).
        bisect.insort(self.running, seq, key=_arrival)
        self._append(out, seq, n)

    # -- prefixes still being computed ----------------------------------------------------
    # A prompt whose next block a running sequence is about to compute (the same tokens, salt
    # and prefix: a shared system prompt in a chunked prefill) waits for it instead of
    # computing it a second time beside it; it starts once those blocks are cache hits.

    def _blocks_in_flight(self) -> set[bytes]:
        if not self.block_manager.enable_prefix_caching or not self.waiting:
            return set()
        return {h for seq in self.running for h in self._pending_hashes(seq)}

    def _pending_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of `seq`'s full blocks that no step has scheduled yet."""
        if not self.block_manager.enable_prefix_caching:
            return []
        return self.block_manager.compute_block_hashes(seq)[seq.num_cached_blocks:]

    def _waits_for_prefix(self, seq: Sequence, num_hits: int, in_flight: set[bytes]) -> bool:
        if not seq.reads_prefix_cache:
            return False  # it would not take those blocks as hits anyway
        limit = (seq.num_tokens - 1) // self.block_manager.block_size  # hits stop there anyway
        return bool(in_flight) and num_hits < limit and seq.block_hashes[num_hits] in in_flight


def _arrival(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id
