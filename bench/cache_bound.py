"""The most prefix-cache hits any eviction policy can get from a pool of a given size.

A replay, not an engine: the requests are served one at a time in the order given, each one's
blocks all resident while it runs, and between requests the cache keeps whatever fits. Evicting
the block whose next use is furthest away (Belady's MIN, 1966) maximizes the number of block
hits for a fixed order, and here it also maximizes prefix hits: a block is only ever used
together with every block before it in its chain, so a parent's next use never comes after its
child's, and breaking ties deepest-first means MIN never keeps a child without its parent.

It is an optimistic bound for a serving engine, which also keeps running requests' blocks in
the same pool: no policy can beat it on the same order, and the engine's concurrency can only
take room from the cache.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

NEVER = float("inf")


@dataclass(frozen=True, slots=True)
class Request:
    """One request's blocks, each named by a key of its whole prefix (a chain hash)."""

    prompt: Sequence[Hashable]  # the leading blocks a cache hit can cover (the engine's cap applied)
    stored: Sequence[Hashable]  # every full block it leaves behind: prompt and answer


def optimal_hits(requests: Sequence[Request], capacity: int, warm: Sequence[Hashable] = ()) -> list[int]:
    """Per request, the blocks of `prompt` an optimal cache of `capacity` blocks hits: the
    leading run already resident when it arrives. `warm` holds blocks computed before the first
    request (the ones with the nearest use are kept if they do not all fit)."""
    if any(len(set(r.stored)) > capacity for r in requests):
        raise ValueError(f"a request stores more than the {capacity} blocks the pool holds")
    uses = _use_times(requests)
    depth = {key: k for r in requests for seq in (r.prompt, r.stored) for k, key in enumerate(seq)}
    resident: dict[Hashable, float] = {}  # key -> its next use, as pushed on the heap
    heap: list[tuple[float, int, int, Hashable]] = []  # (-next use, -depth, tiebreak, key): furthest first
    order = itertools.count()

    def touch(key: Hashable, now: int) -> None:
        times = uses.get(key, ())
        at = bisect_right(times, now)
        resident[key] = nxt = times[at] if at < len(times) else NEVER
        heapq.heappush(heap, (-nxt, -depth.get(key, 0), next(order), key))

    def evict_down_to(room: int, keep: set[Hashable]) -> None:
        held = []  # this request's own blocks, popped while it runs: they cannot go
        while len(resident) > room:
            entry = heapq.heappop(heap)
            key = entry[-1]
            if resident.get(key) != -entry[0]:
                continue  # a stale entry: the key was touched (or evicted) since
            if key in keep:
                held.append(entry)
                continue
            del resident[key]
        for entry in held:
            heapq.heappush(heap, entry)

    for key in warm:
        touch(key, -1)
    evict_down_to(capacity, set())
    hits = []
    for now, request in enumerate(requests):
        run = 0
        while run < len(request.prompt) and request.prompt[run] in resident:
            run += 1
        hits.append(run)
        for key in request.stored:
            touch(key, now)
        evict_down_to(capacity, set(request.stored))
    return hits


def _use_times(requests: Sequence[Request]) -> dict[Hashable, list[int]]:
    """For each key, the requests (by index, ascending) whose prompt could hit it."""
    uses: dict[Hashable, list[int]] = {}
    for i, request in enumerate(requests):
        for key in request.prompt:
            uses.setdefault(key, []).append(i)
    return uses

