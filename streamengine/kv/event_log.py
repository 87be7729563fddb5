"""Recording the prefix cache's KV events: BlockPool's event methods.

While recording (someone subscribed to the engine's KV events), every change to `cached` is
noted as it happens: BlockStored when blocks get their hash (BlockManager.cache_full_blocks),
BlockRemoved when lazy eviction forgets one in `pop_free`, AllBlocksCleared (then the pinned
blocks, which keep their hashes) on `reset_prefix_cache`. Applied in order, they rebuild
`cached`'s keys exactly; `kv_snapshot()` describes the whole set at once. Events carry hashes
and token ids, never a salt.
"""

from __future__ import annotations

from streamengine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from streamengine.kv.free_blocks import KVBlock


class KVEventLogMixin:
    """The KV-event part of BlockPool: needs its block_size, cached, kv_events and kv_medium."""

    kv_events: list[KVCacheEvent] | None

    def record_kv_events(self, medium: str | None, cleared: bool = False) -> None:
        """Starts recording KV events, naming `medium` as where the pool lives. `cleared`:
        first an AllBlocksCleared (a fresh manager replaces one a consumer knew)."""
        if self.kv_events is None:
            self.kv_events = []
        self.kv_medium = medium
        if cleared:
            self.kv_events.append(AllBlocksCleared())

    def stop_kv_events(self) -> None:
        """Stops recording; events not taken yet are dropped."""
        self.kv_events = None

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call (empty when not recording)."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    def kv_snapshot(self) -> list[KVCacheEvent]:
        """AllBlocksCleared, then BlockStored runs covering every cached block, each parent
        before its children: what rebuilds a consumer's view exactly."""
        children: dict[bytes, list[KVBlock]] = {}
        stack: list[KVBlock] = []
        for block in self.cached.values():
            if block.parent_hash is not None and block.parent_hash in self.cached:
                children.setdefault(block.parent_hash, []).append(block)
            else:  # a chain's root, or one whose parent was evicted first
                stack.append(block)
        stack.reverse()
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        while stack:
            run = [stack.pop()]
            while kids := children.get(run[-1].block_hash):
                run.append(kids[0])  # the run follows one child; its siblings start runs later
                stack.extend(reversed(kids[1:]))
            events.append(self._stored_event(run))
        return events

    def record_stored(self, stored: list[tuple[int, KVBlock]]) -> None:
        """One BlockStored per run of consecutive block-table indices among the (index,
        block) pairs of one sequence just cached, in index order."""
        start = 0
        for k in range(1, len(stored) + 1):
            if k == len(stored) or stored[k][0] != stored[k - 1][0] + 1:
                self.kv_events.append(self._stored_event([block for _, block in stored[start:k]]))
                start = k

    def _stored_event(self, run: list[KVBlock]) -> BlockStored:
        bs = self.block_size
        tokens = [t for b in run for t in b.token_src[b.token_start:b.token_start + bs]]
        return BlockStored(
            [b.block_hash for b in run], run[0].parent_hash, tokens, bs, lora_id=run[0].lora_id, medium=self.kv_medium,
        )

    def _record_removed(self, block_hash: bytes) -> None:
        """Evictions in a row go into one BlockRemoved."""
        events = self.kv_events
        if events and isinstance(events[-1], BlockRemoved):
            events[-1].block_hashes.append(block_hash)
        else:
            events.append(BlockRemoved([block_hash], medium=self.kv_medium))
