"""The ASGI bridge to the aiohttp server, driven as an ASGI callable through queue fakes: HTTP
round trips, the body limit, streaming, disconnects, WebSockets and refused handshakes, on a
small app of its own and on the real server over the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
from aiohttp import WSMsgType, web
from conftest import slow_down_steps

from streamengine import AsyncEngine, EngineConfig
from streamengine.ray.asgi_bridge import AiohttpBridge
from streamengine.server import create_app
from streamengine.server import protocol as p
from streamengine.server.config import ServerConfig

TIMEOUT = 10.0
HOST = (b"host", b"127.0.0.1:8000")


class Client:
    """One ASGI connection seen from the server side: what the app receives, what it sends."""

    def __init__(self, messages: Iterable[dict] = ()) -> None:
        self.inbox: asyncio.Queue[dict] = asyncio.Queue()
        self.outbox: asyncio.Queue[dict] = asyncio.Queue()
        for message in messages:
            self.inbox.put_nowait(message)

    async def receive(self) -> dict:
        return await self.inbox.get()

    async def send(self, message: dict) -> None:
        await self.outbox.put(message)

    async def next(self) -> dict:
        return await asyncio.wait_for(self.outbox.get(), TIMEOUT)

    def run(self, bridge: AiohttpBridge, scope: dict) -> asyncio.Task:
        return asyncio.create_task(bridge(scope, self.receive, self.send))


def http_scope(method: str, path: str, query: bytes = b"", headers: Iterable = (HOST,)) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
            "headers": list(headers)}


def ws_scope(path: str, headers: Iterable = (HOST,), subprotocols: Iterable[str] = (),
             http_response: bool = False) -> dict:
    return {"type": "websocket", "asgi": {"version": "3.0"}, "scheme": "ws", "path": path,
            "raw_path": path.encode(), "query_string": b"", "headers": list(headers),
            "subprotocols": list(subprotocols),
            "extensions": {"websocket.http.response": {}} if http_response else {}}


async def request(bridge: AiohttpBridge, method: str, path: str, body: bytes = b"",
                  headers: Iterable = (HOST,), query: bytes = b"") -> tuple[int, list, bytes]:
    client = Client([{"type": "http.request", "body": body, "more_body": False}])
    task = client.run(bridge, http_scope(method, path, query, headers))
    start = await client.next()
    chunks = []
    while True:
        message = await client.next()
        chunks.append(message["body"])
        if not message.get("more_body", False):
            break
    await asyncio.wait_for(task, TIMEOUT)
    return start["status"], start["headers"], b"".join(chunks)


def header(headers: list, name: str) -> list[str]:
    return [v.decode() for k, v in headers if k.decode().lower() == name.lower()]


@pytest.fixture
def socket_dir() -> Iterable[Path]:
    """An empty directory with a short path, for the bridge to make its socket's directory in.
    Not tmp_path: an AF_UNIX path holds at most 107 bytes, and under pytest-xdist tmp_path
    (/tmp/pytest-of-<user>/pytest-<n>/popen-gw<i>/<test name>/) plus the bridge's
    streamengine-bridge-<random>/app.sock is longer than that."""
    path = Path(tempfile.mkdtemp(prefix="se-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def bridged(socket_dir) -> AsyncIterator[tuple[AiohttpBridge, dict]]:
    """A bridge to a small app whose handlers report what they saw in `seen`."""
    seen: dict = {"release": asyncio.Event(), "gone": asyncio.Event(), "cleaned": False}
    app = _test_app(seen)
    bridge = AiohttpBridge(app, socket_dir=str(socket_dir))
    await asyncio.wait_for(bridge.start(), TIMEOUT)
    try:
        yield bridge, seen
    finally:
        await asyncio.wait_for(bridge.close(), TIMEOUT)


def _test_app(seen: dict) -> web.Application:
    app = web.Application(client_max_size=1024)

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        seen["headers"] = request.headers
        reply = {"method": request.method, "path_qs": request.path_qs, "host": request.host,
                 "json": json.loads(body) if body else None}
        response = web.json_response(reply, status=201 if request.method == "POST" else 200)
        response.headers["X-Reply"] = "yes"
        response.set_cookie("a", "1")
        response.set_cookie("b", "2")
        return response

    async def chunks(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        await seen["release"].wait()
        await response.write(b"data: two\n\n")
        await response.write_eof()
        return response

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            while True:
                await response.write(b"tick\n")
                await asyncio.sleep(0.01)
        except ConnectionError as exc:
            seen["gone_by"] = exc
        finally:
            seen["gone"].set()
        return response

    async def socket(request: web.Request) -> web.WebSocketResponse:
        if request.headers.get("Authorization") != "Bearer ok":
            raise web.HTTPUnauthorized(text="no\n", headers={"X-Why": "key"})
        ws = web.WebSocketResponse(protocols=("demo.v1",))
        await ws.prepare(request)
        seen["ws_origin"] = request.headers.get("Origin")
        async for msg in ws:
            if msg.type is WSMsgType.TEXT and msg.data == "close-me":
                await ws.close(code=4005, message=b"bye")
            elif msg.type is WSMsgType.TEXT:
                await ws.send_str(f"echo:{msg.data}")
            elif msg.type is WSMsgType.BINARY:
                await ws.send_bytes(msg.data[::-1])
        seen["ws_close_code"] = ws.close_code
        seen["gone"].set()
        return ws

    async def unavailable(request: web.Request) -> web.Response:
        raise web.HTTPServiceUnavailable()

    async def cleanup(_: web.Application) -> None:
        seen["cleaned"] = True

    app.router.add_route("*", "/echo", echo)
    app.router.add_get("/chunks", chunks)
    app.router.add_get("/endless", endless)
    app.router.add_get("/ws", socket)
    app.router.add_get("/busy", unavailable)
    app.on_cleanup.append(cleanup)
    return app


# ---- HTTP -------------------------------------------------------------------------------------


async def test_get_and_post_round_trip_status_headers_and_json(bridged):
    bridge, seen = bridged
    status, headers, body = await request(bridge, "GET", "/echo", query=b"x=1&y=%20")
    assert status == 200
    assert json.loads(body) == {"method": "GET", "path_qs": "/echo?x=1&y=%20",
                                "host": "127.0.0.1:8000", "json": None}
    assert header(headers, "X-Reply") == ["yes"]
    assert len(header(headers, "Set-Cookie")) == 2  # repeated headers all come back

    sent = [HOST, (b"content-type", b"application/json"), (b"x-tenant", b"t1"),
            (b"connection", b"keep-alive, x-hop"), (b"x-hop", b"1"), (b"keep-alive", b"5")]
    status, headers, body = await request(bridge, "POST", "/echo", b'{"a": [1, 2]}', sent)
    assert status == 201 and json.loads(body)["json"] == {"a": [1, 2]}
    got = seen["headers"]
    assert got["X-Tenant"] == "t1" and got["Content-Type"] == "application/json"
    assert got["Content-Length"] == str(len(b'{"a": [1, 2]}'))
    # hop-by-hop dropped, nothing invented, and the first reply's cookies are not replayed
    for name in ("X-Hop", "Keep-Alive", "User-Agent", "Cookie"):
        assert name not in got
    assert not header(headers, "Connection") and not header(headers, "Transfer-Encoding")
    assert header(headers, "Content-Length") == [str(len(body))]


async def test_oversized_body_gets_the_apps_413_without_being_buffered(bridged):
    bridge, _ = bridged
    answered = asyncio.Event()
    pulled = 0

    async def receive() -> dict:
        # 1025 bytes (one past the limit) take 3 chunks of 512: a bridge that reads a 4th
        # before answering waits here for an answer that never comes.
        nonlocal pulled
        pulled += 1
        if pulled > 3:
            await answered.wait()
        if pulled > 200:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": b"x" * 512, "more_body": pulled < 200}

    sent: asyncio.Queue[dict] = asyncio.Queue()

    async def send(message: dict) -> None:
        answered.set()
        await sent.put(message)

    task = asyncio.create_task(bridge(http_scope("POST", "/echo"), receive, send))
    start = await asyncio.wait_for(sent.get(), TIMEOUT)
    assert start["status"] == 413
    await asyncio.wait_for(task, TIMEOUT)
    # a body exactly at the limit goes through whole
    status, _, body = await request(bridge, "POST", "/echo", b"[" + b" " * 1022 + b"]")
    assert status == 201 and json.loads(body)["json"] == []


async def test_streamed_chunks_arrive_one_by_one(bridged):
    bridge, seen = bridged
    client = Client([{"type": "http.request", "body": b"", "more_body": False}])
    task = client.run(bridge, http_scope("GET", "/chunks"))
    start = await client.next()
    assert start["status"] == 200 and header(start["headers"], "Content-Type") == ["text/event-stream"]
    first = await client.next()
    assert first == {"type": "http.response.body", "body": b"data: one\n\n", "more_body": True}
    assert client.outbox.empty() and not task.done()  # the second chunk is not written yet
    seen["release"].set()
    rest = b""
    while True:
        message = await client.next()
        rest += message["body"]
        if not message["more_body"]:
            break
    assert rest == b"data: two\n\n"
    await asyncio.wait_for(task, TIMEOUT)


async def test_client_disconnect_mid_stream_closes_the_upstream(bridged):
    bridge, seen = bridged
    client = Client([{"type": "http.request", "body": b"", "more_body": False}])
    task = client.run(bridge, http_scope("GET", "/endless"))
    assert (await client.next())["status"] == 200
    assert (await client.next())["body"].startswith(b"tick")
    client.inbox.put_nowait({"type": "http.disconnect"})
    await asyncio.wait_for(task, TIMEOUT)
    await asyncio.wait_for(seen["gone"].wait(), TIMEOUT)  # the handler saw its client leave
    assert isinstance(seen.get("gone_by"), ConnectionError)


async def test_redirects_and_errors_pass_through_unfollowed(bridged):
    bridge, _ = bridged
    status, _, _ = await request(bridge, "GET", "/busy")
    assert status == 503
    status, _, _ = await request(bridge, "GET", "/nowhere")
    assert status == 404


# ---- WebSocket --------------------------------------------------------------------------------


async def _open_ws(bridge: AiohttpBridge, **scope_options) -> tuple[Client, asyncio.Task, dict]:
    client = Client([{"type": "websocket.connect"}])
    task = client.run(bridge, ws_scope("/ws", **scope_options))
    return client, task, await client.next()


OK_HEADERS = (HOST, (b"authorization", b"Bearer ok"), (b"origin", b"http://127.0.0.1:8000"))


async def test_websocket_echo_both_ways_and_upstream_close_code(bridged):
    bridge, seen = bridged
    client, task, accept = await _open_ws(bridge, headers=OK_HEADERS, subprotocols=["demo.v1"])
    assert accept == {"type": "websocket.accept", "subprotocol": "demo.v1"}
    assert seen["ws_origin"] == "http://127.0.0.1:8000"
    client.inbox.put_nowait({"type": "websocket.receive", "text": "hi"})
    assert await client.next() == {"type": "websocket.send", "text": "echo:hi"}
    client.inbox.put_nowait({"type": "websocket.receive", "bytes": b"abc"})
    assert await client.next() == {"type": "websocket.send", "bytes": b"cba"}
    client.inbox.put_nowait({"type": "websocket.receive", "text": "close-me"})
    assert await client.next() == {"type": "websocket.close", "code": 4005, "reason": "bye"}
    await asyncio.wait_for(task, TIMEOUT)


async def test_websocket_client_disconnect_closes_the_upstream(bridged):
    bridge, seen = bridged
    client, task, accept = await _open_ws(bridge, headers=OK_HEADERS)
    assert accept["type"] == "websocket.accept" and accept["subprotocol"] is None
    client.inbox.put_nowait({"type": "websocket.disconnect", "code": 4100})
    await asyncio.wait_for(task, TIMEOUT)
    await asyncio.wait_for(seen["gone"].wait(), TIMEOUT)
    assert seen["ws_close_code"] == 4100
    assert client.outbox.empty()  # nothing is sent to a client that left


async def test_refused_websocket_handshake_is_reported_not_hung(bridged):
    bridge, _ = bridged
    _, task, closed = await _open_ws(bridge)
    assert closed["type"] == "websocket.close" and closed["code"] == 1008
    await asyncio.wait_for(task, TIMEOUT)

    client, task, start = await _open_ws(bridge, http_response=True)
    assert start["type"] == "websocket.http.response.start" and start["status"] == 401
    assert header(start["headers"], "X-Why") == ["key"]
    body = await client.next()
    assert body["type"] == "websocket.http.response.body" and not body["more_body"]
    assert header(start["headers"], "Content-Length") == [str(len(body["body"]))]
    await asyncio.wait_for(task, TIMEOUT)


# ---- lifecycle --------------------------------------------------------------------------------


async def test_lifespan_and_close_clean_up_the_socket_dir(socket_dir):
    seen: dict = {"release": asyncio.Event(), "gone": asyncio.Event(), "cleaned": False}
    bridge = AiohttpBridge(_test_app(seen), socket_dir=str(socket_dir))
    client = Client([{"type": "lifespan.startup"}])
    task = client.run(bridge, {"type": "lifespan", "asgi": {"version": "3.0"}})
    assert await client.next() == {"type": "lifespan.startup.complete"}
    path = bridge.socket_path
    assert path is not None and stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert (await request(bridge, "GET", "/echo"))[0] == 200
    client.inbox.put_nowait({"type": "lifespan.shutdown"})
    assert await client.next() == {"type": "lifespan.shutdown.complete"}
    await asyncio.wait_for(task, TIMEOUT)
    assert seen["cleaned"] and not os.path.exists(os.path.dirname(path))
    assert list(socket_dir.iterdir()) == []
    assert (await request(bridge, "GET", "/echo"))[0] == 503  # closed stays closed


# ---- the real server --------------------------------------------------------------------------

KEY = "bridge-key"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, max_num_seqs=8))


@pytest.fixture
async def server(engine, socket_dir) -> AsyncIterator[AiohttpBridge]:
    app = create_app(engine, ServerConfig(api_key=KEY, model_name="tiny", max_body_bytes=4096))
    bridge = AiohttpBridge(app, socket_dir=str(socket_dir))
    await asyncio.wait_for(bridge.start(), 60)
    try:
        yield bridge
    finally:
        await asyncio.wait_for(bridge.close(), 60)
    assert not engine.is_running


AUTH = (HOST, (b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json"))


async def test_real_server_checks_host_auth_and_body_limit(server):
    assert (await request(server, "GET", "/health", headers=[(b"host", b"10.0.0.1:8000")]))[0] == 200
    status, _, body = await request(server, "GET", "/v1/models", headers=[(b"host", b"evil.example")])
    assert status == 421 and json.loads(body)["error"]["code"] == "host_not_allowed"
    assert (await request(server, "GET", "/v1/models", headers=[HOST]))[0] == 401
    status, _, body = await request(server, "GET", "/v1/models", headers=AUTH)
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"
    big = json.dumps({"model": "tiny", "prompt": "x" * 10_000}).encode()
    status, _, body = await request(server, "POST", "/v1/completions", big, AUTH)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


async def test_real_server_streams_completions_as_server_sent_events(server):
    req = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 5, "stream": True,
           "ignore_eos": True, "temperature": 0}
    status, headers, body = await request(server, "POST", "/v1/completions",
                                          json.dumps(req).encode(), AUTH)
    assert status == 200 and header(headers, "Content-Type")[0].startswith("text/event-stream")
    events = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    assert sum(len(json.loads(e[6:])["choices"]) for e in events[:-1]) >= 5


async def test_real_server_aborts_a_stream_whose_client_left(server, engine, monkeypatch):
    slow_down_steps(monkeypatch, engine)  # 500 tokens take 10 s: only an abort ends it sooner
    req = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 500, "stream": True,
           "ignore_eos": True}
    client = Client([{"type": "http.request", "body": json.dumps(req).encode(), "more_body": False}])
    task = client.run(server, http_scope("POST", "/v1/completions", headers=AUTH))
    assert (await client.next())["status"] == 200
    assert (await client.next())["body"].startswith(b"data: {")
    assert engine.stats()["num_requests"] == 1
    client.inbox.put_nowait({"type": "http.disconnect"})
    # Well inside the 10 s the stream would take without an abort, with room for a busy machine.
    await asyncio.wait_for(task, 5)
    await asyncio.wait_for(_until_idle(engine), 5)


async def _until_idle(engine: AsyncEngine) -> None:
    while engine.stats()["num_requests"]:
        await asyncio.sleep(0.02)


async def test_real_server_websocket_stream_through_the_bridge(server):
    bearer = p.BEARER_PROTOCOL_PREFIX + KEY
    client, task, accept = await _open_ws_real(server, [p.PROTOCOL_NAME, bearer])
    assert accept == {"type": "websocket.accept", "subprotocol": p.PROTOCOL_NAME}
    assert json.loads((await client.next())["text"])["type"] == "ready"
    client.inbox.put_nowait({"type": "websocket.receive", "text": json.dumps(
        {"type": "generate", "id": "a", "prompt": "The sky is",
         "params": {"max_tokens": 3, "ignore_eos": True, "temperature": 0}})})
    while (msg := json.loads((await client.next())["text"]))["type"] != "done":
        assert msg["type"] == "delta" and msg["id"] == "a"
    assert msg["usage"]["completion_tokens"] == 3
    client.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})
    await asyncio.wait_for(task, TIMEOUT)

    _, task, closed = await _open_ws_real(server, [p.PROTOCOL_NAME, p.BEARER_PROTOCOL_PREFIX + "bad"])
    assert closed == {"type": "websocket.close", "code": 1008, "reason": "Unauthorized"}
    await asyncio.wait_for(task, TIMEOUT)


async def _open_ws_real(bridge: AiohttpBridge, subprotocols: list[str]):
    client = Client([{"type": "websocket.connect"}])
    task = client.run(bridge, ws_scope("/v1/stream", headers=[HOST], subprotocols=subprotocols))
    return client, task, await client.next()
