"""Which replica holds which cached block: a mirror of the replicas' KV events.

Kept by the router (and by the directory, which hands a snapshot to routers that start late
or fall behind). Hashes are the engine's chained block hashes, so a block's presence implies
its whole prefix was the same; the depth of a request on a replica is the number of its
leading block hashes that replica holds.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamengine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch


class BlockIndex:
    """Block hash -> replicas holding it, and replica -> its hashes (to forget it at once)."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def replicas(self) -> list[str]:
        return list(self._blocks)

    def num_blocks(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    def hashes(self, replica: str) -> list[bytes]:
        return list(self._blocks.get(replica, ()))

    def apply(self, replica: str, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.add(replica, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.remove(replica, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.forget(replica)

    def add(self, replica: str, hashes: Iterable[bytes]) -> None:
        own = self._blocks.setdefault(replica, set())
        for h in hashes:
            own.add(h)
            self._holders.setdefault(h, set()).add(replica)

    def remove(self, replica: str, hashes: Iterable[bytes]) -> None:
        own = self._blocks.get(replica)
        if own is None:
            return
        for h in hashes:
            own.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del self._holders[h]

    def forget(self, replica: str) -> None:
        """Drops every block of `replica` (it cleared its cache, left, or died)."""
        self.remove(replica, list(self._blocks.get(replica, ())))
        self._blocks.pop(replica, None)

    def depths(self, hashes: list[bytes], replicas: Iterable[str]) -> dict[str, int]:
        """For each of `replicas`, how many of `hashes` it holds from the first one on."""
        depth = dict.fromkeys(replicas, 0)
        alive = set(depth)
        for i, h in enumerate(hashes):
            alive &= self._holders.get(h, set())
            if not alive:
                break
            for replica in alive:
                depth[replica] = i + 1
        return depth
