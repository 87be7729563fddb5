"""KV blocks and the free lists that order their eviction.

A block whose refcount drops to 0 keeps its content (lazy eviction) and waits in a free list
until it is reused or hit again. `FreeBlockQueue` is one LRU list with O(1) removal from the
middle (a prefix-cache hit pulls a block out wherever it is). `TenantFreeBlocks` is a tier of
free blocks kept as one such list per tenant, and `take_next` evicts from the tenant whose free
cached blocks, per unit of weight, are the most, LRU within that tenant.

Why per tenant: under plain LRU the cache follows the traffic. A busy tenant's finished
conversations push out everything older, and a quiet bot's system prompt, last used a minute
ago, is gone before its next conversation comes; the busy tenant's dead histories survive in
its place. Evicting from the largest holder first gives every tenant an equal (weighted) claim
on the free part of the cache, max-min fair: a tenant holding little keeps it, whatever the
others send. With one tenant it is plain LRU. The block manager keeps two tiers (blocks no
waiting request will hit, then those one will): the tenant is chosen first, over both, and the
tiers order that tenant's own blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field


class NoFreeBlocksError(RuntimeError):
    """The pool has no free block left; the scheduler preempts before this can happen."""


SHARED_OWNER = "*"
"""`block_tenants()`'s owner of a block that several tenants hold."""


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block. `prev`/`next` link it into a free list while its refcount is 0.

    `ref_cnt` counts every reference: one per block-table entry (tallied by tenant in
    `holders`) plus `pins`."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev: KVBlock | None = None
    next: KVBlock | None = None
    holders: dict[str, int] = field(default_factory=dict)  # tenant -> block-table entries
    pins: int = 0
    pin_owner: str | None = None  # shown by block_tenants() while no sequence holds it
    queue: FreeBlockQueue | TenantFreeBlocks | None = None  # where it is free, while its refcount is 0
    free_list: FreeBlockQueue | None = None  # the list inside `queue` that links it
    evict_tenant: str = SHARED_OWNER  # while free: whose share of the free cache it counts in
    # While it holds a hash: its parent's hash and where its tokens are (the caching
    # sequence's token list, only ever appended to, from token_start), for KV-event snapshots.
    parent_hash: bytes | None = None
    token_src: list[int] | None = None
    token_start: int = 0
    lora_id: int | None = None  # the LoRA adapter that computed its K/V (KV events say it)


class FreeBlockQueue:
    """Doubly linked list of free blocks, eviction order first.

    Every operation is O(1): a prefix-cache hit must be able to pull a block out of the middle
    of the queue without a scan.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
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
        block.prev = block.next = block.queue = block.free_list = None
        self.num_free -= 1

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        block.queue = block.free_list = self
        block.prev, block.next = anchor, anchor.next
        anchor.next.prev = block
        anchor.next = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next
        while block is not self._tail:
            yield block
            block = block.next


class TenantFreeBlocks:
    """A tier of free blocks: those holding no content, and each tenant's cached ones in its
    own LRU list (filed under their `evict_tenant`). `take_next` decides across tiers which
    block goes first.

    A chain's blocks are one tenant's (salted blocks are private), so each tenant's list keeps
    the block manager's tail-first order."""

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._empty = FreeBlockQueue()  # blocks holding no cached content
        self._tenants: dict[str, FreeBlockQueue] = {}  # only tenants with free cached blocks
        self.num_free = 0
        for block in blocks:
            self.append(block)

    @property
    def num_empty(self) -> int:
        """Free blocks holding no cached content."""
        return self._empty.num_free

    def tenants(self) -> Iterable[str]:
        """The tenants with free cached blocks here."""
        return self._tenants.keys()

    def num_cached(self, tenant: str) -> int:
        """Free cached blocks filed under `tenant`."""
        free_list = self._tenants.get(tenant)
        return free_list.num_free if free_list is not None else 0

    def popleft(self, tenant: str | None = None) -> KVBlock:
        """A block holding no content if any (None), else `tenant`'s least recently used."""
        if tenant is None:
            block = self._empty.popleft()
        else:
            block = self._tenants[tenant].popleft()
            self._drop_if_empty(tenant)
        self.num_free -= 1
        return block

    def append(self, block: KVBlock) -> None:
        self._list_for(block).append(block)
        block.queue = self
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        self._list_for(block).appendleft(block)
        block.queue = self
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        free_list = block.free_list
        free_list.remove(block)
        self.num_free -= 1
        if free_list is not self._empty:
            self._drop_if_empty(block.evict_tenant)

    def __iter__(self) -> Iterator[KVBlock]:
        """Blocks without content, then each tenant's in its LRU order (the order within a
        tenant is the eviction order; across tenants it depends on the counts as they fall)."""
        yield from self._empty
        for free_list in list(self._tenants.values()):
            yield from free_list

    def _list_for(self, block: KVBlock) -> FreeBlockQueue:
        if block.block_hash is None:
            return self._empty
        free_list = self._tenants.get(block.evict_tenant)
        if free_list is None:
            free_list = self._tenants[block.evict_tenant] = FreeBlockQueue()
        return free_list

    def _drop_if_empty(self, tenant: str) -> None:
        if not self._tenants[tenant].num_free:
            del self._tenants[tenant]


def take_next(tiers: Sequence[TenantFreeBlocks], weight_of: Callable[[str], float]) -> KVBlock:
    """Takes the free block to reuse next: one holding no content (nothing is lost); else one
    of the tenant whose free cached blocks, all tiers together, are the most per unit of
    weight: its least recently used in the first tier where it has any.

    Counting every tier is what makes the split fair: a busy tenant's waiting requests want
    more history than the pool can keep, and counted apart those wanted blocks would outrank
    every other tenant's cache. Counted together, the busy tenant gives up its own oldest
    blocks first, and another tenant's cached prefix goes only once the busy tenant holds no
    more than it. Choosing scans the tenants with free cached blocks: cheap next to a step's
    forward pass for the tenant counts one engine serves (a heap would make it logarithmic)."""
    for tier in tiers:
        if tier.num_empty:
            return tier.popleft()
    held: dict[str, int] = {}
    for tier in tiers:
        for tenant in tier.tenants():
            held[tenant] = held.get(tenant, 0) + tier.num_cached(tenant)
    if not held:
        raise NoFreeBlocksError("no free KV blocks")
    tenant = max(held, key=lambda t: held[t] / weight_of(t))
    return next(tier for tier in tiers if tier.num_cached(tenant)).popleft(tenant)
