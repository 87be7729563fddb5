"""Service per tenant, read from `engine.stats()["tenants"]`, and how fair it was: Jain's index
and the largest gap of weighted service among tenants that were backlogged side by side.

Also the backlogged phase of bench/multitenant.py: a few tenants with different weights each
keep far more requests open than the engine can hold, so all of them wait for admission the
whole time. That is the setting where a fairness index is defined (VTC, Sheng et al. OSDI
2024: service among backlogged clients); on the bots' trace, under fair share, the quiet
tenants seldom wait long enough to count as backlogged. FCFS serves each tenant in proportion
to the requests it keeps open; fair share in proportion to its weight.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np

PROMPT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0  # EngineConfig's fair_*_token_weight defaults
BACKLOGGED_TENANTS = (("heavy", 1.0, 3), ("light", 1.0, 1), ("double", 2.0, 2))
"""(name, weight, open requests per unit): "heavy" keeps three times the requests of "light"
at the same weight, "double" twice them at twice the weight. Fair share: service 1:1:2;
FCFS: 3:1:2, whose weighted service 3:1:1 has a Jain index of 0.76."""
BACKLOG_FACTOR = 3
"""Open requests' tokens / the KV pool: enough that each tenant, the lightest included, keeps
requests waiting at every sample under either policy."""
PROMPT_LEN = (256, 768)  # tokens before --scale, drawn per request


@dataclass(slots=True)
class TenantSamples:
    """engine.stats()["tenants"] every `period` seconds: each tenant's cumulative weighted
    service (prompt tokens computed * PROMPT_WEIGHT + output tokens * OUTPUT_WEIGHT) / weight
    and whether it had a request waiting for admission."""

    times: list[float] = field(default_factory=list)
    service: dict[str, list[float]] = field(default_factory=dict)
    waiting: dict[str, list[bool]] = field(default_factory=dict)

    def add(self, now: float, tenants: dict[str, dict]) -> None:
        self.times.append(now)
        for name, t in tenants.items():
            if name not in self.service:  # first seen now: nothing served or waiting before
                self.service[name] = [0.0] * (len(self.times) - 1)
                self.waiting[name] = [False] * (len(self.times) - 1)
            work = t["prompt_tokens"] * PROMPT_WEIGHT + t["output_tokens"] * OUTPUT_WEIGHT
            self.service[name].append(work / t.get("weight", 1.0))
            self.waiting[name].append(t["num_waiting"] > 0)
        for name in self.service.keys() - tenants.keys():
            self.service[name].append(self.service[name][-1])
            self.waiting[name].append(False)


async def sample_tenants(engine, samples: TenantSamples, start: float, period: float) -> None:
    """Until cancelled; nothing on a build whose stats() has no per-tenant figures."""
    while "tenants" in (stats := engine.stats()):
        samples.add(time.perf_counter() - start, stats["tenants"])
        await asyncio.sleep(period)


def window_service(samples: TenantSamples, a: float, b: float) -> dict[str, float]:
    """Weighted service of each tenant that had a request waiting at every sample of [a, b]."""
    i0, i1 = bisect.bisect_left(samples.times, a), bisect.bisect_right(samples.times, b) - 1
    if i1 <= i0:
        return {}
    return {name: service[i1] - service[i0] for name, service in samples.service.items()
            if all(samples.waiting[name][i0 : i1 + 1])}


def jain(xs: list[float]) -> float:
    total, squares = sum(xs), sum(x * x for x in xs)
    return total * total / (len(xs) * squares) if squares else 1.0  # all zero: equal


def fairness(samples: TenantSamples, window: float, until: float | None = None) -> dict:
    """Jain's index and the largest gap of weighted service among tenants backlogged for a
    whole window, over the windows (up to `until` seconds) with two or more of them."""
    if not samples.times:
        return {"jain": None, "jain_min": None, "num_windows": 0, "num_windows_total": 0,
                "max_service_gap": None, "max_service_gap_per_s": None, "worst_windows": []}
    end = samples.times[-1] if until is None else min(until, samples.times[-1])
    total = int(end // window)
    indices, gaps, worst = [], [], []
    for k in range(total):
        by_tenant = window_service(samples, k * window, (k + 1) * window)
        service = list(by_tenant.values())
        if len(service) >= 2:
            indices.append(jain(service))
            gaps.append(max(service) - min(service))
            worst.append((indices[-1], k * window, {name: round(x) for name, x in by_tenant.items()}))
    gap = max(gaps) if gaps else 0.0
    return {
        "jain": float(np.mean(indices)) if indices else 1.0,
        "jain_min": min(indices) if indices else 1.0,
        "num_windows": len(indices),
        "num_windows_total": total,
        "max_service_gap": gap,
        "max_service_gap_per_s": gap / window,
        # The least fair windows: (index, start in seconds, each backlogged tenant's service).
        "worst_windows": sorted(worst, key=lambda w: w[0])[:5],
    }


# -- the backlogged phase -------------------------------------------------------------------


def open_requests(kv_tokens: int, request_tokens: float) -> dict[str, int]:
    """Requests each BACKLOGGED_TENANTS tenant keeps open: BACKLOG_FACTOR pools' worth in all."""
    unit = math.ceil(BACKLOG_FACTOR * kv_tokens / request_tokens / sum(n for _, _, n in BACKLOGGED_TENANTS))
    return {name: n * unit for name, _, n in BACKLOGGED_TENANTS}


