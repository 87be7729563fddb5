"""LoRAAdmin: the AsyncEngine's LoRA adapters at run time, a mixin of AsyncEngine.

Adding reads and checks the adapter's files in a thread, so the event loop keeps serving;
removing refuses new requests at once and waits for those running on the adapter (an event the
registry sets when the last of them releases it). The mixin uses the engine's `core`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from streamengine.lora.adapter import load_adapter


class LoRAAdmin:
    """LoRA adapters of an AsyncEngine (see the module docstring)."""

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapters: name, folder, rank, the projections they adapt, the digest of
        their files (what their blocks are hashed with)."""
        return [{"name": a.name, "path": a.path, "rank": a.rank, "target_modules": sorted(a.target_modules),
                 "digest": a.digest}
                for a in (self.core.loras.adapters[n] for n in self.core.loras.names())]

    def lora_digests(self) -> dict[str, str]:
        """Every adapter the engine holds, name -> the digest of its files, those removed but
        still running requests included (a cluster's removal waits for them too)."""
        return {name: adapter.digest for name, adapter in self.core.loras.adapters.items()}

    async def add_lora(self, name: str, path: str) -> None:
        """Loads the PEFT LoRA adapter in folder `path` as `name` (read in a thread: the loop
        keeps serving); LoRAError (a ValueError) says what is wrong with it."""
        self.core.loras.check_name(name)
        adapter = await asyncio.to_thread(load_adapter, name, path, self.core.loras.model_config,
                                          self.core.loras.max_rank)
        self.core.loras.register(adapter)

    async def remove_lora(self, name: str) -> None:
        """Refuses new requests for `name` at once and returns when the requests running on
        it have ended and it is gone. LoRAError if none is loaded under `name`."""
        if not self.core.remove_lora(name):
            # Its last request's release drops it (core._release); so does stop(), which
            # aborts every request.
            await self.core.loras.wait_dropped(name)
