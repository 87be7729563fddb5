"""Soak: a minute of hostile mixed traffic against the real server, then nothing may be left.

The server is the real app (`create_app` + `AsyncEngine`, tiny random Llama) served the way
`run_server` serves it (`web.AppRunner`, handler cancellation off) on 127.0.0.1. The traffic is
bench/stress.py's MixedTraffic (one implementation for this test and the benchmark): CLIENTS
concurrent clients, each drawing episodes from a seeded RNG (the same draws every run; only
timing differs): WebSocket generates (n, max_tokens, stop strings, temperature, logprobs),
client aborts (at once, after the first delta, after a delay), sockets closed mid-stream
(close frame, FIN without one), TCP resets (SO_LINGER 0: mid-stream, before any output, mid
handshake, mid frame), slow readers (a fixed 64 KiB receive buffer, no reading for up to 2 s, then
a trickle), malformed messages next to a live request, OpenAI requests streamed (SSE) and not,
SSE streams and plain requests cut mid-way, bad HTTP bodies. Every episode checks its answers:
each well-formed request that was not aborted ends with `done` (its tokens complete, usage
matching) or a complete HTTP response; each bad message gets its `error`; anything else is
counted in `tally.errors`.

A warm-up of the same traffic runs first; the soak then runs SOAK_S seconds, and afterwards:
no request in the engine, every block free, no WebSocket or HTTP request held by the server, no
task left over, no exception reported to the event loop, RSS within RSS_MARGIN_MB of its value
after the warm-up (or, when not, across a second round of the same length: a leak grows again),
and a normal request answered exactly as before the traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import importlib.util
import os
import sys
import time
from pathlib import Path

import aiohttp
import torch
from aiohttp import web

from streamengine import AsyncEngine, EngineConfig
from streamengine.server import create_app
from streamengine.server.config import ServerConfig
from streamengine.server.state import STATE_KEY

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
SEED = 20240612
CLIENTS = 8
WARMUP_S = float(os.environ.get("STREAMENGINE_SOAK_WARMUP", "15"))
SOAK_S = float(os.environ.get("STREAMENGINE_SOAK_SECONDS", "45"))
MAX_MESSAGE_BYTES = 64 * 1024  # small, so the oversized-message case stays cheap
# RSS growth allowed across the soak, measured after a warm-up of the same traffic (allocator
# arenas, tokenizer and aiohttp caches, torch's pools fill there) with a full gc and malloc_trim
# before each reading. Seen here over three runs of this test: +5.2, -1.8, +0.1 MiB (and +16
# with a 10 s warm-up); six back-to-back 30 s rounds on one server stayed within +-3 MiB of
# each other. 20 MiB is four times the worst seen with this warm-up, yet a leak of ~13 KiB per
# request (the soak serves ~1,500) or ~35 KiB per connection (~600) would exceed it. Leaks of
# the big things (KV blocks, engine requests, sockets, tasks) are caught exactly by the other
# checks.
RSS_MARGIN_MB = 20.0
EVENTS = (  # finer counts that must also be > 0: each way of leaving and misbehaving happened
    "ws_requests", "ws_aborts_confirmed", "ws_abort_immediately", "ws_abort_after_first_delta",
    "ws_disconnect_close_frame", "ws_disconnect_fin", "ws_reset_mid_stream", "ws_reset_before_output",
    "ws_reset_mid_handshake", "ws_reset_mid_frame", "ws_slow_reader_coalesced",
    "ws_bad_messages_answered", "http_requests", "sse_cut_close", "sse_cut_reset", "http_cut",
    "http_bad_answered",
)


def load_stress():
    spec = importlib.util.spec_from_file_location("bench_stress", ROOT / "bench" / "stress.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@contextlib.asynccontextmanager
async def serve(app: web.Application):
    """The app on a free 127.0.0.1 port, run as `run_server` runs it."""
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=10.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def rss_mb() -> float:
    """Resident set after a full collection and returning freed heap to the OS, so that what
    is measured is memory still referenced, not the allocator's free lists."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


