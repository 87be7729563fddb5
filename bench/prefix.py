"""Prefix caching for multi-tenant bots: the same workload with the cache on and off.

Workload (seeded): K tenants, each a bot with its own system prompt of `--system-len` random
ordinary tokens (~1,000); N user requests, each a tenant's system prompt followed by a short
random question (~20 tokens), answered greedily with exactly `--answer-len` tokens
(`ignore_eos`). Tenants arrive interleaved (round after round, each round a shuffled
permutation of the tenants) with Poisson arrivals at `--rate` requests/s (0 = all at once).

It runs through `AsyncEngine` twice, `enable_prefix_caching` True and False, same weights and
the same KV budget (`--kv-tokens` tokens of this model), and reports per mode:

  throughput   requests/s and output tokens/s from the first arrival to the last finish
  TTFT         time from submission to the first output carrying a token, p50/p99/mean
  hit rate     prefix_cache_hits / prefix_cache_queries (tokens, from `engine.stats()`), and
               hits / shared tokens, where the shared tokens are the system-prompt tokens of
               every request after its tenant's first (what a perfect cache could serve;
               block granularity caps it at floor(system_len / block_size) * block_size)

and, on the caching engine with nothing else running, one request with a fresh system prompt
(cold) then one with the same system prompt and another question once the first has finished
(warm), repeated `--trials` times: `ttft_speedup_warm` = median cold TTFT / median warm TTFT.

    python bench/prefix.py --quick     # 2 tenants, 12 requests; < 3 min on a 2-core CPU
    python bench/prefix.py             # 4 tenants, 64 requests
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import model_folder, quiet_transformers, software  # noqa: E402
from tqdm import tqdm  # noqa: E402
from traces import normal_token_ids  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16
MODES = ("cache_on", "cache_off")


@dataclass(frozen=True, slots=True)
class BotRequest:
    tenant: int
    arrival_s: float  # offset from the start of the run
    system: tuple[int, ...]
    question: tuple[int, ...]

    @property
    def prompt(self) -> list[int]:
        return [*self.system, *self.question]


@dataclass(slots=True)
class Timing:
    tenant: int
    submit: float
    first_token: float
    finish: float
    output_tokens: int
    cached_tokens: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.submit


# -- workload -------------------------------------------------------------------------------


def _random_ids(rng: random.Random, ids: list[int], n: int) -> tuple[int, ...]:
    return tuple(ids[rng.randrange(len(ids))] for _ in range(n))


def make_workload(args, token_ids: list[int]) -> list[BotRequest]:
    rng = random.Random(f"{args.seed}:prefix")
    systems = [_random_ids(rng, token_ids, args.system_len) for _ in range(args.tenants)]
    order: list[int] = []
    while len(order) < args.requests:  # rounds of shuffled tenants: interleaved, balanced
        round_ = list(range(args.tenants))
        rng.shuffle(round_)
        order.extend(round_)
    t = 0.0
    out = []
    for tenant in order[: args.requests]:
        q_len = max(1, round(args.question_len * rng.uniform(0.75, 1.25)))
        out.append(BotRequest(tenant, t, systems[tenant], _random_ids(rng, token_ids, q_len)))
        if args.rate > 0:
            t += rng.expovariate(args.rate)
    return out


def shared_tokens(workload: list[BotRequest]) -> tuple[int, int]:
    """(system tokens of requests after their tenant's first, the same rounded down to blocks)."""
    seen: set[int] = set()
    total = aligned = 0
    for r in workload:
        if r.tenant in seen:
            total += len(r.system)
            aligned += len(r.system) // BLOCK_SIZE * BLOCK_SIZE
        seen.add(r.tenant)
    return total, aligned


# -- running --------------------------------------------------------------------------------


async def timed_request(engine, prompt: list[int], params, request_id: str) -> tuple[float, float, float, int, int]:
    """(submit, first token, finish, output tokens, cached prompt tokens) of one request."""
    submit = time.perf_counter()
    first = None
    last = None
    async for out in engine.generate(prompt, params, request_id=request_id):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter()
        last = out
    finish = time.perf_counter()
    if last is None or first is None:
        raise RuntimeError(f"request {request_id} ended without output")
    return submit, first, finish, len(last.outputs[0].token_ids), last.num_cached_tokens


async def run_workload(engine, workload: list[BotRequest], params, bar: tqdm) -> tuple[list[Timing], float]:
    start = time.perf_counter()

    async def one(i: int, r: BotRequest) -> Timing:
        await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
        submit, first, finish, n_out, cached = await timed_request(engine, r.prompt, params, f"bot{i}")
        bar.update(1)
        return Timing(r.tenant, submit, first, finish, n_out, cached)

    timings = await asyncio.gather(*(one(i, r) for i, r in enumerate(workload)))
    return list(timings), time.perf_counter() - start


async def cold_warm(engine, args, token_ids: list[int], params) -> dict:
    """TTFT of a fresh system prompt, then of the same system prompt after that finished."""
    rng = random.Random(f"{args.seed}:coldwarm")
    cold, warm, warm_cached = [], [], []
    for t in tqdm(range(args.trials), desc="cold/warm", unit="pair", file=sys.stderr, dynamic_ncols=True):
        system = list(_random_ids(rng, token_ids, args.system_len))
        q1 = list(_random_ids(rng, token_ids, args.question_len))
        q2 = list(_random_ids(rng, token_ids, args.question_len))
        s, f, *_ = await timed_request(engine, system + q1, params, f"cold{t}")
        cold.append(f - s)
        s, f, _, _, cached = await timed_request(engine, system + q2, params, f"warm{t}")
        warm.append(f - s)
        warm_cached.append(cached)
    return {
        "cold_ttft_s": cold,
        "warm_ttft_s": warm,
        "warm_cached_tokens": warm_cached,
        "cold_ttft_median_s": statistics.median(cold),
        "warm_ttft_median_s": statistics.median(warm),
        "ttft_speedup_warm": statistics.median(cold) / statistics.median(warm),
    }


def _engine(loaded, folder: Path, args, caching: bool):
    from streamengine import AsyncEngine, EngineConfig

    config = EngineConfig(
        model=str(folder), dtype="float32", device="cpu", block_size=BLOCK_SIZE,
        kv_cache_bytes=args.kv_bytes, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=caching,
        num_threads=args.threads, seed=args.seed,
    )
    return AsyncEngine(config, loaded=loaded)


async def run_mode(loaded, folder: Path, args, workload, token_ids, caching: bool) -> dict:
    from streamengine import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.answer_len)
    engine = _engine(loaded, folder, args, caching)
    result: dict = {}
    async with engine:
        # Warm-up on a prompt that shares nothing with the workload (first-call overheads).
        await timed_request(engine, list(token_ids[:24]), params, "warmup")
        if caching and args.trials > 0:
            result["single"] = await cold_warm(engine, args, token_ids, params)
        before = engine.stats()
        name = "cache on " if caching else "cache off"
        with tqdm(total=len(workload), desc=name, unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
            timings, _ = await run_workload(engine, workload, params, bar)
        after = engine.stats()
    del engine
    gc.collect()
    result.update(summarize(timings, before, after, workload))
    result["kv_capacity_tokens"] = after["num_total_blocks"] * BLOCK_SIZE
    return result


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def summarize(timings: list[Timing], before: dict, after: dict, workload: list[BotRequest]) -> dict:
    start = min(t.submit for t in timings)
    end = max(t.finish for t in timings)
    ttft = [t.ttft for t in timings]
    out_tokens = sum(t.output_tokens for t in timings)
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    shared, shared_aligned = shared_tokens(workload)
    return {
        "num_requests": len(timings),
        "elapsed_s": end - start,
        "requests_per_s": len(timings) / (end - start),
        "output_tok_s": out_tokens / (end - start),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "ttft_mean_s": statistics.fmean(ttft),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "hit_rate_of_queries": hits / queries if queries else 0.0,
        "shared_tokens": shared,
        "shared_tokens_block_aligned": shared_aligned,
        "hit_rate_of_shared": hits / shared if shared else 0.0,
        "cached_tokens_reported": sum(t.cached_tokens for t in timings),
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "ttft_s": [round(x, 4) for x in ttft],
    }


# -- report ---------------------------------------------------------------------------------


def build_report(args, folder: Path, modes: dict[str, dict]) -> dict:

    on, off = modes.get("cache_on"), modes.get("cache_off")
    single = on.get("single") if on else None
    report = {
        "ttft_speedup_warm": single["ttft_speedup_warm"] if single else None,
        "hit_rate": on["hit_rate_of_shared"] if on else None,
        "hit_rate_of_queries": on["hit_rate_of_queries"] if on else None,
        "throughput_speedup": on["requests_per_s"] / off["requests_per_s"] if on and off else None,
        "ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"] if on and off else None,
        "ttft_p99_speedup": off["ttft_p99_s"] / on["ttft_p99_s"] if on and off else None,
        "single": single,
        "modes": {k: {kk: vv for kk, vv in v.items() if kk != "single"} for k, v in modes.items()},
        "config": {
            "model": str(folder),
            "quick": args.quick,
            "tenants": args.tenants,
            "requests": args.requests,
            "system_len": args.system_len,
            "question_len": args.question_len,
            "answer_len": args.answer_len,
            "rate": args.rate,
            "kv_tokens": args.kv_tokens,
            "kv_cache_bytes": args.kv_bytes,
            "block_size": BLOCK_SIZE,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "trials": args.trials,
            "threads": args.threads,
            "seed": args.seed,
            **software(),
        },
    }
    return report


