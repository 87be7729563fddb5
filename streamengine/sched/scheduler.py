"""Iteration-level continuous batching under a token budget, with preemption by swap or
recompute.

Each step the scheduler decides, for every sequence it runs, how many of its tokens to compute
(`num_new_tokens`). One rule covers every phase: `num_computed_tokens` catches up to
`num_tokens`. A fresh prompt computes up to the budget (chunked prefill), a decoding sequence
computes its one new token, a prefix-cache hit starts with `num_computed_tokens` > 0.
`max_prefill_chunk` caps the tokens one sequence computes per step, so a long prompt takes
several steps and the decode streams batched with it keep getting a token every step.

This module is the mechanism (queues, budget, blocks, preemption); what differs between
policies is asked of a SchedulingPolicy (policy.py): "fcfs" (fcfs.py) admits in arrival order
across everyone; "fair" (fair.py, with tenancy/fair_share.py's accounting) admits from the
tenant owed the most service, within its quotas. plan.py holds the plan a step returns,
preemption.py how to preempt, groups.py what a request's samples and beams share and how
they wait for each other.
"""

from __future__ import annotations

import bisect
from collections import deque

from streamengine.config import SCHEDULING_POLICIES
from streamengine.kv.block_manager import BlockManager
from streamengine.kv.free_blocks import KVBlock
from streamengine.sched.fair import FairPolicy
from streamengine.sched.fcfs import FcfsPolicy
from streamengine.sched.groups import make_way_for_siblings, waits_for_sibling
from streamengine.sched.plan import ScheduledSeq, SchedulerOutput
from streamengine.sched.policy import SchedulingPolicy, StepCaps
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
        max_loras: int = 4,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.policy: SchedulingPolicy = FairPolicy() if policy == "fair" else FcfsPolicy()
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
        self.max_loras = max_loras  # LoRA adapters among the running sequences, at most
        self.caps = StepCaps()  # the policy's limits for the step being scheduled
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
            self.block_manager.retention.want(seq, first)

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
        self.block_manager.retention.unwant(seq)
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
        self.caps = StepCaps()
        self.policy.begin_step(self, self.caps)
        budget = self.max_num_batched_tokens - self.policy.serve_first(self, out)
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
        if not out.scheduled and self.running:
            make_way_for_siblings(self, out, yielded)
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
        return self.block_manager.num_blocks - self.block_manager.retention.num_pinned_blocks

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
            return sum(1 for block_id in seq.block_table if bm.pool.blocks[block_id].pins)
        return sum(1 for block in bm.find_cached_blocks(seq) if block.pins)

    def _num_new_tokens(self, seq: Sequence, num_computed: int, budget: int) -> int:
        """How many of `seq`'s tokens past `num_computed` to compute this step."""
        n = min(seq.num_tokens - num_computed, budget)
        if self.max_prefill_chunk is None:
            return n
        return self.caps.cap(seq.tenant, min(n, self.policy.prefill_chunk(self, seq)))

    def _append(self, out: SchedulerOutput, seq: Sequence, n: int, num_spec: int = 0) -> None:
        """Schedules `n` of `seq`'s tokens, then `num_spec` proposed ones (slots allocated)."""
        self.caps.spend(seq.tenant, n)
        item = ScheduledSeq.of(seq, n, num_spec)
        out.scheduled.append(item)
        self.share.charge(seq, seq.num_computed_tokens, n, item.samples)  # accepted proposals: charge_accepted
        # Full blocks this step will compute become hits for requests admitted after it (not
        # those holding proposed tokens: those may be rejected).
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + n)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """The running sequences in the policy's order, each growing by its next tokens,
        preempting (the policy's victims) when the pool runs out."""
        admitted = {item.seq for item in out.scheduled}  # this step's, scheduled already
        for seq in self.policy.running_order(self, out, budget, admitted):
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
                num_spec = self._fit_proposals(seq, n, budget - n)
                self._append(out, seq, n, num_spec)
                budget -= n + num_spec
        return budget

    def _fit_proposals(self, seq: Sequence, n: int, budget: int) -> int:
        """How many of `seq`'s proposed tokens (speculative decoding) to verify with its next
        `n`, slots allocated: those the budget and the free blocks beyond the watermark hold.
        Proposals never preempt anyone: they only use room nobody else asked for."""
        if not seq.spec_token_ids or seq.num_computed_tokens + n != seq.num_tokens:
            return 0
        bm = self.block_manager
        free_slots = (len(seq.block_table) + bm.num_free_blocks - self.watermark_blocks) * bm.block_size
        k = max(0, min(len(seq.spec_token_ids), budget, free_slots - seq.num_tokens))
        if k and not bm.allocate_slots(seq, n + k):  # cannot fail: the slots were counted
            raise RuntimeError("no room for proposed tokens that were counted free")
        return k

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
            over_quota = not self.policy.may_grow(self, seq, n)
            if not over_quota and self.block_manager.allocate_slots(seq, n):
                return True
            victim = self.policy.take_victim(self, out, seq.tenant if over_quota else None)
            if self.preemption.should_swap(victim, self.block_manager):
                self._swap_out(victim, out)
            else:
                self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False

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

    def lora_fits(self, seq: Sequence) -> bool:
        """Whether `seq` may start beside the running sequences: its LoRA adapter (if any) is
        one of theirs, or fewer than `max_loras` adapters run (each needs a slot in the
        forward's stacks, models/lora.py). A sequence that must wait lets others start."""
        if seq.lora is None:
            return True
        running = {s.lora.identity for s in self.running if s.lora is not None}
        return seq.lora.identity in running or len(running) < self.max_loras

    def _has_room(self, need: int) -> bool:
        return self.block_manager.num_free_blocks >= need and len(self.running) < self.max_num_seqs

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
            if not self.lora_fits(seq):
                break
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
        self.policy.schedule_waiting(self, out, budget, yielded or [])

    def _admit(self, out: SchedulerOutput, seq: Sequence, n: int, num_hit_tokens: int) -> None:
        bm = self.block_manager
        if seq.num_preemptions == 0:
            bm.stats.queries += seq.num_tokens
            bm.stats.hits += num_hit_tokens
            self.share.count_admission(seq, num_hit_tokens)
            seq.num_cached_tokens = num_hit_tokens
        seq.status = SequenceStatus.RUNNING
        self.share.on_admit(seq)
        bm.retention.unwant(seq)
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
