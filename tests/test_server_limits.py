"""The server's limits and failure paths on the WebSocket: hostile JSON, slow and silent
readers on real loopback sockets, size and id limits, and every engine error's structured
reply (a fake engine stands in where the tiny model cannot fail on demand)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import socket
import struct
import sys
import termios
import time

import aiohttp
import pytest
from aiohttp import WSMsgType
from conftest import slow_down_steps
from test_server import collect, connect, recv, serve, wait_idle

from streamengine import AsyncEngine, EngineConfig
from streamengine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    LimitExceededError,
    PromptTooLong,
    RequestFailedError,
)
from streamengine.sample.outputs import CompletionOutput, RequestOutput
from streamengine.server.state import STATE_KEY
from streamengine.server.streaming import RequestTimeoutError

SHORT = {"max_tokens": 4, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    # Room for 32 sequences of ~600 tokens at once: the slow-reader tests stream 16 x n=2.
    return AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=1280, max_num_seqs=32))


class ScriptedEngine:
    """Stands in for AsyncEngine where the tiny model cannot do what a test needs: fail on
    demand, or stream tokens far faster than it computes them. It borrows the real engine's
    tokenizer and chat template; `live` holds the requests whose streams are still open.

    `error` is raised by generate() after `fail_after` outputs (0: on the first step, before
    the request is admitted, as the engine's overload refusal is).
    """

    model_name = "tiny"

    def __init__(self, real: AsyncEngine, *, error: Exception | None = None, fail_after: int = 0,
                 tokens_per_step: int = 1, step_s: float = 0.0) -> None:
        self.real = real
        self.error, self.fail_after = error, fail_after
        self.tokens_per_step, self.step_s = tokens_per_step, step_s
        self.is_running = False
        self.live: set[str] = set()
        self.aborted: set[str] = set()

    @property
    def tokenizer(self):
        return self.real.tokenizer

    async def start(self) -> None:
        self.is_running = True

    async def stop(self) -> None:
        self.is_running = False

    def stats(self) -> dict:
        return {"num_requests": len(self.live), "num_running": len(self.live), "num_waiting": 0,
                "num_total_blocks": 4, "num_free_blocks": 4, "block_size": 16, "max_model_len": 4096}

    def kv_state(self) -> dict:
        return {"block_size": 16, "num_blocks": 4, "blocks": [0, 0, 0, 0]}

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return self.real.apply_chat_template(messages)

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def generate(self, prompt, params, request_id=None, cache_salt=None):
        if self.error is not None and self.fail_after == 0:
            raise self.error
        prompt_ids = list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt)
        want_logprobs = params.logprobs is not None
        self.live.add(request_id)
        try:
            produced = steps = 0
            while True:
                # Delta outputs, as the server asks for: each step's samples carry only news.
                samples = [CompletionOutput(i, "", [], logprobs=[] if want_logprobs else None) for i in range(params.n)]
                await asyncio.sleep(self.step_s)
                if request_id in self.aborted:
                    for sample in samples:
                        sample.finish_reason = "abort"
                    yield RequestOutput(request_id, prompt_ids, samples, True)
                    return
                if self.error is not None and steps == self.fail_after:
                    raise self.error
                for _ in range(min(self.tokens_per_step, params.max_tokens - produced)):
                    self._append(samples, produced, params.logprobs)
                    produced += 1
                steps += 1
                finished = produced >= params.max_tokens
                if finished:
                    for sample in samples:
                        sample.finish_reason = "length"
                yield RequestOutput(request_id, prompt_ids, samples, finished)
                if finished:
                    return
        finally:
            self.live.discard(request_id)

    @staticmethod
    def _append(samples: list[CompletionOutput], position: int, logprobs: int | None) -> None:
        for sample in samples:
            token = 1000 + position
            sample.token_ids.append(token)
            sample.text += f"t{position} "
            if logprobs is not None:
                sample.logprobs.append({token: -0.5, **{2000 + j: -3.0 for j in range(logprobs)}})


def scripted_text(num_tokens: int) -> str:
    return "".join(f"t{i} " for i in range(num_tokens))


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# ---- hostile JSON ------------------------------------------------------------------------------


async def test_deeply_nested_json_gets_an_error_and_the_socket_lives_on(engine):
    async with serve(engine) as client:
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "live", "prompt": "Hi", "params": {**SHORT, "max_tokens": 30}})
        deep = [
            f'{{"type": "generate", "id": "d", "prompt": "x", "params": {{"stop": {nested(1000)}}}}}',
            f'{{"type": "generate", "id": "d", "prompt": "x", "params": {{"junk": {nested(1000)}}}}}',
            '{"type": "generate", "id": "d", "prompt": "x", "params": ' + '{"a": ' * 2000 + "1" + "}" * 2001,
            f'{{"type": "abort", "id": "d", "junk": {nested(1000)}}}',  # unknown field: refused first
        ]
        for raw in deep:
            assert len(raw.encode()) < 16_000
            await ws.send_str(raw)
        errors = []
        result = {"tokens": 0, "done": None}
        while result["done"] is None or len(errors) < len(deep):
            msg = await recv(ws)
            if msg["type"] == "error":
                errors.append(msg)
            elif msg["type"] == "delta":
                result["tokens"] += len(msg["token_ids"])
            else:
                result["done"] = msg
        assert [e["code"] for e in errors] == ["too_deep"] * 3 + ["bad_message"]
        assert all(e["message"] and len(e["message"]) < 600 for e in errors)
        assert result["done"]["finish_reason"] == "length" and result["tokens"] == 30
        await ws.send_json({"type": "generate", "id": "after", "prompt": "Hi", "params": SHORT})
        assert (await collect(ws, {"after"}))["after"]["done"]["finish_reason"] == "length"
        await wait_idle(engine)


# ---- slow readers on real sockets -------------------------------------------------------------

SLOW_RCVBUF = 4096
MANY = {"max_tokens": 500, "ignore_eos": True, "temperature": 1.0, "seed": 1, "n": 2, "logprobs": 20}


def _small_rcvbuf_socket(addr_info) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)  # a 4 KB receive window
    return sock


@contextlib.asynccontextmanager
async def slow_socket(client):
    """A WebSocket to `client`'s server whose receive window is tiny, and its server side."""
    state = client.app[STATE_KEY]
    before = set(state.connections)
    connector = aiohttp.TCPConnector(socket_factory=_small_rcvbuf_socket)
    async with aiohttp.ClientSession(connector=connector) as session:
        ws = await session.ws_connect(client.make_url("/v1/stream"), max_msg_size=0)
        assert (await recv(ws))["type"] == "ready"
        (conn,) = set(state.connections) - before
        yield ws, conn


def unsent_bytes(conn) -> int:
    """What the server has handed on but the peer has not taken: the transport's buffer plus
    the kernel's send queue (Linux SIOCOUTQ); everything a heartbeat ping would queue behind."""
    transport = conn._transport
    if transport is None:
        return 0
    queued = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None and sys.platform == "linux":
        queued += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    return queued


async def send_many(ws, count: int, params: dict) -> set[str]:
    ids = {f"r{i}" for i in range(count)}
    for i in sorted(ids):
        await ws.send_json({"type": "generate", "id": i, "prompt": f"{i} once upon a time", "params": params})
    return ids


async def read_all(ws, ids: set[str], timeout: float = 60.0) -> dict[str, dict]:
    """Per id: tokens per sample, number of deltas, the done message; fails on any close."""
    out = {i: {"tokens": {}, "text": {}, "deltas": 0, "done": None} for i in ids}
    pending = set(ids)
    while pending:
        msg = await recv(ws, timeout)
        entry = out[msg["id"]]
        if msg["type"] == "delta":
            entry["tokens"].setdefault(msg["index"], []).extend(msg["token_ids"])
            entry["text"][msg["index"]] = entry["text"].get(msg["index"], "") + msg["text"]
            entry["deltas"] += 1
        else:
            assert msg["type"] == "done", msg
            entry["done"] = msg
            pending.discard(msg["id"])
    return out


async def test_paused_reader_gets_every_token_merged_without_reset(engine):
    # 16 requests x n=2 x 1,000 tokens with logprobs (~1.9 MB), produced faster than a real
    # model would, to a client with a 4 KB receive window that reads nothing for 1.5 s.
    fake = ScriptedEngine(engine, tokens_per_step=4, step_s=0.002)
    params = {"max_tokens": 1000, "n": 2, "logprobs": 2}
    heartbeat = 2.0  # a ping after 2 s of client silence must be answered within 1 s
    async with serve(fake, heartbeat_s=heartbeat) as client, slow_socket(client) as (slow, conn):
        ids = await send_many(slow, 16, params)
        started = time.monotonic()
        fast = await connect(client)
        await fast.send_json({"type": "generate", "id": "f", "prompt": "Hello", "params": {"max_tokens": 8}})
        fast_result = asyncio.ensure_future(collect(fast, {"f"}))
        worst = 0
        while time.monotonic() - started < 0.75 * heartbeat:
            worst = max(worst, unsent_bytes(conn))
            await asyncio.sleep(0.01)
        # the other socket was served meanwhile
        assert fast_result.done() and len(fast_result.result()["f"]["tokens"]) == 8
        assert conn.outbox.num_coalesced > 0 and conn.outbox.pending_bytes > 512 * 1024
        # Only a little is ever handed to the socket ahead of the outbox, so a heartbeat ping
        # never waits behind megabytes (without the bound the kernel alone takes ~3 MB here).
        assert worst < 512 * 1024, worst
        results = await read_all(slow, ids)
        for entry in results.values():
            assert entry["done"]["finish_reasons"] == ["length", "length"]
            for index in (0, 1):
                assert entry["tokens"][index] == list(range(1000, 2000))
                assert entry["text"][index] == scripted_text(1000)
        assert sum(e["deltas"] for e in results.values()) < 32 * 1000 / 4  # merged
        with pytest.raises(TimeoutError):  # reading on, pings are answered: no reset
            await asyncio.wait_for(slow.receive(), 1.5 * heartbeat)  # (receive's own timeout restarts at each ping)
        await slow.send_json({"type": "generate", "id": "again", "prompt": "Hi", "params": {"max_tokens": 3}})
        assert (await read_all(slow, {"again"}))["again"]["done"]["finish_reason"] == "length"
    assert not fake.live


async def test_reader_too_slow_even_for_merged_deltas_is_closed_1008(engine):
    params = {"max_tokens": 500, "ignore_eos": True, "n": 2, "logprobs": 20}
    async with serve(engine, max_pending_bytes=64 * 1024) as client, slow_socket(client) as (slow, conn):
        ids = await send_many(slow, 16, params)
        fast = await connect(client)
        # The slow socket is closed as soon as 64 KiB wait unsent; its requests are aborted,
        # long before they could finish, while another socket keeps streaming.
        await wait_idle(engine, timeout=30)
        assert conn.outbox.overflowed and conn.outbox.pending_bytes == 0
        await fast.send_json({"type": "generate", "id": "f", "prompt": "Hello", "params": SHORT})
        assert len((await collect(fast, {"f"}))["f"]["tokens"]) == 4
        tokens = 0
        while True:
            msg = await slow.receive(timeout=30)
            if msg.type is not WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            assert data["type"] == "delta" and data["id"] in ids, data  # never a `done`
            tokens += len(data["token_ids"])
        assert msg.type is WSMsgType.CLOSE and msg.data == 1008, msg
        assert "too slow" in msg.extra
        assert tokens < 32 * params["max_tokens"]
    await wait_idle(engine)


# ---- ids, sizes, connections --------------------------------------------------------------------


async def test_long_ids_are_refused_without_being_echoed(engine):
    async with serve(engine, max_pending_bytes=128 * 1024) as client, slow_socket(client) as (slow, conn):
        huge = "x" * 200_000
        for _ in range(300):  # a socket that reads nothing while it sends these
            await slow.send_json({"type": "abort", "id": huge})
        errors = [await recv(slow) for _ in range(300)]
        # every reply is small, so what the socket held for them was small too
        for error in errors:
            assert (error["type"], error["id"], error["code"]) == ("error", None, "bad_message")
            assert "length <= 256" in error["message"] and len(json.dumps(error)) < 600
        await slow.send_json({"type": "generate", "id": huge[:257], "prompt": "Hi", "params": SHORT})
        assert (await recv(slow))["id"] is None
        longest = "y" * 256  # the limit itself is fine
        await slow.send_json({"type": "generate", "id": longest, "prompt": "Hi", "params": SHORT})
        assert (await collect(slow, {longest}))[longest]["done"]["finish_reason"] == "length"
        # Unknown ids of legal length from a socket that does not read: each error counts
        # against the same 128 KiB budget as deltas, and then the socket is cut off.
        for i in range(4000):
            await slow.send_str(json.dumps({"type": "abort", "id": f"{i:0256d}"}))
        deadline = time.monotonic() + 20
        while not conn.outbox.overflowed and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert conn.outbox.overflowed and conn.outbox.pending_bytes == 0
        while (msg := await slow.receive(timeout=30)).type is WSMsgType.TEXT:
            assert json.loads(msg.data)["code"] == "unknown_id"
        assert msg.type is WSMsgType.CLOSE and msg.data == 1008


async def test_connections_beyond_the_limit_get_503(engine):
    async with serve(engine, max_connections=2) as client:
        first, second = await connect(client), await connect(client)
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect("/v1/stream")
        assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "1"
        await first.close()
        connections = client.app[STATE_KEY].connections
        deadline = time.monotonic() + 5
        while len(connections) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        third = await connect(client)  # a freed slot is usable again
        await third.close()
        await second.close()


async def test_message_limit_counts_utf8_bytes(engine):
    async with serve(engine, max_message_bytes=4096) as client:
        ws = await connect(client)
        three_byte = json.dumps({"type": "generate", "id": "e", "prompt": "€" * 2000}, ensure_ascii=False)
        assert len(three_byte) < 4096 < len(three_byte.encode())  # under in characters, over in bytes
        await ws.send_str(three_byte)
        error = await recv(ws)
        assert (error["code"], error["id"]) == ("message_too_large", None)
        assert str(len(three_byte.encode())) in error["message"]
        await ws.send_bytes(three_byte.encode())
        assert (await recv(ws))["code"] == "message_too_large"
        two_byte = {"type": "generate", "id": "ok", "prompt": "é" * 1000, "params": SHORT}
        await ws.send_str(json.dumps(two_byte, ensure_ascii=False))  # ~2 KB: within the limit
        assert (await collect(ws, {"ok"}))["ok"]["done"]["finish_reason"] == "length"


# ---- auth and admin ----------------------------------------------------------------------------


async def test_auth_message_gets_a_reply_with_or_without_keys(engine):
    async with serve(engine) as client:
        ws = await connect(client)
        await ws.send_json({"type": "auth", "key": "anything"})
        reply = await recv(ws)
        assert (reply["type"], reply["id"], reply["code"]) == ("error", None, "auth_not_required")
        await ws.send_json({"type": "generate", "id": "a", "prompt": "Hi", "params": SHORT})
        assert (await collect(ws, {"a"}))["a"]["done"]["finish_reason"] == "length"
    async with serve(engine, api_key="k1") as client:
        ws = await connect(client, headers={"Authorization": "Bearer k1"})
        await ws.send_json({"type": "auth", "key": "k1"})
        assert (await recv(ws))["code"] == "bad_message"  # already authenticated


async def test_kv_state_needs_an_admin_tenant(engine):
    async with serve(engine, api_key=["k1"]) as client:
        ws = await connect(client, headers={"Authorization": "Bearer k1"})
        await ws.send_json({"type": "kv_state"})
        refused = await recv(ws)
        assert (refused["type"], refused["code"]) == ("error", "forbidden")
        await ws.send_json({"type": "generate", "id": "a", "prompt": "Hi", "params": SHORT})
        assert (await collect(ws, {"a"}))["a"]["done"]["finish_reason"] == "length"
    async with serve(engine) as client:  # no keys: everyone is admin
        ws = await connect(client)
        await ws.send_json({"type": "kv_state"})
        assert (await recv(ws))["type"] == "kv_state"


# ---- the engine's errors, shutdown, timeouts ---------------------------------------------------


@pytest.mark.parametrize(
    ("error", "fail_after", "code", "extra"),
    [
        (LimitExceededError("max_num_seqs", "n=40 is more than max_num_seqs=32"), 0, "limit_exceeded",
         {"limit": "max_num_seqs"}),
        (EngineOverloadedError("the engine's queue is full", retry_after=2.5), 0, "overloaded",
         {"retry_after": 2.5}),
        (RequestFailedError("step failed: out of memory"), 2, "engine_error", {}),
        (EngineDeadError("engine step loop died: boom"), 2, "engine_error", {}),
    ],
    ids=["limit", "overload", "failed", "dead"],
)
async def test_engine_errors_reach_the_socket_as_structured_errors(engine, error, fail_after, code, extra):
    fake = ScriptedEngine(engine, error=error, fail_after=fail_after)
    async with serve(fake) as client:
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "e", "prompt": "Hi", "params": {"max_tokens": 8}})
        deltas = 0
        while (msg := await recv(ws))["type"] == "delta":
            deltas += 1
        assert deltas == fail_after
        assert (msg["type"], msg["id"], msg["code"]) == ("error", "e", code)
        assert str(error) in msg["message"]  # the engine's own words, not just a type name
        assert {k: msg[k] for k in extra} == extra
        await ws.send_json({"type": "kv_state"})  # the socket carries on
        assert (await recv(ws))["type"] == "kv_state"
    assert not fake.live


