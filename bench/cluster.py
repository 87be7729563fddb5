"""Scale-out on Ray Serve: how the router placing requests decides the prefix hit rate and TTFT.

Workload: bench/multitenant.py's bots (seeded, nothing downloaded): `--bots` bots with
Zipf(`--zipf`) popularity, each its own system prompt of random ordinary tokens, conversations
of 3-6 turns arriving by Poisson at `--rate` per second over `--duration` seconds, each turn
re-sending the whole history, answers of a fixed drawn length (greedy, `ignore_eos`), the next
turn sent when the answer finished (closed loop per conversation). No noisy-tenant burst. Each
bot is a tenant with its own API key in a tenants file (so its own cache salt); nothing is
pinned (a pin would sit on every replica and hide what routing does).

The client speaks HTTP to the server: `POST /v1/completions` with the prompt as token ids,
`stream: true`, `stream_options.include_usage`; TTFT is the first streamed chunk as the
client sees it, prompt and cached tokens come from the final usage. The stream carries text,
not token ids, so the next turn re-sends the answer as the model's tokenizer encodes its
text (what any OpenAI client does): an answer whose text does not encode back to the same
tokens hits the cache only up to where it differs, in every system alike.

Systems, one after the other on the same trace (each starts by computing every bot's system
prompt once (of the bots the trace talks to), concurrently, through its own router, before the
clock starts):

  single       one AsyncEngine with both replicas' KV memory and 2 threads, behind the
               single-process server (create_app on a local port, same tenants file), in this
               process: the hit rate one big engine reaches (hit_rate_single)
  pow2         2 Ray Serve replicas (1 thread, 1 Ray CPU each) behind the ingress, Ray
               Serve's default power-of-two-choices router
  ray_prefix   the same, Ray's PrefixCacheAffinityRouter (matches prompt text)
  cached       the same, streamengine's router (the prompt tokens a replica would compute
               past its cached chain of the prompt's salted block hashes, from the replicas'
               KV events, times --cache-weight, plus the tokens queued there; cheapest wins)

Each replica's KV pool holds `--kv-fraction` (0.33) of every token the trace ever holds (the
system prompts of the bots it talks to plus every conversation's full history), so both
together hold two thirds of it: enough for the working set only if each bot lives on one
replica; a router that spreads every bot over both replicas makes each one hold everything
and thrash. During the `cached` run the script
reads the directory's KV event log as a second reader (events, bytes and blocks per second
per replica), and it measures the router's block index offline (tracemalloc): the figures
docs/scaling.md scales to 1,000 replicas.

    python bench/cluster.py --quick     # ~7 min on a 2-core CPU
    python bench/cluster.py             # ~18 min
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import pickle
import random
import socket
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

from common import mode_defaults, quiet_transformers, software, write_report  # noqa: E402
from multitenant import (  # noqa: E402
    Bot,
    Conversation,
    Turn,
    Workload,
    describe,
    hit_rate,
    make_workload,
    makespan,
    pct,
)
from tqdm import tqdm  # noqa: E402
from traces import normal_token_ids  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16
SYSTEMS = ("single", "pow2", "ray_prefix", "cached")
REPORT_NAME = {"single": "single", "pow2": "pow2", "ray_prefix": "ray_prefix", "cached": "ours"}
REPLICAS = 2
STREAM_TIMEOUT_S = 600.0
SETTLE_S = 1.0  # after the warm-up: the replicas' KV events reach the router (reported every 0.2 s)
GOALS = {  # name: (report key, the key it is compared with, factor, comparison)
    "hit_rate_ours_vs_single": ("hit_rate_ours", "hit_rate_single", 0.9, ">="),
    "ttft_p50_ours_vs_pow2": ("ttft_p50_ours", "ttft_p50_pow2", 0.5, "<="),
    "ttft_p50_ours_vs_ray_prefix": ("ttft_p50_ours", "ttft_p50_ray_prefix", 1.0, "<"),
}


# -- workload -------------------------------------------------------------------------------


def workload_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench/multitenant.py's workload knobs: its shape, no burst (burst_factor 1), turns back
    to back (think_time 0)."""
    return argparse.Namespace(
        bots=args.bots, zipf=args.zipf, noisy_rank=1, popular=args.bots, burst_factor=1.0,
        rate=args.rate, duration=args.duration, scale=args.scale, system_len=args.system_len,
        user_len=args.user_len, answer_len=args.answer_len, turns=args.turns, think_time=0.0, seed=args.seed,
    )


