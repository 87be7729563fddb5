"""The hostile-tenant phase of bench/stress.py: one tenant attacks, another must not notice.

The server runs with two API keys, so two engine tenants: `quiet-key` and `hostile-key` (and an
admin key for /metrics and /v1/kv_state). The quiet tenant sends a steady trickle of short
streamed chat requests (HTTP SSE, greedy, `ignore_eos`), first alone (the baseline), then while
the hostile tenant runs every probe below at once; its time to first token and the gaps between
its content chunks are compared. The probes, each bounded in count and in time:

  wide_n         chat requests with a wide `n` (64 samples of 64 tokens), one after another
  slow_grammars  waves of distinct `(a{N}){N}` regexes (structured_outputs): slow to compile,
                 tens of MB each once compiled
  masks          `n`=16 rows constrained by one slow regex: mask work inside every shared step
  keyless_ws     WebSocket handshakes without a key, held idle (reopened when closed)
  slowloris      HTTP connections that send their head, or their body, a few bytes a second
  huge_prompts   multi-MB prompts that must be refused
  queue_burst    many plain requests at once, past any queue bound

When the quiet trickle is done the probes are cut (their connections closed). The server's
RSS is read after the baseline and after the hostile phase has settled, and sampled throughout;
/health is polled throughout; the engine's restarts are counted from the server's log (the
engine logs each one: "restarting the engine core").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import struct
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from stress import HOST, PROMPTS, HealthPoller, RawWebSocket, percentiles, rss_mb, settle

QUIET_KEY, HOSTILE_KEY, ADMIN_KEY = "quiet-key", "hostile-key", "stress-admin-key"
SERVER_FLAGS = ("--api-key", QUIET_KEY, "--api-key", HOSTILE_KEY, "--admin-key", ADMIN_KEY)
PROBES = ("wide_n", "slow_grammars", "masks", "keyless_ws", "slowloris", "huge_prompts", "queue_burst")
RESTART_LINE = "restarting the engine core"  # streamengine/engine/async_engine.py logs this on every restart
QUIET_TIMEOUT_S = 60.0  # one quiet request, from send to its last chunk (past it, a failure)
PROBE_GRACE_S = QUIET_TIMEOUT_S + 30.0  # probes end by then even if nobody cancels them
MAX_ROUNDS = 1000  # per probe loop: every loop is bounded in count as well as in time
TRICKLE_S = 1.0  # a slowloris connection sends a few bytes this often
REFUSED_RETRY_S = 5.0  # a keyless socket refused at the handshake tries again this much later
RSS_SAMPLE_S = 1.0


@dataclass(slots=True)
class HostileConfig:
    warmup_s: float = 3.0
    baseline_s: float = 60.0
    hostile_s: float = 120.0
    quiet_interval_s: float = 0.5
    quiet_max_tokens: int = 32
    wide_n: int = 64
    wide_max_tokens: int = 64
    grammars: int = 48  # distinct slow regexes in all
    grammar_wave: int = 8  # sent at once
    grammar_base_n: int = 400  # the first is (a{400}){400}, then 401, ...
    mask_n: int = 16
    mask_pattern: str = "(a{300}){300}"
    mask_max_tokens: int = 32
    keyless_sockets: int = 200
    slowloris: int = 100
    huge_prompts: int = 12
    huge_prompt_mb: float = 2.5
    burst: int = 640  # past a lone tenant's share of the default queue (half of max_waiting 1024)
    burst_max_tokens: int = 16
    rss_bound_mb: float = 512.0
    probes: tuple[str, ...] = PROBES


QUICK = {"baseline_s": 20.0, "hostile_s": 40.0, "grammars": 16, "huge_prompts": 4, "burst": 128}


# ---- what the probes saw --------------------------------------------------------------------


@dataclass(slots=True)
class Outcomes:
    """Per probe, how its attempts ended (HTTP status[:error code], or what the socket did),
    and how long the server held the sockets it closed itself."""

    counts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    held_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def add(self, probe: str, outcome: str, example: str | None = None) -> None:
        self.counts[probe][outcome] += 1
        if example and len(self.examples[probe]) < 3:
            self.examples[probe].append(example[:300])

    def report(self) -> dict:
        held = {k: {"p50": percentiles(v)["p50"], "max": percentiles(v)["max"], "count": len(v)}
                for k, v in self.held_s.items()}
        return {"outcomes": {k: dict(v) for k, v in self.counts.items()}, "server_closed_after_ms": held,
                "examples": dict(self.examples)}


@dataclass(slots=True)
class QuietTimes:
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    sent: int = 0
    failures: list[str] = field(default_factory=list)

    def report(self) -> dict:
        return {"requests": self.sent, "completed": len(self.e2e), "failures": len(self.failures),
                "failure_examples": self.failures[:5], "ttft_ms": percentiles(self.ttft),
                "gap_ms": percentiles(self.gaps), "e2e_ms": percentiles(self.e2e)}


def http_outcome(status: int, text: str) -> str:
    """`status`, with the OpenAI error's code (or type) when there is one."""
    if status == 200:
        return "200"
    try:
        error = json.loads(text).get("error") or {}
        return f"{status}:{error.get('code') or error.get('type') or '?'}"
    except (ValueError, AttributeError):
        return str(status)


