"""The "fcfs" policy: everyone in arrival order; the newest running sequence is preempted."""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamengine.sched.groups import cached_blocks
from streamengine.sched.policy import StepCaps

if TYPE_CHECKING:
    from streamengine.sched.plan import SchedulerOutput
    from streamengine.sched.scheduler import Scheduler
    from streamengine.sequence import Sequence


class FcfsPolicy:
    def begin_step(self, sched: Scheduler, caps: StepCaps) -> None:
        pass  # no per-tenant limits

    def serve_first(self, sched: Scheduler, out: SchedulerOutput) -> int:
        return 0

    def running_order(self, sched: Scheduler, out: SchedulerOutput, budget: int, admitted: set[Sequence]) -> list[Sequence]:
        return list(sched.running)

    def prefill_chunk(self, sched: Scheduler, seq: Sequence) -> int:
        return sched.max_prefill_chunk

    def take_victim(self, sched: Scheduler, out: SchedulerOutput, tenant: str | None) -> Sequence:
        return sched.running.pop()

    def may_grow(self, sched: Scheduler, seq: Sequence, n: int) -> bool:
        return True

    def schedule_waiting(self, sched: Scheduler, out: SchedulerOutput, budget: int, yielded: list[Sequence]) -> None:
        """The head of the line first; one waiting for a prefix in flight keeps its place
        while those behind it that share nothing start."""
        in_flight = sched._blocks_in_flight()
        i = 0
        while i < len(sched.waiting) and budget > 0 and len(sched.running) < sched.max_num_seqs:
            seq = sched.waiting[i]
            if not sched.lora_fits(seq):  # its adapter waits for a slot: others may start
                i += 1
                continue
            cached = cached_blocks(sched, seq)
            if sched._waits_for_prefix(seq, len(cached), in_flight):
                i += 1
                continue
            n = sched._admit_from_waiting(out, seq, cached, budget)
            if n == 0:
                break  # nobody overtakes the head of the line for blocks
            in_flight.update(sched._pending_hashes(seq))
            budget -= n