def bot_keys(workload: Workload, seed: int) -> dict[str, str]:
    """An API key per bot (seeded: a rerun has the same salts)."""
    rng = random.Random(f"{seed}:cluster-keys")
    return {b.name: f"sk-{b.name}-{rng.getrandbits(64):016x}" for b in workload.bots}


def tenants_file(keys: dict[str, str]):
    from streamengine.server.tenants_file import parse_tenants

    return parse_tenants({"tenants": [{"name": name, "api_key": key} for name, key in keys.items()]}, "<bench>")


@dataclass(frozen=True, slots=True)
class Pool:
    """The KV pool of one replica (the single engine gets `REPLICAS` times it)."""

    blocks: int
    block_bytes: int
    footprint_tokens: int
    fraction: float

    @property
    def tokens(self) -> int:
        return self.blocks * BLOCK_SIZE

    def describe(self) -> dict:
        return {
            "how": (f"each replica: {self.fraction:g} x the tokens the trace ever holds (the system prompts of the "
                    "bots it talks to plus every conversation's full history), at least the longest turn; the "
                    f"single engine: {REPLICAS} x that"),
            "footprint_tokens": self.footprint_tokens, "fraction_per_replica": self.fraction,
            "blocks_per_replica": self.blocks, "tokens_per_replica": self.tokens,
            "bytes_per_replica": self.blocks * self.block_bytes,
            "blocks_single": REPLICAS * self.blocks, "tokens_single": REPLICAS * self.tokens,
        }


def bots_in_trace(workload: Workload) -> list[Bot]:
    """The bots some conversation talks to (with Zipf popularity a short trace leaves rare
    bots out: their prompts would never be asked for)."""
    used = {c.bot for c in workload.conversations}
    return [b for b in workload.bots if b.rank in used]


def footprint_tokens(workload: Workload) -> int:
    """Every token the trace ever holds: the system prompts of its bots, every full history."""
    return sum(len(b.system) for b in bots_in_trace(workload)) + sum(c.history_tokens for c in workload.conversations)


