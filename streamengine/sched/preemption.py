"""Preemption: the policy that picks swap or recompute for a victim, and what preempting a
set of sequences would free."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from streamengine.kv.block_manager import BlockManager
from streamengine.sequence import Sequence


@dataclass(slots=True)
class PreemptionPolicy:
    """How to preempt: "recompute", "swap" (recompute when the host pool is full) or "auto".

    "auto" compares estimated costs per victim: recomputing redoes the forward pass of its
    computed tokens; swapping moves its blocks out and back. Multi-sequence groups are always
    swapped when possible, since recomputing them would re-prefill each sample separately.
    """

    mode: str = "recompute"
    recompute_cost_per_token: float = 1.0  # seconds, estimated by the engine for its device
    swap_cost_per_block: float = 0.0

    def should_swap(self, seq: Sequence, block_manager: BlockManager) -> bool:
        if self.mode == "recompute" or not block_manager.can_swap_out(seq):
            return False
        if self.mode == "swap" or seq.group_size > 1:
            return True
        moved = len(seq.block_table) - block_manager.num_kept_on_swap(seq)  # shared ones stay
        swap = 2 * moved * self.swap_cost_per_block  # out and back in
        return swap < seq.num_computed_tokens * self.recompute_cost_per_token


def blocks_freed_by(block_manager: BlockManager, *seqs: Sequence) -> int:
    """Blocks that only `seqs` hold (no pin, no other sequence): what preempting them
    all frees."""
    blocks = block_manager.pool.blocks
    entries = Counter(b for seq in seqs for b in seq.block_table)
    return sum(1 for b, n in entries.items() if blocks[b].ref_cnt == n)
