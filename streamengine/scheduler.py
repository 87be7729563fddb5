"""Iteration-level continuous batching under a token budget, with preemption by recompute.

Each step the scheduler decides, for every sequence it runs, how many of its tokens to compute
(`num_new_tokens`). One rule covers every phase: `num_computed_tokens` catches up to
`num_tokens`. A fresh prompt computes up to the budget (chunked prefill), a decoding sequence
computes its one new token, a prefix-cache hit starts with `num_computed_tokens` > 0.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from streamengine.block_manager import BlockManager
from streamengine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # compute positions [num_computed_tokens, num_computed_tokens + this)
    samples: bool = False  # reaches the last known token, whose logits give the next one

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        return cls(seq, num_new_tokens, seq.num_computed_tokens + num_new_tokens == seq.num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    """A plain plan for one step: what to compute, which blocks to copy first."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Running sequences first (oldest first), then waiting ones in arrival order (FCFS)."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Admission keeps ~1% of the pool free so a new prompt does not force the very next
        # decode step to preempt (the same watermark vLLM uses).
        self.watermark_blocks = block_manager.num_blocks // 100

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that starts with computed blocks already (a fork of a running one)."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the queues and returns its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.blocks_to_copy = self.block_manager.take_pending_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, n, out):
                break  # seq itself was preempted, and everything after it before it
            out.scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n
            i += 1
        return budget

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Allocates for `seq`, preempting the newest running sequences until it fits."""
        while not self.block_manager.allocate_slots(seq, n):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the blocks, keep the tokens, go back to the head of the
        line (ahead of everything that arrived later, so no request starves)."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.find_cached_blocks(seq)
            num_computed = len(cached) * bm.block_size
            n = min(seq.num_tokens - num_computed, budget)
            reserve = self.watermark_blocks if self.running else 0
            if not bm.allocate_slots(seq, n, cached, reserve=reserve):
                break  # FCFS: nobody overtakes the head of the line
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                bm.stats.queries += seq.num_tokens
                bm.stats.hits += num_computed
                seq.num_cached_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            # Running stays in arrival order: preemption takes the newest (least work lost),
            # so a re-admitted old request is not the next victim again (no thrash).
            bisect.insort(self.running, seq, key=_arrival)
            out.scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n


def _arrival(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id
