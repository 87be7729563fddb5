"""Multi-tenant bots: FCFS with plain LRU against fair share with pinned system prompts.

Workload (seeded, nothing downloaded): `--bots` bots with Zipf(`--zipf`) popularity, each with
its own system prompt of random ordinary tokens (300-1,500 tokens); conversations of 3-6 turns
start by Poisson arrivals at `--rate` conversations/s over `--duration` seconds, each turn
re-sending the whole history (system prompt, every user turn of 20-80 random tokens and every
answer so far). An answer is exactly the drawn 16-64 tokens (greedy, `ignore_eos`), and a
conversation's next turn is sent when its previous answer finished (closed loop per
conversation), after an exponential pause of mean `--think-time` seconds (0 by default: at
once). During the middle third of the run one noisy bot (Zipf rank `--noisy-rank`)
starts `--burst-factor` times its share of conversations. The KV pool holds `--kv-fraction` of
all tokens the run ever holds (every system prompt plus every conversation's full history).
`--scale` multiplies every length range (`--quick` runs the same shape smaller and shorter).

Two systems, same weights, same KV pool, same arrivals, one after the other:

  baseline      scheduling_policy="fcfs", nothing pinned, retain_waiting_prefixes=False and
                tenant_fair_eviction=False: plain LRU eviction across all bots, each bot's salt
                isolating its cache (what vLLM does with a per-bot cache_salt)
  streamengine  scheduling_policy="fair" (virtual token counter, cache-aware admission), each
                bot's system prompt pinned (most popular first, up to max_pinned_fraction),
                waiting requests' cached prefixes evicted last, and the free cache shared
                max-min fairly between bots (the defaults)

Both start warm in the same way: each bot's system prompt is computed once before the clock
starts (pinned by streamengine, a one-token request for the baseline). Measured per tenant class
(noisy = the noisy bot, popular = the other bots among the `--popular` top ranks, rare = the
rest): TTFT p50/p99, over all turns and over the turns submitted during the burst (from its
first extra conversation's start to its last extra conversation's last answer: each one goes
on, closed-loop, after the burst's last start), output tokens/s over the run, prefix hit rate (num_cached_tokens / prompt tokens). Fairness, from
`engine.stats()["tenants"]` sampled every `--sample-period` seconds: the run is cut into
`--window`-second windows; in each, the tenants with a request waiting for admission at every
sample are backlogged, and each one's service is (prompt tokens computed *
fair_prompt_token_weight + output tokens * fair_output_token_weight) / weight. Jain's index of
the backlogged tenants' service, averaged over windows with two or more of them (1.0 when there
is none: no two tenants waited a whole window side by side), and the largest service gap
between two backlogged tenants of a window.

Under fair share the bots seldom wait a whole window, so each system also runs a backlogged
phase (bench/tenant_service.py) on a fresh engine with the same pool and budget: three tenants
of weights 1, 1 and 2 keep 3:1:2 open requests, three pools' worth in all, for
`--backlogged-s` seconds, so every one of them waits for admission throughout. Jain's index
over `--backlogged-window`-second windows of that phase is `jain_fair` / `jain_baseline`; the
bots' trace's own is `jain_fair_trace` / `jain_baseline_trace`.

    python bench/multitenant.py --quick     # < 5 min on a 2-core CPU
    python bench/multitenant.py             # full shape
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

import numpy as np  # noqa: E402
import torch  # noqa: E402
from cache_bound import Request, optimal_hits  # noqa: E402
from common import load_bench_model, mode_defaults, software, write_report  # noqa: E402
from tenant_service import (  # noqa: E402
    TenantSamples,
    backlogged_config,
    fairness,
    run_backlogged,
    sample_tenants,
)
from tqdm import tqdm  # noqa: E402
from traces import normal_token_ids  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16
SYSTEMS = ("baseline", "streamengine")
POLICIES = {"baseline": "fcfs", "streamengine": "fair"}
CLASSES = ("noisy", "popular", "rare")
GOALS = {  # report key: the least value that meets the goal
    "quiet_ttft_p99_ratio": 5.0,
    "hit_rate_gain_points": 15.0,
    "throughput_ratio": 0.95,
    "jain_fair": 0.95,
}


# -- workload -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bot:
    name: str
    rank: int  # 0 = most popular
    share: float  # of conversation starts outside the burst
    klass: str  # one of CLASSES
    system: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Conversation:
    index: int
    bot: int
    arrival_s: float  # offset from the start of the run
    users: tuple[tuple[int, ...], ...]  # one user turn per turn
    answer_lens: tuple[int, ...]
    burst: bool  # one of the noisy bot's extra conversations
    think_s: tuple[float, ...] = ()  # the user's pause before each turn after the first (none: back to back)

    @property
    def history_tokens(self) -> int:
        return sum(len(u) for u in self.users) + sum(self.answer_lens)


@dataclass(frozen=True, slots=True)
class Workload:
    bots: tuple[Bot, ...]
    conversations: tuple[Conversation, ...]
    duration_s: float
    burst: tuple[float, float]  # [start, end) of the noisy bot's extra conversation starts, seconds

    @property
    def footprint_tokens(self) -> int:
        """Every token the run ever holds: each system prompt and each full history."""
        return sum(len(b.system) for b in self.bots) + sum(c.history_tokens for c in self.conversations)

    @property
    def longest_turn_tokens(self) -> int:
        return max(len(self.bots[c.bot].system) + c.history_tokens for c in self.conversations)


def scaled(bounds: tuple[int, int], scale: float) -> tuple[int, int]:
    return max(1, round(bounds[0] * scale)), max(1, round(bounds[1] * scale))


def zipf_shares(n: int, s: float) -> list[float]:
    weights = [1.0 / (k ** s) for k in range(1, n + 1)]
    return [w / sum(weights) for w in weights]


def bot_class(rank: int, noisy: int, popular: int) -> str:
    if rank == noisy:
        return "noisy"
    return "popular" if rank < popular else "rare"


def make_bots(args, rng: random.Random, token_ids: list[int]) -> tuple[Bot, ...]:
    lo, hi = scaled(args.system_len, args.scale)
    shares = zipf_shares(args.bots, args.zipf)
    return tuple(
        Bot(f"bot{rank:02d}", rank, share, bot_class(rank, args.noisy_rank - 1, args.popular),
            random_ids(rng, token_ids, rng.randint(lo, hi)))
        for rank, share in enumerate(shares)
    )


def random_ids(rng: random.Random, ids: list[int], n: int) -> tuple[int, ...]:
    return tuple(ids[rng.randrange(len(ids))] for _ in range(n))


def poisson_times(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    times, t = [], start
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= end:
            return times
        times.append(t)
    return times


def arrivals(args, rng: random.Random, bots: tuple[Bot, ...]) -> list[tuple[float, int, bool]]:
    """(time, bot, extra) of every conversation start: Zipf over the whole run, plus the noisy
    bot's extra (burst_factor - 1) x its share during the middle third."""
    shares = [b.share for b in bots]
    base = [(t, rng.choices(range(len(bots)), shares)[0], False)
            for t in poisson_times(rng, args.rate, 0.0, args.duration)]
    noisy = args.noisy_rank - 1
    extra_rate = (args.burst_factor - 1) * args.rate * shares[noisy]
    burst = poisson_times(rng, extra_rate, args.duration / 3, 2 * args.duration / 3)
    return sorted(base + [(t, noisy, True) for t in burst])


