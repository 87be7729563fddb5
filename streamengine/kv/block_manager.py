"""The paged KV-cache pool: physical blocks, refcounts, block tables and the prefix cache.

No torch here: this module decides *which* slots hold which tokens; the model runner moves the
bytes. Invariants (checked by tests/test_block_manager.py and tests/test_prefix_isolation.py):

- a block is in the free queue iff its refcount is 0;
- a block's refcount equals the number of block-table entries that point at it plus its pins;
- a block holding a hash is reachable from `cached` under that hash (until it is evicted);
- a free cached block's cached parent, if free too and the same tenant's, is behind it in
  that tenant's queue: eviction takes a chain's tail first, never stranding a cached child
  behind an evicted parent;
- free blocks that a waiting sequence's prefix will hit (`want`) sit in a second queue, taken
  only after the same tenant's others: a request queued behind others keeps the history it
  re-sends, instead of losing it to the churn of the requests it waits for. In that queue the
  blocks of the request served last go first (the order of the waiting line, not LRU);
- eviction takes from the tenant whose free cached blocks (both queues) are the most per unit
  of weight (free_blocks.py): the free cache is shared max-min fairly, so a busy tenant's
  traffic cannot flush a quiet tenant's prefixes.

Content hashes, salts and isolation: block_hash.py. KV events: kv/event_log.py. Swapping:
kv/swap.py. Pins: block_pins.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from streamengine.kv.block_hash import extend_hashes
from streamengine.kv.block_pins import BlockPinsMixin, owner_of
from streamengine.kv.event_log import KVEventLogMixin
from streamengine.kv.events import KVCacheEvent
from streamengine.kv.free_blocks import (
    SHARED_OWNER,
    KVBlock,
    TenantFreeBlocks,
    take_next,
)
from streamengine.kv.swap import KVSwapMixin
from streamengine.sequence import Sequence


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class BlockManager(KVSwapMixin, BlockPinsMixin, KVEventLogMixin):
    """Hands out blocks a block at a time, shares them by refcount, caches full ones by hash."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0, weight_of: Callable[[str], float] | None = None,
        tenant_fair_eviction: bool = True,
    ) -> None:
        """`weight_of(tenant)` weighs each tenant's claim on the free cache (default: equal);
        with `tenant_fair_eviction` off every free block is filed under one owner, so eviction
        is one LRU order across tenants."""
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0:
            raise ValueError("num_blocks and block_size must be >= 1, num_cpu_blocks >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Two tiers of free blocks, each evicting from the tenant with the most (free_blocks.py):
        # first those no waiting sequence will hit, then those one will (`want`).
        self.free_queue = TenantFreeBlocks(self.blocks)
        self.wanted_queue = TenantFreeBlocks()
        self.weight_of = weight_of or (lambda tenant: 1.0)
        self.tenant_fair_eviction = tenant_fair_eviction
        self.cached: dict[bytes, KVBlock] = {}
        self._wanted: Counter[bytes] = Counter()  # hash -> waiting sequences that will hit it
        self._wants: dict[int, list[bytes]] = {}  # seq_id -> the hashes it wants
        self.stats = PrefixCacheStats()
        # (src, dst) block copies the runner must do before the next forward (copy-on-write)
        self.pending_copies: list[tuple[int, int]] = []
        # The host pool for swapped-out sequences: a plain stack, no sharing or caching there.
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self._num_pinned = 0
        # KV events since the last take_kv_events(); None while nobody records (no cost then).
        self.kv_events: list[KVCacheEvent] | None = None
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

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache --------------------------------------------------------------------

    def compute_block_hashes(self, seq: Sequence) -> list[bytes]:
        """Extends `seq.block_hashes` to cover every full block of its known tokens."""
        return extend_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.salt_segments, seq.cache_salt)

    def find_cached_blocks(self, seq: Sequence) -> list[KVBlock]:
        """Longest run of leading full blocks already in the cache.

        Capped so at least one token is left to compute: its logits are needed to sample.
        No hits for a sequence that must compute every position (`seq.reads_prefix_cache`).
        """
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in self.compute_block_hashes(seq)[:max_blocks]:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def blocks_computed_alike(self, seq: Sequence, other: Sequence) -> list[KVBlock]:
        """The leading full blocks `other` has computed over the same tokens as `seq` (a
        sibling sample or beam): what `seq`, holding no blocks, may start on instead of
        computing them. Capped like `find_cached_blocks`."""
        size = self.block_size
        limit = min((seq.num_tokens - 1) // size, other.num_computed_tokens // size, len(other.block_table))
        shared: list[KVBlock] = []
        for i in range(limit):
            if seq.token_ids[i * size:(i + 1) * size] != other.token_ids[i * size:(i + 1) * size]:
                break
            shared.append(self.blocks[other.block_table[i]])
        return shared

    def cache_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Registers the blocks that became full since the last call, counting the first
        `num_tokens` tokens (default: the computed ones).

        The scheduler passes the tokens it has just scheduled: their K/V are written before any
        attention reads in the same forward pass (layer by layer), so a request admitted later
        in the same step may already share them."""
        if not self.enable_prefix_caching:
            return
        upto = seq.num_computed_tokens if num_tokens is None else num_tokens
        num_full = min(upto // self.block_size, len(seq.block_table))
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self.compute_block_hashes(seq)
        stored: list[int] | None = [] if self.kv_events is not None else None
        for i in range(seq.num_cached_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                block.parent_hash = hashes[i - 1] if i else None
                block.token_src, block.token_start = seq.token_ids, i * self.block_size
                self.cached[hashes[i]] = block
                if stored is not None:
                    stored.append(i)
        seq.num_cached_blocks = num_full
        if stored:
            self._record_stored(seq, stored)

    # -- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock] = (), reserve: int = 0
    ) -> bool:
        """Makes room for `num_new_tokens` more tokens of `seq`; False (and no change) if the
        pool cannot hold them while keeping `reserve` blocks free.

        `cached` are prefix-cache hits from `find_cached_blocks`, taken for a sequence that
        has no blocks yet; they count as computed tokens.
        """
        need = self.num_new_blocks(seq, num_new_tokens, cached)
        cow = self.needs_copy_on_write(seq, num_new_tokens)
        if need + cow + reserve > self._num_available(cached):
            return False
        if cached:
            self._take_cached(seq, cached)
        if cow:
            self._copy_on_write(seq)
        for _ in range(need):
            seq.block_table.append(self._pop_free(seq.tenant).block_id)
        return True

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock] = ()) -> int:
        """Free blocks `seq` takes to compute `num_new_tokens` more (after `cached` hits)."""
        have = len(seq.block_table) + len(cached)
        computed = seq.num_computed_tokens + len(cached) * self.block_size
        return max(0, self.blocks_needed(computed + num_new_tokens) - have)

    def _num_available(self, cached: list[KVBlock]) -> int:
        return self.num_free_blocks - self.num_free_hits(cached)

    @staticmethod
    def num_free_hits(cached: list[KVBlock]) -> int:
        """Of the hits `cached`, those in the free queue: taking them takes them out of it, so
        they count among the free blocks but are no room for the sequence that hits them."""
        return sum(1 for b in cached if b.ref_cnt == 0)

    def needs_copy_on_write(self, seq: Sequence, num_new_tokens: int) -> bool:
        """True if the next write lands in a block another sequence also references."""
        if num_new_tokens == 0:
            return False
        index = seq.num_computed_tokens // self.block_size
        if index >= len(seq.block_table):
            return False
        return self.blocks[seq.block_table[index]].ref_cnt > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        index = seq.num_computed_tokens // self.block_size
        src = self.blocks[seq.block_table[index]]
        dst = self._pop_free(seq.tenant)
        _drop(src, seq.tenant)  # refcount still > 0: another sequence (or a pin) holds it
        seq.block_table[index] = dst.block_id
        self.pending_copies.append((src.block_id, dst.block_id))

    def _take_cached(self, seq: Sequence, cached: list[KVBlock]) -> None:
        if seq.block_table:
            raise ValueError("prefix-cache hits can only start an empty block table")
        for block in cached:
            if block.ref_cnt == 0:
                block.queue.remove(block)
            _hold(block, seq.tenant)
            seq.block_table.append(block.block_id)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_cached_blocks = len(cached)

    def _pop_free(self, tenant: str) -> KVBlock:
        block = take_next((self.free_queue, self.wanted_queue), self.weight_of)
        if block.block_hash is not None:  # lazy eviction: forget the content only now
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.kv_events is not None:
                    self._record_removed(block.block_hash)
            _forget(block)
        _hold(block, tenant)
        return block

    # -- release and sharing -------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s references, tail first, so a prefix outlives its own suffix in the
        cache. Blocks with no cached content go to the front of the queue: reuse them first."""
        self.cpu_free.extend(reversed(seq.cpu_block_table))
        seq.cpu_block_table = []
        self._release_blocks(seq)

    def _release_blocks(self, seq: Sequence, start: int = 0) -> None:
        """Drops `seq`'s references to its blocks from index `start` on, tail first."""
        hashes = seq.block_hashes
        for i in range(len(seq.block_table) - 1, start - 1, -1):
            block = self.blocks[seq.block_table[i]]
            if block.holders.get(seq.tenant, 0) <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            _drop(block, seq.tenant)
            if block.ref_cnt == 0:
                block.evict_tenant = self._evict_owner(seq.tenant)
                self._enqueue_free(block)
            if block.block_hash is None and i < len(hashes):
                self._touch_free_cached(hashes[i])
        seq.block_table = seq.block_table[:start]  # a new list: a plan in flight may hold the old one
        seq.num_cached_blocks = min(seq.num_cached_blocks, start)

    def _evict_owner(self, tenant: str | None) -> str:
        """Whose share of the free cache a block freed by `tenant` counts in."""
        return (tenant or SHARED_OWNER) if self.tenant_fair_eviction else SHARED_OWNER

    def _enqueue_free(self, block: KVBlock) -> None:
        if block.block_hash is None:
            self.free_queue.appendleft(block)
        else:
            self._queue_of(block).append(block)

    def _queue_of(self, block: KVBlock) -> TenantFreeBlocks:
        """The queue a free block is in (or goes to)."""
        wanted = block.block_hash is not None and block.block_hash in self._wanted
        return self.wanted_queue if wanted else self.free_queue

    # -- prefixes of waiting sequences --------------------------------------------------------

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
        hashes = self.compute_block_hashes(seq)[: (seq.num_tokens - 1) // self.block_size]
        own = hashes if first else [block_hash for block_hash in hashes if block_hash not in self._wanted]
        self._wants[seq.seq_id] = hashes
        self._wanted.update(hashes)
        self._requeue(own, front=not first)

    def unwant(self, seq: Sequence) -> None:
        """`seq` stopped waiting (admitted or removed); idempotent."""
        hashes = self._wants.pop(seq.seq_id, None)
        if not hashes:
            return
        self._wanted.subtract(hashes)
        for block_hash in hashes:
            if self._wanted[block_hash] <= 0:
                del self._wanted[block_hash]
        self._requeue(hashes)

    def _requeue(self, hashes: list[bytes], front: bool = False) -> None:
        """Moves the free cached blocks of a chain to the back (or `front`) of the queue they
        now belong in, so that either way the chain's tail comes first and each parent stays
        behind its children: to the back deepest first, to the front root first."""
        for block_hash in hashes if front else reversed(hashes):
            block = self.cached.get(block_hash)
            if block is not None and block.ref_cnt == 0:
                block.queue.remove(block)
                queue = self._queue_of(block)
                (queue.appendleft if front else queue.append)(block)

    def _touch_free_cached(self, block_hash: bytes) -> None:
        """The sequence being freed held a duplicate of a cached block (both computed at
        once, or past the hit cap): the cached one, if free, moves behind the blocks just
        freed after it, which may be its cached children, so the chain's tail still goes
        first."""
        block = self.cached.get(block_hash)
        if block is not None and block.ref_cnt == 0:
            queue = block.queue
            queue.remove(block)
            queue.append(block)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (refcount + 1), like fork(); writes into a
        shared partial block are copied on write by `allocate_slots`."""
        if child.block_table:
            raise ValueError("fork target must have an empty block table")
        for block_id in parent.block_table:
            _hold(self.blocks[block_id], child.tenant)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forgets cached content (blocks in use keep their data, not their hash), except that
        pinned blocks keep their hash: they were computed in earlier steps."""
        kept = {h: b for h, b in self.cached.items() if b.pins}
        for block in self.blocks:
            if not block.pins:
                _forget(block)
        self.cached.clear()
        self.cached.update(kept)
        for block in [*self.free_queue, *self.wanted_queue]:  # no content left to keep for anyone
            if block.block_hash is None:
                block.queue.remove(block)
                self.free_queue.appendleft(block)
        if self.kv_events is not None:  # what came before the clear no longer matters
            self.kv_events[:] = self.kv_snapshot()

    # -- introspection -----------------------------------------------------------------------

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



def _forget(block: KVBlock) -> None:
    """The block's content no longer counts as cached."""
    block.block_hash = block.parent_hash = block.token_src = None


def _hold(block: KVBlock, tenant: str) -> None:
    block.ref_cnt += 1
    block.holders[tenant] = block.holders.get(tenant, 0) + 1


def _drop(block: KVBlock, tenant: str) -> None:
    block.ref_cnt -= 1
    left = block.holders[tenant] - 1
    if left:
        block.holders[tenant] = left
    else:
        del block.holders[tenant]
