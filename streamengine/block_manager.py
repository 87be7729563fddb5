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

Salts and isolation
-------------------
Block i (tokens [i*bs, (i+1)*bs)) is hashed as H(hash of block i-1, its tokens, its salt), H
being 128-bit BLAKE2b. Its salt is that of the last of `Sequence.salt_segments` starting at or
before the block's last token (`cache_salt` with no segments, or before the first one), so a
block holding the end of a shared segment and the start of the next takes the next one's salt.
A lookup is an exact match of hashes, so a request hits a cached block only if it computes that
block's hash itself: the same tokens, the same whole prefix before them, the same salt.

Everything a request can learn from the prefix cache (how many of its blocks hit, hence its
`num_cached_tokens`, how many tokens it computes and so its prefill time; whether the scheduler
holds it back for a prefix in flight, also an exact hash match) is a function of which of its
own hashes are cached. Of those:
- a block hashed with salt s matches only lookups hashed with s. A tenant's salt is secret to
  other tenants, so no other tenant computes the hash of any of its private blocks, whatever
  tokens it sends (short of a BLAKE2b collision); through the chain, nor of any block after one;
- the engine leaves only a leading segment unsalted, over a shared pinned prefix, so an
  unsalted block holds only that prefix's tokens (its last token is in the segment, hence all
  before it are). The prefix is public and, while pinned, always cached: its hit tells nothing;
- a per-user salt after the tenant's segment separates one tenant's users the same way, if it
  combines the tenant's secret salt with the user's: a user salt alone anyone can send, and the
  block before it may be an unsalted one that anyone can compute.
Not covered: load. Other tenants' traffic changes queueing delays, admission order and how soon
one's own unpinned blocks are evicted; that shows how much others use, not their tokens.

