"""Pinned prefixes, and the salts a request's blocks are hashed with.

A pinned prefix (a bot's system prompt, or a platform preamble every bot shares) is computed
once and its full blocks stay resident until unpinned. Whether a request's block can hit a
cached one is decided by the salt it is hashed with (block_manager.hash_block):

    [0, shared)        no salt          a prefix pinned with shared=True: every tenant hits it
    [shared, user)     the tenant salt  the tenant's own blocks, e.g. its pinned system prompt
    [user, ...)        tenant + user    with a per-user salt: one user's messages

`shared` and `user` are the lengths (in whole blocks) of the longest shared pin and the longest
pin of the request's tenant that the prompt starts with. Without a per-user salt everything
after the shared part carries the tenant salt (the tenant's requests share all their prefixes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Segments = tuple[tuple[int, str | None], ...]


@dataclass(frozen=True, slots=True)
class PinnedPrefix:
    pin_id: str
    tenant: str | None  # None for a shared prefix
    shared: bool
    num_tokens: int  # tokens of the prefix; its full blocks are the pinned ones
    num_blocks: int


@dataclass(slots=True)
class Pin:
    info: PinnedPrefix
    token_ids: tuple[int, ...]
    block_ids: list[int] = field(default_factory=list)


class Pins:
    """The engine's pinned prefixes, by id."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pins: dict[str, Pin] = {}

    def add(self, pin: Pin) -> None:
        self._pins[pin.info.pin_id] = pin

    def pop(self, pin_id: str) -> Pin:
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            raise KeyError(f"no pinned prefix {pin_id!r}")
        return pin

    def get(self, pin_id: str) -> Pin | None:
        return self._pins.get(pin_id)

    def all(self) -> list[Pin]:
        return list(self._pins.values())

    def clear(self) -> list[Pin]:
        pins = list(self._pins.values())
        self._pins.clear()
        return pins

    def segments(self, prompt_ids: list[int], tenant: str, tenant_salt: str, user_salt: str | None) -> Segments:
        """The salt segments of a request of `tenant` (see the module docstring)."""
        shared = self._longest(prompt_ids, None)
        own = max(shared, self._longest(prompt_ids, tenant))
        segments: list[tuple[int, str | None]] = [(0, None)] if shared else []
        if not user_salt or own > shared:
            segments.append((shared, tenant_salt))
        if user_salt:
            segments.append((own, f"{tenant_salt}\x00user:{user_salt}"))
        return tuple(segments)

    def _longest(self, prompt_ids: list[int], tenant: str | None) -> int:
        """Tokens, in whole blocks, of the longest pin of `tenant` (None: shared pins) that
        `prompt_ids` starts with."""
        best = 0
        for pin in self._pins.values():
            if (pin.info.tenant if not pin.info.shared else None) != tenant:
                continue
            n = len(pin.token_ids) // self.block_size * self.block_size
            if n > best and len(prompt_ids) >= n and tuple(prompt_ids[:n]) == pin.token_ids[:n]:
                best = n
        return best