def print_table(report: dict) -> None:
    c = report["config"]
    print(
        f"{c['tenants']} tenants x {c['system_len']}-token system prompts, {c['requests']} requests "
        f"(question ~{c['question_len']}, answer {c['answer_len']} tokens), rate "
        f"{c['rate'] or 'burst'} req/s, KV {c['kv_tokens']} tokens"
    )
    head = f"{'mode':<10} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'hit/query':>9} {'hit/shared':>10}"
    print(head)
    print("-" * len(head))
    for name, m in report["modes"].items():
        print(
            f"{name:<10} {m['requests_per_s']:>7.2f} {m['output_tok_s']:>9.1f} {m['ttft_p50_s']:>8.2f}s "
            f"{m['ttft_p99_s']:>8.2f}s {m['hit_rate_of_queries']:>9.1%} {m['hit_rate_of_shared']:>10.1%}"
        )
    if report["throughput_speedup"] is not None:
        print(
            f"cache on vs off: throughput {report['throughput_speedup']:.2f}x, TTFT p50 "
            f"{report['ttft_p50_speedup']:.1f}x, p99 {report['ttft_p99_speedup']:.1f}x lower"
        )
    single = report["single"]
    if single:
        print(
            f"single request, {c['system_len']}-token system prompt: cold TTFT "
            f"{single['cold_ttft_median_s'] * 1e3:.0f} ms, warm {single['warm_ttft_median_s'] * 1e3:.0f} ms "
            f"-> {single['ttft_speedup_warm']:.1f}x (goal >= 10x); hit rate {report['hit_rate']:.1%} "
            f"of shared tokens (goal >= 95%)"
        )