async def test_generate_while_shutting_down_is_refused(engine):
    async with serve(engine) as client:
        ws = await connect(client)
        state = client.app[STATE_KEY]
        state.shutting_down = True
        await ws.send_json({"type": "generate", "id": "late", "prompt": "Hi", "params": SHORT})
        refused = await recv(ws)
        assert (refused["type"], refused["id"], refused["code"]) == ("error", "late", "shutting_down")
        state.shutting_down = False
        await ws.send_json({"type": "generate", "id": "ok", "prompt": "Hi", "params": SHORT})
        assert (await collect(ws, {"ok"}))["ok"]["done"]["finish_reason"] == "length"


async def test_request_timeout_ends_the_request_and_frees_its_blocks(engine, monkeypatch):
    slow_down_steps(monkeypatch, engine)  # 1,000 tokens take 20 s, far past the timeout
    async with serve(engine, request_timeout=2.0) as client:
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "quick", "prompt": "Hi", "params": SHORT})
        assert (await collect(ws, {"quick"}))["quick"]["done"]["finish_reason"] == "length"
        started = time.monotonic()
        await ws.send_json({"type": "generate", "id": "slow", "prompt": "Hi",
                            "params": {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}})
        tokens = 0
        while (msg := await recv(ws))["type"] == "delta":
            tokens += len(msg["token_ids"])
        assert (msg["type"], msg["id"], msg["code"]) == ("error", "slow", "timeout")
        assert 0 < tokens < 1000 and time.monotonic() - started < 10
        await wait_idle(engine)  # aborted in the engine: every block back
        await ws.send_json({"type": "kv_state"})
        assert (await recv(ws))["type"] == "kv_state"