# ---- the quiet tenant -----------------------------------------------------------------------


async def quiet_request(session: aiohttp.ClientSession, base: str, body: dict, times: QuietTimes) -> None:
    """One streamed chat request: TTFT to its first content chunk, then the gaps between chunks."""
    t0 = time.perf_counter()
    last: float | None = None
    async with session.post(f"{base}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            times.failures.append(f"{r.status} {(await r.text())[:200]}")
            return
        for _ in range(10 * body["max_tokens"] + 10):
            line = await r.content.readline()
            if not line or line.strip() == b"data: [DONE]":
                break
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                times.failures.append(f"in-band error {str(chunk)[:200]}")
                return
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                now = time.perf_counter()
                if last is None:
                    times.ttft.append(now - t0)
                else:
                    times.gaps.append(now - last)
                last = now
    times.e2e.append(time.perf_counter() - t0)


async def quiet_trickle(base: str, model: str, seconds: float, cfg: HostileConfig) -> QuietTimes:
    """A request every `quiet_interval_s` for `seconds`, each on its own; waits for them all."""
    times = QuietTimes()
    headers = {"Authorization": f"Bearer {QUIET_KEY}"}
    timeout = aiohttp.ClientTimeout(total=QUIET_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers,
                                     timeout=timeout) as session:
        tasks: list[asyncio.Task] = []
        start = time.monotonic()
        for i in range(int(seconds / cfg.quiet_interval_s)):
            await asyncio.sleep(max(0.0, start + i * cfg.quiet_interval_s - time.monotonic()))
            body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    "max_tokens": cfg.quiet_max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
            tasks.append(asyncio.create_task(quiet_request(session, base, body, times)))
            times.sent += 1
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, TimeoutError):
                times.failures.append(f"no end within {QUIET_TIMEOUT_S:g} s")
            elif isinstance(result, BaseException):
                times.failures.append(f"{type(result).__name__}: {str(result)[:200]}")
    return times


# ---- the hostile tenant's probes ------------------------------------------------------------


@dataclass(slots=True)
class Attack:
    """What every probe needs: where the server is, the hostile session, the run's bounds."""

    base: str
    port: int
    model: str
    session: aiohttp.ClientSession
    cfg: HostileConfig
    deadline: float  # monotonic: no probe outlives it
    outcomes: Outcomes = field(default_factory=Outcomes)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def chat(self, content: str, max_tokens: int, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, **extra}

    async def post(self, probe: str, body: dict | bytes) -> None:
        """One chat request, its outcome recorded; cut (cancelled) requests are recorded too."""
        kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        try:
            async with self.session.post(f"{self.base}/v1/chat/completions", **kwargs) as r:
                text = await r.text()
                self.outcomes.add(probe, http_outcome(r.status, text), None if r.status == 200 else text)
        except asyncio.CancelledError:
            self.outcomes.add(probe, "cut_at_end")
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.outcomes.add(probe, type(exc).__name__, str(exc))

    async def repeat(self, probe: str, make_body) -> None:
        """Sends `make_body(i)` one after another until the phase ends."""
        for i in range(MAX_ROUNDS):
            if self.left() <= 0:
                return
            await self.post(probe, make_body(i))


async def wide_n(a: Attack) -> None:
    await a.repeat("wide_n", lambda i: a.chat(f"Tell a story {i}.", a.cfg.wide_max_tokens, n=a.cfg.wide_n,
                                               temperature=1.0, ignore_eos=True))


async def slow_grammars(a: Attack) -> None:
    """Waves of distinct slow regexes: each a new compile, none a cache hit."""
    cfg = a.cfg
    for wave in range(0, cfg.grammars, cfg.grammar_wave):
        if a.left() <= 0:
            return
        sizes = range(cfg.grammar_base_n + wave, cfg.grammar_base_n + min(wave + cfg.grammar_wave, cfg.grammars))
        await asyncio.gather(*(a.post("slow_grammars", a.chat(
            "Scream.", 4, structured_outputs={"regex": f"(a{{{n}}}){{{n}}}"})) for n in sizes))