KV events
---------
While recording (someone subscribed to the engine's KV events), every change to `cached` is
noted as it happens: BlockStored when blocks get their hash in `cache_full_blocks`,
BlockRemoved when lazy eviction forgets one in `_pop_free`, AllBlocksCleared (then the pinned
blocks, which keep their hashes) on `reset_prefix_cache`. Applied in order, they rebuild
`cached`'s keys exactly; `kv_snapshot()` describes the whole set at once. Events carry hashes
and token ids, never a salt.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from streamengine.free_blocks import (
    SHARED_OWNER,
    KVBlock,
    NoFreeBlocksError,
    TenantFreeBlocks,
    take_next,
)
from streamengine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from streamengine.sequence import Sequence


def hash_block(parent: bytes | None, token_ids: list[int], extra: str | None) -> bytes:
    """Chained content hash of one full block, stable across processes and machines.

    The parent hash makes a block's identity depend on the whole prefix; `extra` (the block's
    salt) separates tenants and users: see "Salts and isolation" in the module docstring.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra is not None:
        h.update(b"\x00salt:" + extra.encode())
    return h.digest()


def prompt_block_hashes(
    token_ids: list[int], block_size: int, salt_segments: tuple[tuple[int, str | None], ...] = (),
    cache_salt: str | None = None,
) -> list[bytes]:
    """The chained hashes of every full block of `token_ids`, salted as a sequence with these
    `salt_segments` and `cache_salt` is (see "Salts and isolation"): what a router computes to
    find the engine that holds a request's blocks."""
    return _extend_hashes([], token_ids, block_size, salt_segments, cache_salt)


def _extend_hashes(
    hashes: list[bytes], token_ids: list[int], block_size: int,
    salt_segments: tuple[tuple[int, str | None], ...], cache_salt: str | None,
) -> list[bytes]:
    """Appends to `hashes` (those of the leading blocks) the hashes of the remaining full blocks."""
    bs = block_size
    for i in range(len(hashes), len(token_ids) // bs):
        parent = hashes[i - 1] if i else None
        salt = _segment_salt(salt_segments, cache_salt, (i + 1) * bs - 1)
        hashes.append(hash_block(parent, token_ids[i * bs:(i + 1) * bs], salt))
    return hashes


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class BlockManager:
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
        return _extend_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.salt_segments, seq.cache_salt)

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

    # -- swapping -------------------------------------------------------------------------

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.cpu_free)

    def num_kept_on_swap(self, seq: Sequence) -> int:
        """Leading blocks of `seq` that something else holds too (a pin, another sequence):
        swapping `seq` out keeps its references to them, so they stay on the device, shared.
        Copying them out would free nothing (the other holders keep them), and coming back
        into private copies would need more blocks than `seq` ever took: beside a pinned
        prompt, more than the pool leaves free of pins (the request could never come back)."""
        kept = 0
        for block_id in seq.block_table:
            if self.blocks[block_id].ref_cnt < 2:
                break
            kept += 1
        return kept

    def can_swap_out(self, seq: Sequence) -> bool:
        return bool(seq.block_table) and len(seq.block_table) - self.num_kept_on_swap(seq) <= len(self.cpu_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Moves `seq`'s own blocks to the host pool: returns (device block, host block)
        copies to make before the device blocks are reused. Its leading shared blocks
        (num_kept_on_swap) stay in `seq.block_table`, held; the rest are in
        `seq.cpu_block_table`, in order, after them. A shared block past the first private one
        is copied too (the copy is private to `seq`; the device block stays with the others)."""
        if not self.can_swap_out(seq):
            raise NoFreeBlocksError("not enough free swap blocks")
        kept = self.num_kept_on_swap(seq)
        mapping = [(block_id, self.cpu_free.pop()) for block_id in seq.block_table[kept:]]
        self._release_blocks(seq, kept)
        seq.cpu_block_table = [cpu for _, cpu in mapping]
        return mapping

    def can_swap_in(self, seq: Sequence, reserve: int = 0) -> bool:
        return len(seq.cpu_block_table) + reserve <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Brings `seq`'s host blocks back into fresh device blocks behind the shared ones it
        kept: returns (host block, device block) copies to make before its next forward."""
        if not self.can_swap_in(seq):
            raise NoFreeBlocksError("not enough free KV blocks to swap in")
        mapping = [(cpu, self._pop_free(seq.tenant).block_id) for cpu in seq.cpu_block_table]
        self.cpu_free.extend(reversed(seq.cpu_block_table))
        seq.cpu_block_table = []
        seq.block_table = [*seq.block_table, *(gpu for _, gpu in mapping)]
        # fresh blocks: register their hashes again as they fill
        seq.num_cached_blocks = min(seq.num_cached_blocks, len(seq.block_table) - len(mapping))
        return mapping

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

    # -- pins ------------------------------------------------------------------------------

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
            block.pin_owner = _either(block.pin_owner, owner or _owner_of(block.holders))
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

    # -- KV events ---------------------------------------------------------------------------

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

    def _record_stored(self, seq: Sequence, indices: list[int]) -> None:
        """One BlockStored per run of consecutive block indices of `seq` just cached."""
        start = 0
        for k in range(1, len(indices) + 1):
            if k == len(indices) or indices[k] != indices[k - 1] + 1:
                run = [self.blocks[seq.block_table[i]] for i in indices[start:k]]
                self.kv_events.append(self._stored_event(run))
                start = k

    def _stored_event(self, run: list[KVBlock]) -> BlockStored:
        bs = self.block_size
        tokens = [t for b in run for t in b.token_src[b.token_start:b.token_start + bs]]
        return BlockStored(
            [b.block_hash for b in run], run[0].parent_hash, tokens, bs, medium=self.kv_medium,
        )

    def _record_removed(self, block_hash: bytes) -> None:
        """Evictions in a row go into one BlockRemoved."""
        events = self.kv_events
        if events and isinstance(events[-1], BlockRemoved):
            events[-1].block_hashes.append(block_hash)
        else:
            events.append(BlockRemoved([block_hash], medium=self.kv_medium))

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
        return [_owner_of(b.holders) if b.holders else b.pin_owner for b in self.blocks]


def _segment_salt(
    salt_segments: tuple[tuple[int, str | None], ...], cache_salt: str | None, last_token: int,
) -> str | None:
    """The salt of the segment holding `last_token`; tokens before the first segment, or a
    sequence with none, get `cache_salt`."""
    for start, salt in reversed(salt_segments):
        if start <= last_token:
            return salt
    return cache_salt


def _forget(block: KVBlock) -> None:
    """The block's content no longer counts as cached."""
    block.block_hash = block.parent_hash = block.token_src = None


def _either(owner: str | None, other: str | None) -> str | None:
    if owner is None or owner == other:
        return other
    return owner if other is None else SHARED_OWNER


def _owner_of(holders: dict[str, int]) -> str | None:
    if not holders:
        return None
    return next(iter(holders)) if len(holders) == 1 else SHARED_OWNER


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
