"""bench/cache_bound.py: Belady's MIN over prefix chains is the best any eviction can do,
checked against an exhaustive search of every eviction choice on small random traces."""

from __future__ import annotations

import itertools
import random
from functools import cache

import pytest
from test_bench_perf_smoke import load_bench

cache_bound = load_bench("cache_bound.py")
Request = cache_bound.Request


def chat_trace(rng: random.Random, num_requests: int) -> tuple[list, list]:
    """Conversations of two bots: each turn's prompt is its bot's system chain plus the
    conversation so far; it leaves one more block (its answer) behind. Keys are the chains
    themselves (tuples), so a key names its whole prefix, as a chain hash does."""
    systems = [tuple(f"s{b}.{k}" for k in range(rng.randint(1, 2))) for b in range(2)]
    chains: dict[int, tuple] = {}
    requests = []
    for t in range(num_requests):
        conv = rng.randrange(4)
        chain = chains.get(conv, systems[conv % 2]) + (f"u{t}",)
        prompt = [chain[: k + 1] for k in range(len(chain))]
        chains[conv] = chain + (f"a{t}",)
        requests.append(Request(prompt, prompt + [chains[conv]]))
    warm = [s[: k + 1] for s in systems for k in range(len(s))]
    return requests, warm


def exhaustive_best(requests: list, capacity: int, warm: list) -> int:
    """Every choice of what to keep, after each request: the most prefix hits in all."""

    def subsets(items: tuple, room: int):
        for size in range(min(room, len(items)) + 1):
            for chosen in itertools.combinations(items, size):
                yield frozenset(chosen)

    @cache
    def best(i: int, resident: frozenset) -> int:
        if i == len(requests):
            return 0
        request = requests[i]
        run = 0
        while run < len(request.prompt) and request.prompt[run] in resident:
            run += 1
        stored = frozenset(request.stored)
        others = tuple(sorted(resident - stored))
        return run + max(best(i + 1, kept | stored) for kept in subsets(others, capacity - len(stored)))

    warm_keys = tuple(sorted(set(warm)))
    return max(best(0, kept) for kept in subsets(warm_keys, capacity))


@pytest.mark.parametrize("seed", range(12))
def test_min_matches_an_exhaustive_search_of_every_eviction(seed):
    rng = random.Random(seed)
    requests, warm = chat_trace(rng, 5)
    capacity = max(len(r.stored) for r in requests) + rng.randint(0, 3)
    hits = cache_bound.optimal_hits(requests, capacity, warm)
    assert sum(hits) == exhaustive_best(requests, capacity, warm)


def test_min_matches_an_exhaustive_search_on_every_short_trace_of_repeated_content():
    """Every trace of four one-block requests over three contents, each either hitting its
    block or computing it anew (1,296 traces, a pool of two): a block that a later request
    recomputes before any hit must count as unused, or MIN keeps it for nothing (4 of them)."""
    options = [Request([key] if hit else [], [key]) for key in (("a",), ("b",), ("c",)) for hit in (False, True)]
    warm = [("a",), ("b",)]
    for trace in itertools.product(options, repeat=4):
        requests = list(trace)
        assert sum(cache_bound.optimal_hits(requests, 2, warm)) == exhaustive_best(requests, 2, warm), trace


def test_a_block_computed_again_before_any_hit_is_worth_no_room():
    # X is recomputed by the second request before the third hits it, so keeping Y (hit by
    # the fourth) is the better use of the room the first request leaves.
    requests = [Request([], ["Z"]), Request([], ["X"]), Request(["X"], ["X"]), Request(["Y"], ["Y"])]
    assert cache_bound.optimal_hits(requests, 2, ["X", "Y"]) == [0, 0, 1, 1]


def test_a_pool_that_holds_everything_hits_every_block_seen_before():
    requests, warm = chat_trace(random.Random(7), 12)
    hits = cache_bound.optimal_hits(requests, 10_000, warm)
    seen = set(warm)
    for request, got in zip(requests, hits, strict=True):
        assert got == next((k for k, key in enumerate(request.prompt) if key not in seen), len(request.prompt))
        seen.update(request.stored)


def test_a_smaller_pool_never_hits_more():
    requests, warm = chat_trace(random.Random(3), 30)
    least = max(len(r.stored) for r in requests)
    totals = [sum(cache_bound.optimal_hits(requests, c, warm)) for c in range(least, least + 12)]
    assert totals == sorted(totals) and totals[0] < totals[-1]


def test_a_request_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="stores more than the 2 blocks"):
        cache_bound.optimal_hits([Request(["a"], ["a", "b", "c"])], 2)
