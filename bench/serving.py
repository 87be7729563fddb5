"""Online serving under Poisson load: the real server vs `transformers serve`, latency vs rate.

Requests come from the seeded ShareGPT-like trace (bench/traces.py; lengths scaled down by
`--scale`). For each request rate, N requests arrive as a Poisson process and each streams
its answer; every system sees the same prompts (as text: `transformers serve` takes only
strings) and must produce exactly the trace's output length (greedy, EOS ignored). Systems:

  se_ws     `python -m streamengine serve` in a subprocess on a free 127.0.0.1 port; one
            WebSocket per request on `/v1/stream` (aiohttp client), the `generate` message
  se_sse    the same server, `/v1/completions` with `stream=true` through the `openai` client
  hf_serve  `transformers serve <folder>` (FastAPI/uvicorn; one `model.generate` at a time on
            its inference thread), `/v1/completions` streamed through the `openai` client; EOS
            is held off with a per-request `generation_config` (min_new_tokens = max_new_tokens)
  hf_serve_cb  the same with `--continuous-batching` (opt in with `--baseline hf_serve_cb`)

Each prompt text starts with a short unique tag, so no system reuses a prefix cached by an
earlier run. Per request: TTFT = first streamed token - arrival; inter-token latency (ITL) =
(last token - first token) / (output tokens - 1), i.e. time per output token after the first
(robust to servers that coalesce tokens into one chunk); normalized latency = end-to-end
latency / output tokens (the paper's metric, averaged over requests). Reported per system and
rate: mean/p50/p99 of each, and a plot of normalized latency against rate (--png).

Event-loop lag while saturated: the server has no lag metric, so the same app
(`create_app` + `AsyncEngine`, same engine flags) is started by this script's `lag-server`
mode in a subprocess with a probe task on its loop (`await asyncio.sleep(0.001)` in a loop,
recording how far past its deadline each wake-up came, 0 for an early one); a burst of
WebSocket requests saturates it while /health is pinged from outside; the probe's percentiles
over that window are fetched from `/bench/lag`.

Both servers get the same torch thread count (`--threads`, also OMP_NUM_THREADS). On a busy
machine, 2 OpenMP threads on 2 cores can collapse (each parallel region waits for a
descheduled thread): seen here for `transformers serve`, whose inter-token latency went from
0.1 s at 1 thread to 1-2.5 s at 2 threads while other jobs ran. Run on a quiet machine, or
compare at `--threads 1`.

    python bench/serving.py --quick                 # < 3 min on a quiet 2-core CPU
    python bench/serving.py                         # full sweep (tens of minutes)
    python bench/serving.py --quick --no-baseline   # streamengine only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only, never another address
SE_SYSTEMS = ("se_ws", "se_sse")
BASELINES = ("hf_serve", "hf_serve_cb")
ALL_SYSTEMS = (*SE_SYSTEMS, *BASELINES)
LABELS = {
    "se_ws": "streamengine (WebSocket)",
    "se_sse": "streamengine (OpenAI SSE)",
    "hf_serve": "transformers serve",
    "hf_serve_cb": "transformers serve --continuous-batching",
}
QUICK = {"num_requests": 8, "scale": 0.1, "rates": (1.0, 2.0, 4.0), "run_timeout": 60.0,
         "lag_requests": 32, "lag_seconds": 15.0}
FULL = {"num_requests": 48, "scale": 0.25, "rates": (0.25, 0.5, 1.0, 2.0, 4.0), "run_timeout": 600.0,
        "lag_requests": 128, "lag_seconds": 60.0}
STARTUP_TIMEOUT_S = 300.0


@dataclass(slots=True)
class Sample:
    """One request as the client saw it; times are perf_counter seconds."""

    index: int
    expected_tokens: int
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    end: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and self.output_tokens > 0


@dataclass(frozen=True, slots=True)
class Job:
    index: int
    prompt: str | list[int]  # token ids go to the OpenAI route as they are
    max_tokens: int
    arrival_s: float  # offset from the start of the run


# -- servers --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on 127.0.0.1 that we started, and only that one is stopped."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str]) -> None:
        self.name, self.cmd, self.port, self.env = name, cmd, port, env
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{name}-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def start(self, session) -> None:
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(Exception):
                async with session.get(f"{self.base_url}/health", timeout=_timeout(2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.name} did not become healthy in {STARTUP_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # SIGTERM: both servers shut down gracefully on it
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def close(self) -> None:
        """Stops the server and removes its log (failures carry the log's tail in their message)."""
        self.stop()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]


