"""Pins on cached KV blocks (held until unpinned, never evicted) and the owner helpers they use."""

from __future__ import annotations

from collections import Counter

from streamengine.kv.free_blocks import SHARED_OWNER, KVBlock


class BlockPinsMixin:
    """The pin half of BlockManager: needs its blocks, cached, _evict_owner and _enqueue_free."""

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks with at least one pin."""
        return self._num_pinned

    def pin_count(self, block_id: int) -> int:
        """Pins on `block_id`: its refcount is its block-table entries plus this."""
        return self.blocks[block_id].pins

    def cached_block_ids(self, block_hashes: list[bytes]) -> list[int]:
        """The cached blocks of a run of chained hashes (`seq.block_hashes[:n]`), up to the
        first not cached. What to pin for a computed prefix: where its sequence computed a
        block twice (the hit cap leaves a whole-block prompt's last block to compute), only
        the first copy is cached."""
        ids = []
        for block_hash in block_hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            ids.append(block.block_id)
        return ids

    def num_pinned_hits(self, block_hashes: list[bytes]) -> int:
        """Pinned blocks in the cached run of `block_hashes` (cached_block_ids)."""
        return sum(1 for block_id in self.cached_block_ids(block_hashes) if self.blocks[block_id].pins)

    def pin_blocks(self, block_ids: list[int], owner: str | None = None) -> None:
        """Adds one pin per entry: a pinned block is never freed nor evicted until unpinned.

        Each must be a cached block (full, holding a hash): a pin is a prefix-cache hit that
        holds on, so it may take a free cached block out of the queue. Pass a prefix's blocks
        root first. `owner` is what `block_tenants()` shows while no sequence holds the block
        (default: the tenant holding it now; "*" from a second owner's pin until the last pin
        goes). All or nothing: a bad entry raises ValueError before any pin is taken."""
        for block_id in block_ids:
            if self._block(block_id).block_hash is None:
                raise ValueError(f"block {block_id} holds no cached content")
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.pins == 0:
                self._num_pinned += 1
            block.pin_owner = either_owner(block.pin_owner, owner or owner_of(block.holders))
            if block.ref_cnt == 0:
                block.queue.remove(block)
            block.pins += 1
            block.ref_cnt += 1

    def unpin_blocks(self, block_ids: list[int]) -> None:
        """Removes one pin per entry, tail first (a block left with no reference is queued
        for eviction as if a sequence had freed it). All or nothing: ValueError if any entry
        has no pin left to remove."""
        for block_id, n in Counter(block_ids).items():
            if self._block(block_id).pins < n:
                raise ValueError(f"block {block_id} has fewer than {n} pins")
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.pins -= 1
            block.ref_cnt -= 1
            if block.pins == 0:
                self._num_pinned -= 1
                block.evict_tenant = self._evict_owner(block.pin_owner)  # if nobody holds it either
                block.pin_owner = None
            if block.ref_cnt == 0:
                self._enqueue_free(block)

    def _block(self, block_id: int) -> KVBlock:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"no block {block_id} in a pool of {self.num_blocks}")
        return self.blocks[block_id]



def either_owner(owner: str | None, other: str | None) -> str | None:
    if owner is None or owner == other:
        return other
    return owner if other is None else SHARED_OWNER


def owner_of(holders: dict[str, int]) -> str | None:
    if not holders:
        return None
    return next(iter(holders)) if len(holders) == 1 else SHARED_OWNER
