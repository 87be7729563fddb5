"""The grammar compile queue: specs wait per tenant, and the compile threads take them round
robin across tenants, so one tenant's flood of slow specs delays that tenant alone.

The pick: among tenants with a spec waiting, the one with the fewest compiles running, and among
those the one served longest ago; first in, first out within a tenant. So a tenant that holds a
compile thread leaves the next free one to any other tenant that waits, and a tenant that sends
one spec now and then is next as soon as a thread frees, however long another's queue is.

Bounds: `max_per_tenant` waiting per tenant and `max_total` in all. The queue only says which one
a new spec would pass (`full`); its owner turns that into the client's overload error.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class TenantQueues(Generic[T]):
    """Items waiting per tenant, taken round robin. Not thread-safe: its owner locks."""

    __slots__ = ("max_per_tenant", "max_total", "_queues", "_turns", "_running", "_total", "_clock")

    def __init__(self, max_per_tenant: int, max_total: int) -> None:
        self.max_per_tenant = max_per_tenant
        self.max_total = max_total
        self._queues: dict[str, deque[T]] = {}  # tenants with items waiting or running
        # When each was last served, (1, tick); one not served yet (0, tick of its arrival):
        # the lowest goes first among tenants running as many items.
        self._turns: dict[str, tuple[int, int]] = {}
        self._running: Counter[str] = Counter()
        self._total = 0  # items waiting, all tenants
        self._clock = itertools.count()

    def __len__(self) -> int:
        return self._total

    def waiting(self, tenant: str) -> int:
        queue = self._queues.get(tenant)
        return len(queue) if queue is not None else 0

    def running(self, tenant: str) -> int:
        return self._running[tenant]

    def full(self, tenant: str) -> str | None:
        """Which bound one more item of `tenant` would pass ("per_tenant", "total"), or None."""
        if self.waiting(tenant) >= self.max_per_tenant:
            return "per_tenant"
        if self._total >= self.max_total:
            return "total"
        return None

    def put(self, tenant: str, item: T) -> None:
        """Queues `item` last among `tenant`'s; a tenant new to the queue goes before every
        tenant already served, after those that came before it. The caller checked `full`."""
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
            self._turns[tenant] = (0, next(self._clock))
        queue.append(item)
        self._total += 1

    def take(self) -> tuple[str, T] | None:
        """The next item to run and its tenant, now counted as running; None when none waits."""
        tenant = min((t for t, q in self._queues.items() if q), key=self._turn, default=None)
        if tenant is None:
            return None
        item = self._queues[tenant].popleft()
        self._turns[tenant] = (1, next(self._clock))
        self._running[tenant] += 1
        self._total -= 1
        return tenant, item

    def finished(self, tenant: str) -> None:
        """An item `take` gave out has finished running."""
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]
        self._forget_if_idle(tenant)

    def remove(self, tenant: str, item: T) -> bool:
        """Drops a waiting item (no one waits for it any more); False if it is not waiting."""
        queue = self._queues.get(tenant)
        if queue is None:
            return False
        try:
            queue.remove(item)
        except ValueError:
            return False
        self._total -= 1
        self._forget_if_idle(tenant)
        return True

    def clear(self) -> list[T]:
        """Every waiting item, removed (those running stay counted until they finish)."""
        items = [item for queue in self._queues.values() for item in queue]
        for tenant in list(self._queues):
            self._queues[tenant].clear()
            self._forget_if_idle(tenant)
        self._total = 0
        return items

    def _turn(self, tenant: str) -> tuple[int, tuple[int, int]]:
        return self._running[tenant], self._turns[tenant]

    def _forget_if_idle(self, tenant: str) -> None:
        """A tenant with nothing waiting or running leaves the rotation (the queue keeps no
        record of every tenant it ever served)."""
        queue = self._queues.get(tenant)
        if queue is not None and not queue and not self._running[tenant]:
            del self._queues[tenant], self._turns[tenant]
            self._running.pop(tenant, None)
