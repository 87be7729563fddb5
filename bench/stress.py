"""Stress and soak of the real server: thousands of concurrent streams, then hostile mixed traffic.

The server is `python -m streamengine serve` in a subprocess on a free 127.0.0.1 port (the
default model, or `--model PATH`). Phases, in order:

  streams_N  N concurrent WebSocket streams (`--streams`, default 1,000 then 2,000) spread over
             `--sockets` sockets (the server takes at most 256 live requests per socket), short
             greedy outputs; every stream must end with `done`, finish "length", max_tokens tokens
  warmup     the soak's own traffic for `--warmup-seconds`, so that the RSS baseline already
             holds every pool, buffer and cache this traffic fills once
  soak       `--soak-seconds` of mixed traffic (MixedTraffic below) from `--clients` concurrent
             clients: WebSocket generates (n, max_tokens, stop strings, temperature, logprobs),
             client aborts, sockets closed mid-stream (close frame, FIN without one, TCP reset),
             slow readers (a fixed receive buffer, nothing read for `--slow-stall` seconds),
             malformed messages, OpenAI HTTP requests streamed (SSE) and not, SSE streams and
             plain requests cut mid-way, bad HTTP bodies
  hostile    on a server of its own, started with two API keys (two tenants): a quiet tenant's
             trickle of short streamed chat requests alone, then beside a hostile tenant's
             probes (wide n, slow grammars, grammar masks, keyless sockets, slowloris, huge
             prompts, a queue burst); bench/hostile.py says what each does and measures

`--phases` chooses among streams, soak (with its warm-up) and hostile. While each phase runs, /health is fetched every 100 ms on its own connection and its latency
recorded. Afterwards: blocks still in use (/v1/kv_state: used + shared), requests still
running or waiting (/metrics), TCP connections the server process still holds, and its RSS.
JSON (`--json`) carries `errors` (unexpected errors, failed streams, failed health checks),
`leaked_blocks`, `health_p99_ms` (over all phases), `rss_growth_mb` (server RSS after the soak
minus after the warm-up), then per-phase details; a table is printed. The hostile phase adds
`hostile_ttft_p99_ratio` and `hostile_gap_p99_ratio` (the quiet tenant's TTFT and inter-chunk
gap p99 under attack over alone; goal <= 2), `hostile_rss_growth_mb` (against
`hostile_rss_bound_mb`), `hostile_engine_restarts`, `hostile_health_ok`,
`hostile_quiet_failures` and `hostile_within_goal`.

MixedTraffic is also the traffic of tests/test_soak.py (against an in-process server there).
Client and server share the machine's cores, so latencies here include the client's own load.

    python bench/stress.py --quick          # ~4.5 min: 200 and 400 streams, 60 s soak, hostile 20 + 40 s
    python bench/stress.py                  # ~19 min: 1,000 and 2,000 streams, 600 s soak, hostile 60 + 120 s
    python bench/stress.py --quick --phases hostile --hostile-probes masks   # one probe alone
    python bench/stress.py --quick --model /path/to/hf_folder --streams 50,100 --soak-seconds 10

The server runs with one torch thread unless `--threads` says otherwise (see its help).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import fcntl
import json
import os
import random
import socket
import struct
import sys
import termios
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

HOST = "127.0.0.1"  # loopback only, never another address
RESULTS = Path(__file__).resolve().parent / "results"
QUICK = {"streams": (200, 400), "soak_seconds": 60.0, "warmup_seconds": 10.0}
PHASES = ("streams", "soak", "hostile")
FULL = {"streams": (1000, 2000), "soak_seconds": 600.0, "warmup_seconds": 60.0}
HEALTH_INTERVAL_S = 0.1
HEALTH_TIMEOUT_S = 10.0
RSS_EVERY_S = 5.0
MAX_MESSAGES = 200_000  # per read loop: every loop is bounded in count as well as in time
MAX_EPISODES = 100_000  # per soak client
# A slow reader's socket receive buffer, fixed (no autotuning). Not much smaller: a window far
# below loopback's 64 KiB MSS trips silly-window avoidance and the connection crawls at ~10 kB/s
# (measured here with 4 KiB: 280 kB in 30 s), a broken link rather than a slow reader.
SLOW_READER_RCVBUF = 64 * 1024

PROMPTS = (
    "The sky is", "Once upon a time", "List three colors:", "def fibonacci(n):",
    "Write a haiku about rain.", "Translate 'good morning' to French.", "1, 2, 3, 4,",
    "The quick brown fox", "Explain what a block table is.", "Hello!",
)
STOPS = (["."], [" the", "\n"], "e", ["!", "?"], [","])


class Problem(Exception):
    """The server answered something a correct server would not."""


# ---- a raw WebSocket client ---------------------------------------------------------------


class RawWebSocket:
    """A minimal RFC 6455 client on a plain socket, for what aiohttp's client does not do: a
    fixed receive buffer and a reader that stops (a slow reader), a TCP reset, a socket dropped without a close frame,
    a handshake or a frame cut in half."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rng: random.Random) -> None:
        self.reader, self.writer, self.rng = reader, writer, rng

    def bytes_unread(self) -> int:
        """Bytes the kernel holds for this socket that nobody has read yet (FIONREAD)."""
        sock = self.writer.get_extra_info("socket")
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]

    async def stop_reading(self, least_s: float, most_s: float = 20.0, still_s: float = 1.0) -> None:
        """Reads nothing for at least `least_s` seconds, then until the kernel's receive queue
        has not grown for `still_s` (the sender is held up, whatever the machine's speed; longer
        than an engine step on a loaded machine, so a pause between steps does not pass for
        it), at most `most_s` seconds in all."""
        start = time.monotonic()
        await asyncio.sleep(least_s)
        seen, since = self.bytes_unread(), time.monotonic()
        while time.monotonic() - start < most_s:
            await asyncio.sleep(0.1)
            now = self.bytes_unread()
            if now != seen or now == 0:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since >= still_s:
                return

    @staticmethod
    async def open_socket(host: str, port: int, rcvbuf: int | None = None):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect: the window scale is fixed at the handshake
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        # A small reader limit: the stream stops pulling from the socket once 2 x limit bytes
        # wait unread, so the kernel window closes and the server really sees a slow reader.
        return await asyncio.open_connection(sock=sock, limit=4096)

    @staticmethod
    def handshake_bytes(host: str, port: int, rng: random.Random) -> bytes:
        key = base64.b64encode(rng.randbytes(16)).decode()
        return (
            f"GET /v1/stream HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()

    @classmethod
    async def connect(cls, host: str, port: int, rng: random.Random, rcvbuf: int | None = None) -> RawWebSocket:
        reader, writer = await cls.open_socket(host, port, rcvbuf)
        ws = cls(reader, writer, rng)
        try:
            writer.write(cls.handshake_bytes(host, port, rng))
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 101"):
                raise Problem(f"handshake refused: {head[:200]!r}")
        except BaseException:
            ws.reset()
            raise
        return ws

    def frame(self, opcode: int, payload: bytes) -> bytes:
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 1 << 16:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        mask = self.rng.randbytes(4)
        keys = (mask * (n // 4 + 1))[:n]
        masked = (int.from_bytes(payload, "big") ^ int.from_bytes(keys, "big")).to_bytes(n, "big") if n else b""
        return head + mask + masked

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def send_text(self, text: str) -> None:
        await self.send_raw(self.frame(0x1, text.encode()))

    async def send_json(self, message: dict) -> None:
        await self.send_text(json.dumps(message))

    async def _frame(self) -> tuple[bool, int, bytes]:
        b0, b1 = await self.reader.readexactly(2)
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", await self.reader.readexactly(2))
        elif n == 127:
            (n,) = struct.unpack("!Q", await self.reader.readexactly(8))
        if b1 & 0x80:
            raise Problem("the server sent a masked frame")
        return bool(b0 & 0x80), b0 & 0x0F, await self.reader.readexactly(n)

    async def recv_json(self) -> dict:
        """The next text message; pings are answered, a close frame is a Problem."""
        parts: list[bytes] = []
        for _ in range(MAX_MESSAGES):
            fin, opcode, payload = await self._frame()
            if opcode == 0x9:
                await self.send_raw(self.frame(0xA, payload))
                continue
            if opcode == 0xA:
                continue
            if opcode == 0x8:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
                raise Problem(f"server closed the socket: {code} {payload[2:]!r}")
            parts.append(payload)
            if fin:
                return json.loads(b"".join(parts))
        raise Problem("too many frames")

    async def close(self) -> None:
        """A clean close: close frame, the server's reply, then FIN."""
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, Problem):
            await self.send_raw(self.frame(0x8, struct.pack("!H", 1000)))
            for _ in range(MAX_MESSAGES):
                _, opcode, _ = await self._frame()
                if opcode == 0x8:
                    break
        self.drop()

    def drop(self) -> None:
        """FIN with no close frame: a client that just goes away."""
        self.writer.transport.close()

    def reset(self) -> None:
        """TCP RST: SO_LINGER 0, then close."""
        reset_transport(self.writer.transport)


def reset_transport(transport: asyncio.BaseTransport | None) -> None:
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


# ---- what one WebSocket request must receive ------------------------------------------------


@dataclass(slots=True)
class Expect:
    params: dict
    aborted: bool = False
    tokens: Counter = field(default_factory=Counter)  # sample index -> tokens received
    deltas: int = 0
    done: dict | None = None

    @property
    def n(self) -> int:
        return self.params.get("n", 1)

    def on_delta(self, rid: str, m: dict) -> None:
        if self.done is not None:
            raise Problem(f"{rid}: delta after done")
        if not 0 <= m.get("index", -1) < self.n:
            raise Problem(f"{rid}: delta index {m.get('index')} with n={self.n}")
        ids = m["token_ids"]
        if self.params.get("logprobs") is not None and len(m.get("logprobs") or []) != len(ids):
            raise Problem(f"{rid}: {len(ids)} tokens but logprobs for {len(m.get('logprobs') or [])}")
        self.tokens[m["index"]] += len(ids)
        self.deltas += 1

    def check(self, rid: str) -> None:
        d = self.done
        assert d is not None
        reasons, most = d.get("finish_reasons") or [], self.params["max_tokens"]
        allowed = {"length", "stop", "abort"} if self.aborted else {"length", "stop"}
        if len(reasons) != self.n or not set(reasons) <= allowed or d.get("finish_reason") != reasons[0]:
            raise Problem(f"{rid}: finish {d.get('finish_reason')!r} {reasons} for n={self.n}, aborted={self.aborted}")
        unstoppable = self.params.get("ignore_eos") and not self.params.get("stop")
        for i, reason in enumerate(reasons):
            got = self.tokens[i]
            if got > most or (reason == "length" and got != most):
                raise Problem(f"{rid}: sample {i} got {got} tokens, finish {reason!r}, max_tokens {most}")
            if unstoppable and reason == "stop":
                raise Problem(f"{rid}: sample {i} stopped early with ignore_eos and no stop strings")
        if d["usage"]["completion_tokens"] != sum(self.tokens.values()):
            raise Problem(f"{rid}: usage says {d['usage']['completion_tokens']} tokens, got {sum(self.tokens.values())}")


async def read_streams(recv, expects: dict[str, Expect], late_unknown: set[str] = frozenset()) -> int:
    """Reads until every request in `expects` got `done`; returns the messages read.

    `late_unknown`: ids whose abort may arrive after their end, answered with `unknown_id`.
    """
    pending = {rid for rid, e in expects.items() if e.done is None}
    for count in range(MAX_MESSAGES):
        if not pending:
            return count
        m = await recv()
        kind, rid = m.get("type"), m.get("id")
        if kind == "delta" and rid in expects:
            expects[rid].on_delta(rid, m)
        elif kind == "done" and rid in pending:
            expects[rid].done = m
            expects[rid].check(rid)
            pending.discard(rid)
        elif kind == "error" and m.get("code") == "unknown_id" and rid in late_unknown:
            continue
        else:
            raise Problem(f"unexpected message {str(m)[:300]}")
    raise Problem("too many messages")


def aiohttp_recv(ws: aiohttp.ClientWebSocketResponse):
    async def recv() -> dict:
        msg = await ws.receive()
        if msg.type is not aiohttp.WSMsgType.TEXT:
            raise Problem(f"socket ended: {msg.type.name} {ws.close_code} {msg.extra!r}")
        return json.loads(msg.data)

    return recv


# ---- malformed messages and their answers ---------------------------------------------------


def _gen(id_: object = None, **fields) -> str:
    body = {"type": "generate", **({"id": id_} if id_ is not None else {}), **fields}
    return json.dumps(body)


BAD_WS_MESSAGES: tuple[tuple[str | bytes, str | None, str], ...] = (
    ("{not json", None, "bad_json"),
    ("", None, "bad_json"),
    (b"\xff\xfe\x00garbage", None, "bad_json"),
    ('{"type": "launch", "id": "u"}', "u", "bad_message"),
    ("[1, 2, 3]", None, "bad_message"),
    ("null", None, "bad_message"),
    (_gen(prompt="no id"), None, "bad_message"),
    (_gen(7, prompt="x"), None, "bad_message"),
    (_gen("e", prompt="x", extra=1), "e", "bad_message"),
    (_gen("t", prompt="x", params={"temperature": -1}), "t", "invalid_params"),
    (_gen("k", prompt="x", params={"max_tokens": "many"}), "k", "invalid_params"),
    (_gen("q", prompt="x", params={"bogus": 1}), "q", "invalid_params"),
    (_gen("n0", prompt="x", params={"n": 0}), "n0", "invalid_params"),
    (_gen("tp", prompt="x", params={"top_p": 2}), "tp", "invalid_params"),
    (_gen("both", prompt="x", messages=[{"role": "user", "content": "y"}]), "both", "invalid_params"),
    (_gen("none"), "none", "invalid_params"),
    (_gen("empty", prompt=""), "empty", "invalid_params"),
    (_gen("ids", prompt=[10**9]), "ids", "invalid_params"),
    (_gen("ctx", prompt="x", params={"max_tokens": 10**6}), "ctx", "invalid_params"),
    (json.dumps({"type": "abort", "id": "ghost"}), "ghost", "unknown_id"),
)


def bad_http_cases(model: str) -> tuple[tuple[str, str, bytes | None, int], ...]:
    """(method, path, body, expected status): each must be answered with an `error` object."""
    ok = {"model": model, "prompt": "x", "max_tokens": 2}
    return (
        ("POST", "/v1/completions", b"{not json", 400),
        ("POST", "/v1/completions", b"", 400),
        ("POST", "/v1/completions", json.dumps({"max_tokens": 2}).encode(), 400),
        ("POST", "/v1/completions", json.dumps({**ok, "temperature": -1}).encode(), 400),
        ("POST", "/v1/completions", json.dumps({**ok, "n": 0}).encode(), 400),
        ("POST", "/v1/completions", json.dumps({**ok, "max_tokens": 10**6}).encode(), 400),
        ("POST", "/v1/completions", json.dumps({**ok, "model": "no-such-model"}).encode(), 404),
        ("POST", "/v1/chat/completions", json.dumps({"model": model, "messages": []}).encode(), 400),
        ("POST", "/v1/chat/completions", json.dumps({"model": model, "messages": "hi"}).encode(), 400),
        ("GET", "/v1/completions", None, 405),
        ("GET", "/v1/no-such-route", None, 404),
    )


# ---- the mixed traffic --------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    episodes: Counter = field(default_factory=Counter)  # per category, finished episodes
    events: Counter = field(default_factory=Counter)  # finer counts (requests, cuts, ...)
    errors: int = 0
    error_examples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_examples) < 20:
            self.error_examples.append(what[:500])


WEIGHTS = {
    "ws_generate": 5.0,
    "ws_abort": 2.0,
    "ws_disconnect": 1.5,
    "ws_reset": 1.5,
    "ws_slow_reader": 1.0,
    "ws_bad_messages": 1.5,
    "http_json": 2.0,
    "http_sse": 2.0,
    "sse_cut": 1.5,
    "http_cut": 1.0,
    "http_bad": 1.0,
}
CATEGORIES = tuple(WEIGHTS)


class MixedTraffic:
    """`clients` concurrent clients, each drawing episodes from WEIGHTS with its own seeded RNG
    until the time is up. Every episode checks what it received; a wrong answer, a failure or
    a timeout is counted in `tally.errors` (with examples), never raised."""

    def __init__(self, host: str, port: int, *, seed: int = 0, clients: int = 8, model: str | None = None,
                 max_message_bytes: int | None = None, episode_timeout: float = 60.0,
                 token_scale: float = 1.0, slow_stall_s: tuple[float, float] = (0.5, 2.0)) -> None:
        if host != HOST:
            raise ValueError("the traffic goes to 127.0.0.1 only")
        self.host, self.port, self.seed, self.clients = host, port, seed, clients
        self.model, self.max_message_bytes = model, max_message_bytes
        self.episode_timeout, self.scale = episode_timeout, token_scale
        self.slow_stall_s = slow_stall_s  # least time a slow reader reads nothing (then until the server is held up)
        self.tally = Tally()
        self._expects: dict[str, dict[str, Expect]] = {}  # per episode, to say where one got stuck
        self.base = f"http://{host}:{port}"
        self._session: aiohttp.ClientSession | None = None

    async def run(self, seconds: float) -> Tally:
        deadline = time.monotonic() + seconds
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            self._session = session
            if self.model is None:
                async with session.get(f"{self.base}/v1/models") as r:
                    self.model = (await r.json())["data"][0]["id"]
            await asyncio.gather(*(self._client(i, deadline) for i in range(self.clients)))
        self._session = None
        return self.tally

    async def _client(self, index: int, deadline: float) -> None:
        rng = random.Random(f"{self.seed}:{index}")
        names, weights = list(WEIGHTS), list(WEIGHTS.values())
        for episode in range(MAX_EPISODES):
            if time.monotonic() >= deadline:
                return
            category = rng.choices(names, weights)[0]
            tag = f"c{index}e{episode}"
            t0 = time.monotonic()
            try:
                async with asyncio.timeout(self.episode_timeout):
                    await getattr(self, category)(random.Random(rng.random()), tag)
                self.tally.episodes[category] += 1
            except Exception as exc:  # recorded: one broken episode must not end the soak
                self.tally.error(f"{category} {tag} after {time.monotonic() - t0:.1f} s: "
                                 f"{type(exc).__name__}: {exc}; {self._progress(tag)}")
            finally:
                self._expects.pop(tag, None)

    # -- helpers

    def _tokens(self, lo: int, hi: int, rng: random.Random) -> int:
        return max(1, round(rng.randint(lo, hi) * self.scale))

    def _prompt(self, rng: random.Random, tag: str) -> dict:
        text = rng.choice(PROMPTS)
        if rng.random() < 0.5:
            text = f"[{tag}] {text}"  # unique: no prefix-cache hit; else shared prompts hit
        if rng.random() < 0.3:
            return {"messages": [{"role": "user", "content": text}]}
        return {"prompt": text}

    def _params(self, rng: random.Random) -> dict:
        p: dict = {"max_tokens": self._tokens(1, 40, rng), "temperature": rng.choice([0.0, 0.0, 0.7, 1.0])}
        if p["temperature"] > 0 and rng.random() < 0.5:
            p["seed"] = rng.randrange(1 << 31)
        if p["temperature"] > 0 and rng.random() < 0.3:
            p["top_p"] = 0.9
        if (n := rng.choice([1, 1, 1, 2, 3])) > 1:
            p["n"] = n
        if rng.random() < 0.3:
            p["stop"] = rng.choice(STOPS)
        if rng.random() < 0.2:
            p["logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.5:
            p["ignore_eos"] = True
        return p

    def _long(self, rng: random.Random, lo: int = 150, hi: int = 400) -> dict:
        return {"max_tokens": self._tokens(lo, hi, rng), "ignore_eos": True,
                "temperature": rng.choice([0.0, 1.0]), "n": rng.choice([1, 2])}

    def _ws(self):
        return self._session.ws_connect(f"{self.base}/v1/stream", max_msg_size=0, heartbeat=None)

    async def _ready(self, recv) -> None:
        m = await recv()
        if m.get("type") != "ready":
            raise Problem(f"expected ready, got {str(m)[:200]}")

    def _progress(self, tag: str) -> str:
        expects = self._expects.get(tag) or {}
        return "requests: " + (", ".join(
            f"{rid} {'done' if e.done else 'open'} {dict(e.tokens)}/{e.params['max_tokens']}x{e.n}"
            for rid, e in expects.items()) or "none")

    async def _send_generates(self, send, rng, tag, count: int, params_fn) -> dict[str, Expect]:
        expects = self._expects[tag] = {}
        for j in range(count):
            rid = f"{tag}-{j}"
            params = params_fn(rng)
            await send({"type": "generate", "id": rid, **self._prompt(rng, tag), "params": params})
            expects[rid] = Expect(params)
        return expects

    # -- WebSocket episodes

    async def ws_generate(self, rng: random.Random, tag: str) -> None:
        async with self._ws() as ws:
            recv = aiohttp_recv(ws)
            await self._ready(recv)
            for _ in range(rng.choice([1, 1, 2])):  # sometimes a second round on the same socket
                expects = await self._send_generates(ws.send_json, rng, tag, rng.randint(1, 4), self._params)
                await read_streams(recv, expects)
                self.tally.events["ws_requests"] += len(expects)

    async def ws_abort(self, rng: random.Random, tag: str) -> None:
        async with self._ws() as ws:
            recv = aiohttp_recv(ws)
            await self._ready(recv)
            expects = await self._send_generates(ws.send_json, rng, tag, rng.randint(1, 3), self._long)
            victims = rng.sample(sorted(expects), rng.randint(1, len(expects)))
            when = rng.choice(["immediately", "after_first_delta", "after_delay"])
            if when == "after_first_delta":
                for _ in range(MAX_MESSAGES):
                    m = await recv()
                    if m.get("type") != "delta" or m.get("id") not in expects:
                        raise Problem(f"expected a delta, got {str(m)[:200]}")
                    expects[m["id"]].on_delta(m["id"], m)
                    break
            elif when == "after_delay":
                await asyncio.sleep(rng.uniform(0.0, 0.3))
            for rid in victims:
                expects[rid].aborted = True
                await ws.send_json({"type": "abort", "id": rid})
            await read_streams(recv, expects, late_unknown=set(victims))
            self.tally.events["ws_requests"] += len(expects)
            self.tally.events[f"ws_abort_{when}"] += 1
            self.tally.events["ws_aborts_confirmed"] += sum(
                "abort" in (expects[rid].done or {}).get("finish_reasons", []) for rid in victims
            )

    async def _some_deltas(self, recv, expects: dict[str, Expect], count: int) -> None:
        for _ in range(count):
            m = await recv()
            if m.get("type") == "delta" and m.get("id") in expects:
                expects[m["id"]].on_delta(m["id"], m)
            elif m.get("type") == "done" and m.get("id") in expects:
                expects[m["id"]].done = m
                expects[m["id"]].check(m["id"])
            else:
                raise Problem(f"unexpected message {str(m)[:200]}")

    async def ws_disconnect(self, rng: random.Random, tag: str) -> None:
        """Leaves with requests streaming: a clean close frame, or just FIN with no close frame."""
        how = rng.choice(["close_frame", "fin"])
        if how == "close_frame":
            async with self._ws() as ws:
                recv = aiohttp_recv(ws)
                await self._ready(recv)
                expects = await self._send_generates(ws.send_json, rng, tag, rng.randint(1, 3), self._long)
                await self._some_deltas(recv, expects, rng.randint(1, 5))
                await ws.close()
        else:
            ws = await RawWebSocket.connect(self.host, self.port, rng)
            try:
                await self._ready(ws.recv_json)
                expects = await self._send_generates(ws.send_json, rng, tag, rng.randint(1, 3), self._long)
                await self._some_deltas(ws.recv_json, expects, rng.randint(1, 5))
            finally:
                ws.drop()
        self.tally.events[f"ws_disconnect_{how}"] += 1

    async def ws_reset(self, rng: random.Random, tag: str) -> None:
        """TCP RST mid-stream, before any output, in the middle of the handshake or of a frame."""
        when = rng.choice(["mid_stream", "before_output", "mid_handshake", "mid_frame"])
        if when == "mid_handshake":
            reader, writer = await RawWebSocket.open_socket(self.host, self.port)
            handshake = RawWebSocket.handshake_bytes(self.host, self.port, rng)
            writer.write(handshake[: rng.randint(1, len(handshake) - 1)])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            reset_transport(writer.transport)
        else:
            ws = await RawWebSocket.connect(self.host, self.port, rng)
            try:
                await self._ready(ws.recv_json)
                expects = await self._send_generates(ws.send_json, rng, tag, rng.randint(1, 3), self._long)
                if when == "mid_stream":
                    await self._some_deltas(ws.recv_json, expects, rng.randint(1, 5))
                elif when == "mid_frame":
                    frame = ws.frame(0x1, _gen(f"{tag}-cut", prompt="never whole").encode())
                    await ws.send_raw(frame[: rng.randint(1, len(frame) - 1)])
            finally:
                ws.reset()
        self.tally.events[f"ws_reset_{when}"] += 1

    async def ws_slow_reader(self, rng: random.Random, tag: str) -> None:
        """A fixed receive buffer, no reading for a while, then a slow trickle: everything must
        still arrive, each sample's tokens complete (merged into fewer deltas if the server's
        writer was held up)."""
        ws = await RawWebSocket.connect(self.host, self.port, rng, rcvbuf=SLOW_READER_RCVBUF)
        try:
            def big(r: random.Random) -> dict:
                # not scaled by token_scale: the volume is the point (~0.1-0.8 MB per episode)
                return {"max_tokens": r.randint(64, 160), "ignore_eos": True, "temperature": 1.0,
                        "seed": r.randrange(1 << 31), "n": 2, "logprobs": 20}  # ~0.5 kB per token

            expects = await self._send_generates(ws.send_json, rng, tag, rng.randint(3, 5), big)
            await ws.stop_reading(rng.uniform(*self.slow_stall_s))  # not reading at all

            async def trickle() -> dict:
                if rng.random() < 0.02:
                    await asyncio.sleep(rng.uniform(0.05, 0.3))
                return await ws.recv_json()

            await self._ready(trickle)
            await read_streams(trickle, expects)
            await ws.close()
        except BaseException:
            ws.reset()
            raise
        self.tally.events["ws_requests"] += len(expects)
        tokens = sum(sum(e.tokens.values()) for e in expects.values())
        if sum(e.deltas for e in expects.values()) < tokens:
            self.tally.events["ws_slow_reader_coalesced"] += 1

    async def ws_bad_messages(self, rng: random.Random, tag: str) -> None:
        """Malformed messages next to a live request: each gets its `error`, the socket and the
        live request carry on, and a good request afterwards is served."""
        cases = list(rng.sample(BAD_WS_MESSAGES, rng.randint(3, 6)))
        if self.max_message_bytes is not None and rng.random() < 0.1:
            cases.append((_gen("huge", prompt="x" * (self.max_message_bytes + 100)), None, "message_too_large"))
        async with self._ws() as ws:
            recv = aiohttp_recv(ws)
            await self._ready(recv)
            live = {"max_tokens": self._tokens(300, 500, rng), "ignore_eos": True, "temperature": 0.0}
            expects = {"live": Expect(live)}
            await ws.send_json({"type": "generate", "id": "live", "prompt": rng.choice(PROMPTS), "params": live})
            # sent at once, before "live" can have finished: the id is certainly in use
            cases.insert(0, (_gen("live", prompt="again"), "live", "duplicate_id"))
            for raw, want_id, want_code in cases:
                await (ws.send_bytes(raw) if isinstance(raw, bytes) else ws.send_str(raw))
                for _ in range(MAX_MESSAGES):
                    m = await recv()
                    if m.get("type") == "delta" and m.get("id") == "live":
                        expects["live"].on_delta("live", m)
                    elif m.get("type") == "done" and m.get("id") == "live" and not expects["live"].done:
                        expects["live"].done = m  # a fast model may finish it meanwhile
                        expects["live"].check("live")
                    else:
                        break
                if (m.get("type"), m.get("id"), m.get("code")) != ("error", want_id, want_code) or not m.get("message"):
                    raise Problem(f"sent {str(raw)[:80]!r}: expected error {want_id}/{want_code}, got {str(m)[:300]}")
                self.tally.events["ws_bad_messages_answered"] += 1
            expects["live"].aborted = True  # if it is still live; else the abort gets unknown_id
            await ws.send_json({"type": "abort", "id": "live"})
            ok = {"max_tokens": self._tokens(2, 8, rng), "ignore_eos": True, "temperature": 0.0}
            expects["ok"] = Expect(ok)
            await ws.send_json({"type": "generate", "id": "ok", "prompt": rng.choice(PROMPTS), "params": ok})
            await read_streams(recv, expects, late_unknown={"live"})
            self.tally.events["ws_requests"] += 2

    # -- HTTP episodes

    def _http_body(self, rng: random.Random, stream: bool, long: bool = False) -> tuple[str, dict, dict]:
        chat = rng.random() < 0.5
        body: dict = {"model": self.model, "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        else:
            body["prompt"] = rng.choice(PROMPTS)
        if long:
            body.update(max_tokens=self._tokens(150, 400, rng), ignore_eos=True, n=rng.choice([1, 2]))
        else:
            params = self._params(rng)
            params.pop("logprobs", None)
            body.update(params)
        if stream and rng.random() < 0.7:
            body["stream_options"] = {"include_usage": True}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return path, body, {"n": body.get("n", 1), "max_tokens": body["max_tokens"]}

    @staticmethod
    def _check_choices(reasons: dict[int, str | None], want: dict, body: dict) -> None:
        if sorted(reasons) != list(range(want["n"])):
            raise Problem(f"choices {sorted(reasons)} for n={want['n']}")
        if not set(reasons.values()) <= {"length", "stop"}:
            raise Problem(f"finish reasons {reasons}")
        if body.get("ignore_eos") and not body.get("stop") and set(reasons.values()) != {"length"}:
            raise Problem(f"finish reasons {reasons} with ignore_eos and no stop strings")

    async def http_json(self, rng: random.Random, tag: str) -> None:
        path, body, want = self._http_body(rng, stream=False)
        async with self._session.post(self.base + path, json=body) as r:
            data = await r.json()
            if r.status != 200:
                raise Problem(f"{path}: {r.status} {str(data)[:300]}")
        reasons = {c["index"]: c["finish_reason"] for c in data["choices"]}
        self._check_choices(reasons, want, body)
        usage = data["usage"]["completion_tokens"]
        if usage > want["n"] * want["max_tokens"] or (set(reasons.values()) == {"length"} and usage != want["n"] * want["max_tokens"]):
            raise Problem(f"{path}: usage {usage} for n={want['n']}, max_tokens {want['max_tokens']}, {reasons}")
        self.tally.events["http_requests"] += 1

    async def http_sse(self, rng: random.Random, tag: str) -> None:
        path, body, want = self._http_body(rng, stream=True)
        reasons: dict[int, str | None] = {}
        usage, ended = None, False
        async with self._session.post(self.base + path, json=body) as r:
            if r.status != 200 or not r.headers.get("Content-Type", "").startswith("text/event-stream"):
                raise Problem(f"{path}: {r.status} {(await r.text())[:300]}")
            for _ in range(MAX_MESSAGES):
                line = await r.content.readline()
                if not line:
                    break
                line = line.strip()
                if not line:
                    continue
                if ended or not line.startswith(b"data: "):
                    raise Problem(f"{path}: unexpected line {line[:200]!r}")
                if line == b"data: [DONE]":
                    ended = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise Problem(f"{path}: in-band error {chunk}")
                for c in chunk["choices"]:
                    if c.get("finish_reason") is not None:
                        reasons[c["index"]] = c["finish_reason"]
                usage = chunk.get("usage") or usage
        if not ended:
            raise Problem(f"{path}: stream ended without [DONE]")
        self._check_choices(reasons, want, body)
        if body.get("stream_options") and usage is None:
            raise Problem(f"{path}: include_usage but no usage chunk")
        self.tally.events["http_requests"] += 1

    async def sse_cut(self, rng: random.Random, tag: str) -> None:
        """A long SSE stream left after a few events: FIN, or a TCP reset."""
        path, body, _ = self._http_body(rng, stream=True, long=True)
        how = rng.choice(["close", "reset"])
        r = await self._session.post(self.base + path, json=body)
        try:
            if r.status != 200:
                raise Problem(f"{path}: {r.status} {(await r.text())[:300]}")
            events, cut_after = 0, rng.randint(1, 3)
            for _ in range(MAX_MESSAGES):
                line = await r.content.readline()
                if not line:
                    raise Problem(f"{path}: stream ended without [DONE]")
                if line.startswith(b"data: [DONE]"):  # merged into fewer events than the cut
                    self.tally.events["sse_cut_too_late"] += 1
                    return
                if line.startswith(b"data: "):
                    events += 1
                    if events >= cut_after:
                        break
            if how == "reset" and r.connection is not None:
                reset_transport(r.connection.transport)
        finally:
            r.close()
        self.tally.events[f"sse_cut_{how}"] += 1

    async def http_cut(self, rng: random.Random, tag: str) -> None:
        """A long non-streamed request whose client gives up (the connection is closed)."""
        path, body, want = self._http_body(rng, stream=False, long=True)
        try:
            async with asyncio.timeout(rng.uniform(0.05, 0.5)):
                async with self._session.post(self.base + path, json=body) as r:
                    data = await r.json()
        except TimeoutError:
            self.tally.events["http_cut"] += 1
            return
        if r.status != 200 or len(data["choices"]) != want["n"]:
            raise Problem(f"{path}: {r.status} {str(data)[:300]}")
        self.tally.events["http_cut_too_late"] += 1  # it finished first: a complete response

    async def http_bad(self, rng: random.Random, tag: str) -> None:
        for method, path, body, status in rng.sample(bad_http_cases(self.model), rng.randint(1, 4)):
            headers = {"Content-Type": "application/json"} if body is not None else None
            async with self._session.request(method, self.base + path, data=body, headers=headers) as r:
                text = await r.text()
                try:
                    error = json.loads(text).get("error") or {}
                except (ValueError, AttributeError):
                    error = {}
                if r.status != status or not error.get("message"):
                    raise Problem(f"{method} {path} {body!r:.80}: expected {status} with an error, got {r.status} {text[:200]}")
            self.tally.events["http_bad_answered"] += 1


# ---- concurrent streams -------------------------------------------------------------------


STREAM_PROMPT = "You are a helpful assistant. Answer in one short sentence. Question number"


@dataclass(slots=True)
class StreamTimes:
    """What one phase's streams measured, in seconds, and how the failed ones failed."""

    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


async def concurrent_streams(base: str, total: int, sockets: int, max_tokens: int, timeout: float) -> dict:
    """`total` greedy streams at once over `sockets` WebSockets; each must finish complete."""
    sockets = max(1, min(sockets, total))
    per = [total // sockets + (i < total % sockets) for i in range(sockets)]
    times = StreamTimes()
    params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(socket_streams(session, base, s, c, params, times)) for s, c in enumerate(per)]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            times.failures.append(f"{len(pending)} sockets timed out after {timeout:.0f} s")
    wall = time.perf_counter() - t0
    completed = len(times.e2e)
    return {
        "streams": total, "sockets": sockets, "max_tokens": max_tokens, "completed": completed,
        "failed": total - completed, "failure_examples": times.failures[:5], "wall_s": wall,
        "tokens_per_s": completed * max_tokens / wall if wall else None,
        "ttft_ms": percentiles(times.ttft), "e2e_ms": percentiles(times.e2e),
    }


async def socket_streams(session: aiohttp.ClientSession, base: str, s: int, count: int, params: dict,
                         times: StreamTimes) -> None:
    """Socket number `s`: sends `count` generates at once, then reads every stream to its end."""
    expects = {f"s{s}-{j}": Expect(dict(params)) for j in range(count)}
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    try:
        async with session.ws_connect(f"{base}/v1/stream", max_msg_size=0) as ws:
            recv = aiohttp_recv(ws)
            if (await recv()).get("type") != "ready":
                raise Problem("no ready message")
            for rid in expects:
                await ws.send_str(json.dumps({"type": "generate", "id": rid, "prompt": f"{STREAM_PROMPT} {rid}?",
                                              "params": params}))
                sent[rid] = time.perf_counter()

            async def timed() -> dict:
                m = await recv()
                if m.get("type") == "delta":
                    first.setdefault(m["id"], time.perf_counter())
                elif m.get("type") == "done" and m.get("id") in sent:
                    times.e2e.append(time.perf_counter() - sent[m["id"]])
                return m

            await read_streams(timed, expects)
    except Exception as exc:
        times.failures.append(f"socket {s}: {type(exc).__name__}: {str(exc)[:300]}")
    times.ttft.extend(first[r] - sent[r] for r in first if r in sent)


# ---- /health latency and server facts -----------------------------------------------------


def percentiles(seconds: list[float]) -> dict:
    if not seconds:
        return {"p50": None, "p99": None, "max": None, "count": 0}
    xs = sorted(seconds)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))] * 1e3

    return {"p50": q(0.5), "p99": q(0.99), "max": xs[-1] * 1e3, "count": len(xs)}


