"""The KV block pool: physical blocks, their refcounts, the free queues and the hash index.

The bottom layer of the KV cache. It knows blocks, not sequences: who holds a block (refcount,
tallied by tenant), where a free block waits (free_blocks.py orders eviction), which content
hash names it (`cached`), and the KV events that report changes to that index (event_log.py).
Above it, block_manager.py gives sequences their blocks (allocation, prefix lookup,
copy-on-write, swap) and retention.py decides what the pool keeps (pins, the blocks waiting
requests will hit). Invariants (tests/test_block_manager.py, tests/test_prefix_isolation.py):

- a block is in a free queue iff its refcount is 0;
- a block holding a hash is reachable from `cached` under that hash (until it is evicted);
- a free cached block's cached parent, if free too and the same tenant's, is behind it in that
  tenant's queue: eviction takes a chain's tail first, never stranding a cached child behind
  an evicted parent;
- free blocks under a hash in `wanted` (retention.py) sit in a second queue, taken only after
  the same tenant's others;
- eviction takes from the tenant whose free cached blocks (both queues) are the most per unit
  of weight (free_blocks.py): the free cache is shared max-min fairly, so a busy tenant's
  traffic cannot flush a quiet tenant's prefixes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from streamengine.kv.event_log import KVEventLogMixin
from streamengine.kv.free_blocks import SHARED_OWNER, KVBlock, TenantFreeBlocks, take_next


class BlockPool(KVEventLogMixin):
    """Blocks by id, shared by refcount, free ones queued for reuse, full ones indexed by hash."""

    def __init__(
        self, num_blocks: int, block_size: int, weight_of: Callable[[str], float] | None = None,
        tenant_fair_eviction: bool = True,
    ) -> None:
        """`weight_of(tenant)` weighs each tenant's claim on the free cache (default: equal);
        with `tenant_fair_eviction` off every free block is filed under one owner, so eviction
        is one LRU order across tenants."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Two tiers of free blocks, each evicting from the tenant with the most (free_blocks.py):
        # first those no waiting sequence will hit, then those one will (`wanted`).
        self.free_queue = TenantFreeBlocks(self.blocks)
        self.wanted_queue = TenantFreeBlocks()
        self.weight_of = weight_of or (lambda tenant: 1.0)
        self.tenant_fair_eviction = tenant_fair_eviction
        self.cached: dict[bytes, KVBlock] = {}
        # hash -> waiting sequences that will hit it; kept by retention.py, read by `queue_of`
        self.wanted: Counter[bytes] = Counter()
        # KV events since the last take_kv_events(); None while nobody records (no cost then).
        self.kv_events = None
        self.kv_medium: str | None = None

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free + self.wanted_queue.num_free

    def free_blocks(self) -> list[KVBlock]:
        """The free blocks in eviction order."""
        return [*self.free_queue, *self.wanted_queue]

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_states(self) -> list[int]:
        """Per block: 0 free, 1 free but holding cached content, 2 in use, 3 shared, 4 pinned."""
        states = []
        for b in self.blocks:
            if b.pins:
                states.append(4)
            elif b.ref_cnt == 0:
                states.append(0 if b.block_hash is None else 1)
            else:
                states.append(2 if b.ref_cnt == 1 else 3)
        return states

    def block_tenants(self) -> list[str | None]:
        """Per block: the tenant of the sequences holding it, "*" when several tenants' do, a
        pinned block's owner while no sequence holds it, None when free."""
        return [owner_of(b.holders) if b.holders else b.pin_owner for b in self.blocks]

    # -- taking and releasing ------------------------------------------------------------

    def pop_free(self, tenant: str) -> KVBlock:
        """The next free block, evicting its cached content now (lazily: a free block keeps
        its content, and can be hit again, until it is reused), held by `tenant`."""
        block = take_next((self.free_queue, self.wanted_queue), self.weight_of)
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.kv_events is not None:
                    self._record_removed(block.block_hash)
            forget(block)
        hold(block, tenant)
        return block

    def take(self, block: KVBlock, tenant: str) -> None:
        """One more reference to `block` by `tenant`, out of the free queue if it was free
        (a prefix-cache hit)."""
        if block.ref_cnt == 0:
            block.queue.remove(block)
        hold(block, tenant)

    def release(self, block: KVBlock, tenant: str) -> None:
        """Drops one of `tenant`'s references; a block left unreferenced joins a free queue."""
        if block.holders.get(tenant, 0) <= 0:
            raise RuntimeError(f"double free of block {block.block_id}")
        drop(block, tenant)
        if block.ref_cnt == 0:
            block.evict_tenant = self.evict_owner(tenant)
            self.enqueue_free(block)

    def evict_owner(self, tenant: str | None) -> str:
        """Whose share of the free cache a block freed by `tenant` counts in."""
        return (tenant or SHARED_OWNER) if self.tenant_fair_eviction else SHARED_OWNER

    def enqueue_free(self, block: KVBlock) -> None:
        """Queues an unreferenced block: one holding no content to the front (reuse it
        first), a cached one to the back of its tier."""
        if block.block_hash is None:
            self.free_queue.appendleft(block)
        else:
            self.queue_of(block).append(block)

    def queue_of(self, block: KVBlock) -> TenantFreeBlocks:
        """The tier a free block is in (or goes to)."""
        wanted = block.block_hash is not None and block.block_hash in self.wanted
        return self.wanted_queue if wanted else self.free_queue

    def requeue(self, hashes: list[bytes], front: bool = False) -> None:
        """Moves the free cached blocks of a chain to the back (or `front`) of the tier they
        now belong in, so that either way the chain's tail comes first and each parent stays
        behind its children: to the back deepest first, to the front root first."""
        for block_hash in hashes if front else reversed(hashes):
            block = self.cached.get(block_hash)
            if block is not None and block.ref_cnt == 0:
                block.queue.remove(block)
                queue = self.queue_of(block)
                (queue.appendleft if front else queue.append)(block)

    def touch_free_cached(self, block_hash: bytes) -> None:
        """A sequence being freed held a duplicate of the block cached under `block_hash`
        (both computed at once, or past the hit cap): the cached one, if free, moves behind
        the blocks just freed after it, which may be its cached children, so the chain's tail
        still goes first."""
        block = self.cached.get(block_hash)
        if block is not None and block.ref_cnt == 0:
            queue = block.queue
            queue.remove(block)
            queue.append(block)

    # -- the hash index ------------------------------------------------------------------

    def cache_block(self, block: KVBlock, block_hash: bytes, parent_hash: bytes | None,
                    token_src: list[int], token_start: int, lora_id: int | None = None) -> bool:
        """Indexes a full block under `block_hash`; False (nothing changes) if the block
        already holds content or another block holds that hash. `token_src[token_start:]`
        starts its tokens (an appended-only list), for KV-event snapshots."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash, block.parent_hash = block_hash, parent_hash
        block.token_src, block.token_start, block.lora_id = token_src, token_start, lora_id
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        """Forgets cached content (blocks in use keep their data, not their hash), except that
        pinned blocks keep their hash: they were computed in earlier steps."""
        kept = {h: b for h, b in self.cached.items() if b.pins}
        for block in self.blocks:
            if not block.pins:
                forget(block)
        self.cached.clear()
        self.cached.update(kept)
        for block in [*self.free_queue, *self.wanted_queue]:  # no content left to keep for anyone
            if block.block_hash is None:
                block.queue.remove(block)
                self.free_queue.appendleft(block)
        if self.kv_events is not None:  # what came before the clear no longer matters
            self.kv_events[:] = self.kv_snapshot()


def forget(block: KVBlock) -> None:
    """The block's content no longer counts as cached."""
    block.block_hash = block.parent_hash = block.token_src = None


def hold(block: KVBlock, tenant: str) -> None:
    block.ref_cnt += 1
    block.holders[tenant] = block.holders.get(tenant, 0) + 1


def drop(block: KVBlock, tenant: str) -> None:
    block.ref_cnt -= 1
    left = block.holders[tenant] - 1
    if left:
        block.holders[tenant] = left
    else:
        del block.holders[tenant]


def owner_of(holders: dict[str, int]) -> str | None:
    if not holders:
        return None
    return next(iter(holders)) if len(holders) == 1 else SHARED_OWNER
