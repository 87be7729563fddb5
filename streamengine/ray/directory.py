"""The directory: where replicas publish their KV events and load, and routers read them.

One small Ray actor per application (named, so replicas, routers and the ingress find it
without being wired together). It keeps a bounded log of encoded event batches with sequence
numbers, and its own block index so a router that starts late, or falls behind the log, gets
a snapshot instead of the events it missed. Routers long-poll it (`poll`); every call is
cheap and nothing is shipped twice except on a resync. A replica that stops reporting is
forgotten after `stale_after_s`: its blocks go from the index, and routers are told.

It also keeps the cluster's run-time LoRA changes (streamengine.ray.adapters): the answer to a
replica's report, and what an ingress that restarts starts from.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from streamengine.kv.events import AllBlocksCleared, EventBatch, decode, encode
from streamengine.ray.block_index import BlockIndex
from streamengine.ray.request import ClusterAdapter

DIRECTORY_NAMESPACE = "streamengine"


def directory_name(app_name: str) -> str:
    return f"streamengine-directory-{app_name}"


@dataclass(slots=True)
class DirectoryUpdate:
    """What a router gets from one poll: the batches after its cursor, or a whole snapshot."""

    cursor: int
    batches: list[tuple[str, bytes]] = field(default_factory=list)
    snapshot: dict[str, list[bytes]] | None = None  # replica -> every hash it holds
    loads: dict[str, dict[str, Any]] = field(default_factory=dict)  # replica -> its last report
    # replica -> (tokens it has still to compute, how many reports it has made): the part of
    # the load a router weighs, small enough to send on every poll.
    work: dict[str, tuple[int, int]] = field(default_factory=dict)
    loras: dict[str, dict[str, str]] = field(default_factory=dict)  # replica -> its adapters' name -> digest


class ReplicaDirectory:
    """The actor's class (see `get_or_create_directory`)."""

    def __init__(
        self, max_log: int = 4096, stale_after_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock  # when replicas were last heard from
        self._log: deque[tuple[int, str, bytes]] = deque(maxlen=max_log)
        self._next = 0
        self._index = BlockIndex()
        self._loads: dict[str, dict[str, Any]] = {}
        self._work: dict[str, tuple[int, int]] = {}
        self._seen: dict[str, float] = {}
        self._loras: dict[str, dict[str, str]] = {}  # replica -> the adapters it holds or loads
        # The cluster's LoRA adapters added (or, None, removed) at run time, by name.
        self._adapters: dict[str, ClusterAdapter | None] = {}
        self._stale_after_s = stale_after_s
        self._changed = asyncio.Event()

    async def publish(
        self, replica: str, batches: list[bytes], load: dict[str, Any],
    ) -> dict[str, ClusterAdapter | None]:
        """A replica's event batches since its last call, and its current load report;
        answers the cluster's run-time LoRA changes, which the replica applies."""
        now = self._clock()
        self._seen[replica] = now
        if "kv_state" not in load and "kv_state" in self._loads.get(replica, {}):
            load = {**load, "kv_state": self._loads[replica]["kv_state"]}  # sent less often
        self._loads[replica] = load
        reports = self._work.get(replica, (0, 0))[1] + 1
        self._work[replica] = (int(load.get("stats", {}).get("num_tokens_to_compute", 0)), reports)
        self._loras[replica] = dict(load.get("loras", {}))
        for data in batches:
            self._index.apply(replica, decode(data))
            self._append(replica, data)
        self._drop_stale(now)
        self._changed.set()
        return dict(self._adapters)

    async def leave(self, replica: str) -> None:
        """A replica shutting down: its blocks are gone."""
        self._forget(replica)
        self._changed.set()

    async def poll(self, cursor: int, timeout_s: float = 1.0, with_loads: bool = True) -> DirectoryUpdate:
        """Everything after `cursor` (-1: a snapshot), waiting up to `timeout_s` for news;
        the load reports too unless `with_loads` is False (the router reads only blocks)."""
        if cursor >= self._next - 1:  # seen everything: wait for the next publish
            await self._next_change(timeout_s)
        self._drop_stale(self._clock())
        loads = dict(self._loads) if with_loads else {}
        work, loras = dict(self._work), dict(self._loras)
        first = self._log[0][0] if self._log else self._next
        if cursor < 0 or cursor < first - 1:
            snapshot = {r: self._index.hashes(r) for r in self._index.replicas()}
            return DirectoryUpdate(self._next - 1, snapshot=snapshot, loads=loads, work=work, loras=loras)
        batches = [(replica, data) for seq, replica, data in self._log if seq > cursor]
        return DirectoryUpdate(self._next - 1, batches=batches, loads=loads, work=work, loras=loras)

    async def loads(self) -> dict[str, dict[str, Any]]:
        self._drop_stale(self._clock())
        return dict(self._loads)

    # -- the cluster's LoRA adapters ----------------------------------------------------

    async def adapters(self) -> dict[str, ClusterAdapter | None]:
        return dict(self._adapters)

    async def set_adapter(self, name: str, adapter: ClusterAdapter | None) -> dict[str, int]:
        """Records that the cluster added `adapter` as `name` (None: removed it). Returns how
        many reports each replica has made so far: `lora_holders`' `since`."""
        self._adapters[name] = adapter
        return {replica: reports for replica, (_, reports) in self._work.items()}

    async def lora_holders(self, name: str, since: dict[str, int], timeout_s: float = 1.0) -> list[str]:
        """The replicas that may still hold adapter `name`, removed when their report counts
        were `since`: those whose last report lists it, and those that have not reported twice
        since (the first report may have been made before the replica read the removal).
        While there are any, waits up to `timeout_s` for a report first."""
        if self._holders(name, since):
            await self._next_change(timeout_s)
            self._drop_stale(self._clock())
        return self._holders(name, since)

    async def _next_change(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for the next publish or report."""
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            pass

    def _holders(self, name: str, since: dict[str, int]) -> list[str]:
        return [replica for replica, held in self._loras.items()
                if name in held or self._work[replica][1] < since.get(replica, -2) + 2]

    def _append(self, replica: str, data: bytes) -> None:
        self._log.append((self._next, replica, data))
        self._next += 1

    def _forget(self, replica: str) -> None:
        self._seen.pop(replica, None)
        self._loads.pop(replica, None)
        self._work.pop(replica, None)
        self._loras.pop(replica, None)
        self._index.forget(replica)
        self._append(replica, encode(EventBatch(ts=time.time(), events=[AllBlocksCleared()])))

    def _drop_stale(self, now: float) -> None:
        for replica, seen in list(self._seen.items()):
            if now - seen > self._stale_after_s:
                self._forget(replica)


def get_or_create_directory(app_name: str) -> ray.actor.ActorHandle:
    """The application's directory actor, created by whoever asks first. Detached, so it
    outlives the process that created it; `app.py` kills it when the application goes."""
    actor = ray.remote(num_cpus=0)(ReplicaDirectory)
    return actor.options(
        name=directory_name(app_name), namespace=DIRECTORY_NAMESPACE, lifetime="detached",
        get_if_exists=True,
    ).remote()
