"""Swapping sequences' KV blocks out to the host pool and back: BlockManager's swap methods."""

from __future__ import annotations

from streamengine.kv.free_blocks import NoFreeBlocksError
from streamengine.sequence import Sequence


class KVSwapMixin:
    """The swap part of BlockManager: needs its pool, cpu_free and _release_blocks."""

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
            if self.pool.blocks[block_id].ref_cnt < 2:
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
        mapping = [(cpu, self.pool.pop_free(seq.tenant).block_id) for cpu in seq.cpu_block_table]
        self.cpu_free.extend(reversed(seq.cpu_block_table))
        seq.cpu_block_table = []
        seq.block_table = [*seq.block_table, *(gpu for _, gpu in mapping)]
        # fresh blocks: register their hashes again as they fill
        seq.num_cached_blocks = min(seq.num_cached_blocks, len(seq.block_table) - len(mapping))
        return mapping
