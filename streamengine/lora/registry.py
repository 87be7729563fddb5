"""The engine's LoRA adapters by name: loaded and checked once, counted while requests use
them, and dropped when removed and no request uses them any more."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

from streamengine.lora.adapter import LoRAAdapter, LoRAError, load_adapter


class LoRARegistry:
    def __init__(self, model_config, max_rank: int) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        self.users: Counter[str] = Counter()  # requests in flight per adapter name
        # Removed, waiting for their last request: each event is set when its adapter goes, so
        # whoever removes it can wait for that instead of polling.
        self.removing: dict[str, asyncio.Event] = {}

    def add(self, name: str, path: str | Path) -> LoRAAdapter:
        """Loads the adapter in folder `path` under `name`; LoRAError names what is wrong."""
        self.check_name(name)
        return self.register(load_adapter(name, path, self.model_config, self.max_rank))

    def check_name(self, name: str) -> None:
        check_new_name(name, {n: a.path for n, a in self.adapters.items()})

    def register(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Adds an adapter loaded elsewhere (a thread: AsyncEngine.add_lora)."""
        self.check_name(adapter.name)
        self.adapters[adapter.name] = adapter
        return adapter

    def get(self, name: str) -> LoRAAdapter:
        """The adapter a new request names; LoRAError if none is loaded under `name`."""
        adapter = self.adapters.get(name)
        if adapter is None or name in self.removing:
            raise not_loaded(name, self.names())
        return adapter

    def acquire(self, adapter: LoRAAdapter) -> None:
        """Counts a request on `adapter` until `release`."""
        self.users[adapter.name] += 1

    def release(self, adapter: LoRAAdapter) -> None:
        self.users[adapter.name] -= 1
        if self.users[adapter.name] <= 0:
            del self.users[adapter.name]
            if adapter.name in self.removing:
                self._drop(adapter.name)

    def remove(self, name: str) -> bool:
        """Refuses new requests for `name`; True once it is gone (now, if none uses it), False
        while requests still run on it (it goes with the last of them)."""
        if name not in self.adapters:
            raise not_loaded(name, self.adapters)
        if not self.users[name]:
            self._drop(name)
            return True
        self.removing.setdefault(name, asyncio.Event())
        return False

    def is_loaded(self, name: str) -> bool:
        return name in self.adapters and name not in self.removing

    def names(self) -> list[str]:
        return sorted(n for n in self.adapters if n not in self.removing)

    async def wait_dropped(self, name: str) -> None:
        """Returns once `name`, removed while requests ran on it, is gone (at once if it is)."""
        gone = self.removing.get(name)
        if gone is not None:
            await gone.wait()

    def _drop(self, name: str) -> None:
        self.adapters.pop(name, None)
        gone = self.removing.pop(name, None)
        if gone is not None:
            gone.set()


def check_new_name(name: str, paths: Mapping[str, str]) -> None:
    """LoRAError unless `name` can name a new adapter beside `paths` (name -> folder): the
    engine's check, and a cluster's (streamengine.ray.adapters)."""
    if not name or not isinstance(name, str):
        raise LoRAError(f"a LoRA adapter needs a name, got {name!r}")
    if name in paths:
        raise LoRAError(f"a LoRA adapter named {name!r} is already loaded (from {paths[name]})")


def not_loaded(name: str, loaded: Iterable[str]) -> LoRAError:
    return LoRAError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(loaded)})")
