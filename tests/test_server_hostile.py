"""Hostile clients against the server's own bounds (issue 43): keyless WebSockets, slowloris
heads and bodies, bodies that lie about their encoding, readers that stall, drains that cut
requests, responses too large to build on the loop. Each test failed before its fix.

Bounds are set small here so the tests are quick; they assert what the client sees and what
the server holds, never how long something took (a deadline only turns a hang into a failure).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import aiohttp
import pytest
from aiohttp import WSMsgType
from test_server import collect, connect, recv, serve
from test_server_edge_cases import wait_for
from test_server_limits import ScriptedEngine

from streamengine import AsyncEngine, EngineConfig
from streamengine.server import middlewares
from streamengine.server.app import drain
from streamengine.server.openai.format import ResponseFormat
from streamengine.server.state import STATE_KEY

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=256, max_num_seqs=8))


def address(client) -> tuple[str, int]:
    return client.server.host, client.server.port


async def raw_connection(client, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, address(client))
    return await asyncio.open_connection(sock=sock)


async def closed_by_server(reader: asyncio.StreamReader, timeout: float = 20.0) -> bytes:
    """Everything the server sent until it closed the connection (fails if it never does)."""
    return await asyncio.wait_for(reader.read(), timeout)


# ---- WebSockets that never authenticate ---------------------------------------------------------


async def test_keyless_sockets_have_their_own_cap_and_never_take_a_keyed_clients_place(engine):
    # Before: every socket counted against max_connections from its handshake, so idle keyless
    # sockets (each allowed the auth timeout) held every slot and keyed clients got 503.
    async with serve(engine, api_key=KEY, max_connections=2, max_unauthenticated=3) as client:
        state = client.app[STATE_KEY]
        idle = [await client.ws_connect("/v1/stream") for _ in range(3)]
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect("/v1/stream")
        assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "1"
        keyed = [await connect(client, headers=AUTH) for _ in range(2)]  # not refused for the idle ones
        with pytest.raises(aiohttp.WSServerHandshakeError) as full:
            await client.ws_connect("/v1/stream", headers=AUTH)
        assert full.value.status == 503
        assert (len(state.connections), len(state.unauthenticated)) == (5, 3)
        # One that authenticates by message while the keyed ones are at their limit is closed
        # with 1013 (try again later): authenticating never takes the socket past the limit.
        await idle[0].send_json({"type": "auth", "key": KEY})
        msg = await idle[0].receive(timeout=10)
        assert msg.type is WSMsgType.CLOSE and msg.data == 1013, msg
        await keyed[0].close()
        await wait_for(lambda: len(state.connections) - len(state.unauthenticated) < 2, "a keyed slot to free")
        await idle[1].send_json({"type": "auth", "key": KEY})
        assert (await recv(idle[1]))["type"] == "ready"
        await idle[1].send_json({"type": "generate", "id": "a", "prompt": "Hi", "params": {"max_tokens": 2}})
        assert (await collect(idle[1], {"a"}))["a"]["done"]["finish_reason"] == "length"
        for ws in (*idle, *keyed):
            await ws.close()


async def test_a_socket_silent_past_the_auth_timeout_is_closed(engine):
    async with serve(engine, api_key=KEY, auth_timeout=0.2) as client:
        ws = await client.ws_connect("/v1/stream")
        msg = await ws.receive(timeout=20)
        assert msg.type is WSMsgType.CLOSE and msg.data == 4001 and "timeout" in msg.extra
        await wait_for(lambda: not client.app[STATE_KEY].unauthenticated, "the socket to be forgotten")


# ---- slowloris: heads and bodies sent a byte at a time -----------------------------------------


async def test_a_head_never_finished_is_closed_after_the_idle_timeout(engine):
    # Before: aiohttp's keep-alive timeout (about an hour) was the only bound.
    async with serve(engine, api_key=KEY, idle_timeout=0.3) as client:
        reader, writer = await raw_connection(client)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        await writer.drain()
        assert await closed_by_server(reader) == b""
        writer.close()
        # an idle keep-alive connection is closed the same way, after its last response
        reader, writer = await raw_connection(client)
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert (await closed_by_server(reader)).startswith(b"HTTP/1.1 200")
        writer.close()


async def test_a_body_never_finished_gets_408_and_is_no_request_in_flight(engine, monkeypatch):
    # Before: the body was read by the handler with no bound, and the request counted as in
    # flight from its head on, so a drain waited its whole timeout for bodies that never came.
    reading = asyncio.Event()
    read_body = middlewares.read_body

    async def watched(request, timeout):
        reading.set()
        return await read_body(request, timeout)

    monkeypatch.setattr(middlewares, "read_body", watched)
    async with serve(engine, api_key=KEY, body_timeout=0.5) as client:
        state = client.app[STATE_KEY]
        reader, writer = await raw_connection(client)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        await writer.drain()
        await asyncio.wait_for(reading.wait(), 20)
        assert state.http_in_flight == 0  # a drain now would not wait for it
        answer = await closed_by_server(reader)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(body)["error"]["code"] == "body_timeout"
        writer.close()
        resp = await client.post("/v1/completions", headers=AUTH, json={"prompt": "Hi", "max_tokens": 2})
        assert resp.status == 200  # whole bodies are served as before


async def test_a_body_without_a_key_is_not_read(engine, monkeypatch):
    async def never(request, timeout):
        raise AssertionError("the body of an unauthenticated request was read")

    monkeypatch.setattr(middlewares, "read_body", never)
    async with serve(engine, api_key=KEY) as client:
        resp = await client.post("/v1/completions", json={"prompt": "Hi"})
        assert resp.status == 401


async def test_a_body_marked_gzip_that_is_not_gzip_is_a_400(engine):
    # Before: aiohttp's decoding error escaped the handler as a 500 "internal server error".
    async with serve(engine, api_key=KEY) as client:
        resp = await client.post("/v1/completions", data=b'{"prompt": "Hi"}',
                                 headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": "gzip"})
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["code"] == "invalid_body" and "gzip" in error["message"]


# ---- readers that stall --------------------------------------------------------------------------


async def test_a_stalled_sse_reader_is_dropped_and_its_request_aborted(engine):
    # Before: the handler waited in write() for good and the request was never aborted. The
    # scripted engine computes only when its stream is read, so "never aborted" is a hang here.
    fake = ScriptedEngine(engine, tokens_per_step=8, step_s=0.001)
    async with serve(fake, write_timeout=0.3) as client:
        reader, writer = await raw_connection(client, rcvbuf=4096)  # a 4 KB window it never reads
        body = json.dumps({"prompt": "Hi", "max_tokens": 1_000_000, "stream": True, "logprobs": 5}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        await wait_for(lambda: fake.live, "the request to start")
        (request_id,) = fake.live
        await wait_for(lambda: not fake.live, "the stalled request to be aborted")
        assert request_id in fake.aborted
        assert client.app[STATE_KEY].http_in_flight == 0
        writer.close()


# ---- a drain that cuts WebSocket requests --------------------------------------------------------


async def test_websocket_requests_cut_by_a_drain_each_get_shutting_down_before_the_close(engine):
    # Before: the socket was closed with 1001 and no word about which requests were cut.
    fake = ScriptedEngine(engine, step_s=0.01)
    async with serve(fake) as client:
        ws = await connect(client)
        for rid in ("a", "b"):
            await ws.send_json({"type": "generate", "id": rid, "prompt": "Hi", "params": {"max_tokens": 100_000}})
        await ws.send_json({"type": "generate", "id": "quick", "prompt": "Hi", "params": {"max_tokens": 1}})
        await wait_for(lambda: len(fake.live) == 2, "both long requests to run")
        draining = asyncio.ensure_future(drain(client.app, timeout=0.05))
        errors, finished = {}, set()
        while (msg := await ws.receive(timeout=20)).type is WSMsgType.TEXT:
            data = json.loads(msg.data)
            if data["type"] == "error":
                errors[data["id"]] = data["code"]
            elif data["type"] == "done":
                finished.add(data["id"])
        assert errors == {"a": "shutting_down", "b": "shutting_down"} and finished == {"quick"}
        assert msg.type is WSMsgType.CLOSE and msg.data == 1001
        await asyncio.wait_for(draining, 20)
    assert not fake.live


# ---- responses too large to build on the loop ----------------------------------------------------


async def test_health_answers_while_a_large_response_is_built(engine, monkeypatch):
    # Before: the whole body (n x tokens x top logprobs) was built and encoded on the event loop,
    # so nothing else was served meanwhile. The builder here waits for /health to be answered:
    # on the loop that wait could never end (it times out, and the test fails).
    class Probed(ScriptedEngine):
        def health(self) -> dict:
            return {"state": "ready"}

    fake = Probed(engine, tokens_per_step=8)
    entered, health_answered = threading.Event(), threading.Event()
    waited: list[bool] = []
    completion = ResponseFormat.completion

    def held_completion(self, *args):
        entered.set()
        waited.append(health_answered.wait(10))
        return completion(self, *args)

    monkeypatch.setattr(ResponseFormat, "completion", held_completion)
    async with serve(fake) as client:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "n": 4, "logprobs": True,
                "top_logprobs": 5}
        posted = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
        assert await asyncio.to_thread(entered.wait, 20)
        assert (await client.get("/health")).status == 200
        health_answered.set()
        resp = await asyncio.wait_for(posted, 20)
        choices = (await resp.json())["choices"]
    assert waited == [True]
    assert len(choices) == 4 and all(len(c["logprobs"]["content"]) == 16 for c in choices)
    assert all(len(entry["top_logprobs"]) == 5 for c in choices for entry in c["logprobs"]["content"])


# ---- prompts too long to be worth tokenizing, and a tokenizer no client can monopolize -----------


class Tenanted(ScriptedEngine):
    """The scripted engine, taking the `tenant` argument that keyed requests may carry."""

    def health(self) -> dict:
        return {"state": "ready"}

    async def generate(self, prompt, params, request_id=None, cache_salt=None, tenant=None):
        async for out in super().generate(prompt, params, request_id, cache_salt):
            yield out


@pytest.fixture
def encoded(monkeypatch):
    """The texts the server tokenizes, in order; `hold` makes the first one wait until set."""
    from streamengine.server import state as state_module

    record = {"texts": [], "hold": None, "entered": threading.Event()}
    encode = state_module.encode_prompt

    def watched(tokenizer, text, *, chat=False):
        record["texts"].append(text)
        record["entered"].set()
        if record["hold"] is not None and len(record["texts"]) == 1:
            assert record["hold"].wait(20)
        return encode(tokenizer, text, chat=chat)

    monkeypatch.setattr(state_module, "encode_prompt", watched)
    return record


async def test_a_prompt_longer_than_any_that_fits_is_refused_without_tokenizing(engine, encoded):
    # Before: every prompt was tokenized first (seconds for megabytes), then refused.
    from streamengine.server.state import longest_token_chars

    per_token = longest_token_chars(engine.tokenizer)
    context = engine.stats()["max_model_len"]
    async with serve(engine, max_prompt_tokens=10) as client:
        # more characters than the context's tokens could hold at the longest token's length
        resp = await client.post("/v1/completions", json={"prompt": "a" * (context * per_token + 1), "max_tokens": 1})
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert "without tokenizing" in error["message"]
        # the WebSocket applies --max-prompt-tokens before tokenizing too
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "w", "prompt": "a" * (10 * per_token + 1),
                            "params": {"max_tokens": 1}})
        error = await recv(ws)
        assert error["code"] == "prompt_too_long" and "without tokenizing" in error["message"]
        assert encoded["texts"] == []
        # at the bound it may still fit, so it is tokenized (and refused by its count of tokens)
        await ws.send_json({"type": "generate", "id": "w", "prompt": "a" * (10 * per_token),
                            "params": {"max_tokens": 1}})
        error = await recv(ws)
        assert error["code"] == "prompt_too_long" and "without tokenizing" not in error["message"]
        assert len(encoded["texts"]) == 1


async def test_one_clients_backlog_of_long_prompts_does_not_hold_up_another_client(engine, encoded):
    # Before: one tokenizer thread, first come first served: B's prompt waited for all of A's.
    fake = Tenanted(engine)
    keys = {"A": "key-a", "B": "key-b"}
    long = 9000  # past INLINE_TOKENIZE_CHARS: tokenized in the worker thread
    encoded["hold"] = threading.Event()
    async with serve(fake, api_key=list(keys.values())) as client:
        state = client.app[STATE_KEY]

        async def post(who: str, i: int):
            return await client.post("/v1/completions", headers={"Authorization": f"Bearer {keys[who]}"},
                                     json={"prompt": f"{who}{i} " + "x" * long, "max_tokens": 1})

        flood = [asyncio.ensure_future(post("A", i)) for i in range(5)]
        assert await asyncio.to_thread(encoded["entered"].wait, 20)
        await wait_for(lambda: state._tokenizer_pool.pending() == 4, "A's backlog to queue")
        other = asyncio.ensure_future(post("B", 0))
        await wait_for(lambda: state._tokenizer_pool.pending() == 5, "B's prompt to queue")
        encoded["hold"].set()
        responses = await asyncio.wait_for(asyncio.gather(other, *flood), 30)
        assert [r.status for r in responses] == [200] * 6
    order = [text.split(" ", 1)[0] for text in encoded["texts"]]
    # B's one prompt came right after the A prompt being tokenized, ahead of A's backlog
    assert order[1] == "B0" and sorted(order[:1] + order[2:]) == ["A0", "A1", "A2", "A3", "A4"], order


async def test_the_fair_pool_takes_clients_in_turn_and_drops_cancelled_jobs():
    from streamengine.server.fair_pool import FairPool

    pool = FairPool(1, "test-pool")
    gate, ran = threading.Event(), []

    def job(name: str):
        def run() -> str:
            if name == "a0":
                gate.wait(20)
            ran.append(name)
            return name
        return run

    try:
        first = asyncio.ensure_future(pool.run("a", job("a0")))
        await asyncio.sleep(0)
        queued = {name: asyncio.ensure_future(pool.run(name[0], job(name))) for name in ("a1", "a2", "a3", "b0", "c0", "b1")}
        await wait_for(lambda: pool.pending() == 6, "the jobs to queue")
        queued["a2"].cancel()
        gate.set()
        assert await first == "a0"
        results = await asyncio.gather(*queued.values(), return_exceptions=True)
        assert [r for r in results if isinstance(r, str)] == ["a1", "a3", "b0", "c0", "b1"]
        # round robin, a running client's next job behind the others'; the cancelled a2 never ran
        assert ran == ["a0", "b0", "c0", "a1", "b1", "a3"]
    finally:
        pool.close()


# ---- a queue no tenant can fill -------------------------------------------------------------------


async def test_the_waiting_queue_is_bounded_by_default_and_shared_between_tenants(tiny_llama_dir, monkeypatch):
    # Before: no bound by default, and within a bound one tenant could fill the whole queue.
    from conftest import slow_down_steps

    from streamengine.errors import EngineOverloadedError
    from streamengine.sample.sampling_params import SamplingParams

    assert EngineConfig().max_waiting == 1024
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=128, max_num_seqs=1, max_waiting=8))
    slow_down_steps(monkeypatch, engine)
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
    streams, tasks = [], []

    async def queue(tenant: str, i: int) -> None:
        stream = engine.generate(f"{tenant} {i}", params, request_id=f"{tenant}{i}", tenant=tenant)
        streams.append(stream)
        tasks.append(asyncio.ensure_future(anext(stream)))
        await wait_for(lambda: engine.core.requests.get(f"{tenant}{i}") is not None or tasks[-1].done(), "intake")
        if tasks[-1].done() and tasks[-1].exception() is not None:
            raise tasks[-1].exception()

    async with engine:
        await queue("a", 0)  # running: max_num_seqs=1 keeps every later one waiting
        await wait_for(lambda: engine.stats()["num_running"] == 1, "the first to run")
        for i in range(1, 5):
            await queue("a", i)  # alone, a may hold half the queue: 4 of 8
        with pytest.raises(EngineOverloadedError, match="tenant 'a' already has 4 requests waiting") as refused:
            await queue("a", 5)
        assert refused.value.retry_after > 0
        await queue("b", 0)  # the other half is left for the others
        await queue("b", 1)
        await queue("c", 0)  # three tenants waiting: a share of 8 // 3 = 2 each
        with pytest.raises(EngineOverloadedError, match="its share"):
            await queue("b", 2)
        await queue("d", 0)  # a tenant with nothing waiting gets in while there is room
        assert engine.stats()["num_waiting"] == 8
        with pytest.raises(EngineOverloadedError, match="max_waiting=8"):
            await queue("e", 0)  # a full queue refuses anyone
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def test_tokenized_prompts_share_one_int_object_per_token_id(engine):
    # Before: every tokenization made a new 28-byte int object per id above 256, which each
    # queued request kept (with 8 bytes per reference: about 40% of what a waiting prompt held).
    async with serve(engine) as client:
        state = client.app[STATE_KEY]
        text = "Paged attention keeps every request's cache in blocks anywhere in one shared pool."
        first, second = state.tokenize(text), state.tokenize(text)
        assert first == second == engine.tokenizer.encode(text) and any(t > 256 for t in first)
        assert all(a is b for a, b in zip(first, second, strict=True))
