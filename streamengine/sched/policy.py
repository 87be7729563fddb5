"""What differs between scheduling policies, and the per-step state a policy sets.

The Scheduler (scheduler.py) is the mechanism: queues, the token budget, block allocation,
preemption, the plan. A `SchedulingPolicy` answers its questions: who is served before the
running sequences grow, in what order the running ones are served, how large a prompt's chunk
is, who is preempted, whether a sequence may grow, and which waiting sequence starts next.
"fcfs" (fcfs.py) serves in arrival order; "fair" (fair.py) by tenant share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from streamengine.sched.plan import SchedulerOutput
    from streamengine.sched.scheduler import Scheduler
    from streamengine.sequence import Sequence


@dataclass(slots=True)
class StepCaps:
    """A policy's limits for one step, made fresh as the step begins."""

    # Each tenant's prompts in flight or waiting, which share its prefill chunks.
    prefills: dict[str, int] = field(default_factory=dict)
    # When the step or the pool is short: each tenant's weighted slice of the prompt tokens.
    slice_sizes: dict[str, int] = field(default_factory=dict)
    # The prompt tokens each capped tenant may still compute this step (counts down).
    prefill_slices: dict[str, int] = field(default_factory=dict)
    # Tenants with prompts running as the step began (fewer than two: no pool to split).
    num_prefilling_tenants: int = 0

    def cap(self, tenant: str, n: int) -> int:
        """`n` prompt tokens of `tenant`, cut to what is left of its slice."""
        if n > 1 and tenant in self.prefill_slices:
            return min(n, max(0, self.prefill_slices[tenant]))
        return n

    def spend(self, tenant: str, n: int) -> None:
        if n > 1 and tenant in self.prefill_slices:
            self.prefill_slices[tenant] -= n


class SchedulingPolicy(Protocol):
    """The Scheduler's questions; each gets the scheduler to read its queues and pool."""

    def begin_step(self, sched: Scheduler, caps: StepCaps) -> None:
        """Sets this step's limits in `caps` (already `sched.caps`, which policy code reads)."""
        ...

    def serve_first(self, sched: Scheduler, out: SchedulerOutput) -> int:
        """Admits whoever must start before the running sequences grow; the tokens scheduled."""
        ...

    def running_order(self, sched: Scheduler, out: SchedulerOutput, budget: int, admitted: set[Sequence]) -> list[Sequence]:
        """The running sequences in the order they are served (and kept) this step."""
        ...

    def prefill_chunk(self, sched: Scheduler, seq: Sequence) -> int:
        """The most prompt tokens `seq` computes this step (with max_prefill_chunk set)."""
        ...

    def take_victim(self, sched: Scheduler, out: SchedulerOutput, tenant: str | None) -> Sequence:
        """Removes from `sched.running` the sequence to preempt (one of `tenant`'s if given)."""
        ...

    def may_grow(self, sched: Scheduler, seq: Sequence, n: int) -> bool:
        """Whether `seq` may take the blocks `n` more tokens need (False: it is over a quota)."""
        ...

    def schedule_waiting(self, sched: Scheduler, out: SchedulerOutput, budget: int, yielded: list[Sequence]) -> None:
        """Admits waiting sequences within `budget`, none into room `yielded` gave to others."""
        ...