def make_workload(args, token_ids: list[int]) -> Workload:
    rng = random.Random(f"{args.seed}:multitenant")
    bots = make_bots(args, rng, token_ids)
    user_lo, user_hi = scaled(args.user_len, args.scale)
    ans_lo, ans_hi = scaled(args.answer_len, args.scale)
    # Think times come from their own generator, so that the rest of the trace is the same
    # with and without them.
    think, think_rng = args.think_time, random.Random(f"{args.seed}:think")
    conversations = []
    for i, (t, bot, extra) in enumerate(arrivals(args, rng, bots)):
        turns = rng.randint(*args.turns)
        users = tuple(random_ids(rng, token_ids, rng.randint(user_lo, user_hi)) for _ in range(turns))
        answers = tuple(rng.randint(ans_lo, ans_hi) for _ in range(turns))
        pauses = tuple(think_rng.expovariate(1 / think) for _ in range(turns - 1)) if think > 0 else ()
        conversations.append(Conversation(i, bot, t, users, answers, extra, pauses))
    burst = (args.duration / 3, 2 * args.duration / 3)
    return Workload(bots, tuple(conversations), args.duration, burst)


def describe(workload: Workload) -> dict:
    convs = workload.conversations
    by_class = {k: sum(workload.bots[c.bot].klass == k for c in convs) for k in CLASSES}
    return {
        "num_bots": len(workload.bots),
        "num_conversations": len(convs),
        "num_turns": sum(len(c.users) for c in convs),
        "conversations_by_class": by_class,
        "noisy_bot": next(b.name for b in workload.bots if b.klass == "noisy"),
        "popular_bots": [b.name for b in workload.bots if b.klass == "popular"],
        "system_prompt_tokens": [len(b.system) for b in workload.bots],
        "bot_shares": [round(b.share, 4) for b in workload.bots],
        "footprint_tokens": workload.footprint_tokens,
        "longest_turn_tokens": workload.longest_turn_tokens,
        "burst_s": list(workload.burst),
    }


# -- driving the engine ---------------------------------------------------------------------


@dataclass(slots=True)
class Turn:
    bot: int
    conversation: int
    submit: float  # seconds from the start of the run
    first_token: float = 0.0
    finish: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    queue_s: float = 0.0  # of its time to first token, the wait for admission (the engine's clock)
    token_ids: tuple[int, ...] = ()  # prompt and answer: for the unbounded-cache hit rate

    @property
    def ttft(self) -> float:
        return self.first_token - self.submit