async def masks(a: Attack) -> None:
    await a.repeat("masks", lambda i: a.chat(f"Scream {i}.", a.cfg.mask_max_tokens, n=a.cfg.mask_n, temperature=1.0,
                                              structured_outputs={"regex": a.cfg.mask_pattern}))


async def huge_prompts(a: Attack) -> None:
    """A few multi-MB prompts, spread over the phase."""
    cfg = a.cfg
    words = int(cfg.huge_prompt_mb * 1e6 / 6)
    body = json.dumps(a.chat("hello " * words, 8)).encode()
    for _ in range(cfg.huge_prompts):
        if a.left() <= 0:
            return
        await a.post("huge_prompts", body)
        await asyncio.sleep(min(a.left(), cfg.hostile_s / max(1, cfg.huge_prompts)))


async def queue_burst(a: Attack) -> None:
    await asyncio.gather(*(a.post("queue_burst", a.chat(f"Count to {i}.", a.cfg.burst_max_tokens, ignore_eos=True))
                           for i in range(a.cfg.burst)))


async def _until_closed(reader: asyncio.StreamReader, limit: float) -> bytes:
    """What the server sends until it closes the connection (or `limit` seconds pass)."""
    got = b""
    async with asyncio.timeout(limit):
        for _ in range(MAX_ROUNDS):
            data = await reader.read(4096)
            if not data:
                return got
            got += data[: 4096 - len(got)]
    return got


def _close_code(frames: bytes) -> str:
    """The code of the server's close frame (unmasked, opcode 8), if that is what it sent."""
    if len(frames) >= 4 and frames[0] & 0x0F == 0x8:
        return str(struct.unpack("!H", frames[2:4])[0])
    return "no_close_frame"


async def _keyless_once(a: Attack) -> bool:
    """One keyless socket, held idle until the server closes it; False if it was refused."""
    reader, writer = await RawWebSocket.open_socket(HOST, a.port)
    t0 = time.monotonic()
    try:
        writer.write(RawWebSocket.handshake_bytes(HOST, a.port, a.rng))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=max(0.1, a.left()))
        status = head.split(b" ", 2)[1].decode()
        if status != "101":
            a.outcomes.add("keyless_ws", status)
            return False
        a.outcomes.add("keyless_ws", "101")
        # The server's first bytes (its close frame) or EOF end the wait; its close handshake,
        # which this client never answers, is not counted.
        try:
            frames = await asyncio.wait_for(reader.read(4096), timeout=max(0.1, a.left()))
        except asyncio.CancelledError:
            a.outcomes.add("keyless_ws", "held_to_end")  # still open when the probes were cut
            raise
        a.outcomes.add("keyless_ws", f"closed:{_close_code(frames)}")
        a.outcomes.held_s["keyless_ws"].append(time.monotonic() - t0)
        return True
    finally:
        writer.transport.abort()


async def keyless_ws(a: Attack) -> None:
    async def slot() -> None:
        for _ in range(MAX_ROUNDS):
            if a.left() <= 0:
                return
            try:
                if not await _keyless_once(a):  # refused: try again a little later
                    await asyncio.sleep(min(REFUSED_RETRY_S, max(0.0, a.left())))
            except TimeoutError:
                a.outcomes.add("keyless_ws", "held_to_end")
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                a.outcomes.add("keyless_ws", type(exc).__name__, str(exc))
                await asyncio.sleep(min(1.0, max(0.0, a.left())))

    await asyncio.gather(*(slot() for _ in range(a.cfg.keyless_sockets)))


SLOWLORIS_KINDS = ("partial_head", "slow_body_keyed", "slow_body_keyless")


def _slowloris_answer(got: bytes) -> str:
    """The status the server answered with, or "closed" when it closed without one."""
    return got.split(b" ", 2)[1].decode(errors="replace") if got.startswith(b"HTTP/") else "closed"


def _slowloris_start(kind: str, port: int) -> tuple[bytes, bytes]:
    """(what to send at once, what to send every TRICKLE_S) for one kind of slow client."""
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
    if kind == "partial_head":
        return head.encode(), b"X-Slow: 1\r\n"  # the blank line that ends the head never comes
    if kind == "slow_body_keyed":
        head += f"Authorization: Bearer {HOSTILE_KEY}\r\n"
    return (head + "Content-Length: 1000000\r\n\r\n{\"x\": \"").encode(), b"aaaa"


