"""What the KV pool keeps beyond the blocks sequences hold: pins and the prefixes of waiting requests.

- A pin is a prefix-cache hit that holds on: a pinned block (a tenant's system prompt) counts
  in its refcount, so it is never freed nor evicted until unpinned.
- A waiting request's prefix is "wanted": the free blocks it will hit are evicted only after
  every other free block of their tenant (the pool's second tier), so a request queued behind
  others keeps the history it re-sends.

The tenants' shares of the free cache are the pool's eviction order (free_blocks.py); their
quotas of blocks in use are the fair scheduling policy's (tenancy/fair_share.py).
"""

from __future__ import annotations

from collections import Counter

from streamengine.kv.block_hash import sequence_hashes
from streamengine.kv.block_pool import BlockPool, owner_of
from streamengine.kv.free_blocks import SHARED_OWNER, KVBlock
from streamengine.sequence import Sequence


class BlockRetention:
    """Pins on cached blocks and the wanted prefixes of waiting sequences, over one pool."""

    def __init__(self, pool: BlockPool, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.enable_prefix_caching = enable_prefix_caching
        self._num_pinned = 0
        self._wants: dict[int, list[bytes]] = {}  # seq_id -> the hashes it wants

    # -- pins ----------------------------------------------------------------------------

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks with at least one pin."""
        return self._num_pinned

    def pin_count(self, block_id: int) -> int:
        """Pins on `block_id`: its refcount is its block-table entries plus this."""
        return self.pool.blocks[block_id].pins

    def cached_block_ids(self, block_hashes: list[bytes]) -> list[int]:
        """The cached blocks of a run of chained hashes (`seq.block_hashes[:n]`), up to the
        first not cached. What to pin for a computed prefix: where its sequence computed a
        block twice (the hit cap leaves a whole-block prompt's last block to compute), only
        the first copy is cached."""
        ids = []
        for block_hash in block_hashes:
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            ids.append(block.block_id)
        return ids

    def num_pinned_hits(self, block_hashes: list[bytes]) -> int:
        """Pinned blocks in the cached run of `block_hashes` (cached_block_ids)."""
        blocks = self.pool.blocks
        return sum(1 for block_id in self.cached_block_ids(block_hashes) if blocks[block_id].pins)

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
            block = self.pool.blocks[block_id]
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
            block = self.pool.blocks[block_id]
            block.pins -= 1
            block.ref_cnt -= 1
            if block.pins == 0:
                self._num_pinned -= 1
                block.evict_tenant = self.pool.evict_owner(block.pin_owner)  # if nobody holds it either
                block.pin_owner = None
            if block.ref_cnt == 0:
                self.pool.enqueue_free(block)

    def _block(self, block_id: int) -> KVBlock:
        if not 0 <= block_id < self.pool.num_blocks:
            raise ValueError(f"no block {block_id} in a pool of {self.pool.num_blocks}")
        return self.pool.blocks[block_id]

    # -- prefixes of waiting sequences ---------------------------------------------------

    def want(self, seq: Sequence, first: bool = False) -> None:
        """`seq` waits to be admitted: the free blocks its prefix would hit (and any that get
        cached under its hashes meanwhile) are evicted only after every other free block.

        Among wanted blocks, those of the request served last go first. A request queued
        behind others (`first=False`) is served after them, so the blocks only it wants go in
        front of theirs; one put at the head of the line (a preempted sequence, `first=True`)
        keeps its blocks behind everyone's. Kept in LRU order instead, a queue longer than the
        cache would lose each request's history just before its turn: the oldest waiter's
        blocks would be the least recently used."""
        if not self.enable_prefix_caching or seq.seq_id in self._wants:
            return
        size, wanted = self.pool.block_size, self.pool.wanted
        hashes = sequence_hashes(seq, size)[: (seq.num_tokens - 1) // size]
        own = hashes if first else [block_hash for block_hash in hashes if block_hash not in wanted]
        self._wants[seq.seq_id] = hashes
        wanted.update(hashes)
        self.pool.requeue(own, front=not first)

    def unwant(self, seq: Sequence) -> None:
        """`seq` stopped waiting (admitted or removed); idempotent."""
        hashes = self._wants.pop(seq.seq_id, None)
        if not hashes:
            return
        wanted = self.pool.wanted
        wanted.subtract(hashes)
        for block_hash in hashes:
            if wanted[block_hash] <= 0:
                del wanted[block_hash]
        self.pool.requeue(hashes)


def either_owner(owner: str | None, other: str | None) -> str | None:
    if owner is None or owner == other:
        return other
    return owner if other is None else SHARED_OWNER
