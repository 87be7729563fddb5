"""Routing by cached blocks: a Ray Serve request router that sends each request where its
first token comes soonest, counting what each replica has cached of its prompt and the work
already queued there.

The hashes are the engine's own (`prompt_block_hashes` over the salt segments the ingress
computed with `Pins.segments`), so a tenant's request matches only blocks hashed with its
salt: the router can never send one tenant toward another's private blocks, because it
cannot compute their hashes either. Where replicas hold blocks comes from their KV events
(through the directory, mirrored in a BlockIndex), plus the router's own recent placements:
a burst of requests for a prefix nobody has cached yet follows the first one, whose
prefill the replica's engine then shares, instead of each replica computing it again.

A replica's cost for a request is the prompt tokens it would compute (those past its cached
chain), times `cache_weight`, plus the tokens it has still to compute for the requests it
holds: its last load report's `num_tokens_to_compute`, and what this router sent it since.
The cheapest wins (ties: the deeper chain, then a replica holding the request's LoRA adapter,
then fewer requests in flight). Queued work is measured in tokens because that is what a
step's time follows; a replica deep in a long prefill loses a short cached turn to an idle
one that must compute a few hundred tokens.
`cache_weight` above 1 charges a recomputation for more than the request's own wait: the
copy it makes takes pool space, and the replica computing it delays what comes after.

LoRA adapters come after cached blocks. A replica lacking the request's adapter loads it on
first use and keeps it (adapters.py), a one-time cost that is not worth queueing a request
behind work or a recomputation for, so holding it decides only between replicas that are
otherwise equal: idle replicas and a prompt nobody has cached, the usual case for an adapter's
first requests, which then gather where it is loaded. A replica with cached blocks of the
request already holds its adapter: blocks computed under an adapter are hashed with its
identity. Which replica holds which adapter (name and digest) comes from their reports, plus
the router's own placements of the last `affinity_ttl_s`, as for blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter, deque
from typing import Any

import ray
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from streamengine.kv.block_hash import prompt_block_hashes
from streamengine.kv.events import decode
from streamengine.ray.block_index import BlockIndex
from streamengine.ray.directory import DirectoryUpdate, get_or_create_directory
from streamengine.ray.request import ClusterAdapter, ReplicaRequest

log = logging.getLogger(__name__)

DEFAULT_CACHE_WEIGHT = 2.0
DEFAULT_AFFINITY_TTL_S = 10.0
# A placement this recent may not show in the replica's report yet (reports every 0.2 s, then
# a hop through the directory): its tokens are added to the reported ones.
DEFAULT_REPORT_LAG_S = 0.3
_POLL_TIMEOUT_S = 1.0
_RETRY_S = 0.5


class CachedBlockRouter(RequestRouter):
    """See the module docstring. Configured through `RequestRouterConfig(
    request_router_class=CachedBlockRouter, request_router_kwargs={"app_name": ...,
    "block_size": ...})`."""

    def initialize_state(
        self, app_name: str = "streamengine", block_size: int = 16,
        cache_weight: float = DEFAULT_CACHE_WEIGHT, affinity_ttl_s: float = DEFAULT_AFFINITY_TTL_S,
        report_lag_s: float = DEFAULT_REPORT_LAG_S, **_: Any,
    ) -> None:
        self._app_name, self._block_size = app_name, block_size
        self._cache_weight = cache_weight
        self._ttl, self._lag = affinity_ttl_s, report_lag_s
        self._index = BlockIndex()  # what the replicas' KV events say they hold
        self._recent = BlockIndex()  # where this router sent prefixes lately
        # (when, replica, hashes, adapter) of the placements of the last `affinity_ttl_s`
        self._placements: deque[tuple[float, str, list[bytes], ClusterAdapter | None]] = deque()
        self._loras: dict[str, dict[str, str]] = {}  # replica -> its adapters' name -> digest, as reported
        self._placed_loras: Counter[tuple[str, ClusterAdapter]] = Counter()  # (replica, adapter) placed lately
        self._work: dict[str, tuple[int, int]] = {}  # replica -> (tokens to compute, report number)
        # replica -> (when, prompt tokens it was expected to compute) of the placements its
        # last report may not show yet, oldest first
        self._unreported: dict[str, deque[tuple[float, int]]] = {}
        self._in_flight: Counter[str] = Counter()
        self._by_request: dict[str, str] = {}
        self._sync_task: asyncio.Task | None = None
        # Why a replica won: "cached" (the deepest chain), "balanced" (a shallower chain on a
        # less busy replica), "fresh" (nobody holds any of the prompt).
        self.decisions: Counter[str] = Counter()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        self._start_sync()
        if not candidate_replicas:
            return []
        request = _replica_request(pending_request)
        if request is None:  # a call that is not a generate: any replica will do
            return [self._two_choices(candidate_replicas)]
        hashes = self.request_hashes(request)
        ranked = self.rank(candidate_replicas, hashes, len(request.prompt_token_ids), request.lora)
        return [[ranked[0]], ranked[1:]] if len(ranked) > 1 else [ranked]

    def request_hashes(self, request: ReplicaRequest) -> list[bytes]:
        if request.block_hashes is None:
            ids = request.prompt_token_ids
            # Only the blocks a lookup could hit: the engine always computes the last prompt token.
            usable = ids[: (len(ids) - 1) // self._block_size * self._block_size]
            request.block_hashes = prompt_block_hashes(usable, self._block_size, request.salt_segments)
        return request.block_hashes

    def rank(
        self, candidates: list[RunningReplica], hashes: list[bytes], num_tokens: int | None = None,
        adapter: ClusterAdapter | None = None,
    ) -> list[RunningReplica]:
        """Candidates cheapest first (see the module docstring). `num_tokens` is the prompt's
        length (default: its full blocks, all a cache could hold); `adapter` its LoRA adapter."""
        self._expire(time.monotonic())
        by_id = {r.replica_id.unique_id: r for r in candidates}
        depth = self._depths(hashes, by_id)
        size = len(hashes) * self._block_size if num_tokens is None else num_tokens
        cost = {rid: self._cache_weight * (size - depth[rid] * self._block_size) + self.queued_tokens(rid)
                for rid in by_id}
        lacks = {rid: adapter is not None and not self.holds(rid, adapter) for rid in by_id}
        order = sorted(by_id, key=lambda rid: (cost[rid], -depth[rid], lacks[rid], self._in_flight[rid],
                                               random.random()))
        deepest = max(depth.values())
        self.decisions["fresh" if deepest == 0 else "cached" if depth[order[0]] == deepest else "balanced"] += 1
        return [by_id[rid] for rid in order]

    def queued_tokens(self, rid: str) -> int:
        """What `rid` has still to compute: its last report plus this router's placements
        that the report may not show yet (all of the last `affinity_ttl_s` when it has not
        reported)."""
        pending = self._unreported.get(rid)
        _drop_older(pending, time.monotonic() - self._ttl)
        return self._work.get(rid, (0, 0))[0] + sum(n for _, n in pending or ())

    def holds(self, rid: str, adapter: ClusterAdapter) -> bool:
        """Whether `rid` holds `adapter` (these files: a name re-added with others is another
        adapter), as it reported or as this router placed requests lately."""
        return self._loras.get(rid, {}).get(adapter.name) == adapter.digest or self._placed_loras[(rid, adapter)] > 0

    def _depths(self, hashes: list[bytes], replicas: dict[str, Any]) -> dict[str, int]:
        cached = self._index.depths(hashes, replicas)
        recent = self._recent.depths(hashes, replicas)
        return {rid: max(cached[rid], recent[rid]) for rid in replicas}

    def _two_choices(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        pair = random.sample(candidates, min(2, len(candidates)))
        return sorted(pair, key=lambda r: self._in_flight[r.replica_id.unique_id])

    # -- what Ray Serve tells the router ---------------------------------------------------

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
        self._in_flight[rid] += 1
        self._by_request[pending_request.metadata.internal_request_id] = rid
        request = _replica_request(pending_request)
        if request is not None:
            hashes = self.request_hashes(request)
            computed = len(request.prompt_token_ids) - self._depths(hashes, {rid: None})[rid] * self._block_size
            now = time.monotonic()
            self._recent.add(rid, hashes)
            self._placements.append((now, rid, hashes, request.lora))
            self._unreported.setdefault(rid, deque()).append((now, computed))
            if request.lora is not None:
                self._placed_loras[(rid, request.lora)] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._by_request.pop(internal_request_id, replica_id.unique_id)
        if self._in_flight[rid] > 0:
            self._in_flight[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for rid in (set(self._index.replicas()) | set(self._recent.replicas())) - live:
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        """Drops a replica that died or left, here and (sooner than its silence would) in the
        directory, whose loads the ingress reports."""
        self._index.forget(rid)
        self._recent.forget(rid)
        self._in_flight.pop(rid, None)
        self._work.pop(rid, None)
        self._unreported.pop(rid, None)
        self._loras.pop(rid, None)
        for key in [key for key in self._placed_loras if key[0] == rid]:
            del self._placed_loras[key]
        if ray.is_initialized():  # not in unit tests, which have no cluster
            with contextlib.suppress(Exception):
                get_or_create_directory(self._app_name).leave.remote(rid)

    def _expire(self, now: float) -> None:
        while self._placements and now - self._placements[0][0] > self._ttl:
            _, rid, hashes, adapter = self._placements.popleft()
            self._recent.remove(rid, hashes)
            if adapter is not None:  # -= drops counts that reach 0 (and one forgotten since)
                self._placed_loras -= Counter([(rid, adapter)])

    # -- the directory feed ----------------------------------------------------------------

    def _start_sync(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.get_running_loop().create_task(self._sync(), name="streamengine-router-sync")

    async def _sync(self) -> None:
        cursor = -1
        directory = None
        while True:
            try:
                directory = directory or get_or_create_directory(self._app_name)
                update: DirectoryUpdate = await directory.poll.remote(cursor, _POLL_TIMEOUT_S, with_loads=False)
                cursor = self.apply(update)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("reading the KV directory failed; retrying", exc_info=True)
                directory, cursor = None, -1
                await asyncio.sleep(_RETRY_S)

    def apply(self, update: DirectoryUpdate) -> int:
        """Mirrors one directory update; returns the cursor to poll from next."""
        if update.snapshot is not None:
            self._index = BlockIndex()
            for rid, hashes in update.snapshot.items():
                self._index.add(rid, hashes)
        for rid, data in update.batches:
            self._index.apply(rid, decode(data))
        self._loras = dict(update.loras)  # every live replica's, in each update
        now = time.monotonic()
        for rid, work in update.work.items():
            if self._work.get(rid, (0, 0))[1] != work[1]:  # a new report: it counts what came before
                _drop_older(self._unreported.get(rid), now - self._lag)
            self._work[rid] = work
        return update.cursor


def _replica_request(pending_request: PendingRequest | None) -> ReplicaRequest | None:
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, ReplicaRequest):
            return arg
    return None


def _drop_older(pending: deque[tuple[float, int]] | None, cutoff: float) -> None:
    """Drops the placements made at or before `cutoff` (the deque is oldest first)."""
    while pending and pending[0][0] <= cutoff:
        pending.popleft()
