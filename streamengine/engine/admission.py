"""Admission to the engine's waiting queue: `EngineConfig.max_waiting`, and each tenant's share of it."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from streamengine.errors import EngineOverloadedError
from streamengine.sequence import Sequence

OVERLOAD_RETRY_AFTER_S = 1.0


def check_queue_room(waiting: Collection[Sequence], limit: int, tenant: str) -> None:
    """Raises EngineOverloadedError when `limit` requests already wait, or `tenant` holds its share."""
    if len(waiting) >= limit:
        raise EngineOverloadedError(
            f"{len(waiting)} requests are already waiting (EngineConfig.max_waiting={limit}); "
            f"retry in {OVERLOAD_RETRY_AFTER_S:g} s",
            retry_after=OVERLOAD_RETRY_AFTER_S,
        )
    check_waiting_share(tenant, waiting, limit)


def check_waiting_share(tenant: str, waiting: Iterable[Sequence], limit: int) -> None:
    """A tenant holds at most max(1, limit // max(2, k)) waiting sequences, k the tenants with
    sequences waiting, itself included: alone it may fill half the queue, so another tenant
    always finds room; with more, each an equal share (one above it adds no more until
    the queue drains below it). Scans the queue, which `limit` bounds."""
    held, tenants = 0, {tenant}
    for seq in waiting:
        tenants.add(seq.tenant)
        held += seq.tenant == tenant
    share = max(1, limit // max(2, len(tenants)))
    if held >= share:
        raise EngineOverloadedError(
            f"tenant {tenant!r} already has {held} requests waiting, its share of the queue "
            f"(EngineConfig.max_waiting={limit} shared by {max(2, len(tenants))}); "
            f"retry in {OVERLOAD_RETRY_AFTER_S:g} s",
            retry_after=OVERLOAD_RETRY_AFTER_S,
        )
