"""The paged KV-cache pool: physical blocks, refcounts, block tables and the prefix cache.

No torch here: this module decides *which* slots hold which tokens; the model runner moves the
bytes. Invariants (checked by tests/test_block_manager.py):

- a block is in the free queue iff its refcount is 0;
- a block's refcount equals the number of block-table entries that point at it;
- a block holding a hash is reachable from `cached` under that hash (until it is evicted).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from streamengine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    """The pool has no free block left; the scheduler preempts before this can happen."""


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block. `prev`/`next` link it into the free queue while its refcount is 0."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev: KVBlock | None = None
    next: KVBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks, eviction order first.

    Every operation is O(1): a prefix-cache hit must be able to pull a block out of the middle
    of the queue without a scan.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail:
            raise NoFreeBlocksError("no free KV blocks")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        block.prev, block.next = anchor, anchor.next
        anchor.next.prev = block
        anchor.next = block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next
        while block is not self._tail:
            yield block
            block = block.next


def hash_block(parent: bytes | None, token_ids: list[int], extra: str | None) -> bytes:
    """Chained content hash of one full block, stable across processes and machines.

    The parent hash makes a block's identity depend on the whole prefix; `extra` (the tenant's
    cache salt) separates tenants, so one cannot probe another's prompts through cache timing.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra is not None:
        h.update(b"\x00salt:" + extra.encode())
    return h.digest()


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class BlockManager:
    """Hands out blocks a block at a time, shares them by refcount, caches full ones by hash."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0:
            raise ValueError("num_blocks and block_size must be >= 1, num_cpu_blocks >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.stats = PrefixCacheStats()
        # (src, dst) block copies the runner must do before the next forward (copy-on-write)
        self.pending_copies: list[tuple[int, int]] = []
        # The host pool for swapped-out sequences: a plain stack, no sharing or caching there.
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache --------------------------------------------------------------------

    def compute_block_hashes(self, seq: Sequence) -> list[bytes]:
        """Extends `seq.block_hashes` to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs], seq.cache_salt))
        return hashes

    def find_cached_blocks(self, seq: Sequence) -> list[KVBlock]:
        """Longest run of leading full blocks already in the cache.

        Capped so at least one token is left to compute: its logits are needed to sample.
        """
        if not self.enable_prefix_caching:
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
        for i in range(seq.num_cached_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                self.cached[hashes[i]] = block
        seq.num_cached_blocks = num_full

    # -- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock] = (), reserve: int = 0
    ) -> bool:
        """Makes room for `num_new_tokens` more tokens of `seq`; False (and no change) if the
        pool cannot hold them while keeping `reserve` blocks free.

        `cached` are prefix-cache hits from `find_cached_blocks`, taken for a sequence that
        has no blocks yet; they count as computed tokens.
        """
        need = self._num_new_blocks(seq, num_new_tokens, cached)
        cow = self._needs_copy_on_write(seq, num_new_tokens)
        if need + cow + reserve > self._num_available(cached):
            return False
        if cached:
            self._take_cached(seq, cached)
        if cow:
            self._copy_on_write(seq)
        for _ in range(need):
            seq.block_table.append(self._pop_free().block_id)
        return True

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock]) -> int:
        have = len(seq.block_table) + len(cached)
        computed = seq.num_computed_tokens + len(cached) * self.block_size
        return max(0, self.blocks_needed(computed + num_new_tokens) - have)

    def _num_available(self, cached: list[KVBlock]) -> int:
        # A hit on a free cached block takes it out of the free queue.
        return self.num_free_blocks - sum(1 for b in cached if b.ref_cnt == 0)

    def _needs_copy_on_write(self, seq: Sequence, num_new_tokens: int) -> bool:
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
        dst = self._pop_free()
        src.ref_cnt -= 1  # still > 0: another sequence holds it
        seq.block_table[index] = dst.block_id
        self.pending_copies.append((src.block_id, dst.block_id))

    def _take_cached(self, seq: Sequence, cached: list[KVBlock]) -> None:
        if seq.block_table:
            raise ValueError("prefix-cache hits can only start an empty block table")
        for block in cached:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            seq.block_table.append(block.block_id)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_cached_blocks = len(cached)

    def _pop_free(self) -> KVBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:  # lazy eviction: forget the content only now
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    # -- release and sharing -------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s references, tail first, so a prefix outlives its own suffix in the
        cache. Blocks with no cached content go to the front of the queue: reuse them first."""
        self.cpu_free.extend(reversed(seq.cpu_block_table))
        seq.cpu_block_table = []
        self._release_blocks(seq)

    def _release_blocks(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
        seq.block_table = []
        seq.num_cached_blocks = 0

    # -- swapping -------------------------------------------------------------------------

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.cpu_free)

    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < len(seq.block_table) <= len(self.cpu_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Moves `seq` to the host pool: returns (device block, host block) copies to make
        before the device blocks are reused. A block shared with another sequence is copied
        too (the copy is private to `seq`; the device block stays with the other holders)."""
        if not self.can_swap_out(seq):
            raise NoFreeBlocksError("not enough free swap blocks")
        mapping = [(block_id, self.cpu_free.pop()) for block_id in seq.block_table]
        self._release_blocks(seq)
        seq.cpu_block_table = [cpu for _, cpu in mapping]
        return mapping

    def can_swap_in(self, seq: Sequence, reserve: int = 0) -> bool:
        return len(seq.cpu_block_table) + reserve <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Brings `seq` back into fresh device blocks: returns (host block, device block)
        copies to make before its next forward."""
        if not self.can_swap_in(seq):
            raise NoFreeBlocksError("not enough free KV blocks to swap in")
        mapping = [(cpu, self._pop_free().block_id) for cpu in seq.cpu_block_table]
        self.cpu_free.extend(reversed(seq.cpu_block_table))
        seq.cpu_block_table = []
        seq.block_table = [gpu for _, gpu in mapping]
        seq.num_cached_blocks = 0  # fresh blocks: register their hashes again as they fill
        return mapping

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (refcount + 1), like fork(); writes into a
        shared partial block are copied on write by `allocate_slots`."""
        if child.block_table:
            raise ValueError("fork target must have an empty block table")
        for block_id in parent.block_table:
            self.blocks[block_id].ref_cnt += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forgets cached content of free blocks (blocks in use keep their data, not their hash)."""
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()

    def block_states(self) -> list[int]:
        """Per block: 0 free, 1 free but holding cached content, 2 in use, 3 shared."""
        states = []
        for b in self.blocks:
            if b.ref_cnt == 0:
                states.append(0 if b.block_hash is None else 1)
            else:
                states.append(2 if b.ref_cnt == 1 else 3)
        return states