async def _drip_until_answered(a: Attack, writer: asyncio.StreamWriter, first: bytes, drip: bytes,
                               answer: asyncio.Task) -> str:
    """Sends `first`, then `drip` every TRICKLE_S until the server answers or closes."""
    writer.write(first)
    for _ in range(MAX_ROUNDS):
        done, _ = await asyncio.wait({answer}, timeout=min(TRICKLE_S, max(0.0, a.left())))
        if done:
            break
        if a.left() <= 0:
            return "held_to_end"
        writer.write(drip)
    else:
        return "held_to_end"
    try:
        return _slowloris_answer(answer.result())
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "held_to_end"


async def _slowloris_once(a: Attack, kind: str) -> None:
    reader, writer = await RawWebSocket.open_socket(HOST, a.port)
    t0 = time.monotonic()
    first, drip = _slowloris_start(kind, a.port)
    answer = asyncio.create_task(_until_closed(reader, max(0.1, a.left())))
    try:
        outcome = await _drip_until_answered(a, writer, first, drip, answer)
    except asyncio.CancelledError:
        a.outcomes.add("slowloris", f"{kind}:held_to_end")  # still open when the probes were cut
        raise
    finally:
        answer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await answer
        writer.transport.abort()
    a.outcomes.add("slowloris", f"{kind}:{outcome}")
    if outcome != "held_to_end":
        a.outcomes.held_s[f"slowloris_{kind}"].append(time.monotonic() - t0)


async def slowloris(a: Attack) -> None:
    async def slot(kind: str) -> None:
        for _ in range(MAX_ROUNDS):
            if a.left() <= 0:
                return
            try:
                await _slowloris_once(a, kind)
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                a.outcomes.add("slowloris", f"{kind}:{type(exc).__name__}", str(exc))
                await asyncio.sleep(min(1.0, max(0.0, a.left())))

    await asyncio.gather(*(slot(SLOWLORIS_KINDS[i % 3]) for i in range(a.cfg.slowloris)))


PROBE_FUNCTIONS = {"wide_n": wide_n, "slow_grammars": slow_grammars, "masks": masks, "keyless_ws": keyless_ws,
                   "slowloris": slowloris, "huge_prompts": huge_prompts, "queue_burst": queue_burst}


# ---- the phase ------------------------------------------------------------------------------


def restarts_logged(log: Path) -> int:
    return log.read_text(errors="replace").count(RESTART_LINE)


def ratio(hostile: float | None, baseline: float | None) -> float | None:
    return hostile / baseline if hostile is not None and baseline else None


async def measured_trickle(server, model: str, seconds: float, cfg: HostileConfig) -> tuple[QuietTimes, HealthPoller]:
    async with HealthPoller(server.base_url, server.proc.pid, rss_every=RSS_SAMPLE_S) as health:
        times = await quiet_trickle(server.base_url, model, seconds, cfg)
    return times, health


