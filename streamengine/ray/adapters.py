"""LoRA adapters on a cluster: added and removed at run time cluster-wide, loaded by each
replica on first use.

The cluster serves its deploy-time adapters (`EngineConfig.lora_modules`, which every replica
loads at start) changed by run-time adds and removals. The ingress (`ClusterLoRAs`, behind
ClusterEngine.add_lora / remove_lora) checks an adapter against the base model as the engine
would, so a bad one is refused at once with the engine's LoRAError, and records the change in
the directory (name -> adapter, or None once removed), which keeps it for an ingress that
restarts. A request carries its adapter's folder and digest (ReplicaRequest.lora), so a replica
that lacks it loads it then (`ReplicaLoRAs`), once however many requests wait for it; one that
cannot ends those requests with a RequestFailedError saying why, never a hang.

Lazily, as Ray Serve's model multiplexing loads a model: an adapter costs a replica a load and
host memory only where requests use it, and the router prefers replicas that hold it (after
cached blocks), so one adapter's requests gather where it is loaded. Every replica answers its
report with the changes (directory.publish) and drops what the cluster removed or replaced,
after the requests running on it, as AsyncEngine.remove_lora does; the ingress's removal
returns once every replica's reports show the adapter gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamengine.errors import RequestFailedError
from streamengine.lora.adapter import LoRAError, files_digest, load_adapter
from streamengine.lora.registry import check_new_name, not_loaded
from streamengine.ray.request import ClusterAdapter

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from streamengine.config import EngineConfig
    from streamengine.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

Changes = dict[str, ClusterAdapter | None]  # the directory's run-time adds (None: removals)


class ClusterLoRAs:
    """The adapters the cluster serves, as the ingress knows them; `directory` gives the
    application's directory actor."""

    def __init__(self, config: EngineConfig, directory: Callable[[], Any]) -> None:
        self._config = config
        self._directory = directory
        self._served = {name: ClusterAdapter(name, path, files_digest(path)) for name, path in config.lora_modules}
        self._model_config: PretrainedConfig | None = None  # read when an adapter is first added

    def apply(self, changes: Changes) -> None:
        """Takes in the run-time changes made before this ingress started."""
        for name, adapter in changes.items():
            if adapter is None:
                self._served.pop(name, None)
            else:
                self._served[name] = adapter

    def get(self, name: str) -> ClusterAdapter:
        """The adapter a new request names; the engine's LoRAError if the cluster has none so named."""
        if name not in self._served:
            raise not_loaded(name, self._served)
        return self._served[name]

    def listing(self) -> list[dict[str, Any]]:
        return [{"name": a.name, "path": a.path} for a in sorted(self._served.values(), key=lambda a: a.name)]

    async def add(self, name: str, path: str) -> None:
        """Checks the adapter in folder `path` against the base model (in a thread) and serves
        it as `name` on every replica, each loading it on its first request for it."""
        check_new_name(name, self._paths())
        loaded = await asyncio.to_thread(load_adapter, name, path, await self._base_config(),
                                         self._config.max_lora_rank)
        check_new_name(name, self._paths())  # another add of this name finished meanwhile
        adapter = ClusterAdapter(name, loaded.path, loaded.digest)
        await self._directory().set_adapter.remote(name, adapter)
        self._served[name] = adapter

    async def remove(self, name: str) -> None:
        """Refuses new requests for `name` at once; returns when no replica holds it any more
        (each drops it once the requests running on it end)."""
        adapter = self.get(name)
        del self._served[name]
        try:
            directory = self._directory()
            since = await directory.set_adapter.remote(name, None)
        except BaseException:
            self._served[name] = adapter  # the cluster never heard of the removal
            raise
        while await directory.lora_holders.remote(name, since):
            pass  # each call waits up to a second for the replicas' next reports

    def _paths(self) -> dict[str, str]:
        return {name: adapter.path for name, adapter in self._served.items()}

    async def _base_config(self) -> PretrainedConfig:
        if self._model_config is None:
            from streamengine.models.loader import load_model_config

            self._model_config = await asyncio.to_thread(load_model_config, self._config.model, self._config.cache_dir)
        return self._model_config