def _timeout(seconds: float):
    import aiohttp

    return aiohttp.ClientTimeout(total=seconds)


def server_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("STREAMENGINE_API_KEY", None)  # the bench talks to an open loopback server
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1")
    return env


def engine_flags(args) -> list[str]:
    flags = ["--model", str(args.folder), "--device", "cpu", "--dtype", "float32",
             "--num-threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs)]
    if args.kv_cache_bytes:
        flags += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    return flags


def streamengine_server(args) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "streamengine", "serve", "--host", HOST, "--port", str(port), *engine_flags(args)]
    return ServerProcess("streamengine", cmd, port, server_env(args.threads))


def lag_server(args) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "lag-server", "--host", HOST, "--port", str(port),
           *engine_flags(args)]
    return ServerProcess("streamengine-lag", cmd, port, server_env(args.threads))


def transformers_server(args, continuous_batching: bool) -> ServerProcess:
    port = free_port()
    exe = Path(sys.executable).parent / "transformers"
    cmd = [str(exe) if exe.exists() else "transformers", "serve", str(args.folder), "--host", HOST,
           "--port", str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    if continuous_batching:
        cmd.append("--continuous-batching")
    return ServerProcess("transformers-serve", cmd, port, server_env(args.threads))


# -- clients --------------------------------------------------------------------------------


async def ws_request(session, server: ServerProcess, job: Job, sample: Sample) -> None:
    """One WebSocket per request (a user's connection), the request, its deltas, `done`."""
    import aiohttp

    url = f"ws://{HOST}:{server.port}/v1/stream"
    params = {"temperature": 0.0, "ignore_eos": True, "max_tokens": job.max_tokens}
    async with session.ws_connect(url, protocols=("streamengine.v1",), max_msg_size=0) as ws:
        await ws.send_str(json.dumps({"type": "generate", "id": "r", "prompt": job.prompt, "params": params}))
        async for msg in ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                raise RuntimeError(f"websocket closed early ({msg.type.name}, {ws.close_code})")
            data = json.loads(msg.data)
            kind = data.get("type")
            if kind == "delta" and data["token_ids"]:
                now = time.perf_counter()
                sample.first_token = sample.first_token or now
                sample.last_token = now
                sample.output_tokens += len(data["token_ids"])
            elif kind == "done":
                sample.end = time.perf_counter()
                usage = data.get("usage") or {}
                sample.prompt_tokens = usage.get("prompt_tokens")
                sample.output_tokens = usage.get("completion_tokens", sample.output_tokens)
                return
            elif kind == "error":
                raise RuntimeError(f"{data.get('code')}: {data.get('message')}")
    raise RuntimeError("websocket ended without `done`")


def sse_extra_body(system: str, max_tokens: int, eos: int, pad: int) -> dict:
    if system.startswith("hf_serve"):
        # transformers serve takes a full GenerationConfig as a JSON string; min_new_tokens
        # holds EOS off so every system produces the trace's exact output length.
        config = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False,
                  "eos_token_id": eos, "pad_token_id": pad}
        if system == "hf_serve_cb":
            config["eos_token_id"] = -1  # its manager takes only max_new_tokens and eos_token_id
        return {"generation_config": json.dumps(config)}
    return {"ignore_eos": True}