async def under_attack(server, model: str, cfg: HostileConfig) -> tuple[QuietTimes, HealthPoller, Outcomes]:
    """The quiet trickle while every chosen probe runs; the probes are cut when it is done."""
    headers = {"Authorization": f"Bearer {HOSTILE_KEY}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers) as session:
        attack = Attack(server.base_url, server.port, model, session, cfg,
                        deadline=time.monotonic() + cfg.hostile_s + PROBE_GRACE_S)
        probes = [asyncio.create_task(PROBE_FUNCTIONS[name](attack), name=name) for name in cfg.probes]
        try:
            times, health = await measured_trickle(server, model, cfg.hostile_s, cfg)
        finally:
            for task in probes:
                task.cancel()
            for task, result in zip(probes, await asyncio.gather(*probes, return_exceptions=True), strict=True):
                if isinstance(result, Exception):
                    attack.outcomes.add(task.get_name(), f"probe_failed:{type(result).__name__}", str(result))
    return times, health, attack.outcomes


def health_summary(pollers: list[HealthPoller]) -> dict:
    states: Counter = Counter()
    for p in pollers:
        states.update(p.engine_states)
    failures = sum(len(p.failures) for p in pollers)
    return {"health_ms": percentiles([x for p in pollers for x in p.latencies]), "failures": failures,
            "failure_examples": [f for p in pollers for f in p.failures][:3], "engine_states": dict(states),
            "ok": failures == 0 and set(states) <= {"ready"}}


async def hostile_phase(admin: aiohttp.ClientSession, server, cfg: HostileConfig) -> dict:
    """Baseline, then the same quiet traffic under attack; the figures of both and the probes'."""
    base, pid, log = server.base_url, server.proc.pid, Path(server.log.name)
    async with admin.get(f"{base}/v1/models") as r:
        model = (await r.json())["data"][0]["id"]
    await quiet_trickle(base, model, cfg.warmup_s, cfg)  # first-request costs stay out of the baseline
    restarts_before = restarts_logged(log)
    baseline, calm = await measured_trickle(server, model, cfg.baseline_s, cfg)
    rss_before = rss_mb(pid)
    t0 = time.perf_counter()
    hostile, stormy, outcomes = await under_attack(server, model, cfg)
    wall = time.perf_counter() - t0
    after = await settle(admin, base, timeout=60.0)
    await asyncio.sleep(1.0)
    rss_after = rss_mb(pid)
    b, h = baseline.report(), hostile.report()
    return {
        "config": asdict(cfg), "baseline": b, "hostile": h, "hostile_wall_s": wall, "probes": outcomes.report(),
        "ttft_p99_ratio": ratio(h["ttft_ms"]["p99"], b["ttft_ms"]["p99"]),
        "ttft_p50_ratio": ratio(h["ttft_ms"]["p50"], b["ttft_ms"]["p50"]),
        "gap_p99_ratio": ratio(h["gap_ms"]["p99"], b["gap_ms"]["p99"]),
        "rss_mb": {"before": rss_before, "peak": max([y for _, y in stormy.rss] + [rss_after]), "after": rss_after},
        "rss_growth_mb": rss_after - rss_before, "rss_mb_series": stormy.rss,
        "engine_restarts": restarts_logged(log) - restarts_before,
        "health": {"baseline": health_summary([calm]), "hostile": health_summary([stormy])},
        "after": after, "server_alive": server.proc.poll() is None,
    }


def summary_keys(phase: dict) -> dict:
    """The phase's headline figures, for the top of the stress JSON."""
    health_ok = phase["health"]["hostile"]["ok"] and phase["health"]["baseline"]["ok"]
    keys = {
        "hostile_ttft_p99_ratio": phase["ttft_p99_ratio"], "hostile_gap_p99_ratio": phase["gap_p99_ratio"],
        "hostile_rss_growth_mb": phase["rss_growth_mb"], "hostile_rss_bound_mb": phase["config"]["rss_bound_mb"],
        "hostile_engine_restarts": phase["engine_restarts"], "hostile_health_ok": health_ok,
        "hostile_quiet_failures": phase["hostile"]["failures"] + phase["baseline"]["failures"],
    }
    ratios = (keys["hostile_ttft_p99_ratio"], keys["hostile_gap_p99_ratio"])
    keys["hostile_within_goal"] = (
        all(r is not None and r <= 2.0 for r in ratios) and keys["hostile_rss_growth_mb"] <= keys["hostile_rss_bound_mb"]
        and keys["hostile_engine_restarts"] == 0 and health_ok and keys["hostile_quiet_failures"] == 0)
    return keys


def print_hostile(phase: dict) -> None:
    def f(x, digits: int = 1) -> str:
        return f"{x:.{digits}f}" if x is not None else "-"

    print("hostile tenant: the quiet tenant's streamed chat requests, alone and under attack")
    print(f"{'':<10} {'requests':>8} {'failed':>6} {'TTFT p50':>9} {'p99 ms':>8} {'gap p50':>8} {'p99 ms':>8}")
    for name in ("baseline", "hostile"):
        q = phase[name]
        print(f"{name:<10} {q['requests']:>8} {q['failures']:>6} {f(q['ttft_ms']['p50']):>9} {f(q['ttft_ms']['p99']):>8} "
              f"{f(q['gap_ms']['p50']):>8} {f(q['gap_ms']['p99']):>8}")
    rss = phase["rss_mb"]
    print(f"ratios (goal <= 2): TTFT p99 {f(phase['ttft_p99_ratio'], 2)}, gap p99 {f(phase['gap_p99_ratio'], 2)}; "
          f"RSS {f(rss['before'], 0)} -> {f(rss['after'], 0)} MB (peak {f(rss['peak'], 0)}, bound "
          f"+{phase['config']['rss_bound_mb']:g}); engine restarts {phase['engine_restarts']}; "
          f"/health engine states {phase['health']['hostile']['engine_states']}")
    for probe, counts in phase["probes"]["outcomes"].items():
        print(f"  {probe}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
