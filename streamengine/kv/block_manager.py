"""Sequences' KV blocks: allocation, prefix lookup, copy-on-write, fork and swap.

No torch here: this decides *which* slots hold which tokens; the model runner moves the bytes.
The manager is the top of three layers: it works on a `BlockPool` (block_pool.py: blocks,
refcounts, free queues, the hash index, KV events) and keeps a `BlockRetention`
(retention.py: pins, the prefixes of waiting requests) beside it. Invariant, checked by
tests/test_block_manager.py: a block's refcount equals the number of block-table entries that
point at it plus its pins.

Content hashes, salts and isolation: block_hash.py. Swapping: swap.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from streamengine.kv.block_hash import sequence_hashes
from streamengine.kv.block_pool import BlockPool, drop, hold
from streamengine.kv.free_blocks import KVBlock
from streamengine.kv.retention import BlockRetention
from streamengine.kv.swap import KVSwapMixin
from streamengine.sequence import Sequence


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class BlockManager(KVSwapMixin):
    """Gives sequences blocks a block at a time, shares them by refcount, caches full ones by hash."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0, weight_of: Callable[[str], float] | None = None,
        tenant_fair_eviction: bool = True,
    ) -> None:
        """`weight_of` and `tenant_fair_eviction` order eviction across tenants (BlockPool)."""
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0:
            raise ValueError("num_blocks and block_size must be >= 1, num_cpu_blocks >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, weight_of, tenant_fair_eviction)
        self.retention = BlockRetention(self.pool, enable_prefix_caching)
        self.stats = PrefixCacheStats()
        # (src, dst) block copies the runner must do before the next forward (copy-on-write)
        self.pending_copies: list[tuple[int, int]] = []
        # The host pool for swapped-out sequences: a plain stack, no sharing or caching there.
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache --------------------------------------------------------------------

    def compute_block_hashes(self, seq: Sequence) -> list[bytes]:
        """Extends `seq.block_hashes` to cover every full block of its known tokens."""
        return sequence_hashes(seq, self.block_size)

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
            block = self.pool.cached.get(block_hash)
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
            shared.append(self.pool.blocks[other.block_table[i]])
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
        pool = self.pool
        stored: list[tuple[int, KVBlock]] = []
        lora_id = seq.lora.lora_id if seq.lora is not None else None
        for i in range(seq.num_cached_blocks, num_full):
            block = pool.blocks[seq.block_table[i]]
            parent = hashes[i - 1] if i else None
            if pool.cache_block(block, hashes[i], parent, seq.token_ids, i * self.block_size, lora_id):
                stored.append((i, block))
        seq.num_cached_blocks = num_full
        if stored and pool.kv_events is not None:
            pool.record_stored(stored)

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
            seq.block_table.append(self.pool.pop_free(seq.tenant).block_id)
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
        return self.pool.blocks[seq.block_table[index]].ref_cnt > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        index = seq.num_computed_tokens // self.block_size
        src = self.pool.blocks[seq.block_table[index]]
        dst = self.pool.pop_free(seq.tenant)
        drop(src, seq.tenant)  # refcount still > 0: another sequence (or a pin) holds it
        seq.block_table[index] = dst.block_id
        self.pending_copies.append((src.block_id, dst.block_id))

    def _take_cached(self, seq: Sequence, cached: list[KVBlock]) -> None:
        if seq.block_table:
            raise ValueError("prefix-cache hits can only start an empty block table")
        for block in cached:
            self.pool.take(block, seq.tenant)
            seq.block_table.append(block.block_id)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_cached_blocks = len(cached)

    # -- release and sharing -------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s references, tail first, so a prefix outlives its own suffix in the
        cache. Blocks with no cached content go to the front of the queue: reuse them first."""
        self.cpu_free.extend(reversed(seq.cpu_block_table))
        seq.cpu_block_table = []
        self._release_blocks(seq)

    def free_unused(self, seq: Sequence) -> None:
        """Gives back the blocks past those `seq`'s tokens fill (held for proposed tokens
        that were rejected, speculative decoding)."""
        keep = self.blocks_needed(seq.num_tokens)
        if len(seq.block_table) > keep:
            self._release_blocks(seq, keep)

    def _release_blocks(self, seq: Sequence, start: int = 0) -> None:
        """Drops `seq`'s references to its blocks from index `start` on, tail first."""
        hashes = seq.block_hashes
        pool = self.pool
        for i in range(len(seq.block_table) - 1, start - 1, -1):
            block = pool.blocks[seq.block_table[i]]
            pool.release(block, seq.tenant)
            if block.block_hash is None and i < len(hashes):
                pool.touch_free_cached(hashes[i])
        seq.block_table = seq.block_table[:start]  # a new list: a plan in flight may hold the old one
        seq.num_cached_blocks = min(seq.num_cached_blocks, start)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (refcount + 1), like fork(); writes into a
        shared partial block are copied on write by `allocate_slots`."""
        if child.block_table:
            raise ValueError("fork target must have an empty block table")
        for block_id in parent.block_table:
            hold(self.pool.blocks[block_id], child.tenant)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