async def sse_request(client, model: str, system: str, job: Job, sample: Sample, eos: int, pad: int) -> None:
    extra = sse_extra_body(system, job.max_tokens, eos, pad)
    kwargs = {"stream_options": {"include_usage": True}} if system.startswith(("se_", "vllm")) else {}
    stream = await client.completions.create(
        model=model, prompt=job.prompt, max_tokens=job.max_tokens, temperature=0.0, stream=True,
        extra_body=extra, **kwargs,
    )
    chunks = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            now = time.perf_counter()
            sample.first_token = sample.first_token or now
            sample.last_token = now
            chunks += 1
        if chunk.usage is not None:
            sample.prompt_tokens = chunk.usage.prompt_tokens
            sample.output_tokens = chunk.usage.completion_tokens
    sample.end = time.perf_counter()
    if not sample.output_tokens:
        sample.output_tokens = chunks  # no usage reported: one token per text chunk


@dataclass(slots=True)
class Target:
    """Where and how one system's requests go."""

    system: str
    server: ServerProcess
    session: object  # aiohttp.ClientSession
    client: object | None  # openai.AsyncOpenAI for SSE systems
    model: str
    eos: int
    pad: int

    async def send(self, job: Job, sample: Sample) -> None:
        if self.system == "se_ws":
            await ws_request(self.session, self.server, job, sample)
        else:
            await sse_request(self.client, self.model, self.system, job, sample, self.eos, self.pad)


async def run_rate(target: Target, jobs: list[Job], timeout_s: float, bar) -> list[Sample]:
    """Fires each job at its arrival time; bounded by `timeout_s` for the whole run."""
    start = time.perf_counter()
    samples = [Sample(j.index, j.max_tokens, start + j.arrival_s) for j in jobs]

    async def one(job: Job, sample: Sample) -> None:
        await asyncio.sleep(max(0.0, sample.arrival - time.perf_counter()))
        sample.arrival = time.perf_counter()
        try:
            await target.send(job, sample)
        except asyncio.CancelledError:
            sample.error = "timeout"
            raise
        except Exception as exc:  # recorded per request: one failure must not end the sweep
            sample.error = f"{type(exc).__name__}: {exc}"[:300]
        bar.update(1)

    tasks = [asyncio.create_task(one(j, s)) for j, s in zip(jobs, samples, strict=True)]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for s in samples:
        if s.end is None and s.error is None:
            s.error = "timeout"
    return samples


# -- statistics -----------------------------------------------------------------------------


def _stats(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    import numpy as np

    arr = np.asarray(xs, dtype=float)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def summarize(samples: list[Sample], rate: float) -> dict:
    ok = [s for s in samples if s.ok]
    ttft = [s.first_token - s.arrival for s in ok if s.first_token is not None]
    itl = [(s.last_token - s.first_token) / (s.output_tokens - 1) for s in ok
           if s.output_tokens > 1 and s.first_token is not None and s.last_token is not None]
    norm = [(s.end - s.arrival) / s.output_tokens for s in ok]
    e2e = [s.end - s.arrival for s in ok]
    span = (max(s.end for s in ok) - min(s.arrival for s in samples)) if ok else None
    errors = [s.error for s in samples if s.error is not None]
    wrong_len = sum(1 for s in ok if s.output_tokens != s.expected_tokens)
    return {
        "rate": rate,
        "num_requests": len(samples),
        "completed": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "wrong_output_len": wrong_len,
        "ttft_s": _stats(ttft),
        "itl_s": _stats(itl),
        "normalized_latency_s_per_token": _stats(norm),
        "e2e_s": _stats(e2e),
        "throughput_req_s": len(ok) / span if span else None,
        "output_tok_s": sum(s.output_tokens for s in ok) / span if span else None,
        "prompt_tokens_mean": statistics.fmean(p) if (p := [s.prompt_tokens for s in ok if s.prompt_tokens]) else None,
    }


# -- the sweep ------------------------------------------------------------------------------


def make_jobs(args, texts: list[str] | list[list[int]], outputs: list[int], system_index: int, rate_index: int,
              rate: float) -> list[Job]:
    """Poisson arrivals at `rate`. Text prompts get a unique tag (no cross-run cache hits); token-id
    prompts (bench/peers_vllm.py, servers without prefix caching) go as they are."""
    rng = random.Random(f"{args.seed}:arrivals:{rate}")  # same arrivals for every system at a rate
    t = 0.0
    jobs = []
    for i, (text, n) in enumerate(zip(texts, outputs, strict=True)):
        tag = f"#{system_index}{rate_index:02d}{i:04d} "
        jobs.append(Job(i, tag + text if isinstance(text, str) else text, n, t))
        t += rng.expovariate(rate)
    return jobs


async def warm_up(target: Target) -> None:
    sample = Sample(-1, 4, time.perf_counter())
    await target.send(Job(-1, "Hello there, how are you today?", 4, 0.0), sample)


async def make_target(system: str, server: ServerProcess, session, setup: dict) -> Target:
    client = None
    if system != "se_ws":
        import openai

        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=STARTUP_TIMEOUT_S,
        )
    async with session.get(f"{server.base_url}/v1/models", timeout=_timeout(30)) as r:
        model = (await r.json())["data"][0]["id"]
    return Target(system, server, session, client, model, setup["eos"], setup["pad"])