class HealthPoller:
    """GET /health every 100 ms on one kept-alive connection; latencies and failures. With
    `pid`, the server's RSS every RSS_EVERY_S too, so growth can be told from a plateau."""

    def __init__(self, base: str, pid: int | None = None, rss_every: float = RSS_EVERY_S) -> None:
        self.base, self.pid, self.rss_every = base, pid, rss_every
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.engine_states: Counter = Counter()  # /health's "engine": ready, restarting, stopped
        self.rss: list[tuple[float, float]] = []  # (seconds since start, MB)
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> HealthPoller:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        start = next_rss = time.perf_counter()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=timeout) as session:
            while True:
                t0 = time.perf_counter()
                if self.pid is not None and t0 >= next_rss:
                    self.rss.append((round(t0 - start, 1), round(rss_mb(self.pid), 1)))
                    next_rss += self.rss_every
                try:
                    async with session.get(f"{self.base}/health") as r:
                        body = await r.read()
                        with contextlib.suppress(ValueError, AttributeError):
                            self.engine_states[json.loads(body).get("engine")] += 1
                        if r.status != 200:
                            self.failures.append(f"/health answered {r.status}")
                        else:
                            self.latencies.append(time.perf_counter() - t0)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.failures.append(f"/health: {type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(max(0.0, HEALTH_INTERVAL_S - (time.perf_counter() - t0)))

    def report(self) -> dict:
        return {**percentiles(self.latencies), "failures": len(self.failures), "failure_examples": self.failures[:3]}


def slope_per_min(series: list[tuple[float, float]]) -> float | None:
    """Least-squares slope (MB per minute) of the second half of an RSS series: a leak keeps
    climbing there, a pool that fills once has flattened."""
    half = [(t, y) for t, y in series if t >= series[-1][0] / 2] if series else []
    if len(half) < 3:
        return None
    mt = sum(t for t, _ in half) / len(half)
    my = sum(y for _, y in half) / len(half)
    var = sum((t - mt) ** 2 for t, _ in half)
    return 60 * sum((t - mt) * (y - my) for t, y in half) / var if var else None


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_connections(pid: int, port: int) -> dict[str, int]:
    """TCP connections of the server process on its port, by state (the listener excluded)."""
    import psutil

    states: Counter = Counter()
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.status != psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            states[c.status] += 1
    return dict(states)


LOG_PROBLEMS = ("Traceback", "Task was destroyed", "ERROR", "exception was never retrieved", "Unclosed")


def log_problems(path: Path) -> dict:
    """Lines of the server's log that a clean run would not print (and a few of them); a
    traceback is shown by the exception that ends it, its first line says nothing."""
    text = path.read_text(errors="replace").splitlines()
    lines = [i for i, line in enumerate(text) if any(p in line for p in LOG_PROBLEMS)]
    examples = [traceback_end(text, i) if text[i].startswith("Traceback") else text[i] for i in lines]
    return {"count": len(lines), "examples": list(dict.fromkeys(examples))[:10]}


def traceback_end(lines: list[str], start: int) -> str:
    """The first line after `start` that is not indented: the exception a traceback ends with."""
    for line in lines[start + 1:start + 200]:
        if line and not line[0].isspace():
            return f"Traceback ... {line}"
    return lines[start]


async def server_load(session: aiohttp.ClientSession, base: str) -> dict:
    """Blocks in use (kv_state) and requests running/waiting (/metrics)."""
    async with session.get(f"{base}/v1/kv_state") as r:
        kv = await r.json()
    async with session.get(f"{base}/metrics") as r:
        text = await r.text()
    values = {}
    for line in text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "num_preemptions_total"):
            if line.startswith(f"streamengine:{name} "):
                values[name] = float(line.split()[1])
    return {"used_blocks": kv["counts"]["used"] + kv["counts"]["shared"], "num_blocks": kv["num_blocks"],
            "requests": int(values.get("num_requests_running", 0) + values.get("num_requests_waiting", 0)),
            "preemptions": int(values.get("num_preemptions_total", 0))}