async def normal_request(port: int) -> tuple[list[int], str]:
    """One greedy WebSocket request and one OpenAI completion; tokens and text."""
    prompt = "The capital of France is"
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"http://{HOST}:{port}/v1/stream") as ws:
            assert (await ws.receive_json(timeout=30))["type"] == "ready"
            await ws.send_json({"type": "generate", "id": "n", "prompt": prompt,
                                "params": {"max_tokens": 12, "ignore_eos": True, "temperature": 0}})
            tokens = []
            for _ in range(100):
                m = await ws.receive_json(timeout=30)
                if m["type"] == "done":
                    break
                assert m["type"] == "delta", m
                tokens += m["token_ids"]
            assert m["type"] == "done" and m["finish_reason"] == "length", m
            assert m["usage"]["completion_tokens"] == len(tokens) == 12
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
        async with session.post(f"http://{HOST}:{port}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            data = await r.json()
    assert data["choices"][0]["finish_reason"] == "length" and data["usage"]["completion_tokens"] == 12
    return tokens, data["choices"][0]["text"]


async def settle(engine: AsyncEngine, app: web.Application, timeout: float = 20.0) -> dict:
    """Waits (bounded) until the engine and the server hold nothing; returns engine stats."""
    state = app[STATE_KEY]
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        idle = stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
        if idle and not state.connections and not state.http_requests:
            return stats
        if time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def test_soak_mixed_traffic_leaves_nothing_behind(tiny_llama_dir):
    stress = load_stress()
    loop_problems: list[str] = []
    loop = asyncio.get_running_loop()
    # Anything reported to the loop (a task destroyed while pending, an exception never
    # retrieved) is a leak or a lost error, even when every answer was right.
    loop.set_exception_handler(
        lambda _, ctx: loop_problems.append(f"{ctx.get('message')}: {ctx.get('exception') or ctx.get('task')}")
    )
    # A small pool (128 blocks of 16 tokens) next to long requests: steps preempt (~300 times
    # per run here), so the recompute path is soaked too (at 64 blocks recompute thrashes and
    # episodes time out). One torch thread: on 2 busy cores two OpenMP threads collapse into
    # futex waits (measured here: 5x slower per step).
    # num_threads sets torch's count for the whole process: given back in the end, so the tests
    # run after this one in the same process (a pytest-xdist worker's) keep the default.
    torch_threads = torch.get_num_threads()
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=128, max_num_seqs=32, num_threads=1))
    app = create_app(engine, ServerConfig(model_name="tiny", max_message_bytes=MAX_MESSAGE_BYTES))
    state = app[STATE_KEY]
    try:
        async with asyncio.timeout(WARMUP_S + 2 * SOAK_S + 90), serve(app) as port:
            reference = await normal_request(port)

            def traffic(seed: int) -> object:
                return stress.MixedTraffic(HOST, port, seed=seed, clients=CLIENTS, model="tiny",
                                           max_message_bytes=MAX_MESSAGE_BYTES, episode_timeout=30.0,
                                           token_scale=0.5)

            t0 = time.monotonic()
            warm = await traffic(SEED).run(WARMUP_S)
            print(f"\nwarm-up: {time.monotonic() - t0:.0f} s, {sum(warm.episodes.values())} episodes")
            assert warm.errors == 0, warm.error_examples
            await settle(engine, app)
            rss_before, tasks_before = rss_mb(), len(asyncio.all_tasks())

            t0 = time.monotonic()
            tally = await traffic(SEED + 1).run(SOAK_S)
            wall = time.monotonic() - t0
            print(f"\nsoak: {wall:.0f} s, episodes {dict(sorted(tally.episodes.items()))}\n"
                  f"events {dict(sorted(tally.events.items()))}")
            assert tally.errors == 0, tally.error_examples
            for category in stress.CATEGORIES:
                assert tally.episodes[category] > 0, f"no {category} episode in {SOAK_S:g} s"
            for event in EVENTS:
                assert tally.events[event] > 0, f"no {event} in {SOAK_S:g} s: {dict(tally.events)}"

            stats = await settle(engine, app)
            assert stats["num_requests"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
            assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
            assert not state.connections, f"{len(state.connections)} WebSockets still held"
            assert not state.http_requests, state.http_requests
            assert await normal_request(port) == reference  # alive, and still exact
            await settle(engine, app)
            growth = rss_mb() - rss_before
            print(f"RSS {rss_before:.0f} MiB after the warm-up, growth across the soak {growth:+.1f} MiB; "
                  f"preemptions {stats['num_preemptions']}")
            if growth >= RSS_MARGIN_MB:
                # On a loaded machine the traffic batches differently and allocator pools can fill
                # further during the soak (seen once: +22.9 MiB). That growth does not repeat; a leak
                # grows again with the same traffic, so a second round decides.
                rss_again = rss_mb()
                again = await traffic(SEED + 2).run(SOAK_S)
                assert again.errors == 0, again.error_examples
                await settle(engine, app)
                growth = rss_mb() - rss_again
                print(f"a second round: growth {growth:+.1f} MiB")
            assert growth < RSS_MARGIN_MB, f"RSS grew {growth:.1f} MiB across the soak (margin {RSS_MARGIN_MB})"
            assert len(asyncio.all_tasks()) <= tasks_before, [t.get_name() for t in asyncio.all_tasks()]
            assert not loop_problems, loop_problems[:5]
    finally:
        loop.set_exception_handler(None)
        torch.set_num_threads(torch_threads)