async def sweep_server(args, server: ServerProcess, systems: list[str], texts, outputs, setup, results) -> None:
    import aiohttp
    from tqdm import tqdm

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        print(f"starting {server.name} on {server.base_url} ...", file=sys.stderr)
        try:
            await server.start(session)
            for system in systems:
                target = await make_target(system, server, session, setup)
                await warm_up(target)
                results[system] = {}
                sys_index = ALL_SYSTEMS.index(system)
                for ri, rate in enumerate(args.rates):
                    jobs = make_jobs(args, texts, outputs, sys_index, ri, rate)
                    desc = f"{system} @ {rate:g} req/s"
                    with tqdm(total=len(jobs), desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
                        samples = await run_rate(target, jobs, args.run_timeout, bar)
                    results[system][f"{rate:g}"] = summarize(samples, rate)
                if target.client is not None:
                    await target.client.close()
        finally:
            server.close()


# -- event-loop lag -------------------------------------------------------------------------


async def measure_lag(args, texts, outputs, setup) -> dict:
    """Saturates the lag-probed server with a burst of WebSocket requests, pinging /health."""
    import aiohttp
    from tqdm import tqdm

    server = lag_server(args)
    n = args.lag_requests
    reps = (n + len(texts) - 1) // len(texts)
    burst_texts = (texts * reps)[:n]
    burst_out = (outputs * reps)[:n]
    jobs = [Job(i, f"#9{i:05d} {t}", o, 0.0) for i, (t, o) in enumerate(zip(burst_texts, burst_out, strict=True))]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        print(f"starting lag-probed server on {server.base_url} ...", file=sys.stderr)
        try:
            await server.start(session)
            target = await make_target("se_ws", server, session, setup)
            await warm_up(target)
            rtts: list[float] = []
            stop = asyncio.Event()
            pinger = asyncio.create_task(_ping(session, server, rtts, stop))
            async with session.get(f"{server.base_url}/bench/lag?reset=1") as r:
                await r.read()
            with tqdm(total=n, desc="saturation burst", unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
                samples = await run_rate(target, jobs, args.lag_seconds, bar)
            async with session.get(f"{server.base_url}/bench/lag") as r:
                lag = await r.json()
            stop.set()
            await pinger
        finally:
            server.close()
    done = sum(1 for s in samples if s.ok)
    return {
        **lag,
        "burst_requests": n,
        "burst_completed": done,
        "burst_window_s": args.lag_seconds,
        "health_rtt_ms": {k: (v * 1e3 if v is not None else None) for k, v in _stats(rtts).items()},
        "health_pings": len(rtts),
    }


async def _ping(session, server: ServerProcess, rtts: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        with contextlib.suppress(Exception):
            async with session.get(f"{server.base_url}/health", timeout=_timeout(10)) as r:
                await r.read()
                rtts.append(time.perf_counter() - t0)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)


# -- the lag-probed server (a subprocess of this script) ------------------------------------


@dataclass(slots=True)
class LagProbe:
    """How late `asyncio.sleep(interval)` wakes on the server's own loop, plus engine load.

    A sample is the wake-up's delay past its deadline (the clock when the sleep began, plus
    `interval`), and 0 when it woke before it: uvloop's timers run on a millisecond clock read
    once per loop iteration, so a timer may fire a little before the deadline as perf_counter
    sees it (a clean-clone CI run once got a p50 of -0.005 ms). Early wake-ups are counted.
    """

    engine: object
    interval: float = 0.001
    clock: Callable[[], float] = time.perf_counter
    lags: list[float] | None = None
    early: int = 0
    max_running: int = 0

    def reset(self) -> None:
        self.lags = []
        self.early = 0
        self.max_running = 0

    async def run(self) -> None:
        self.reset()
        while True:
            deadline = self.clock() + self.interval
            await asyncio.sleep(self.interval)
            self.record(self.clock() - deadline)
            self.max_running = max(self.max_running, len(self.engine.core.scheduler.running))

    def record(self, overshoot: float) -> None:
        """One wake-up, `overshoot` seconds after its deadline (negative when early)."""
        if overshoot < 0.0:
            self.early += 1
        self.lags.append(max(0.0, overshoot))

    def report(self) -> dict:
        import numpy as np

        lags = np.asarray(self.lags or [0.0]) * 1e3  # every sample >= 0: so is every percentile
        return {
            "lag_samples": len(self.lags or []),
            "lag_early_samples": self.early,
            "lag_p50_ms": float(np.percentile(lags, 50)),
            "lag_p99_ms": float(np.percentile(lags, 99)),
            "lag_max_ms": float(lags.max()),
            "lag_mean_ms": float(lags.mean()),
            "max_running": self.max_running,
        }


def lag_server_main(argv: list[str]) -> int:
    """`serving.py lag-server <streamengine serve flags>`: the real app with a lag probe."""
    from aiohttp import web

    from streamengine.__main__ import build_parser, config_from_args
    from streamengine.engine.async_engine import AsyncEngine
    from streamengine.server import ServerConfig, _run, create_app

    a = build_parser().parse_args(["serve", *argv])
    if a.host != HOST:
        raise SystemExit("the lag server binds 127.0.0.1 only")
    engine = AsyncEngine(config_from_args(a))
    app = create_app(engine, ServerConfig(model_name=engine.model_name))
    probe = LagProbe(engine)

    async def lag(request: web.Request) -> web.Response:
        body = probe.report()
        if request.query.get("reset"):
            probe.reset()
        return web.json_response(body)

    async def probe_ctx(_app):
        task = asyncio.create_task(probe.run(), name="lag-probe")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.router.add_get("/bench/lag", lag)
    app.cleanup_ctx.append(probe_ctx)
    _run(_serve_until_signal(app, a.host, a.port))
    return 0


async def _serve_until_signal(app, host: str, port: int) -> None:
    import signal

    from aiohttp import web

    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, host, port).start()
        await stop.wait()
    finally:
        await runner.cleanup()


# -- report ---------------------------------------------------------------------------------


def print_table(report: dict) -> None:
    w = max([26, *(len(LABELS[s]) for s in report["systems"])])
    head = (f"{'system':<{w}} {'rate':>5} {'done':>6} {'TTFT mean':>9} {'p50':>7} {'p99':>7} "
            f"{'ITL mean':>9} {'p99':>7} {'norm s/tok':>10} {'p99':>7} {'tok/s':>7}")
    print(head)
    print("-" * len(head))

    def f(x: float | None, width: int, digits: int = 3) -> str:
        return f"{x:>{width}.{digits}f}" if x is not None else f"{'-':>{width}}"

    for system, by_rate in report["systems"].items():
        for rate, r in by_rate.items():
            t, i, n = r["ttft_s"], r["itl_s"], r["normalized_latency_s_per_token"]
            print(
                f"{LABELS[system]:<{w}} {rate:>5} {r['completed']:>3}/{r['num_requests']:<2} "
                f"{f(t['mean'], 9)} {f(t['p50'], 7)} {f(t['p99'], 7)} {f(i['mean'], 9)} {f(i['p99'], 7)} "
                f"{f(n['mean'], 10)} {f(n['p99'], 7)} {f(r['output_tok_s'], 7, 1)}"
            )
    lag = report.get("event_loop_lag")
    if lag:
        print(
            f"event-loop lag while saturated ({lag['burst_requests']} requests at once, up to "
            f"{lag['max_running']} running): p50 {lag['lag_p50_ms']:.2f} ms, p99 {lag['lag_p99_ms']:.2f} ms, "
            f"max {lag['lag_max_ms']:.1f} ms (goal p99 <= 20 ms); /health RTT p50 "
            f"{_ms(lag['health_rtt_ms']['p50'])}, p99 {_ms(lag['health_rtt_ms']['p99'])}"
        )
    if report.get("baseline_note"):
        print(report["baseline_note"])


def _ms(x: float | None) -> str:
    return f"{x:.1f} ms" if x is not None else "-"


def write_png(report: dict, path: Path) -> None:
    from common import pyplot, save_figure

    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"se_ws": ("#2b7bba", "o-"), "se_sse": ("#5aa0d8", "s--"),
              "hf_serve": ("#e08a2c", "^-"), "hf_serve_cb": ("#7a9e3a", "v-")}
    for system, by_rate in report["systems"].items():
        color, style = styles[system]
        rows = [(float(k), r) for k, r in by_rate.items() if r["completed"]]
        xs = [k for k, _ in rows]
        ax1.plot(xs, [r["normalized_latency_s_per_token"]["mean"] for _, r in rows], style, color=color,
                 label=LABELS[system])
        ax2.plot(xs, [r["ttft_s"]["p99"] for _, r in rows], style, color=color, label=LABELS[system])
    for ax, ylabel, title in (
        (ax1, "normalized latency (s/token, mean)", "Normalized latency vs request rate"),
        (ax2, "time to first token p99 (s)", "TTFT p99 vs request rate"),
    ):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    cfg = report["config"]
    fig.suptitle(f"ShareGPT-like trace x{cfg['scale']:g}, {cfg['num_requests']} requests per rate (CPU, float32)",
                 fontsize=9)
    save_figure(fig, path)


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 requests per rate, lengths x0.1, 3 rates")
    p.add_argument("--model", help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests", type=int, help="requests per rate")
    p.add_argument("--scale", type=float, help="multiply every trace length")
    p.add_argument("--max-len", type=int, default=512, help="cap on each prompt and output length")
    p.add_argument("--rates", help="comma-separated request rates (req/s)")
    p.add_argument("--systems", default=",".join(SE_SYSTEMS), help="streamengine clients: " + ",".join(SE_SYSTEMS))
    p.add_argument("--baseline", choices=(*BASELINES, "none"), default="hf_serve")
    p.add_argument("--no-baseline", action="store_true", help="same as --baseline none")
    p.add_argument("--no-lag", action="store_true", help="skip the event-loop lag measurement")
    p.add_argument("--lag-requests", type=int, help="requests in the saturating burst")
    p.add_argument("--lag-seconds", type=float, help="cap on the saturation window")
    p.add_argument("--run-timeout", type=float, help="cap per (system, rate) run, seconds")
    p.add_argument("--kv-cache-bytes", type=int, help="streamengine KV budget (default: the server's)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads per server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "serving.json")
    p.add_argument("--png", type=Path, default=None, help="the plot (default: beside --json, same name)")
    p.add_argument("--no-png", action="store_true")
    args = p.parse_args(argv)
    args.png = args.png or args.json.with_suffix(".png")  # never over a committed plot
    mode = QUICK if args.quick else FULL
    for key in ("num_requests", "scale", "run_timeout", "lag_requests", "lag_seconds"):
        if getattr(args, key) is None:
            setattr(args, key, mode[key])
    try:
        args.rates = [float(r) for r in args.rates.split(",")] if args.rates else list(mode["rates"])
    except ValueError:
        p.error("--rates must be comma-separated numbers")
    if not args.rates or min(args.rates) <= 0:
        p.error("--rates must all be > 0")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if any(s not in SE_SYSTEMS for s in args.systems):
        p.error(f"--systems must name some of {', '.join(SE_SYSTEMS)}")
    if args.no_baseline:
        args.baseline = "none"
    for name in ("num_requests", "max_len", "lag_requests", "max_num_seqs", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (args.scale > 0 and args.run_timeout > 0 and args.lag_seconds > 0):
        p.error("--scale, --run-timeout and --lag-seconds must be > 0")
    return args


def load_setup(args) -> tuple[list[str], list[int], dict]:
    from traces import SHAREGPT, make_trace, normal_token_ids, summarize
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(args.folder)
    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    ids = normal_token_ids(tokenizer, config.vocab_size)
    trace = make_trace(SHAREGPT, args.num_requests, ids, seed=args.seed, scale=args.scale, max_len=args.max_len)
    texts = [tokenizer.decode(r.prompt_token_ids) for r in trace]
    outputs = [r.output_len for r in trace]
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return texts, outputs, {"eos": eos, "pad": pad, "trace": summarize(trace)}


async def run_all(args, texts, outputs, setup) -> tuple[dict, dict | None, str | None]:
    results: dict[str, dict] = {}
    if args.systems:
        await sweep_server(args, streamengine_server(args), args.systems, texts, outputs, setup, results)
    note = None
    if args.baseline != "none":
        server = transformers_server(args, args.baseline == "hf_serve_cb")
        try:
            await sweep_server(args, server, [args.baseline], texts, outputs, setup, results)
        except Exception as exc:  # report it and keep our own numbers
            note = f"baseline {args.baseline} failed: {exc}"[:2000]
            print(note, file=sys.stderr)
    lag = None if args.no_lag else await measure_lag(args, texts, outputs, setup)
    return results, lag, note


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lag-server"]:
        return lag_server_main(argv[1:])
    args = parse_args(argv)
    from common import model_folder

    args.folder = model_folder(args.model)
    texts, outputs, setup = load_setup(args)
    results, lag, note = asyncio.run(run_all(args, texts, outputs, setup))
    report = build_report(args, results, lag, note, setup)
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    if not args.no_png and results:
        write_png(report, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def build_report(args, results: dict, lag: dict | None, note: str | None, setup: dict) -> dict:
    from common import software  # torch is imported only where the report is built

    baseline_desc = {
        "hf_serve": "`transformers serve` (default: one model.generate at a time, no batching), "
                    "/v1/completions SSE via the openai client",
        "hf_serve_cb": "`transformers serve --continuous-batching`, /v1/completions SSE via the openai client",
        "none": None,
    }[args.baseline]
    ours = results.get("se_ws") or results.get("se_sse") or {}
    base = results.get(args.baseline) if args.baseline != "none" else None
    ratio = {}
    if ours and base:
        for rate, r in ours.items():
            b = base.get(rate)
            mine = r["normalized_latency_s_per_token"]["mean"]
            if b and mine and b["normalized_latency_s_per_token"]["mean"]:
                ratio[rate] = b["normalized_latency_s_per_token"]["mean"] / mine
    return {
        "systems": results,
        "rates": args.rates,
        "normalized_latency_ratio_baseline_over_ours": ratio,
        "event_loop_lag": lag,
        "event_loop_lag_p50_ms": lag["lag_p50_ms"] if lag else None,
        "event_loop_lag_p99_ms": lag["lag_p99_ms"] if lag else None,
        "baseline": args.baseline,
        "baseline_description": baseline_desc,
        "baseline_note": note,
        "trace": setup["trace"],
        "config": {
            "model": str(args.folder),
            "quick": args.quick,
            "num_requests": args.num_requests,
            "scale": args.scale,
            "max_len": args.max_len,
            "threads": args.threads,
            "max_num_seqs": args.max_num_seqs,
            "kv_cache_bytes": args.kv_cache_bytes,
            "run_timeout_s": args.run_timeout,
            "seed": args.seed,
            **software(),
        },
    }


if __name__ == "__main__":
    sys.exit(main())
