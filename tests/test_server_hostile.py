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
import time

import aiohttp
import pytest
from aiohttp import WSMsgType
from test_server import collect, connect, recv, serve
from test_server_limits import ScriptedEngine

from streamengine import AsyncEngine, EngineConfig
from streamengine.server import app as app_module
from streamengine.server.app import drain
from streamengine.server.openai.format import ResponseFormat
from streamengine.server.state import STATE_KEY

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=256, max_num_seqs=8))


async def wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    """Polls `predicate` (a generous timeout only turns a hang into a failure)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


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
    read_body = app_module.read_body

    async def watched(request, timeout):
        reading.set()
        return await read_body(request, timeout)

    monkeypatch.setattr(app_module, "read_body", watched)
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

    monkeypatch.setattr(app_module, "read_body", never)
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
