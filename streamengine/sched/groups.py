"""The sequences of one request (its `n` samples or its beams) share the blocks they computed
over the same tokens, also after one of them was preempted by recompute.

Forking shares a group's prompt blocks; recompute preemption drops a member's blocks. Without
prefix caching nothing brought the sharing back: the member re-prefilled its prompt into
private blocks, so a group that fits the pool shared could need more than the pool unshared,
and its members preempted each other without end (beams wait for each other's logits, so none
finishes to make room). Here a recomputed member starts on a running sibling's computed full
blocks, as it would on prefix-cache hits, and waits while a sibling is still computing the
prompt they share rather than computing it beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamengine.kv.free_blocks import KVBlock
from streamengine.sequence import Sequence

if TYPE_CHECKING:
    from streamengine.sched.scheduler import Scheduler


def cached_blocks(sched: Scheduler, seq: Sequence) -> list[KVBlock]:
    """The leading full blocks `seq` may start on: its prefix-cache hits, or a running
    sibling's computed blocks over the same tokens where those are more."""
    bm = sched.block_manager
    hits = bm.find_cached_blocks(seq)
    sibling = _furthest_sibling(sched, seq)
    if sibling is None or not seq.reads_prefix_cache:
        return hits
    shared = bm.blocks_computed_alike(seq, sibling)
    return shared if len(shared) > len(hits) else hits


def waits_for_sibling(sched: Scheduler, seq: Sequence) -> bool:
    """True while a running sibling is still computing the prompt `seq` would share (asked
    by Scheduler._waits_for_prefix, for a sequence that reads cached blocks)."""
    sibling = _furthest_sibling(sched, seq)
    return sibling is not None and sibling.num_computed_tokens < seq.num_prompt_tokens


def _furthest_sibling(sched: Scheduler, seq: Sequence) -> Sequence | None:
    """The running sequence of `seq`'s request that has computed the most tokens."""
    if seq.group_size == 1:
        return None
    siblings = [s for s in sched.running if s.request_id == seq.request_id and s is not seq]
    return max(siblings, key=lambda s: s.num_computed_tokens, default=None)
