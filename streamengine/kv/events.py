"""KV cache events: which block hashes an engine holds, as a stream of batches.

The records have the shape of vLLM's `vllm/distributed/kv_events.py` (msgspec structs in the
array form, tagged by class name, msgpack on the wire), so a consumer written for vLLM's
stream reads ours; docs/engine.md ("KV events") lists the fields that differ. Block hashes are
the block manager's 16-byte BLAKE2b digests. A salted block's hash already includes its salt;
no event carries a salt, only hashes, token ids and the block size.

`KVEventHub` is the engine's side: it fans each engine step's events out, as one `EventBatch`,
to every `KVEventSubscription`. A subscription buffers at most `max_batches`; past that it
discards its buffer and owes its consumer one resync batch (`AllBlocksCleared` and then every
block cached when the consumer reads it), so the consumer's view is exact again.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import msgspec


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to the set of cached blocks; the tag on the wire is the class name."""


# The array form writes every field, defaults included: vLLM declares lora_id and medium
# without defaults, so its decoders find them in their positions (and ignore extra ones).
class BlockStored(KVCacheEvent):
    """A run of consecutive full blocks of one sequence became cached; `token_ids` are all
    their tokens (block_size per block), `parent_block_hash` the hash of the block before the
    run (None for a run from the first block)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "CPU"


class BlockRemoved(KVCacheEvent):
    """These cached blocks were evicted: their hashes no longer hit."""

    block_hashes: list[bytes]
    medium: str | None = "CPU"


class AllBlocksCleared(KVCacheEvent):
    """Every cached block was forgotten (a prefix-cache reset, or the engine restarted)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the batch was made
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def encode(batch: EventBatch) -> bytes:
    """msgpack bytes of `batch`, in vLLM's layout."""
    return msgspec.msgpack.encode(batch)


def decode(data: bytes) -> EventBatch:
    """The batch `encode` wrote; msgspec.ValidationError for bytes of another shape."""
    return msgspec.msgpack.decode(data, type=EventBatch)


Snapshot = Callable[[], list[KVCacheEvent]]
"""Returns `[AllBlocksCleared(), BlockStored(...), ...]`: every block cached now, parents first."""


class KVEventSubscription:
    """Async iterator of `EventBatch`es, in order, buffering at most `max_batches`.

    On overflow the buffered batches and every later one until the consumer reads are
    discarded (counted in `dropped`), and the next batch read is a resync batch built from the
    cache at that moment: `AllBlocksCleared()` and a `BlockStored` for every block cached. So
    a consumer that applies batches in order holds the exact set of cached hashes after each
    one, dropped or not. Iteration ends at `close()` (at once) or when the engine stops (after
    the batches already buffered)."""

    def __init__(
        self, max_batches: int, snapshot: Snapshot,
        on_close: Callable[[KVEventSubscription], None] | None = None,
    ) -> None:
        if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
            raise ValueError(f"max_batches must be an integer >= 1, got {max_batches!r}")
        self.max_batches = max_batches
        self.dropped = 0  # batches discarded on overflow
        self._buffer: deque[EventBatch] = deque()
        self._snapshot = snapshot
        self._on_close = on_close
        self._resync = False  # the next read is a resync batch
        self._ended = False  # the engine stopped: drain what is buffered, then stop
        self._closed = False  # the consumer closed it: stop now
        self._ready = asyncio.Event()

    @property
    def closed(self) -> bool:
        return self._closed or self._ended

    @property
    def num_pending(self) -> int:
        """Batches a read would return now without waiting (the resync batch counts one)."""
        return 0 if self._closed else len(self._buffer) + self._resync

    def put(self, batch: EventBatch) -> None:
        """Queues one batch (the engine's side); never blocks."""
        if self.closed:
            return
        if self._resync:  # the resync batch, built when read, covers this one
            self.dropped += 1
        elif len(self._buffer) >= self.max_batches:
            self.dropped += len(self._buffer) + 1
            self._buffer.clear()
            self._resync = True
        else:
            self._buffer.append(batch)
        self._ready.set()

    def end(self) -> None:
        """The engine stopped: iteration ends once the buffered batches are read."""
        self._ended = True
        self._ready.set()

    def close(self) -> None:
        """Unsubscribes; iteration ends at once (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._buffer.clear()
        self._ready.set()
        if self._on_close is not None:
            self._on_close(self)

    def __aiter__(self) -> KVEventSubscription:
        return self

    async def __anext__(self) -> EventBatch:
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._resync:
                self._resync = False
                return EventBatch(time.time(), self._snapshot())
            if self._buffer:
                return self._buffer.popleft()
            if self._ended:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()


class KVEventHub:
    """The engine's subscriptions. `set_recording(True)` is called when the first one
    subscribes and `set_recording(False)` when the last one goes, so an engine nobody
    subscribes to records nothing."""

    def __init__(self, snapshot: Snapshot, set_recording: Callable[[bool], None]) -> None:
        self._snapshot = snapshot
        self._set_recording = set_recording
        self._subscriptions: list[KVEventSubscription] = []

    @property
    def active(self) -> bool:
        return bool(self._subscriptions)

    def subscribe(self, max_batches: int) -> KVEventSubscription:
        """A new subscription; its first batch is a snapshot when blocks are cached already."""
        sub = KVEventSubscription(max_batches, self._snapshot, self._unsubscribe)
        if not self._subscriptions:
            self._set_recording(True)
        self._subscriptions.append(sub)
        snapshot = self._snapshot()
        if len(snapshot) > 1:  # more than AllBlocksCleared: the consumer starts from this
            sub.put(EventBatch(time.time(), snapshot))
        return sub

    def publish(self, events: list[KVCacheEvent]) -> None:
        """One engine step's events, as one batch to every subscription."""
        if not events:
            return
        batch = EventBatch(time.time(), events)
        for sub in self._subscriptions:
            sub.put(batch)

    def end_all(self) -> None:
        """The engine stopped: every subscription ends after what it has buffered."""
        subs, self._subscriptions = self._subscriptions, []
        for sub in subs:
            sub.end()
        if subs:
            self._set_recording(False)

    def _unsubscribe(self, sub: KVEventSubscription) -> None:
        if sub in self._subscriptions:
            self._subscriptions.remove(sub)
            if not self._subscriptions:
                self._set_recording(False)
