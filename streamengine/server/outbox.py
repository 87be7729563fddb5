"""Outbox: one WebSocket's unsent messages, in order, with an estimate of their bytes. A
slow reader's deltas of one (request, sample) merge into one pending message instead of
queueing, and past the byte bound the socket is to be closed (websocket.Connection)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from streamengine.server import protocol as p
from streamengine.server.config import DEFAULT_MAX_PENDING_BYTES
from streamengine.server.streaming import SampleDelta

ITEM_OVERHEAD = 128  # estimated bytes of bookkeeping per queued message
LOGPROB_ENTRY_BYTES = 24
TOKEN_ID_BYTES = 8


@dataclass(slots=True)
class _PendingDelta:
    request_id: str
    index: int
    text: list[str]
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    nbytes: int = ITEM_OVERHEAD
    tool_calls: list[p.DeltaToolCall] | None = None

    def merge(self, delta: SampleDelta, tool_calls: list[p.DeltaToolCall] | None = None) -> int:
        """Appends `delta` (and what it adds to the calls); returns the bytes it adds to the estimate."""
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        added = _delta_bytes(delta)
        for call in tool_calls or ():
            added += self._merge_call(call)
        self.nbytes += added
        return added

    def _merge_call(self, call: p.DeltaToolCall) -> int:
        """Adds one call part: arguments join the unsent entry of the same call."""
        if self.tool_calls is None:
            self.tool_calls = []
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == call.index and call.id is None:
            last.function.arguments += call.function.arguments
            return len(call.function.arguments)
        self.tool_calls.append(call)
        return ITEM_OVERHEAD + len(call.function.name or "") + len(call.function.arguments)

    def message(self) -> p.Delta:
        return p.Delta(self.request_id, self.index, "".join(self.text), self.token_ids, self.logprobs,
                       self.tool_calls)


def _delta_bytes(delta: SampleDelta) -> int:
    logprobs = delta.logprobs or ()
    return (len(delta.text) + TOKEN_ID_BYTES * len(delta.token_ids)
            + sum(TOKEN_ID_BYTES + LOGPROB_ENTRY_BYTES * len(entry) for entry in logprobs))


class Outbox:
    """Unsent messages of one socket, in order, and an estimate of their bytes.

    Deltas of one (request, sample) coalesce into one pending message; other messages are kept
    encoded. When `pending_bytes` would pass `max_bytes`, everything unsent is dropped, further
    pushes are ignored and `on_overflow` is called once: the socket is to be closed.
    """

    def __init__(self, on_overflow: Callable[[], None], max_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 codec: p.Codec | None = None) -> None:
        self._items: OrderedDict[tuple, _PendingDelta | str] = OrderedDict()
        self._ready = asyncio.Event()
        self._serial = 0
        self._codec = codec or p.Codec()
        self._on_overflow = on_overflow
        self.max_bytes = max_bytes
        self.pending_bytes = 0
        self.overflowed = False
        self.num_coalesced = 0  # deltas merged into an unsent one (observable by tests)

    def push_delta(self, request_id: str, delta: SampleDelta, tool_calls: list[p.DeltaToolCall] | None = None,
                   *, run: str) -> None:
        """Queues `delta` of sample `delta.index` of request `request_id`, merged into an unsent
        delta of the same run. `run` (the engine's request id) differs between two requests
        that reuse one client id: a later run's tokens must never merge into an earlier run's
        unsent delta, which sits ahead of that run's `done`."""
        if self.overflowed:
            return
        key = ("delta", run, delta.index)
        pending = self._items.get(key)
        if pending is not None:
            self.num_coalesced += 1
        else:
            pending = _PendingDelta(request_id, delta.index, [], [], None, ITEM_OVERHEAD + len(request_id))
            self._items[key] = pending
            self._grow(pending.nbytes)
            self._ready.set()
        self._grow(pending.merge(delta, tool_calls))  # type: ignore[union-attr]

    def push(self, message: p.ServerMessage, *, replace_key: str | None = None) -> None:
        """Queue a non-delta message; with `replace_key`, a newer one replaces an unsent one."""
        if self.overflowed:
            return
        text = self._codec.encode(message)
        if replace_key is not None:
            key: tuple = ("latest", replace_key)
            replaced = self._items.get(key)
            if isinstance(replaced, str):
                self.pending_bytes -= ITEM_OVERHEAD + len(replaced)
        else:
            self._serial += 1
            key = ("msg", self._serial)
        self._items[key] = text  # a replacement keeps the unsent one's place in the order
        self._ready.set()
        self._grow(ITEM_OVERHEAD + len(text))

    def _grow(self, nbytes: int) -> None:
        self.pending_bytes += nbytes
        if self.pending_bytes > self.max_bytes and not self.overflowed:
            self.overflowed = True
            self._items.clear()
            self.pending_bytes = 0
            self._on_overflow()

    async def get(self) -> str:
        """The next message, encoded."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        _, item = self._items.popitem(last=False)
        if isinstance(item, _PendingDelta):
            self.pending_bytes -= item.nbytes
            return self._codec.encode(item.message())
        self.pending_bytes -= ITEM_OVERHEAD + len(item)
        return item

    def __len__(self) -> int:
        return len(self._items)
