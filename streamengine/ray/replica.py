"""The engine deployment: one AsyncEngine per Ray Serve replica.

A replica streams a request's outputs from its async-generator method `generate` (callers use
a DeploymentHandle with `stream=True`), pins the application's prefixes when it starts (so a
replica that replaces a dead one holds them too), and publishes its KV events and load to
the directory every `report_interval_s`; the directory answers with the cluster's run-time
LoRA changes. It loads a request's adapter on first use (adapters.py). Ray Serve drains a
replica before stopping it (its graceful shutdown waits for the requests in flight), then
`__del__` stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from streamengine.config import EngineConfig
from streamengine.kv.events import encode
from streamengine.ray.adapters import ReplicaLoRAs
from streamengine.ray.directory import get_or_create_directory
from streamengine.ray.request import ReplicaRequest
from streamengine.sample.outputs import RequestOutput

log = logging.getLogger(__name__)

DEFAULT_REPORT_INTERVAL_S = 0.2
KV_STATE_INTERVAL_S = 1.0
_EVENT_BUFFER = 4096  # batches a slow publisher may fall behind before the stream resyncs


@dataclass(frozen=True, slots=True)
class PinSpec:
    """A prefix every replica pins at start: a tenant's system prompt, or a shared preamble."""

    pin_id: str
    token_ids: tuple[int, ...]
    tenant: str | None
    shared: bool


class EngineReplica:
    """The deployment's class (app.py wraps it with `serve.deployment`)."""

    async def __init__(
        self, config: EngineConfig, app_name: str, pins: tuple[PinSpec, ...] = (),
        report_interval_s: float = DEFAULT_REPORT_INTERVAL_S,
    ) -> None:
        from streamengine.engine.async_engine import (
            AsyncEngine,  # the model loads here, in the replica
        )

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = AsyncEngine(config)
        await self.engine.start()
        for pin in pins:
            await self.engine.pin_prefix(list(pin.token_ids), tenant=pin.tenant, shared=pin.shared)
        self.loras = ReplicaLoRAs(self.engine, self.replica_id)
        self._app_name = app_name
        self._directory = get_or_create_directory(app_name)
        self._interval = report_interval_s
        self._pending: list[bytes] = []
        self._events = self.engine.kv_events(max_batches=_EVENT_BUFFER)
        self._tasks = [
            asyncio.create_task(self._collect(), name="streamengine-kv-events"),
            asyncio.create_task(self._report(), name="streamengine-report"),
        ]

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine yields them; cancelling the call aborts it.
        An adapter the replica lacks is loaded first."""
        if request.lora is not None:
            await self.loras.ensure(request.lora)
        async for output in self.engine.generate(
            request.prompt_token_ids, request.params, request_id=request.request_id,
            cache_salt=request.cache_salt, tenant=request.tenant,
            lora=request.lora.name if request.lora is not None else None,
        ):
            yield output

    async def check_health(self) -> None:
        """Ray Serve's health probe: a stopped engine makes the replica be replaced."""
        state = self.engine.health()["state"]
        if state == "stopped":
            raise RuntimeError(f"engine stopped: {self.engine.health()['reason']}")

    def load(self, with_kv_state: bool = True) -> dict[str, Any]:
        """What the directory shows routers and the ingress: stats, health, the adapters it
        holds (name -> digest) and (the chat page's KV map, one entry per block) the block states."""
        load = {"stats": self.engine.stats(), "health": self.engine.health(), "loras": self.loras.held()}
        if with_kv_state:
            load["kv_state"] = self.engine.kv_state()
        return load

    async def _collect(self) -> None:
        async for batch in self._events:
            self._pending.append(encode(batch))

    async def _report(self) -> None:
        last_map = -float("inf")
        while True:
            batches, self._pending = self._pending, []
            now = time.monotonic()
            with_map = now - last_map >= KV_STATE_INTERVAL_S  # the map is big: once a second
            try:
                changes = await self._directory.publish.remote(self.replica_id, batches, self.load(with_map))
                last_map = now if with_map else last_map
                self.loras.apply(changes)
            except Exception:  # the directory restarting: routing degrades to load only
                log.exception("publishing to the directory failed; finding it again")
                self._pending[:0] = batches  # sent again next time, so no event is lost
                self._directory = get_or_create_directory(self._app_name)
            await asyncio.sleep(self._interval)

    async def __del__(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._events.close()
        await self.loras.close()
        with contextlib.suppress(Exception):
            await self._directory.leave.remote(self.replica_id)
        await self.engine.stop()
