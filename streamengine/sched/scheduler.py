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
(fair_share.py holds that policy, sched/fair.py its steps here; this module keeps the queues
and the blocks; sched/plan.py holds the plan a step returns, preemption.py how to preempt).
"""

from __future__ import annotations

import bisect
from collections import deque

from streamengine.config import SCHEDULING_POLICIES
from streamengine.kv.block_manager import BlockManager
from streamengine.kv.free_blocks import KVBlock
from streamengine.sched.fair import (
    blocks_by_tenant,
    count_prefills,
    free_for_next_tokens,
    over_block_share,
    schedule_waiting_fair,
    serve_underserved,
    split_pool,
    tenant_chunk,
)
from streamengine.sched.groups import cached_blocks, waits_for_sibling
from streamengine.sched.plan import ScheduledSeq, SchedulerOutput
from streamengine.sched.preemption import PreemptionPolicy
from streamengine.sequence import Sequence, SequenceStatus
from streamengine.tenancy.fair_share import FairShare
from streamengine.tenancy.tenants import Tenants


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
        # step has no pool to split between them (split_pool skips its scan).
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
        count_prefills(self)
        budget = self.max_num_batched_tokens - serve_underserved(self, out)
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
        return tenant_chunk(self, seq.tenant, self._slice_sizes.get(seq.tenant, 0))

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
            free_for_next_tokens(self, out, admitted)
            # With one tenant running, its being over its share would move all or none: the
            # order is the service order, without scanning every block table each step.
            several = len({s.tenant for s in self.running}) > 1
            over = over_block_share(self) if several else set()
            split_pool(self, budget, admitted, over)
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

    def _over_block_share(self) -> set[str]:
        return over_block_share(self)

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
        victim = self.share.pick_victim(candidates, blocks_by_tenant(self), self.block_manager.enable_prefix_caching)
        self.running.remove(victim)
        return victim

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
            schedule_waiting_fair(self, out, budget, yielded or [])
        else:
            self._schedule_waiting_fcfs(out, budget)

    def _schedule_waiting_fcfs(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        in_flight = self._blocks_in_flight()
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            cached = cached_blocks(self, seq)
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
        if waits_for_sibling(self, seq):
            return True
        limit = (seq.num_tokens - 1) // self.block_manager.block_size  # hits stop there anyway
        return bool(in_flight) and num_hits < limit and seq.block_hashes[num_hits] in in_flight


def _arrival(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id