async def run_backlogged(engine, token_ids: list[int], *, duration: float, window: float, period: float,
                         kv_tokens: int, scale: float, answer_len: tuple[int, int], seed: int) -> dict:
    """Every BACKLOGGED_TENANTS tenant keeps its requests open (a new one as each ends, fresh
    random tokens, so nothing hits the cache) for `duration` seconds; then all are aborted.
    Returns the fairness over those seconds and each tenant's share of the weighted service."""
    from streamengine import SamplingParams

    lo, hi = max(1, round(PROMPT_LEN[0] * scale)), max(1, round(PROMPT_LEN[1] * scale))
    rng = random.Random(f"{seed}:backlogged")
    counts = open_requests(kv_tokens, (lo + hi + sum(answer_len)) / 2)
    samples = TenantSamples()

    async def client(tenant: str) -> None:
        while True:
            prompt = [token_ids[rng.randrange(len(token_ids))] for _ in range(rng.randint(lo, hi))]
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(*answer_len))
            async for _ in engine.generate(prompt, params, tenant=tenant):
                pass

    # Clients start interleaved across tenants (one of each, in turn, while a tenant has any
    # left), so that FCFS's first admissions do not all go to whichever tenant started first.
    order = sorted(((i / n, name) for name, n in counts.items() for i in range(n)))
    before = engine.stats()["num_preemptions"]
    start = time.perf_counter()
    clients = [asyncio.create_task(client(name)) for _, name in order]
    await asyncio.sleep(period)  # the first sample sees the clients' requests queued
    sampler = asyncio.create_task(sample_tenants(engine, samples, start, period))
    await asyncio.sleep(duration)
    # A last sample now, however late the sampler's own last one ran on a busy machine: the
    # samples then always reach `duration`, and so do the windows.
    samples.add(time.perf_counter() - start, engine.stats()["tenants"])
    for task in [*clients, sampler]:
        task.cancel()  # closes each stream: the engine aborts its request
    await asyncio.gather(*clients, sampler, return_exceptions=True)
    served = {name: _served(samples, name, duration) for name, _, _ in BACKLOGGED_TENANTS}
    total = sum(served.values()) or 1.0
    return {
        "duration_s": duration,
        "window_s": window,
        # Engine steps seen by the samples (the service counters move once a step): a window
        # must hold several, or the index measures where step boundaries fell, not the policy.
        "steps_per_window": _num_jumps(samples, duration) * window / duration,
        "num_preemptions": engine.stats()["num_preemptions"] - before,
        "tenants": {name: {"weight": weight, "open_requests": counts[name],
                           "weighted_service": served[name], "share": served[name] / total}
                    for name, weight, _ in BACKLOGGED_TENANTS},
        "fairness": fairness(samples, window, until=duration),
        "samples": {"times": [round(t, 3) for t in samples.times],
                    "service": {k: [round(x, 1) for x in v] for k, v in samples.service.items()},
                    "waiting": {k: [int(x) for x in v] for k, v in samples.waiting.items()}},
    }


def _num_jumps(samples: TenantSamples, until: float) -> int:
    """Samples before `until` at which some tenant's service had moved since the last one."""
    series = list(samples.service.values())
    return sum(1 for i in range(1, len(samples.times))
               if samples.times[i] <= until and any(s[i] != s[i - 1] for s in series))


def _served(samples: TenantSamples, name: str, until: float) -> float:
    """A tenant's weighted service from the start to the last sample before `until`."""
    i = bisect.bisect_right(samples.times, until) - 1
    series = samples.service.get(name, [])
    return series[i] if 0 <= i < len(series) else 0.0


def backlogged_config(config):
    """`config` with the backlogged phase's tenants and weights instead of the bots."""
    from streamengine.tenancy.tenants import TenantConfig

    tenants = tuple(TenantConfig(name, weight=weight) for name, weight, _ in BACKLOGGED_TENANTS)
    return dataclasses.replace(config, tenants=tenants)
