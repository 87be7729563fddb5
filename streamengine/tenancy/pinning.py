"""Pinned prefixes, and the salts a request's blocks are hashed with.

A pinned prefix (a bot's system prompt, or a platform preamble every bot shares) is computed
once and its full blocks stay resident until unpinned. Whether a request's block can hit a
cached one is decided by the salt it is hashed with (kv.block_hash.hash_block):

    [0, shared)        no salt          a prefix pinned with shared=True: every tenant hits it
    [shared, user)     the tenant salt  the tenant's own blocks, e.g. its pinned system prompt
    [user, ...)        tenant + user    with a per-user salt: one user's messages

`shared` and `user` are the lengths (in whole blocks) of the longest shared pin and the longest
pin of the request's tenant that the prompt starts with. Without a per-user salt everything
after the shared part carries the tenant salt (the tenant's requests share all their prefixes).

A tenant's pinned blocks keep the hashes they were computed with, so a request that starts with
a tenant pin takes that pin's unsalted part (`Pin.unsalted`, the shared pins of the moment it
was computed), not today's: otherwise pinning a shared preamble after a bot's system prompt, or
unpinning one before it, changed every hash of the system prompt and its pinned blocks were
never hit again (held for nothing, against `max_pinned_fraction`).
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
    unsalted: int = 0  # leading tokens its blocks were hashed without a salt (set by Pins.add)


class Pins:
    """The engine's pinned prefixes, by id."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pins: dict[str, Pin] = {}

    def add(self, pin: Pin, segments: Segments | None = None) -> None:
        """Registers a computed pin. `segments`: the salt segments its blocks were hashed with
        (default: those a request of its tokens gets now, from the pins in place)."""
        if pin.info.shared:
            pin.unsalted = len(pin.token_ids)
        elif segments is not None:
            pin.unsalted = segments[1][0] if len(segments) > 1 and segments[0] == (0, None) else 0
        else:  # what segments() gave its request, if no pin came or went since
            pin.unsalted = self._heads(list(pin.token_ids), pin.info.tenant)[0]
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
        shared, own = self._heads(prompt_ids, tenant)
        segments: list[tuple[int, str | None]] = [(0, None)] if shared else []
        if not user_salt or own > shared:
            segments.append((shared, tenant_salt))
        if user_salt:
            segments.append((own, f"{tenant_salt}\x00user:{user_salt}"))
        return tuple(segments)

    def _heads(self, prompt_ids: list[int], tenant: str) -> tuple[int, int]:
        """`shared` and `user` of a request of `tenant` (see the module docstring)."""
        shared = self._longest(prompt_ids, None)[0]
        own, pin = self._longest(prompt_ids, tenant)
        if pin is not None and own > shared:
            shared = min(pin.unsalted, own)  # the hashes its pinned blocks have
        return shared, max(shared, own)

    def _longest(self, prompt_ids: list[int], tenant: str | None) -> tuple[int, Pin | None]:
        """Tokens, in whole blocks, of the longest pin of `tenant` (None: shared pins) that
        `prompt_ids` starts with, and that pin."""
        best, best_pin = 0, None
        for pin in self._pins.values():
            if (pin.info.tenant if not pin.info.shared else None) != tenant:
                continue
            n = len(pin.token_ids) // self.block_size * self.block_size
            if n > best and len(prompt_ids) >= n and tuple(prompt_ids[:n]) == pin.token_ids[:n]:
                best, best_pin = n, pin
        return best, best_pin
