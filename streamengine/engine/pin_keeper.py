"""PinKeeper: the AsyncEngine's tenants and pinned prefixes, a mixin of AsyncEngine.

A prefix is pinned by running it through the engine as a one-token request that pins its
prompt's blocks as it ends; after a core restart the pins the old bookkeeping held are
computed again in the background (`_repin`), under their old ids. The mixin uses the
engine's `config`, `core`, `_submit`, `_abort` and `_streams`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from streamengine.errors import LimitExceededError, RequestFailedError
from streamengine.sample.sampling_params import SamplingParams
from streamengine.tenancy.pinning import Pin, PinnedPrefix
from streamengine.tenancy.tenants import DEFAULT_TENANT, TenantConfig

log = logging.getLogger("streamengine.engine.async_engine")  # the engine's log, as before the split


class PinKeeper:
    """Tenants and pinned prefixes of an AsyncEngine (see the module docstring)."""

    def _init_pins(self) -> None:
        self._pending_pin_blocks = 0  # blocks of pin_prefix calls still computing
        self._repin_task: asyncio.Task | None = None  # pins computed again after a restart
        self._repin_pending: dict[str, Pin] = {}  # pins the repin task has not made yet, by id

    @property
    def tenants(self) -> list[TenantConfig]:
        return [self.core.tenants.get(name) for name in self.core.tenants.names()]

    def add_tenant(self, config: TenantConfig) -> None:
        """Registers a tenant, or changes its settings (requests in flight keep running)."""
        self.core.tenants.add(config)

    def pinned(self) -> list[PinnedPrefix]:
        """Every pinned prefix, those a restart has yet to compute again among them."""
        pins = {pin.info.pin_id: pin.info for pin in self.core.pins.all()}
        pins.update((pin_id, pin.info) for pin_id, pin in self._repin_pending.items())
        return list(pins.values())

    async def pin_prefix(
        self, prompt: str | list[int], tenant: str | None = None, shared: bool = False,
    ) -> PinnedPrefix:
        """Computes `prompt` once and keeps its full blocks resident until `unpin`.

        A tenant's pin (its system prompt) is hashed with the tenant's salt: only its own
        requests hit it. `shared=True` hashes it without a salt, so every tenant's requests that
        start with it hit it (a platform preamble); what follows stays salted. Raises
        LimitExceededError past `max_pinned_fraction` of the pool, ValueError for a prompt
        shorter than one block."""
        ids = self.core.intake.prompt_ids(prompt)
        pin = self._new_pin(ids, tenant, shared)
        await self._compute_pin(pin, tenant)
        return pin.info

    async def _compute_pin(self, pin: Pin, tenant: str | None) -> None:
        """Runs the prefix as a one-token request that pins its prompt's blocks as it ends."""
        self._pending_pin_blocks += pin.info.num_blocks
        try:
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            request_id, stream = self._submit(list(pin.token_ids), params, f"pin-{pin.info.pin_id}", None, tenant, pin)
            try:
                while not (await stream.get()).finished:
                    pass
            finally:
                self._streams.pop(request_id, None)
                self._abort(request_id)  # a no-op once it finished
        finally:
            self._pending_pin_blocks -= pin.info.num_blocks
        if self.core.pins.get(pin.info.pin_id) is None:
            raise RequestFailedError("the prefix was not pinned: its request ended early")

    async def _repin(self) -> None:
        """After a restart: computes and pins again the prefixes the old bookkeeping held,
        under their old ids, except those unpinned in the meantime (`unpin`)."""
        while self._repin_pending:
            pin_id, pin = next(iter(self._repin_pending.items()))
            try:
                await self._compute_pin(Pin(pin.info, pin.token_ids), pin.info.tenant)
            except Exception:
                log.exception("pinning prefix %s again after a restart failed", pin_id)
            if self._repin_pending.pop(pin_id, None) is None and self.core.pins.get(pin_id) is not None:
                self.core.unpin(pin_id)  # unpinned while it was being computed

    def _new_pin(self, ids: list[int], tenant: str | None, shared: bool) -> Pin:
        num_blocks = len(ids) // self.config.block_size
        if num_blocks == 0:
            raise ValueError(f"a pinned prefix needs at least one full block ({self.config.block_size} tokens)")
        limit = int(self.config.max_pinned_fraction * self.core.kv_spec.num_blocks)
        held = self.core.block_manager.retention.num_pinned_blocks + self._pending_pin_blocks
        if held + num_blocks > limit:
            raise LimitExceededError(
                "max_pinned_fraction",
                f"pinning {num_blocks} more blocks would exceed max_pinned_fraction "
                f"({self.config.max_pinned_fraction:g} of {self.core.kv_spec.num_blocks} blocks; {held} pinned)",
            )
        owner = None if shared else (tenant if tenant is not None else DEFAULT_TENANT)
        info = PinnedPrefix(uuid.uuid4().hex[:12], owner, shared, len(ids), num_blocks)
        return Pin(info, tuple(ids))

    async def unpin(self, pin_id: str) -> None:
        """Lets a pinned prefix's blocks be evicted again; KeyError for an unknown id. A pin
        not yet made again after a restart is dropped from the repin."""
        if self.core.pins.get(pin_id) is None and self._repin_pending.pop(pin_id, None) is not None:
            return
        self.core.unpin(pin_id)

    def _start_repin(self) -> None:
        """Starts the repin task for the pins a restart (or a stop before its repin ended) left."""
        if self._repin_pending:
            self._repin_task = asyncio.get_running_loop().create_task(self._repin(), name="streamengine-repin")

    async def _hold_pins_for_repin(self) -> None:
        """Before a restart resets the core: the pins held, and those an earlier restart's
        repin had not made again yet, become the ones to repin."""
        if self._repin_task is not None:
            repin, self._repin_task = self._repin_task, None
            repin.cancel()
            await asyncio.wait({repin})
        self._repin_pending = {pin.info.pin_id: pin for pin in [*self.core.pins.all(), *self._repin_pending.values()]}