def write_png(report: dict, path: Path, timings_by_mode: dict[str, list[float]]) -> None:
    from common import pyplot, save_figure

    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    colors = {"cache_on": "#2b7bba", "cache_off": "#e08a2c"}
    for name, ttft in timings_by_mode.items():
        xs = np.sort(np.asarray(ttft))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax1.step(xs, ys, where="post", color=colors[name], label=name.replace("_", " "))
    ax1.set_xscale("log")
    ax1.set_xlabel("time to first token (s)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("Multi-tenant bots: TTFT distribution")
    ax1.legend(fontsize=8)
    ax1.grid(True, which="both", alpha=0.3)
    single = report["single"]
    if single:
        vals = [single["cold_ttft_median_s"] * 1e3, single["warm_ttft_median_s"] * 1e3]
        bars = ax2.bar(["cold", "warm"], vals, color=["#e08a2c", "#2b7bba"])
        ax2.bar_label(bars, fmt="%.0f ms", fontsize=8)
        ax2.set_yscale("log")
        ax2.set_ylabel("TTFT (ms, median)")
        ax2.set_title(f"{report['config']['system_len']}-token system prompt: "
                      f"{single['ttft_speedup_warm']:.0f}x")
    save_figure(fig, path)


# -- main -----------------------------------------------------------------------------------


QUICK = {"tenants": 2, "requests": 12, "rate": 1.0, "trials": 3}
FULL = {"tenants": 4, "requests": 64, "rate": 1.0, "trials": 5}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 tenants, 12 requests, 3 cold/warm pairs (< 3 min)")
    p.add_argument("--model", help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tenants", type=int, help="system prompts K (default 2 quick, 4 full)")
    p.add_argument("--requests", type=int, help="user requests N (default 12 quick, 64 full)")
    p.add_argument("--system-len", type=int, default=1000, help="tokens per system prompt")
    p.add_argument("--question-len", type=int, default=20, help="mean tokens per question (+-25%%)")
    p.add_argument("--answer-len", type=int, default=16, help="output tokens per request")
    p.add_argument("--rate", type=float, help="Poisson arrivals, requests/s; 0 = all at once (default 1)")
    p.add_argument("--trials", type=int, help="cold/warm single-request pairs (default 3 quick, 5 full)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--kv-tokens", type=int, default=16384, help="KV budget of both modes, in tokens")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "prefix.json")
    p.add_argument("--png", type=Path, default=None, help="the plot (default: beside --json, same name)")
    p.add_argument("--no-png", action="store_true")
    args = p.parse_args(argv)
    args.png = args.png or args.json.with_suffix(".png")  # never over a committed plot
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes must name some of {', '.join(MODES)}")
    for name in ("tenants", "requests", "system_len", "question_len", "answer_len", "kv_tokens",
                 "max_num_seqs", "max_num_batched_tokens", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.rate < 0 or args.trials < 0:
        p.error("--rate and --trials must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_transformers()
    from streamengine.kv.spec import kv_bytes_per_block
    from streamengine.models import load_model

    folder = model_folder(args.model)
    loaded = load_model(str(folder), "float32", "cpu")
    block_bytes = kv_bytes_per_block(loaded.model.config, BLOCK_SIZE, torch.float32)
    args.kv_bytes = -(-args.kv_tokens // BLOCK_SIZE) * block_bytes
    token_ids = normal_token_ids(loaded.tokenizer, loaded.model.config.vocab_size)
    workload = make_workload(args, token_ids)
    modes: dict[str, dict] = {}
    ttfts: dict[str, list[float]] = {}
    for mode in args.modes:
        result = asyncio.run(run_mode(loaded, folder, args, workload, token_ids, mode == "cache_on"))
        ttfts[mode] = result["ttft_s"]
        modes[mode] = result
    report = build_report(args, folder, modes)
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    if not args.no_png:
        write_png(report, args.png, ttfts)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