async def test_sampling_limits_are_limit_exceeded(engine):
    async with serve(engine) as client:
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "s", "prompt": "Hi", "params": {"stop": ["x"] * 33}})
        error = await recv(ws)
        assert (error["id"], error["code"], error["limit"]) == ("s", "limit_exceeded", "max_stop_strings")


def test_done_has_one_finish_reason_per_sample_even_without_output():
    from streamengine.server.websocket import _done

    assert _done("r", None, 3).finish_reasons == ["abort", "abort", "abort"]


FAILURES = [  # exception, WebSocket code, HTTP status, OpenAI code
    (PromptTooLong("prompt has 300 tokens"), "prompt_too_long", 400, "context_length_exceeded"),
    (LimitExceededError("max_num_seqs", "n=40"), "limit_exceeded", 400, "limit_exceeded"),
    (ValueError("bad"), "invalid_params", 400, None),
    (ValueError("exceeds the maximum context length"), "invalid_params", 400, "context_length_exceeded"),
    (EngineOverloadedError("full", retry_after=0.2), "overloaded", 429, "overloaded"),
    (RequestTimeoutError(2.0), "timeout", 504, "timeout"),
    (RequestFailedError("oom"), "engine_error", 500, "engine_error"),
    (EngineDeadError("stopped"), "engine_error", 500, "engine_error"),
]


@pytest.mark.parametrize(("exc", "code", "status", "openai_code"), FAILURES)
def test_one_classifier_maps_failures_for_both_protocols(exc, code, status, openai_code):
    from streamengine.server.failures import classify
    from streamengine.server.websocket import _failure

    failure = classify(exc)
    assert (failure.code, failure.status, failure.openai_code) == (code, status, openai_code)
    assert failure.message == str(exc)
    assert _failure("r", "ws-1", exc).code == code


def test_unexpected_exceptions_are_not_classified():
    from streamengine.server.failures import classify
    from streamengine.server.websocket import _failure

    assert classify(KeyError("bug")) is None
    error = _failure("r", "ws-1", KeyError("bug"))
    assert (error.code, error.message) == ("engine_error", "generation failed: KeyError")