def size_pool(workload: Workload, fraction: float, block_bytes: int) -> Pool:
    footprint = footprint_tokens(workload)
    tokens = max(round(footprint * fraction), workload.longest_turn_tokens + BLOCK_SIZE)
    return Pool(-(-tokens // BLOCK_SIZE), block_bytes, footprint, fraction)


def model_block_bytes(model: str | None) -> int:
    """KV bytes of one float32 block of the model (from its config: no weights loaded)."""
    import torch
    from transformers import AutoConfig

    from streamengine.kv.spec import kv_bytes_per_block
    from streamengine.models.loader import load_tokenizer

    tokenizer, _ = load_tokenizer(model)
    config = AutoConfig.from_pretrained(tokenizer.name_or_path)
    return kv_bytes_per_block(config, BLOCK_SIZE, torch.float32)


# -- the client -----------------------------------------------------------------------------


@dataclass(slots=True)
class Client:
    """One system's HTTP endpoint, the bots' keys, and the tokenizer the client encodes with."""

    url: str
    keys: dict[str, str]
    tokenizer: object
    session: object = None  # aiohttp.ClientSession, open while a trace runs

    async def complete(self, bot: str, prompt: list[int], max_tokens: int, turn: Turn, start: float) -> str:
        """Streams one completion; fills in the turn's timings and usage; returns the text."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        headers = {"Authorization": f"Bearer {self.keys[bot]}"}
        text, usage = [], None
        async with self.session.post(f"{self.url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{bot}: HTTP {resp.status}: {(await resp.text())[:300]}")
            async for line in resp.content:
                chunk = _sse_data(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    raise RuntimeError(f"{bot}: {chunk['error']}")
                if chunk.get("choices"):
                    if not turn.first_token:
                        turn.first_token = time.perf_counter() - start
                    text.append(chunk["choices"][0]["text"])
                usage = chunk.get("usage") or usage
        turn.finish = time.perf_counter() - start
        _fill_usage(turn, usage, bot, max_tokens)
        return "".join(text)


def _sse_data(line: bytes) -> dict | None:
    line = line.strip()
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return None
    return json.loads(line[6:])


def _fill_usage(turn: Turn, usage: dict | None, bot: str, max_tokens: int) -> None:
    if usage is None or usage["completion_tokens"] != max_tokens:
        raise RuntimeError(f"a turn of {bot} ended without the usage of {max_tokens} tokens: {usage}")
    turn.prompt_tokens = usage["prompt_tokens"]
    turn.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    turn.output_tokens = usage["completion_tokens"]


async def run_conversation(client: Client, workload: Workload, conv: Conversation, start: float,
                           bar: tqdm) -> list[Turn]:
    await asyncio.sleep(max(0.0, start + conv.arrival_s - time.perf_counter()))
    bot = workload.bots[conv.bot]
    history = list(bot.system)
    turns = []
    for user, answer_len in zip(conv.users, conv.answer_lens, strict=True):
        prompt = history + list(user)
        turn = Turn(conv.bot, conv.index, time.perf_counter() - start)
        answer = await client.complete(bot.name, prompt, answer_len, turn, start)
        # The answer as its text encodes (the stream has no token ids): see the module docstring.
        history = prompt + client.tokenizer.encode(answer, add_special_tokens=False)
        turns.append(turn)
        bar.update(1)
    return turns


async def warm_up(client: Client, workload: Workload) -> None:
    """First-call overheads, then the system prompt of every bot in the trace once, all at once (through the
    system's own router: where each lands is part of what is measured)."""
    first = workload.bots[0]
    filler = [first.system[0]] * 8  # shares no full block with the workload
    await asyncio.gather(*(client.complete(first.name, filler, 2, Turn(-1, -1, 0.0), time.perf_counter())
                           for _ in range(REPLICAS)))
    await asyncio.gather(*(client.complete(b.name, list(b.system), 1, Turn(b.rank, -1, 0.0), time.perf_counter())
                           for b in bots_in_trace(workload)))


async def wait_ready(session, url: str, timeout_s: float = 120.0) -> None:
    """Until the server's /ready says so (the ingress sees every replica's report)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with session.get(f"{url}/ready") as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout_s:g} s")
        await asyncio.sleep(0.2)


async def run_trace(client: Client, workload: Workload, name: str,
                    on_start: Callable[[], None] = lambda: None) -> tuple[list[Turn], float]:
    """Warms up, then runs every conversation; returns the turns and the trace's wall time."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        client.session = session
        await wait_ready(session, client.url)
        await warm_up(client, workload)
        await asyncio.sleep(SETTLE_S)
        total = sum(len(c.users) for c in workload.conversations)
        with tqdm(total=total, desc=name, unit="turn", file=sys.stderr, dynamic_ncols=True,
                  disable=not sys.stderr.isatty()) as bar:
            on_start()
            start = time.perf_counter()
            runs = await asyncio.gather(*(run_conversation(client, workload, c, start, bar)
                                          for c in workload.conversations))
            wall = time.perf_counter() - start
    return [t for run in runs for t in run], wall


# -- systems --------------------------------------------------------------------------------


@dataclass(slots=True)
class SystemRun:
    system: str
    turns: list[Turn]
    trace_s: float
    setup_s: float  # start (or deploy) until ready
    replicas: dict = field(default_factory=dict)  # replica id -> what it served
    kv_events: dict | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_config(args, pool_blocks: int, threads: int, tenants):
    from streamengine import EngineConfig

    return EngineConfig(model=args.model, block_size=BLOCK_SIZE, num_gpu_blocks=pool_blocks, num_threads=threads,
                        seed=args.seed, tenants=tenants.tenants)


async def run_single(args, pool: Pool, workload: Workload, keys: dict[str, str], tokenizer) -> SystemRun:
    """The single-process server over one engine with both replicas' memory, in this process."""
    from aiohttp import web

    from streamengine import AsyncEngine
    from streamengine.server import ServerConfig, create_app

    began = time.perf_counter()
    tenants = tenants_file(keys)
    engine = AsyncEngine(engine_config(args, REPLICAS * pool.blocks, args.single_threads, tenants))
    runner = web.AppRunner(create_app(engine, ServerConfig(tenants=tenants)), handle_signals=False)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    setup = time.perf_counter() - began
    try:
        turns, wall = await run_trace(Client(f"http://127.0.0.1:{port}", keys, tokenizer), workload, "single")
    finally:
        await runner.cleanup()
    del engine
    gc.collect()
    return SystemRun("single", turns, wall, setup)


def run_cluster(args, router: str, pool: Pool, workload: Workload, keys: dict[str, str], tokenizer,
                port: int) -> SystemRun:
    """Deploys 2 replicas behind the ingress with `router`, runs the trace, takes it down."""
    from streamengine.ray import ClusterOptions, deploy

    began = time.perf_counter()
    tenants = tenants_file(keys)
    options = ClusterOptions(
        replicas=REPLICAS, router=router, app_name=f"bench-{router}", port=port, replica_cpus=1.0,
        tenants_file=tenants, graceful_shutdown_timeout_s=5.0,
        router_kwargs={"cache_weight": args.cache_weight} if router == "cached" and args.cache_weight is not None else {},
    )
    app = deploy(engine_config(args, pool.blocks, 1, tenants), options)
    setup = time.perf_counter() - began
    before: dict = {}

    def on_start() -> None:  # after the warm-up: the replicas' figures then cover the trace only
        before.update(app.replica_loads())
        if tap is not None:
            tap.start()

    try:
        tap = EventTap(app.app_name) if router == "cached" else None
        turns, wall = asyncio.run(_cluster_trace(app.url, keys, tokenizer, workload, router, tap, on_start))
        replicas = replica_figures(before, app.replica_loads())
    finally:
        app.shutdown()
    return SystemRun(router, turns, wall, setup, replicas, tap.summary() if tap else None)


async def _cluster_trace(url: str, keys: dict[str, str], tokenizer, workload: Workload, router: str,
                         tap: EventTap | None, on_start: Callable[[], None]) -> tuple[list[Turn], float]:
    client = Client(url, keys, tokenizer)
    if tap is None:
        return await run_trace(client, workload, router, on_start)
    task = asyncio.create_task(tap.run())
    try:
        return await run_trace(client, workload, router, on_start)
    finally:
        tap.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def replica_figures(before: dict, after: dict) -> dict:
    """Per replica: prefix-cache figures over the trace and the bots it computed tokens for."""
    out = {}
    for rid, load in after.items():
        end, start = load["stats"], before.get(rid, {}).get("stats", {})
        tenants = {name: row.get("prompt_tokens", 0) + row.get("output_tokens", 0)
                   - start.get("tenants", {}).get(name, {}).get("prompt_tokens", 0)
                   - start.get("tenants", {}).get(name, {}).get("output_tokens", 0)
                   for name, row in end.get("tenants", {}).items()}
        out[rid] = {
            **{k: end[k] - start.get(k, 0) for k in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")},
            "num_total_blocks": end["num_total_blocks"],
            "bots_served": sorted(name for name, work in tenants.items() if work > 0),
            # What the replica sends the directory every report interval besides its events.
            "report_bytes": len(pickle.dumps(load)),
            "report_kv_state_bytes": len(pickle.dumps(load.get("kv_state"))),
        }
    return out


# -- KV event traffic -----------------------------------------------------------------------


@dataclass(slots=True)
class ReplicaTraffic:
    batches: int = 0
    events: int = 0
    bytes: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0

    def add(self, data: bytes) -> None:
        from streamengine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, decode

        batch = decode(data)
        self.batches += 1
        self.bytes += len(data)
        self.events += len(batch.events)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.blocks_stored += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.blocks_removed += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clears += 1

    def rates(self, seconds: float) -> dict:
        per_s = {f"{k}_per_s": getattr(self, k) / seconds
                 for k in ("batches", "events", "bytes", "blocks_stored", "blocks_removed")}
        return {**per_s, "totals": {k: getattr(self, k) for k in self.__slots__},
                "bytes_per_block": self.bytes / max(1, self.blocks_stored + self.blocks_removed)}


class EventTap:
    """A second reader of the directory's KV event log (beside the router): counts what the
    replicas publish between `start` and `stop`."""

    def __init__(self, app_name: str) -> None:
        self._app_name = app_name
        self._traffic: dict[str, ReplicaTraffic] = {}
        self._began = self._ended = 0.0
        self.resyncs = 0  # snapshots after the first: the tap fell behind the log

    def start(self) -> None:
        self._traffic.clear()
        self._began = time.perf_counter()

    def stop(self) -> None:
        self._ended = time.perf_counter()

    async def run(self) -> None:
        from streamengine.ray.directory import get_or_create_directory

        directory = get_or_create_directory(self._app_name)
        cursor = -1
        while True:
            update = await directory.poll.remote(cursor, 1.0)
            if update.snapshot is not None and cursor >= 0:
                self.resyncs += 1
            cursor = update.cursor
            if self._began and not self._ended:
                for rid, data in update.batches:
                    self._traffic.setdefault(rid, ReplicaTraffic()).add(data)

    def summary(self) -> dict:
        seconds = max(1e-9, (self._ended or time.perf_counter()) - self._began)
        return {"seconds": seconds, "resyncs": self.resyncs,
                "replicas": {rid: t.rates(seconds) for rid, t in sorted(self._traffic.items())}}


def index_memory(num_hashes: int = 100_000, num_replicas: int = 4, run_blocks: int = 8) -> dict:
    """The router's memory per indexed block: a BlockIndex built from decoded BlockStored
    batches (hashes as the engine's 16-byte digests), measured with tracemalloc; once with
    every hash on one replica, once with each hash on every replica (a prefix many replicas
    hold); plus how fast it ingests blocks and ranks a 64-block chain over 1,000 replicas."""
    distinct = _indexed_bytes(_stored_batches(num_hashes, num_replicas, run_blocks, shared=False))
    shared = _indexed_bytes(_stored_batches(num_hashes // num_replicas, num_replicas, run_blocks, shared=True))
    return {
        "num_hashes": num_hashes, "num_replicas": num_replicas,
        "bytes_per_indexed_block": distinct / num_hashes,
        # each (hash, replica) pair of a hash every replica holds
        "bytes_per_holder_shared": shared / (num_hashes // num_replicas * num_replicas),
        "apply_blocks_per_s": _apply_rate(num_hashes, num_replicas, run_blocks),
        "rank_us_64_blocks_1000_replicas": _rank_time_us(1000, 64),
    }


def _stored_batches(num_hashes: int, num_replicas: int, run_blocks: int, shared: bool) -> list[tuple[str, bytes]]:
    import hashlib

    from streamengine.kv.events import BlockStored, EventBatch, encode

    out = []
    for start in range(0, num_hashes, run_blocks):
        hashes = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()
                  for i in range(start, min(num_hashes, start + run_blocks))]
        event = BlockStored(hashes, None, [0] * (BLOCK_SIZE * len(hashes)), BLOCK_SIZE)
        data = encode(EventBatch(time.time(), [event]))
        owners = range(num_replicas) if shared else [start // run_blocks % num_replicas]
        out += [(f"replica{r}", data) for r in owners]
    return out


def _indexed_bytes(batches: list[tuple[str, bytes]]) -> int:
    from streamengine.kv.events import decode
    from streamengine.ray.block_index import BlockIndex

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = BlockIndex()
        for rid, data in batches:  # decoded as the router decodes them: fresh hash objects
            index.apply(rid, decode(data))
        gc.collect()
        size = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    del index
    return size


def _apply_rate(num_hashes: int, num_replicas: int, run_blocks: int) -> float:
    from streamengine.kv.events import decode
    from streamengine.ray.block_index import BlockIndex

    batches = _stored_batches(num_hashes, num_replicas, run_blocks, shared=False)
    index = BlockIndex()
    began = time.perf_counter()
    for rid, data in batches:
        index.apply(rid, decode(data))
    return num_hashes / (time.perf_counter() - began)


def _rank_time_us(num_replicas: int, chain: int, repeats: int = 200) -> float:
    """One request's lookup: `depths` of a `chain`-block prompt over `num_replicas`
    candidates, of which a few hold its first blocks."""
    import hashlib

    from streamengine.ray.block_index import BlockIndex

    hashes = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(chain)]
    replicas = [f"replica{r}" for r in range(num_replicas)]
    index = BlockIndex()
    for r, rid in enumerate(replicas[:8]):
        index.add(rid, hashes[: chain // (r + 1)])
    began = time.perf_counter()
    for _ in range(repeats):
        index.depths(hashes, replicas)
    return (time.perf_counter() - began) / repeats * 1e6


# -- report ---------------------------------------------------------------------------------


def summarize(run: SystemRun) -> dict:
    ttft = [t.ttft for t in run.turns]
    span = makespan(run.turns)
    return {
        "num_turns": len(run.turns),
        "hit_rate": hit_rate(run.turns),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "output_tok_s": sum(t.output_tokens for t in run.turns) / span,
        "prompt_tokens": sum(t.prompt_tokens for t in run.turns),
        "cached_tokens": sum(t.cached_tokens for t in run.turns),
        "makespan_s": span,
        "trace_s": run.trace_s,
        "setup_s": run.setup_s,
        "replicas": run.replicas,
        "turns": [[t.bot, round(t.submit, 3), round(t.ttft, 4), t.prompt_tokens, t.cached_tokens] for t in run.turns],
    }


def headline(systems: dict[str, dict]) -> dict:
    """The issue's keys: hit_rate_*, ttft_p50_*, ttft_p99_*, throughput_* per system."""
    out = {}
    for metric, key in (("hit_rate", "hit_rate"), ("ttft_p50", "ttft_p50_s"), ("ttft_p99", "ttft_p99_s"),
                        ("throughput", "output_tok_s")):
        for system in SYSTEMS:
            out[f"{metric}_{REPORT_NAME[system]}"] = systems[system][key] if system in systems else None
    return out


def goals(report: dict) -> dict:
    out = {}
    for name, (key, other, factor, op) in GOALS.items():
        value, bound = report.get(key), report.get(other)
        limit = factor * bound if bound is not None else None
        met = value is not None and limit is not None and {
            ">=": value >= limit, "<=": value <= limit, "<": value < limit}[op]
        out[name] = {"target": f"{key} {op} {factor:g} x {other}", "value": value, "limit": limit, "met": met}
    return out


def build_report(args, workload: Workload, pool: Pool, systems: dict[str, dict], kv_events: dict | None,
                 memory: dict) -> dict:
    report = headline(systems)
    report["goals"] = goals(report)
    report["all_goals_met"] = all(g["met"] for g in report["goals"].values())
    report["workload"] = {
        **describe(workload), "footprint_tokens": footprint_tokens(workload),
        "bots_in_trace": [b.name for b in bots_in_trace(workload)],
        "answers_resent_as": "the streamed text, encoded by the tokenizer",
    }
    report["kv_pool"] = pool.describe()
    report["kv_events"] = kv_events
    report["router_memory"] = memory
    report["single_served_by"] = "streamengine.server.create_app on a local port, in the benchmark's process"
    report["systems"] = systems
    report["config"] = run_config(args)
    return report


def run_config(args) -> dict:
    from streamengine.ray.router import DEFAULT_CACHE_WEIGHT

    keys = ("quick", "bots", "zipf", "rate", "duration", "scale", "system_len", "user_len", "answer_len", "turns",
            "kv_fraction", "seed")
    return {"model": args.model or "default (SmolLM2-135M-Instruct)", "replicas": REPLICAS,
            "replica_threads": 1, **{k: getattr(args, k) for k in (*keys, "single_threads")},
            "cache_weight": DEFAULT_CACHE_WEIGHT if args.cache_weight is None else args.cache_weight, **software()}


def fmt(x: float | None, spec: str) -> str:
    return format(x, spec) if x is not None else "-"


def print_table(report: dict) -> None:
    w, p = report["workload"], report["kv_pool"]
    print(f"{w['num_bots']} bots, {w['num_conversations']} conversations / {w['num_turns']} turns; "
          f"KV {p['tokens_per_replica']} tokens per replica = {p['fraction_per_replica']:g} of {p['footprint_tokens']}")
    head = f"{'system':<11} {'turns':>5} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'out tok/s':>9} {'setup':>6}"
    print(head)
    print("-" * len(head))
    for name, s in report["systems"].items():
        print(f"{name:<11} {s['num_turns']:>5} {s['hit_rate']:>8.1%} {fmt(s['ttft_p50_s'], '8.3f')}s "
              f"{fmt(s['ttft_p99_s'], '8.3f')}s {s['output_tok_s']:>9.1f} {s['setup_s']:>5.0f}s")
    for name, g in report["goals"].items():
        print(f"{name:<28} {fmt(g['value'], '.3f'):>8} vs {fmt(g['limit'], '.3f'):>8}  {'yes' if g['met'] else 'NO'}")
    ev = report["kv_events"]
    if ev:
        for rid, r in ev["replicas"].items():
            print(f"KV events {rid}: {r['events_per_s']:.1f} events/s, {r['bytes_per_s']:.0f} B/s, "
                  f"{r['blocks_stored_per_s']:.1f} stored + {r['blocks_removed_per_s']:.1f} removed blocks/s")
    m = report["router_memory"]
    print(f"router index: {m['bytes_per_indexed_block']:.0f} B per block ({m['bytes_per_holder_shared']:.0f} B per "
          f"extra holder), {m['apply_blocks_per_s']:.0f} blocks/s applied, "
          f"{m['rank_us_64_blocks_1000_replicas']:.0f} us per 64-block lookup over 1,000 replicas")


def write_png(report: dict, path: Path) -> None:
    import numpy as np
    from common import pyplot, save_figure

    plt = pyplot()
    names = list(report["systems"])
    systems = [report["systems"][n] for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(names, [100 * s["hit_rate"] for s in systems], color="#1f77b4")
    ax1.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax1.set_title("hit rate")
    xs = np.arange(len(names))
    ax2.bar(xs - 0.2, [s["ttft_p50_s"] or 0 for s in systems], 0.4, label="p50")
    ax2.bar(xs + 0.2, [s["ttft_p99_s"] or 0 for s in systems], 0.4, label="p99")
    ax2.set_xticks(xs, names)
    ax2.set_yscale("log")
    ax2.set_ylabel("TTFT (s)")
    ax2.set_title("time to first token")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.grid(True, axis="y", which="both", alpha=0.3)
    save_figure(fig, path)


# -- main -----------------------------------------------------------------------------------


# Arrival rates that keep the cached router's replicas busy but not saturated on 2 cores.
QUICK = {"duration": 50.0, "rate": 0.6, "scale": 0.7}
FULL = {"duration": 180.0, "rate": 0.45, "scale": 1.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from multitenant import add_conversation_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="lengths x0.7, 50 s of arrivals (< 10 min)")
    p.add_argument("--model", help="model folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--bots", type=int, default=16)
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of bot popularity")
    p.add_argument("--rate", type=float, help="conversation starts per second (0.6 quick, 0.45 full)")
    p.add_argument("--duration", type=float, help="seconds of arrivals (50 quick, 180 full)")
    p.add_argument("--scale", type=float, help="multiplies every length range (0.7 quick, 1 full)")
    add_conversation_args(p)
    p.add_argument("--kv-fraction", type=float, default=0.33, help="each replica's KV pool / tokens the run holds")
    p.add_argument("--cache-weight", type=float,
                   help="our router's price of a prompt token computed, against one queued (default: router.py's)")
    p.add_argument("--single-threads", type=int, default=REPLICAS, help="torch threads of the single engine")
    p.add_argument("--index-hashes", type=int, default=100_000, help="hashes of the offline router-memory test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    p.add_argument("--no-png", action="store_true")
    return check_args(p, p.parse_args(argv))


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    mode_defaults(p, args, QUICK, FULL, "cluster", RESULTS_DIR, SYSTEMS)
    args.systems = [s for s in SYSTEMS if s in args.systems]  # single first, then the routers
    if args.bots < 2 or args.index_hashes < 4:
        p.error("--bots must be >= 2 and --index-hashes >= 4")
    if min(args.rate, args.duration, args.scale, args.kv_fraction, args.zipf) <= 0:
        p.error("--rate, --duration, --scale, --kv-fraction and --zipf must be > 0")
    if args.cache_weight is not None and args.cache_weight < 0:
        p.error("--cache-weight must be >= 0")
    return args


def run_systems(args, workload: Workload, pool: Pool, keys: dict[str, str], tokenizer) -> tuple[dict, dict | None]:
    systems, kv_events = {}, None
    if "single" in args.systems:
        systems["single"] = summarize(asyncio.run(run_single(args, pool, workload, keys, tokenizer)))
    routers = [s for s in args.systems if s != "single"]
    if not routers:
        return systems, kv_events
    import ray
    from ray import serve

    ray.init(num_cpus=REPLICAS, include_dashboard=False, namespace="streamengine", log_to_driver=False)
    try:
        port = free_port()
        for router in routers:
            run = run_cluster(args, router, pool, workload, keys, tokenizer, port)
            systems[router] = summarize(run)
            kv_events = run.kv_events or kv_events
    finally:
        serve.shutdown()
        ray.shutdown()
    return systems, kv_events


def main(argv: list[str] | None = None) -> int:
    from streamengine.models.loader import load_tokenizer

    args = parse_args(argv)
    quiet_transformers()
    tokenizer, _ = load_tokenizer(args.model)
    workload = make_workload(workload_args(args), normal_token_ids(tokenizer))
    pool = size_pool(workload, args.kv_fraction, model_block_bytes(args.model))
    keys = bot_keys(workload, args.seed)
    memory = index_memory(args.index_hashes)
    systems, kv_events = run_systems(args, workload, pool, keys, tokenizer)
    report = build_report(args, workload, pool, systems, kv_events, memory)
    print_table(report)
    write_report(report, args.json, None if args.no_png else args.png, write_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