async def run_turn(engine, turn: Turn, prompt: list[int], max_tokens: int, tenant: str | None,
                   start: float) -> list[int]:
    """Sends one turn and fills in its timings and counts; returns the answer's token ids."""
    from streamengine import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    last = None
    async for out in engine.generate(prompt, params, tenant=tenant):
        if last is None and out.outputs[0].token_ids:
            turn.first_token = time.perf_counter() - start
        last = out
    turn.finish = time.perf_counter() - start
    answer = list(last.outputs[0].token_ids) if last is not None else []
    if len(answer) != max_tokens:
        raise RuntimeError(f"a turn of {tenant} got {len(answer)} tokens for max_tokens={max_tokens}")
    turn.prompt_tokens, turn.cached_tokens, turn.output_tokens = len(prompt), last.num_cached_tokens, len(answer)
    turn.queue_s = last.metrics.queue_time
    turn.token_ids = (*prompt, *answer)
    return answer


async def run_conversation(engine, workload: Workload, conv: Conversation, start: float, bar: tqdm) -> list[Turn]:
    await asyncio.sleep(max(0.0, start + conv.arrival_s - time.perf_counter()))
    bot = workload.bots[conv.bot]
    history = list(bot.system)
    turns = []
    for k, (user, answer_len) in enumerate(zip(conv.users, conv.answer_lens, strict=True)):
        if k and conv.think_s:
            await asyncio.sleep(conv.think_s[k - 1])
        prompt = history + list(user)
        turn = Turn(conv.bot, conv.index, time.perf_counter() - start)
        history = prompt + await run_turn(engine, turn, prompt, answer_len, bot.name, start)
        turns.append(turn)
        bar.update(1)
    return turns


async def prepare_prefixes(engine, workload: Workload, pin: bool) -> list[str]:
    """Computes every system prompt once before the clock starts; pins them (most popular
    first, while the pool's pinned share allows) when `pin`. Returns the pinned bots."""
    from streamengine.errors import LimitExceededError

    pinned = []
    for bot in workload.bots:
        if pin:
            try:
                await engine.pin_prefix(list(bot.system), tenant=bot.name)
                pinned.append(bot.name)
                continue
            except LimitExceededError:
                pin = False  # the pool's pinned share is used up: warm the rest like the baseline
        await run_turn(engine, Turn(bot.rank, -1, 0.0), list(bot.system), 1, bot.name, time.perf_counter())
    return pinned


def engine_config(args, workload: Workload, system: str):
    from streamengine import EngineConfig
    from streamengine.tenancy.tenants import TenantConfig

    return EngineConfig(
        model=str(args.folder), dtype="float32", device=args.device, block_size=BLOCK_SIZE,
        kv_cache_bytes=args.kv_bytes, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads, seed=args.seed,
        scheduling_policy=POLICIES[system], tenants=tuple(TenantConfig(b.name) for b in workload.bots),
        # The baseline evicts by plain LRU across all tenants, as vLLM does.
        retain_waiting_prefixes=system == "streamengine", tenant_fair_eviction=system == "streamengine",
    )


@dataclass(slots=True)
class SystemRun:
    system: str
    turns: list[Turn]
    pinned: list[str]
    stats: dict  # engine.stats() deltas and final figures
    kv_capacity_tokens: int
    samples: TenantSamples