async def settle(session: aiohttp.ClientSession, base: str, timeout: float = 30.0) -> dict:
    """Waits (bounded) until no request runs and no block is used; returns the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        load = await server_load(session, base)
        if (load["used_blocks"] == 0 and load["requests"] == 0) or time.monotonic() > deadline:
            return load
        await asyncio.sleep(0.2)


# ---- the run ------------------------------------------------------------------------------


@dataclass(slots=True)
class RunTotals:
    """What the phases add up to: unexpected errors (a few of them shown) and /health latencies."""

    errors: int = 0
    examples: list[str] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)

    def add(self, errors: int, examples: list[str], health: HealthPoller) -> None:
        self.errors += errors + len(health.failures)
        self.examples += examples + health.failures[:3]
        self.health_ms += health.latencies


def server_process(args, flags: tuple[str, ...] = ()):
    """`python -m streamengine serve` on a free port, with the run's model and torch threads
    (and `flags`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
    from serving import ServerProcess, free_port, server_env

    port = free_port()
    cmd = [sys.executable, "-m", "streamengine", "serve", "--host", HOST, "--port", str(port), *flags]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--num-threads", str(args.threads)]
    env = server_env(args.threads or os.cpu_count() or 1)
    if not args.threads:
        env.pop("OMP_NUM_THREADS", None)
    return ServerProcess("streamengine", cmd, port, env)


def run_config(args) -> dict:
    return {
        "model": args.model or "SmolLM2-135M-Instruct (default)", "streams": list(args.streams),
        "sockets": args.sockets, "stream_max_tokens": args.max_tokens, "soak_seconds": args.soak_seconds,
        "warmup_seconds": args.warmup_seconds, "clients": args.clients, "seed": args.seed, "quick": args.quick,
        "threads": args.threads or "torch default", "token_scale": args.token_scale,
        "slow_stall_s": list(args.slow_stall), "phases": list(args.phases),
    }


async def streams_phase(session: aiohttp.ClientSession, base: str, n: int, args, totals: RunTotals) -> dict:
    print(f"{n} concurrent streams over {args.sockets} sockets ...", file=sys.stderr)
    async with HealthPoller(base) as health:
        phase = await concurrent_streams(base, n, args.sockets, args.max_tokens, args.stream_timeout)
    phase["health_ms"] = health.report()
    phase["after"] = await settle(session, base)
    totals.add(phase["failed"], phase["failure_examples"], health)
    return phase


async def traffic_phase(session: aiohttp.ClientSession, server, name: str, seconds: float, seed: int,
                        args, totals: RunTotals) -> dict:
    """`seconds` of MixedTraffic, with the server's RSS sampled alongside /health."""
    from streamengine.server.config import DEFAULT_MAX_MESSAGE_BYTES  # the CLI's limit

    print(f"{name}: {seconds:g} s of mixed traffic from {args.clients} clients ...", file=sys.stderr)
    traffic = MixedTraffic(HOST, server.port, seed=seed, clients=args.clients, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
                           episode_timeout=args.episode_timeout, token_scale=args.token_scale,
                           slow_stall_s=args.slow_stall)
    t0 = time.perf_counter()
    async with HealthPoller(server.base_url, server.proc.pid) as health:
        tally = await traffic.run(seconds)
    phase = {"wall_s": time.perf_counter() - t0, "episodes": dict(tally.episodes),
             "events": dict(tally.events), "errors": tally.errors,
             "error_examples": tally.error_examples, "health_ms": health.report(),
             "rss_mb_series": health.rss, "rss_slope_mb_per_min": slope_per_min(health.rss)}
    phase["after"] = await settle(session, server.base_url)
    phase["missing_categories"] = [c for c in CATEGORIES if not tally.episodes[c]]
    totals.add(tally.errors, tally.error_examples, health)
    return phase


async def run_phases(session: aiohttp.ClientSession, server, args, report: dict, totals: RunTotals,
                     rss: dict[str, float]) -> None:
    """Starts the server, runs every phase, then records what the server is left holding."""
    base = server.base_url
    print(f"starting the server on {base} ...", file=sys.stderr)
    await server.start(session)
    pid = server.proc.pid
    rss["started"] = rss_mb(pid)
    for n in args.streams if "streams" in args.phases else ():
        report["phases"][f"streams_{n}"] = await streams_phase(session, base, n, args, totals)
        rss["after_streams"] = rss_mb(pid)
    for name, seconds, seed in (("warmup", args.warmup_seconds, args.seed),
                                ("soak", args.soak_seconds, args.seed + 1)) if "soak" in args.phases else ():
        report["phases"][name] = await traffic_phase(session, server, name, seconds, seed, args, totals)
        await asyncio.sleep(1.0)  # let the server finish closing what the clients left
        rss[f"after_{name}"] = rss_mb(pid)
    final = await settle(session, base)
    await session.close()
    await asyncio.sleep(1.0)
    report["server"] = {"rss_mb": rss, "final": final, "open_connections": open_connections(pid, server.port),
                        "alive": server.proc.poll() is None}


def summarize(report: dict, totals: RunTotals, rss: dict[str, float]) -> None:
    finals = [s["final"] for s in (report.get("server", {}), report.get("hostile_server", {})) if "final" in s]
    report.update(
        errors=totals.errors,
        error_examples=totals.examples[:20],
        leaked_blocks=sum(f["used_blocks"] for f in finals) if finals else None,
        health_p99_ms=percentiles(totals.health_ms)["p99"],
        rss_growth_mb=(rss["after_soak"] - rss["after_warmup"]) if {"after_soak", "after_warmup"} <= rss.keys() else None,
        rss_slope_mb_per_min=report["phases"].get("soak", {}).get("rss_slope_mb_per_min"),
    )


async def hostile_run(args, report: dict, totals: RunTotals) -> None:
    """The hostile-tenant phase on a server of its own, started with the tenants' API keys."""
    from hostile import ADMIN_KEY, SERVER_FLAGS, hostile_phase, summary_keys

    server = server_process(args, SERVER_FLAGS)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    report["hostile_server"] = {}
    async with aiohttp.ClientSession(headers=headers) as admin:
        try:
            print(f"hostile: starting a server with two tenant keys on {server.base_url} ...", file=sys.stderr)
            await server.start(admin)
            print(f"hostile: {args.hostile.baseline_s:g} s of quiet traffic alone, then {args.hostile.hostile_s:g} s "
                  f"beside {', '.join(args.hostile.probes)} ...", file=sys.stderr)
            phase = await hostile_phase(admin, server, args.hostile)
            report["phases"]["hostile"] = phase
            report.update(summary_keys(phase))
            report["hostile_server"] = {"final": phase["after"], "alive": phase["server_alive"]}
            for part in (phase["health"]["baseline"], phase["health"]["hostile"], phase["baseline"], phase["hostile"]):
                totals.errors += part["failures"]  # /health failures, then the quiet tenant's failed requests
                totals.examples += part["failure_examples"]
        except Exception as exc:
            totals.errors += 1
            totals.examples.append(f"hostile phase aborted: {type(exc).__name__}: {exc}")
            report["hostile_server"]["log_tail"] = server.tail()
        finally:
            server.stop()
            report["hostile_server"]["log_problems"] = log_problems(Path(server.log.name))
            server.close()


async def run(args) -> dict:
    report: dict = {"phases": {}, "config": run_config(args)}
    totals = RunTotals()
    rss: dict[str, float] = {}
    if {"streams", "soak"} & set(args.phases):
        server = server_process(args)
        async with aiohttp.ClientSession() as session:
            try:
                await run_phases(session, server, args, report, totals, rss)
            except Exception as exc:
                totals.errors += 1
                totals.examples.append(f"run aborted: {type(exc).__name__}: {exc}")
                report["server_log_tail"] = server.tail()
                report.setdefault("server", {"rss_mb": rss})
            finally:
                server.stop()
                report["server"]["log_problems"] = log_problems(Path(server.log.name))
                server.close()
    if "hostile" in args.phases:
        await hostile_run(args, report, totals)
    summarize(report, totals, rss)
    return report


def print_server_phases(report: dict) -> None:
    head = f"{'phase':<14} {'streams':>9} {'done':>7} {'errors':>6} {'wall s':>7} {'health p50':>10} {'p99':>7} {'max ms':>8}"
    print(head)
    print("-" * len(head))

    def f(x, width: int, digits: int = 1) -> str:
        return f"{x:>{width}.{digits}f}" if x is not None else f"{'-':>{width}}"

    for name, p in report["phases"].items():
        if name == "hostile":
            continue
        h = p["health_ms"]
        if name.startswith("streams_"):
            counts = f"{p['streams']:>9} {p['completed']:>7} {p['failed'] + h['failures']:>6}"
        else:
            counts = f"{sum(p['episodes'].values()):>9} {'':>7} {p['errors'] + h['failures']:>6}"
        print(f"{name:<14} {counts} {f(p['wall_s'], 7)} {f(h['p50'], 10)} {f(h['p99'], 7)} {f(h['max'], 8)}")
    soak = report["phases"].get("soak")
    if soak:
        print("(for warmup and soak, `streams` counts episodes of mixed traffic)")
        print("soak episodes: " + ", ".join(f"{k} {v}" for k, v in sorted(soak["episodes"].items())))
        print("soak events: " + ", ".join(f"{k} {v}" for k, v in sorted(soak["events"].items())))
    server = report.get("server", {})
    print(f"errors {report['errors']}, leaked blocks {report['leaked_blocks']}, "
          f"health p99 {f(report['health_p99_ms'], 0)} ms, RSS growth over the soak "
          f"{f(report['rss_growth_mb'], 0)} MB (second half: {f(report['rss_slope_mb_per_min'], 0, 2)} MB/min; "
          f"RSS {server.get('rss_mb')}), "
          f"server connections left {server.get('open_connections')}, "
          f"problem lines in the server log {server.get('log_problems', {}).get('count')}")


def print_table(report: dict) -> None:
    if "server" in report:  # the streams and soak phases ran
        print_server_phases(report)
    else:
        print(f"errors {report['errors']}, leaked blocks {report['leaked_blocks']}")
    if "hostile" in report["phases"]:
        from hostile import print_hostile

        print_hostile(report["phases"]["hostile"])
        problems = report.get("hostile_server", {}).get("log_problems", {})
        print(f"  problem lines in the hostile server's log {problems.get('count')}: {problems.get('examples', [])[:3]}")
    for e in report["error_examples"][:10]:
        print(f"  error: {e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer streams, a 60 s soak, a shorter hostile phase")
    p.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--streams", default=None, help="comma-separated stream counts (default 1000,2000; quick 200,400)")
    p.add_argument("--sockets", type=int, default=16, help="WebSockets the streams are spread over")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per concurrent stream")
    p.add_argument("--soak-seconds", type=float, default=None, help="default 600 (quick 60)")
    p.add_argument("--warmup-seconds", type=float, default=None, help="default 60 (quick 10)")
    p.add_argument("--clients", type=int, default=8, help="concurrent soak clients")
    # A real model on CPU makes ~200 tokens/s in all: a slow reader must stop for seconds before
    # its output outgrows the buffers in between (~256 kB: its socket, the server's kernel and
    # transport buffers) and the server's outbox starts merging deltas.
    p.add_argument("--slow-stall", default="2,8", help="min,max of the least seconds a slow reader reads nothing (it then waits until the server is held up)")
    # One thread by default: on these shared 2-core machines two OpenMP threads collapse into
    # futex waits whenever another job runs (measured here: SmolLM2, 64 streams, 46 tok/s at 2
    # threads vs 216 tok/s at 1). `--threads 0` leaves torch's default.
    p.add_argument("--threads", type=int, default=1, help="server torch threads (0: torch's default)")
    p.add_argument("--token-scale", type=float, default=0.25,
                   help="scales the soak's max_tokens ranges (1.0: up to 400 tokens per request)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream-timeout", type=float, default=600.0, help="bound on one streams phase")
    p.add_argument("--episode-timeout", type=float, default=120.0, help="bound on one soak episode")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated phases to run, of {', '.join(PHASES)} (soak includes its warm-up)")
    p.add_argument("--hostile-seconds", type=float, default=None,
                   help="the hostile phase's quiet traffic under attack (default 120; quick 40)")
    p.add_argument("--hostile-baseline-seconds", type=float, default=None,
                   help="the same quiet traffic alone, before (default 60; quick 20)")
    p.add_argument("--hostile-warmup-seconds", type=float, default=3.0, help="quiet traffic before the baseline")
    p.add_argument("--hostile-probes", default=None,
                   help="comma-separated probes of the hostile phase (default: all), to tell which one hurts")
    p.add_argument("--hostile-rss-bound-mb", type=float, default=512.0,
                   help="the stated bound on the server's RSS growth over the hostile phase")
    p.add_argument("--json", type=Path, default=None, help="default results/stress.json (quick: stress_quick.json)")
    args = p.parse_args(argv)
    args.phases = tuple(x.strip() for x in args.phases.split(",") if x.strip())
    if not args.phases or not set(args.phases) <= set(PHASES):
        p.error(f"--phases must name some of {', '.join(PHASES)}")
    args.hostile = hostile_config(p, args)
    args.json = args.json or RESULTS / ("stress_quick.json" if args.quick else "stress.json")
    preset = QUICK if args.quick else FULL
    args.streams = tuple(int(x) for x in args.streams.split(",")) if args.streams else preset["streams"]
    args.soak_seconds = preset["soak_seconds"] if args.soak_seconds is None else args.soak_seconds
    if args.warmup_seconds is None:
        args.warmup_seconds = min(preset["warmup_seconds"], max(3.0, args.soak_seconds / 4))
    lo, _, hi = args.slow_stall.partition(",")
    args.slow_stall = (float(lo), float(hi or lo))
    if args.model:
        args.model = str(Path(args.model).resolve())
    return args


def hostile_config(p: argparse.ArgumentParser, args: argparse.Namespace):
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
    from hostile import PROBES, HostileConfig
    from hostile import QUICK as HOSTILE_QUICK

    cfg = HostileConfig(**(HOSTILE_QUICK if args.quick else {}))
    probes = tuple(x.strip() for x in args.hostile_probes.split(",") if x.strip()) if args.hostile_probes else PROBES
    if not probes or not set(probes) <= set(PROBES):
        p.error(f"--hostile-probes must name some of {', '.join(PROBES)}")
    cfg.probes, cfg.warmup_s, cfg.rss_bound_mb = probes, args.hostile_warmup_seconds, args.hostile_rss_bound_mb
    if args.hostile_seconds is not None:
        cfg.hostile_s = args.hostile_seconds
    if args.hostile_baseline_seconds is not None:
        cfg.baseline_s = args.hostile_baseline_seconds
    return cfg


def source_tree() -> dict:
    """The commit the server ran from, and how many files differed from it (work in progress)."""
    import subprocess

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=RESULTS.parent.parent).stdout

    return {"commit": git("rev-parse", "HEAD").strip() or None,
            "changed_files": len(git("status", "--porcelain", "--untracked-files=no").splitlines())}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    report = asyncio.run(run(args))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import software

    report["software"] = software()
    report["tree"] = source_tree()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
