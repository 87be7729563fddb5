"""The sequences of one request (its `n` samples or its beams) share the blocks they computed
over the same tokens, also after one of them was preempted by recompute.

Forking shares a group's prompt blocks; recompute preemption drops a member's blocks. Without
prefix caching nothing brought the sharing back: the member re-prefilled its prompt into
private blocks, so a group that fits the pool shared could need more than the pool unshared,
and its members preempted each other without end (beams wait for each other's logits, so none
finishes to make room). Here a recomputed member starts on a running sibling's computed full
blocks, as it would on prefix-cache hits, and waits while a sibling is still computing the
prompt they share rather than computing it beside it.

Beams advance together: a beam that has its logits computes nothing more until its siblings
have theirs. When every running sequence so waits on a sibling that cannot get blocks, the
waiting ones make way (`make_way_for_siblings`): the group then finishes its members in turn,
each recomputing on what the others computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamengine.kv.free_blocks import KVBlock
from streamengine.sequence import Sequence

if TYPE_CHECKING:
    from streamengine.sched.plan import SchedulerOutput
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


def make_way_for_siblings(sched: Scheduler, out: SchedulerOutput, yielded: list[Sequence]) -> None:
    """The step scheduled nothing, yet sequences run: they are idle (beams waiting for a
    sibling's logits) while that sibling, queued, cannot get blocks. The policy's victims
    recompute later, behind the blocked sibling (ahead of it, they would take the same blocks
    back: a livelock), until something is scheduled or nothing runs."""
    while not out.scheduled and sched.running and (sched.waiting or sched.swapped):
        victim = sched.policy.take_victim(sched, out, None)
        sched._preempt(victim, front=False)
        out.preempted.append(victim)
        sched.caps.prefill_slices.clear()  # split for a step that scheduled nothing
        budget = sched._schedule_swapped(out, sched.max_num_batched_tokens)
        if not sched.swapped:
            sched._schedule_waiting(out, budget, yielded)


def _furthest_sibling(sched: Scheduler, seq: Sequence) -> Sequence | None:
    """The running sequence of `seq`'s request that has computed the most tokens."""
    if seq.group_size == 1:
        return None
    siblings = [s for s in sched.running if s.request_id == seq.request_id and s is not seq]
    return max(siblings, key=lambda s: s.num_computed_tokens, default=None)