class ReplicaLoRAs:
    """One replica's adapters: loads those its requests name and it lacks, drops those the
    cluster removed or replaced. Owns its background removals (`close`)."""

    def __init__(self, engine: AsyncEngine, replica_id: str) -> None:
        self._engine = engine
        self._replica_id = replica_id
        self._loading: dict[str, tuple[ClusterAdapter, asyncio.Task]] = {}
        self._dropping: dict[str, asyncio.Task] = {}

    def held(self) -> dict[str, str]:
        """name -> digest of every adapter it holds or is loading: what its report lists, so
        that a removal on the cluster also waits for loads under way."""
        held = self._engine.lora_digests()
        held.update({name: adapter.digest for name, (adapter, _) in self._loading.items()})
        return held

    async def ensure(self, adapter: ClusterAdapter) -> None:
        """Returns once the engine serves `adapter`, loading it first if it lacks it;
        RequestFailedError (naming the replica and the cause) if it cannot."""
        if self._serves(adapter):
            return
        if adapter.name not in self._loading:
            task = asyncio.create_task(self._load(adapter), name=f"streamengine-lora-load-{adapter.name}")
            self._loading[adapter.name] = (adapter, task)
            task.add_done_callback(lambda _: self._loading.pop(adapter.name, None))
        try:
            await asyncio.shield(self._loading[adapter.name][1])  # a cancelled request leaves the load to the others
        except Exception as exc:
            raise self._failed(adapter, f"{type(exc).__name__}: {exc}") from None
        if not self._serves(adapter):  # the load was of another version of it, replaced meanwhile
            raise self._failed(adapter, "the cluster replaced it while this replica loaded it")

    def apply(self, changes: Changes) -> None:
        """Starts dropping every adapter it holds that the cluster removed, or replaced by
        other files since this replica loaded it."""
        for name, digest in self._engine.lora_digests().items():
            if name in changes and name not in self._dropping and (
                    changes[name] is None or changes[name].digest != digest):
                task = asyncio.create_task(self._drop(name, digest), name=f"streamengine-lora-drop-{name}")
                self._dropping[name] = task
                task.add_done_callback(lambda _, name=name: self._dropping.pop(name, None))

    async def close(self) -> None:
        tasks = [task for _, task in self._loading.values()] + list(self._dropping.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _serves(self, adapter: ClusterAdapter) -> bool:
        return any(a["name"] == adapter.name and a["digest"] == adapter.digest for a in self._engine.lora_adapters())

    async def _load(self, adapter: ClusterAdapter) -> None:
        if adapter.name in self._engine.lora_digests():  # another version, replaced on the cluster
            with contextlib.suppress(LoRAError):  # gone meanwhile
                await self._engine.remove_lora(adapter.name)
        await self._engine.add_lora(adapter.name, adapter.path)
        if self._engine.lora_digests()[adapter.name] != adapter.digest:
            await self._engine.remove_lora(adapter.name)
            raise LoRAError(f"its files in {adapter.path} changed since it was added to the cluster")

    async def _drop(self, name: str, digest: str) -> None:
        # Checked right before the call, with no await between: a newer version loaded since
        # the changes were read must stay.
        if self._engine.lora_digests().get(name) == digest:
            try:
                await self._engine.remove_lora(name)
            except LoRAError:  # gone meanwhile
                pass
            except Exception:
                log.exception("dropping LoRA adapter %r failed", name)

    def _failed(self, adapter: ClusterAdapter, why: str) -> RequestFailedError:
        return RequestFailedError(f"replica {self._replica_id} could not load LoRA adapter {adapter.name!r} "
                                  f"from {adapter.path}: {why}")