async def run_system(loaded, args, workload: Workload, system: str) -> SystemRun:
    from streamengine import AsyncEngine

    engine = AsyncEngine(engine_config(args, workload, system), loaded=loaded)
    total = sum(len(c.users) for c in workload.conversations)
    samples = TenantSamples()
    async with engine:
        # First-call overheads, on a prompt and a tenant that share nothing with the workload.
        await run_turn(engine, Turn(-1, -1, 0.0), [workload.bots[0].system[0]] * 8, 2, None, time.perf_counter())
        pinned = await prepare_prefixes(engine, workload, pin=system == "streamengine")
        before = engine.stats()
        with tqdm(total=total, desc=system, unit="turn", file=sys.stderr, dynamic_ncols=True) as bar:
            start = time.perf_counter()
            sampler = asyncio.create_task(sample_tenants(engine, samples, start, args.sample_period))
            runs = await asyncio.gather(*(run_conversation(engine, workload, c, start, bar)
                                          for c in workload.conversations))
            sampler.cancel()
        after = engine.stats()
    del engine
    gc.collect()
    stats = {k: after[k] - before[k] for k in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")}
    if "tenants" in after:
        stats["tenants"] = after["tenants"]
    turns = [t for run in runs for t in run]
    return SystemRun(system, turns, pinned, stats, after["num_total_blocks"] * BLOCK_SIZE, samples)


async def run_backlogged_system(loaded, args, workload: Workload, system: str, token_ids: list[int]) -> dict:
    """tenant_service's backlogged phase on a fresh engine of `system` (same pool and budget)."""
    from streamengine import AsyncEngine

    engine = AsyncEngine(backlogged_config(engine_config(args, workload, system)), loaded=loaded)
    async with engine:
        result = await run_backlogged(
            engine, token_ids, duration=args.backlogged_s, window=args.backlogged_window, period=args.sample_period,
            kv_tokens=args.kv_tokens, scale=args.scale, answer_len=scaled(args.answer_len, args.scale),
            seed=args.seed)
    del engine
    gc.collect()
    return result


# -- metrics --------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def hit_rate(turns: list[Turn]) -> float:
    return _rate(sum(t.cached_tokens for t in turns), turns)


def unbounded_hits(turns: list[Turn], workload: Workload) -> list[int]:
    """Per turn (in the order given), the prompt tokens a cache that never evicts would hit:
    its prompt's leading full blocks that an earlier turn (submitted before it) computed; the
    engine's cap (the last prompt token is always computed) applies."""
    return ceiling_hits(turns, workload, sys.maxsize)


def optimal_hit_rate(turns: list[Turn], workload: Workload, kv_tokens: int) -> float:
    """The hit rate of this run's turns, in their submission order, with the best eviction a
    pool of `kv_tokens` allows when they run one at a time (Belady's MIN, bench/cache_bound.py),
    every system prompt computed before the clock."""
    return _rate(sum(ceiling_hits(turns, workload, kv_tokens // BLOCK_SIZE)), turns)


def ceiling_hits(turns: list[Turn], workload: Workload, capacity: int) -> list[int]:
    """Per turn (in the order given), the prompt tokens the best eviction of a pool of
    `capacity` blocks hits, the turns replayed one at a time in submission order."""
    order = replay(turns)
    hits = [0] * len(turns)
    for (i, _), n in zip(order, optimal_hits([r for _, r in order], capacity, warm_blocks(workload)), strict=True):
        hits[i] = BLOCK_SIZE * n
    return hits


def _rate(hit_tokens: int, turns: list[Turn]) -> float:
    prompt = sum(t.prompt_tokens for t in turns)
    return hit_tokens / prompt if prompt else 0.0


def replay(turns: list[Turn]) -> list[tuple[int, Request]]:
    """The turns in submission order, each as (its index in `turns`, its blocks): those its
    prompt could hit (the engine's cap: the last prompt token is always computed) and those it
    leaves cached (the last answer token is never fed back)."""
    order = sorted(range(len(turns)), key=lambda i: turns[i].submit)
    requests = []
    for i in order:
        turn = turns[i]
        stored = _block_prefixes(turn.token_ids[:-1])  # the prompt's blocks lead it
        requests.append((i, Request(stored[: (turn.prompt_tokens - 1) // BLOCK_SIZE], stored)))
    return requests


def warm_blocks(workload: Workload) -> list[int]:
    """The system prompts' blocks, computed before the clock starts."""
    return [prefix for bot in workload.bots for prefix in _block_prefixes(bot.system)]


def lost_hits(turns: list[Turn], bounds: list[int], workload: Workload) -> dict[str, int]:
    """The prompt tokens the run computed that a cache that never evicts would have hit
    (`bounds`, per turn: unbounded_hits), split into those of the bots' system prompts (evicted
    prefixes) and of the conversations' histories."""
    system = history = 0
    for turn, bound in zip(turns, bounds, strict=True):
        lost = max(0, bound - turn.cached_tokens)
        in_system = len(workload.bots[turn.bot].system) // BLOCK_SIZE * BLOCK_SIZE
        lost_system = min(lost, max(0, min(bound, in_system) - turn.cached_tokens))
        system += lost_system
        history += lost - lost_system
    return {"system_prompt": system, "history": history}


def _block_prefixes(ids: tuple[int, ...]) -> list[int]:
    """One key per full block: the hash of everything up to its end (no salts: the bots'
    prompts and conversations share no tokens by construction)."""
    return [hash(ids[: (i + 1) * BLOCK_SIZE]) for i in range(len(ids) // BLOCK_SIZE)]


def makespan(turns: list[Turn]) -> float:
    return max(t.finish for t in turns) - min(t.submit for t in turns)


def burst_period(turns: list[Turn], workload: Workload) -> tuple[float, float]:
    """From the first extra start of the noisy bot to the last answer of its extra
    conversations: the burst's turns go on after its last start, each conversation closed-loop."""
    extra = {c.index for c in workload.conversations if c.burst}
    ends = [t.finish for t in turns if t.conversation in extra]
    return workload.burst[0], max(ends, default=workload.burst[1])


def class_metrics(turns: list[Turn], bounds: list[int], workload: Workload, period: tuple[float, float],
                  span: float) -> dict:
    """One tenant class's figures; `bounds`: each turn's hits with a cache that never evicts."""
    ttft = [t.ttft for t in turns]
    in_burst = [t for t in turns if period[0] <= t.submit < period[1]]
    burst = [t.ttft for t in in_burst]
    return {
        "num_turns": len(turns),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "ttft_p50_burst_s": pct(burst, 50),
        "ttft_p99_burst_s": pct(burst, 99),
        "queue_p99_burst_s": pct([t.queue_s for t in in_burst], 99),
        "output_tok_s": sum(t.output_tokens for t in turns) / span,
        "hit_rate": hit_rate(turns),
        "hit_rate_unbounded": _rate(sum(bounds), turns),
        "lost_hit_tokens": lost_hits(turns, bounds, workload),
    }


def summarize(run: SystemRun, workload: Workload, window: float) -> dict:
    span = makespan(run.turns)
    period = burst_period(run.turns, workload)
    quiet = [t for t in run.turns if workload.bots[t.bot].klass != "noisy" and period[0] <= t.submit < period[1]]
    quiet_burst = [t.ttft for t in quiet]
    # The never-evicting cache's hits, once for all turns: the bots share no blocks, so a
    # class's turns replayed alone would hit the same.
    bounds = unbounded_hits(run.turns, workload)
    classes = {}
    for k in CLASSES:
        mine = [i for i, t in enumerate(run.turns) if workload.bots[t.bot].klass == k]
        classes[k] = class_metrics([run.turns[i] for i in mine], [bounds[i] for i in mine], workload, period, span)
    return {
        "num_turns": len(run.turns),
        "num_conversations": len({t.conversation for t in run.turns}),
        "makespan_s": span,
        "output_tok_s": sum(t.output_tokens for t in run.turns) / span,
        "hit_rate": hit_rate(run.turns),
        "hit_rate_unbounded": _rate(sum(bounds), run.turns),
        "hit_rate_optimal": optimal_hit_rate(run.turns, workload, run.kv_capacity_tokens),
        "ttft_p50_s": pct([t.ttft for t in run.turns], 50),
        "ttft_p99_s": pct([t.ttft for t in run.turns], 99),
        "quiet_ttft_p99_burst_s": pct(quiet_burst, 99),
        "quiet_ttft_p50_burst_s": pct(quiet_burst, 50),
        "quiet_queue_p99_burst_s": pct([t.queue_s for t in quiet], 99),  # the admission wait's part
        "quiet_turns_burst": len(quiet_burst),
        "burst_period_s": list(period),
        "classes": classes,
        "fairness": fairness(run.samples, window),
        "pinned_bots": run.pinned,
        "kv_capacity_tokens": run.kv_capacity_tokens,
        "engine": run.stats,
        "turns": [[t.bot, round(t.submit, 3), round(t.ttft, 4)] for t in run.turns],  # for plots
    }


# -- report ---------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goals(report: dict) -> dict:
    values = {
        "quiet_ttft_p99_ratio": report["quiet_ttft_p99_ratio"],
        "hit_rate_gain_points": report["hit_rate_gain_points"],
        "throughput_ratio": report["throughput_ratio"],
        "jain_fair": report["jain_fair"],
    }
    return {k: {"target": f">= {GOALS[k]:g}", "value": v, "met": v is not None and v >= GOALS[k]}
            for k, v in values.items()}


def build_report(args, workload: Workload, systems: dict[str, dict]) -> dict:
    base, ours = systems.get("baseline"), systems.get("streamengine")
    report = {
        "quiet_ttft_p99_ratio": ratio(base and base["quiet_ttft_p99_burst_s"], ours and ours["quiet_ttft_p99_burst_s"]),
        "hit_rate_fair": ours["hit_rate"] if ours else None,
        "hit_rate_baseline": base["hit_rate"] if base else None,
        "hit_rate_gain_points": 100 * (ours["hit_rate"] - base["hit_rate"]) if base and ours else None,
        # The ceiling: no eviction at all, on the same turns (a gain past it is impossible).
        "hit_rate_unbounded": ours["hit_rate_unbounded"] if ours else None,
        # The ceiling with this pool: the best eviction, serving the same turns one at a time.
        "hit_rate_optimal": ours["hit_rate_optimal"] if ours else None,
        **headroom(base, ours),
        "throughput_ratio": ratio(ours and ours["output_tok_s"], base and base["output_tok_s"]),
        # Jain's index: over the backlogged phase (tenants that all wait the whole time), and
        # over the bots' trace, where few windows have two tenants waiting side by side.
        "jain_fair": _backlogged(ours, "jain"),
        "jain_baseline": _backlogged(base, "jain"),
        "jain_fair_trace": ours["fairness"]["jain"] if ours else None,
        "jain_baseline_trace": base["fairness"]["jain"] if base else None,
        # Windows with two or more backlogged tenants behind each index (none: 1.0, vacuously).
        "jain_fair_windows": _backlogged(ours, "num_windows"),
        "jain_baseline_windows": _backlogged(base, "num_windows"),
        "jain_fair_trace_windows": ours["fairness"]["num_windows"] if ours else None,
        "jain_baseline_trace_windows": base["fairness"]["num_windows"] if base else None,
    }
    report["goals"] = goals(report)
    report["all_goals_met"] = all(g["met"] for g in report["goals"].values())
    report["workload"] = describe(workload)
    report["systems"] = systems
    report["config"] = run_config(args)
    return report


def headroom(base: dict | None, ours: dict | None) -> dict:
    """How far the baseline is from each ceiling (no eviction; the best eviction this pool
    allows), in points, and the share of that distance ours closes: the hit-rate goal is
    reachable only where the distance is >= 15."""
    out = {}
    for ceiling, suffix in (("hit_rate_unbounded", ""), ("hit_rate_optimal", "_optimal")):
        points = gain = None
        if base and ours:
            points = 100 * (ours[ceiling] - base["hit_rate"])
            gain = 100 * (ours["hit_rate"] - base["hit_rate"])
        out[f"hit_rate_headroom_points{suffix}"] = points
        out[f"hit_rate_gap_closed{suffix}"] = gain / points if points and points > 0 else None
    return out


def _backlogged(system: dict | None, key: str) -> float | int | None:
    """`key` of a system's backlogged-phase fairness; None when the phase did not run."""
    phase = system and system.get("backlogged")
    return phase["fairness"][key] if phase else None


def run_config(args) -> dict:
    keys = ("quick", "bots", "zipf", "noisy_rank", "popular", "burst_factor", "rate", "duration", "scale",
            "system_len", "user_len", "answer_len", "turns", "think_time", "kv_fraction", "kv_tokens", "kv_bytes",
            "window", "sample_period", "backlogged_s", "backlogged_window", "max_num_seqs", "max_num_batched_tokens", "threads", "device", "seed")
    return {"model": str(args.folder), **{k: getattr(args, k) for k in keys}, **software()}


def fmt_s(x: float | None) -> str:
    return f"{x:8.2f}s" if x is not None else f"{'-':>9}"


def fmt_x(x: float | None, spec: str = ".2f") -> str:
    return format(x, spec) if x is not None else "-"


def print_table(report: dict) -> None:
    w, c = report["workload"], report["config"]
    print(f"{w['num_bots']} bots (noisy {w['noisy_bot']} x{c['burst_factor']:g} in the middle third), "
          f"{w['num_conversations']} conversations / {w['num_turns']} turns over {c['duration']:g} s, "
          f"KV {c['kv_tokens']} tokens = {c['kv_fraction']:.2f} of {w['footprint_tokens']}")
    head = (f"{'system':<13} {'class':<8} {'turns':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'p99 burst':>9} "
            f"{'queue p99':>9} {'out tok/s':>9} {'hit rate':>8}")
    print(head)
    print("-" * len(head))
    for name, s in report["systems"].items():
        for klass, m in s["classes"].items():
            print(f"{name:<13} {klass:<8} {m['num_turns']:>5} {fmt_s(m['ttft_p50_s'])} {fmt_s(m['ttft_p99_s'])} "
                  f"{fmt_s(m['ttft_p99_burst_s'])} {fmt_s(m['queue_p99_burst_s'])} {m['output_tok_s']:>9.1f} "
                  f"{m['hit_rate']:>8.1%}")
        print(f"{name:<13} {'all':<8} {s['num_turns']:>5} {fmt_s(s['ttft_p50_s'])} {fmt_s(s['ttft_p99_s'])} "
              f"{fmt_s(s['quiet_ttft_p99_burst_s'])} {fmt_s(s['quiet_queue_p99_burst_s'])} "
              f"{s['output_tok_s']:>9.1f} {s['hit_rate']:>8.1%}   (burst p99s of the quiet tenants)")
    for name, s in report["systems"].items():
        f = s["fairness"]
        print(f"{name}: Jain {fmt_x(f['jain'], '.3f')} over {f['num_windows']} of {f['num_windows_total']} "
              f"windows with 2+ backlogged tenants, largest service gap {fmt_x(f['max_service_gap'], '.0f')}; "
              f"burst served {s['burst_period_s'][0]:.0f}-{s['burst_period_s'][1]:.0f} s; "
              f"{len(s['pinned_bots'])} bots pinned; makespan {s['makespan_s']:.0f} s")
    print_backlogged(report["systems"])
    print(f"{'goal':<22} {'value':>8} {'target':>8}  met")
    for key, g in report["goals"].items():
        print(f"{key:<22} {fmt_x(g['value']):>8} {g['target']:>8}  {'yes' if g['met'] else 'NO'}")
    print(f"jain_baseline {fmt_x(report['jain_baseline'], '.3f')}, hit rate {fmt_x(report['hit_rate_fair'], '.1%')} "
          f"(streamengine) vs {fmt_x(report['hit_rate_baseline'], '.1%')} (baseline), "
          f"{fmt_x(report['hit_rate_unbounded'], '.1%')} with a cache that never evicts, "
          f"{fmt_x(report['hit_rate_optimal'], '.1%')} with the best eviction this pool allows")
    print(f"hit-rate headroom over the baseline {fmt_x(report['hit_rate_headroom_points'], '.1f')} points "
          f"to no eviction, {fmt_x(report['hit_rate_headroom_points_optimal'], '.1f')} to the best eviction "
          f"(the goal needs >= 15); streamengine closes {fmt_x(report['hit_rate_gap_closed'], '.0%')} of the first, "
          f"{fmt_x(report['hit_rate_gap_closed_optimal'], '.0%')} of the second")
    for name, s in report["systems"].items():
        lost = "; ".join(f"{k} {m['lost_hit_tokens']['system_prompt']:,} system-prompt + "
                         f"{m['lost_hit_tokens']['history']:,} history" for k, m in s["classes"].items())
        print(f"{name}: prompt tokens computed that a never-evicting cache would have hit: {lost}")


def print_backlogged(systems: dict[str, dict]) -> None:
    for name, s in systems.items():
        if phase := s.get("backlogged"):
            f, t = phase["fairness"], phase["tenants"]
            shares = " / ".join(f"{k} {v['share']:.2f}" for k, v in t.items())
            weights = ":".join(f"{v['weight']:g}" for v in t.values())
            print(f"{name} backlogged {phase['duration_s']:g} s: Jain {fmt_x(f['jain'], '.3f')} over "
                  f"{f['num_windows']} of {f['num_windows_total']} windows of {phase['window_s']:g} s "
                  f"({phase['steps_per_window']:.1f} steps each); weighted-service shares {shares} "
                  f"(weights {weights}, open requests {':'.join(str(v['open_requests']) for v in t.values())})")


COLORS = {"noisy": "#d62728", "popular": "#1f77b4", "rare": "#2ca02c"}


def write_png(report: dict, path: Path) -> None:
    from common import pyplot, save_figure

    plt = pyplot()
    systems = report["systems"]
    fig, axes = plt.subplots(1, len(systems) + 1, figsize=(5 * len(systems) + 4, 4),
                             gridspec_kw={"width_ratios": [3] * len(systems) + [2]})
    classes = class_of_bots(report)
    burst = report["workload"]["burst_s"]
    for ax, (name, s) in zip(axes, systems.items(), strict=False):
        for k in CLASSES:
            pts = [(x, y) for bot, x, y in s["turns"] if classes[bot] == k]
            if pts:
                ax.scatter(*zip(*pts, strict=True), s=6, alpha=0.6, color=COLORS[k], label=k)
        ax.axvspan(*burst, color="#999999", alpha=0.25, label="burst starts")
        ax.axvspan(burst[1], s["burst_period_s"][1], color="#999999", alpha=0.1, label="burst served")
        ax.set_yscale("log")
        ax.set_xlabel("submitted at (s)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{name}: quiet p99 in burst {fmt_x(s['quiet_ttft_p99_burst_s'])} s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, markerscale=2)
    ax = axes[-1]
    width = 0.8 / len(systems)
    for i, (name, s) in enumerate(systems.items()):
        xs = np.arange(len(CLASSES)) + i * width
        ax.bar(xs, [100 * s["classes"][k]["hit_rate"] for k in CLASSES], width, label=name)
    ax.set_xticks(np.arange(len(CLASSES)) + width * (len(systems) - 1) / 2, CLASSES)
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_title("hit rate by tenant class")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def class_of_bots(report: dict) -> list[str]:
    w = report["workload"]
    names = [f"bot{i:02d}" for i in range(w["num_bots"])]
    return ["noisy" if n == w["noisy_bot"] else "popular" if n in w["popular_bots"] else "rare" for n in names]


# -- main -----------------------------------------------------------------------------------


# Quick: 45 s of arrivals and 24 s backlogged keep both systems under 5 minutes on a 2-core Zen 2
# (60 s and 32 s took 5.9 min there).
QUICK = {"duration": 45.0, "rate": 0.75, "scale": 0.3, "window": 2.0, "backlogged_s": 24.0, "backlogged_window": 8.0}
FULL = {"duration": 240.0, "rate": 0.16, "scale": 1.0, "window": 4.0, "backlogged_s": 96.0, "backlogged_window": 16.0}


def int_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        bounds = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return bounds


def add_conversation_args(p: argparse.ArgumentParser) -> None:
    """The length ranges of the bots' conversations (shared with cluster.py)."""
    p.add_argument("--system-len", type=int_range, default=(300, 1500), help="system prompt tokens LO-HI")
    p.add_argument("--user-len", type=int_range, default=(20, 80), help="user turn tokens LO-HI")
    p.add_argument("--answer-len", type=int_range, default=(16, 64), help="answer tokens LO-HI")
    p.add_argument("--turns", type=int_range, default=(3, 6), help="turns per conversation LO-HI")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="same shape, lengths x0.3, 45 s of arrivals (< 5 min)")
    p.add_argument("--model", help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="torch device of both systems")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--bots", type=int, default=16)
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of bot popularity")
    p.add_argument("--noisy-rank", type=int, default=1, help="popularity rank (1 = most) of the noisy bot")
    p.add_argument("--popular", type=int, default=4, help="top ranks counted as popular (the noisy bot aside)")
    p.add_argument("--burst-factor", type=float, default=10.0, help="noisy bot's share multiplier in the burst")
    p.add_argument("--rate", type=float, help="conversation starts per second (0.75 quick, 0.16 full)")
    p.add_argument("--duration", type=float, help="seconds of arrivals (45 quick, 240 full)")
    p.add_argument("--scale", type=float, help="multiplies every length range (0.3 quick, 1 full)")
    add_conversation_args(p)
    p.add_argument("--think-time", type=float, default=0.0,
                   help="mean seconds (exponential) a user takes before the next turn; 0: at once")
    p.add_argument("--kv-fraction", type=float, default=1 / 3, help="KV pool / tokens the run ever holds")
    p.add_argument("--window", type=float, help="fairness window, seconds (2 quick, 4 full)")
    p.add_argument("--backlogged-s", type=float,
                   help="seconds of the backlogged phase per system (24 quick, 96 full; 0: none)")
    p.add_argument("--backlogged-window", type=float,
                   help="fairness window of the backlogged phase, seconds (8 quick, 16 full): several "
                        "engine steps (steps_per_window in the JSON)")
    p.add_argument("--backlogged-only", action="store_true",
                   help="run each system's backlogged phase alone (no bots' trace; no PNG): a quick fairness check")
    p.add_argument("--sample-period", type=float, default=0.25, help="seconds between tenant-stats samples")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    # One thread by default: on a machine shared with other busy processes two OpenMP threads on
    # two cores wait for each other at every parallel region (bench/README.md, throughput.py).
    p.add_argument("--threads", type=int, default=1, help="torch threads of both systems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    p.add_argument("--no-png", action="store_true")
    args = p.parse_args(argv)
    return check_args(p, args)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    mode_defaults(p, args, QUICK, FULL, "multitenant", RESULTS_DIR, SYSTEMS)
    if args.bots < 2 or not 1 <= args.noisy_rank <= args.bots:
        p.error("--bots must be >= 2 and --noisy-rank in 1..bots")
    if args.think_time < 0:
        p.error("--think-time must be >= 0")
    if args.backlogged_only and args.backlogged_s == 0:
        p.error("--backlogged-only needs --backlogged-s > 0")
    if args.backlogged_s < 0 or args.backlogged_window <= 0:
        p.error("--backlogged-s must be >= 0 and --backlogged-window > 0")
    if min(args.rate, args.duration, args.scale, args.window, args.kv_fraction, args.zipf, args.sample_period) <= 0:
        p.error("--rate, --duration, --scale, --window, --kv-fraction, --zipf and --sample-period must be > 0")
    if args.burst_factor < 1 or args.threads < 1 or args.max_num_seqs < 1 or args.max_num_batched_tokens < 1:
        p.error("--burst-factor, --threads, --max-num-seqs and --max-num-batched-tokens must be >= 1")
    return args


def size_pool(args, workload: Workload, block_bytes: int) -> None:
    """`kv_fraction` of the run's footprint, at least the longest turn plus its answer."""
    tokens = max(round(workload.footprint_tokens * args.kv_fraction), workload.longest_turn_tokens + BLOCK_SIZE)
    blocks = -(-tokens // BLOCK_SIZE)
    args.kv_tokens, args.kv_bytes = blocks * BLOCK_SIZE, blocks * block_bytes


def main(argv: list[str] | None = None) -> int:
    from streamengine.kv.spec import kv_bytes_per_block

    args = parse_args(argv)
    loaded = load_bench_model(args)
    token_ids = normal_token_ids(loaded.tokenizer, loaded.model.config.vocab_size)
    workload = make_workload(args, token_ids)
    size_pool(args, workload, kv_bytes_per_block(loaded.model.config, BLOCK_SIZE, torch.float32))
    if args.backlogged_only:
        return backlogged_only(loaded, args, workload, token_ids)
    systems = {}
    for system in args.systems:
        began = time.perf_counter()
        run = asyncio.run(run_system(loaded, args, workload, system))
        systems[system] = summarize(run, workload, args.window)
        if args.backlogged_s > 0:
            systems[system]["backlogged"] = asyncio.run(
                run_backlogged_system(loaded, args, workload, system, token_ids))
        systems[system]["wall_s"] = time.perf_counter() - began
    report = build_report(args, workload, systems)
    print_table(report)
    write_report(report, args.json, None if args.no_png else args.png, write_png)
    return 0


def backlogged_only(loaded, args, workload: Workload, token_ids: list[int]) -> int:
    """--backlogged-only: each system's backlogged phase on the pool the bots' trace would get."""
    systems = {system: {"backlogged": asyncio.run(run_backlogged_system(loaded, args, workload, system, token_ids))}
               for system in args.systems}
    report = {"jain_fair": _backlogged(systems.get("streamengine"), "jain"),
              "jain_baseline": _backlogged(systems.get("baseline"), "jain"),
              "systems": systems, "config": run_config(args)}
    print_backlogged(systems)
    write_report(report, args.json, None, write_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
