"""The most prefix-cache hits any eviction policy can get from a pool of a given size.

A replay, not an engine: the requests are served one at a time in the order given, each one's
blocks all resident while it runs, and between requests the cache keeps whatever fits. Evicting
the block whose next use is furthest away (Belady's MIN, 1966) maximizes the number of block
hits for a fixed order, and here it also maximizes prefix hits: a block is only ever used
together with every block before it in its chain, so a parent's next use never comes after its
child's, and breaking ties deepest-first means MIN never keeps a child without its parent. A
block that a later request computes anyway before any prompt could hit it (the same content
stored again) is worth nothing until then, so it counts as never used.

No eviction beats it when the requests run one at a time in this order. A serving engine runs
them side by side, which takes room from the cache (running requests' blocks) but also gives
some back (an answer's blocks do not exist yet while a later request starts), so it is an
estimate of what the pool allows, not a bound an engine cannot cross.
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
    """One request's blocks, each named by a key of its whole prefix (a chain hash), so that
    `prompt` is a leading part of `stored` and both start at the chain's first block."""

    prompt: Sequence[Hashable]  # the leading blocks a cache hit can cover (the engine's cap applied)
    stored: Sequence[Hashable]  # every full block it leaves behind: prompt and answer


def optimal_hits(requests: Sequence[Request], capacity: int, warm: Sequence[Hashable] = ()) -> list[int]:
    """Per request, the blocks of `prompt` an optimal cache of `capacity` blocks hits: the
    leading run already resident when it arrives. `warm` holds blocks computed before the first
    request (the ones with the nearest use are kept if they do not all fit)."""
    if any(len(set(r.stored)) > capacity for r in requests):
        raise ValueError(f"a request stores more than the {capacity} blocks the pool holds")
    uses = _use_times(requests)
    depth = {key: k for r in requests for k, key in enumerate(r.stored)}  # `prompt` leads `stored`
    resident: dict[Hashable, float] = {}  # key -> its next use, as pushed on the heap
    heap: list[tuple[float, int, int, Hashable]] = []  # (-next use, -depth, tiebreak, key): furthest first
    order = itertools.count()

    def touch(key: Hashable, now: int) -> None:
        times = uses.get(key, ())
        at = bisect_right(times, (now, True))
        nxt = NEVER
        if at < len(times) and times[at][1]:  # its next request hits it (else it recomputes it)
            nxt = times[at][0]
        resident[key] = nxt
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


def _use_times(requests: Sequence[Request]) -> dict[Hashable, list[tuple[int, bool]]]:
    """For each key, the requests (by index, ascending) that hold it, each with whether its
    prompt could hit it."""
    uses: dict[Hashable, list[tuple[int, bool]]] = {}
    for i, request in enumerate(requests):
        in_prompt = set(request.prompt)
        for key in dict.fromkeys((*request.prompt, *request.stored)):
            uses.setdefault(key, []).append((i, key in in_prompt))
    return uses
