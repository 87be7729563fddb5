"""An ASGI front for the unchanged aiohttp server.

Ray Serve's ingress speaks ASGI, but the server (streamengine.server: Host, Origin/CORS, auth
and drain middlewares, the OpenAI routes, the WebSocket /v1/stream with its backpressure) is
an aiohttp app. Rather than keep a second copy of it, the ingress replica runs that app on a
private Unix socket and this bridge forwards every HTTP request and WebSocket to it, byte for
byte where it can: the aiohttp app still checks Host and Origin, refuses oversized bodies,
streams Server-Sent Events token by token, and sees its client leave when the ASGI client does.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import os
import shutil
import tempfile
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web
from multidict import CIMultiDict, MultiMapping
from yarl import URL

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_UPSTREAM_HOST = "asgi-bridge.invalid"
"""The URL host of upstream requests. Only the Unix socket is dialled; the client's own Host
header replaces this name, and a request without one arrives under a name no Host policy
allows (so a missing Host never passes as loopback)."""

_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
"""Headers that describe one connection (RFC 9110 7.6.1), never forwarded across the bridge."""
_RECOMPUTED = frozenset({"content-length", "expect"})
"""Request headers the upstream client writes itself for the body it really sends."""
_FRONT_OWNED = frozenset({"date", "server"})
"""Response headers the ASGI server in front writes itself; passing the app's on would
duplicate them."""
_WS_HANDSHAKE = frozenset({
    "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
    "sec-websocket-accept", "sec-websocket-protocol",
})
"""The upstream WebSocket handshake is the bridge's own (subprotocols go through protocols=)."""
_SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
"""Headers aiohttp's client would invent: the app sees only what the real client sent."""
_RESERVED_CLOSE_CODES = frozenset({1005, 1006, 1015})
"""Close codes that report a state and may not be sent in a close frame (RFC 6455 7.4.1)."""
_WS_CLOSE_TIMEOUT_S = 10.0
_DEFAULT_MAX_BODY_BYTES = 1024**2
"""aiohttp's own default client_max_size, for an app that does not say."""


class AiohttpBridge:
    """ASGI app forwarding HTTP and WebSocket traffic to an aiohttp app on a Unix socket.

    `socket_dir`: where the private directory (mode 0700) holding the socket is made (default
    the system temp dir). `max_body_bytes`: the app's request body limit (default: the app's
    own `client_max_size`); the bridge reads at most one byte more, so the app answers 413.
    Started by the ASGI lifespan, by `start()`, or by the first request; `close()` stops it
    and runs the app's shutdown and cleanup hooks.
    """

    def __init__(self, app: web.Application, *, socket_dir: str | None = None,
                 max_body_bytes: int | None = None) -> None:
        limit = max_body_bytes if max_body_bytes is not None else _app_body_limit(app)
        if limit < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {limit}")
        self._app = app
        self._socket_dir = socket_dir
        self._max_body_bytes = limit
        self._lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tmpdir: str | None = None
        self._closed = False

    @property
    def socket_path(self) -> str | None:
        """The Unix socket the app listens on, once started."""
        return os.path.join(self._tmpdir, "app.sock") if self._tmpdir is not None else None

    async def start(self) -> None:
        """Starts the app (its startup hooks run here) and the client that reaches it."""
        async with self._lock:
            if self._closed:
                raise RuntimeError("AiohttpBridge is closed")
            if self._session is None:
                await self._start()

    async def _start(self) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="streamengine-bridge-", dir=self._socket_dir)
        path = self.socket_path
        assert path is not None
        try:
            # access_log=None: the ASGI server in front already logs each request.
            self._runner = web.AppRunner(self._app, handle_signals=False, access_log=None)
            await self._runner.setup()
            await web.UnixSite(self._runner, path).start()
        except BaseException:
            await self._stop()
            raise
        self._session = _upstream_session(path)

    async def close(self) -> None:
        """Closes the client (open upstream streams end, so their handlers see the client
        leave), then the app (runner.cleanup: shutdown and cleanup hooks), then the socket."""
        async with self._lock:
            self._closed = True
            await self._stop()

    async def _stop(self) -> None:
        session, runner, tmpdir = self._session, self._runner, self._tmpdir
        self._session = self._runner = self._tmpdir = None
        try:
            if session is not None:
                await session.close()
            if runner is not None:
                await runner.cleanup()
        finally:
            if tmpdir is not None:
                shutil.rmtree(tmpdir, ignore_errors=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if kind not in ("http", "websocket"):
            raise ValueError(f"AiohttpBridge cannot serve ASGI scope type {kind!r}")
        session = await self._ready_session()
        if session is None:
            await _refuse_closed(kind, receive, send)
        elif kind == "http":
            await _forward_http(session, scope, receive, send, self._max_body_bytes)
        else:
            await _forward_websocket(session, scope, receive, send)

    async def _ready_session(self) -> aiohttp.ClientSession | None:
        """The upstream client, started on first use; None once the bridge is closed."""
        if self._session is None and not self._closed:
            await self.start()
        return self._session

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:  # the ASGI server reports it and does not serve
                    log.exception("AiohttpBridge failed to start")
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _refuse_closed(kind: str, receive: Receive, send: Send) -> None:
    if kind == "http":
        await _send_plain(send, 503, "server shutting down\n")
    elif (await receive())["type"] == "websocket.connect":
        await send({"type": "websocket.close", "code": 1001, "reason": "server shutting down"})


def _app_body_limit(app: web.Application) -> int:
    # aiohttp keeps the limit it was built with only as this attribute; no public accessor.
    return int(getattr(app, "_client_max_size", _DEFAULT_MAX_BODY_BYTES))


def _upstream_session(path: str) -> aiohttp.ClientSession:
    """One client for every forwarded request. No timeouts (a stream may be long; the app has
    its own), no connection cap (each open stream holds one), no cookie jar (cookies belong to
    each real client, never to the bridge), no redirects followed and no decompression
    (responses go back exactly as the app wrote them)."""
    return aiohttp.ClientSession(
        connector=aiohttp.UnixConnector(path=path, limit=0),
        timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_read=None, sock_connect=None),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        skip_auto_headers=_SKIP_AUTO_HEADERS,
    )


# ---- headers ----------------------------------------------------------------------------------


def _end_to_end(raw: Iterable[tuple[bytes, bytes]], drop: frozenset[str] = frozenset()
                ) -> list[tuple[str, str]]:
    """The headers that may cross a proxy: minus hop-by-hop ones, those the Connection header
    names, and `drop`."""
    pairs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]
    named = {token.strip().lower() for k, v in pairs if k.lower() == "connection"
             for token in v.split(",")}
    skip = _HOP_BY_HOP | named | drop
    return [(k, v) for k, v in pairs if k.lower() not in skip]


def _request_headers(scope: Scope, drop: frozenset[str]) -> CIMultiDict[str]:
    return CIMultiDict(_end_to_end(scope.get("headers", ()), drop))


def _upstream_url(scope: Scope, scheme: str) -> URL:
    path = scope.get("raw_path") or urllib.parse.quote(scope["path"]).encode("latin-1")
    query = scope.get("query_string", b"")
    target = path + (b"?" + query if query else b"")
    return URL(f"{scheme}://{_UPSTREAM_HOST}{target.decode('latin-1')}", encoded=True)


def _response_headers(raw: Iterable[tuple[bytes, bytes]], drop: frozenset[str] = frozenset()
                      ) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in _end_to_end(raw, drop)]


# ---- HTTP -------------------------------------------------------------------------------------


async def _forward_http(session: aiohttp.ClientSession, scope: Scope, receive: Receive,
                        send: Send, max_body_bytes: int) -> None:
    body = await _read_body(receive, max_body_bytes + 1)
    if body is None:
        return  # the client left before sending its whole request
    try:
        resp = await session.request(
            scope["method"], _upstream_url(scope, "http"), data=body or None,
            headers=_request_headers(scope, _RECOMPUTED), allow_redirects=False,
        )
    except aiohttp.ClientError as exc:
        log.warning("AiohttpBridge: upstream request failed: %r", exc)
        await _send_plain(send, 502, "the server behind the bridge did not answer\n")
        return
    try:
        await send({"type": "http.response.start", "status": resp.status,
                    "headers": _response_headers(resp.raw_headers, _FRONT_OWNED)})
        await _relay_body(resp, receive, send)
    except aiohttp.ClientError as exc:
        # The response already started: leaving it incomplete makes the ASGI server drop the
        # connection, so the client sees a truncated body rather than a clean end.
        log.warning("AiohttpBridge: upstream response broke off: %r", exc)
    finally:
        resp.close()  # a no-op once the body was read to its end; otherwise drops the stream


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, cut at `limit` bytes (one past the app's limit: the app still sees
    the body is too big and answers 413 in its own words); None if the client disconnected.
    The rest of an oversized body is left unread, never buffered."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            return b"".join(chunks)[:limit]
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _relay_body(resp: aiohttp.ClientResponse, receive: Receive, send: Send) -> None:
    """Streams the response body while watching for the client to leave; when it does, the
    body pump is cancelled and the caller closes the upstream response at once."""
    pump = asyncio.create_task(_pump_body(resp, send))
    watch = asyncio.create_task(_until_disconnect(receive))
    try:
        done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        if pump in done:
            pump.result()
    finally:
        await _cancel(pump, watch)


async def _pump_body(resp: aiohttp.ClientResponse, send: Send) -> None:
    # iter_any: each chunk as soon as it arrives, so Server-Sent Events are not held back.
    async for chunk in resp.content.iter_any():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(receive: Receive) -> None:
    # Also drains what is left of a body cut at the limit.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_plain(send: Send, status: int, text: str) -> None:
    body = text.encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
    ]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    """Cancels and awaits `tasks`, so none outlives the request that made it."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ---- WebSocket --------------------------------------------------------------------------------


async def _forward_websocket(session: aiohttp.ClientSession, scope: Scope, receive: Receive,
                             send: Send) -> None:
    if (await receive())["type"] != "websocket.connect":
        return
    try:
        ws = await session.ws_connect(
            _upstream_url(scope, "ws"),
            protocols=tuple(scope.get("subprotocols", ())),
            headers=_request_headers(scope, _RECOMPUTED | _WS_HANDSHAKE),
            # The app limits what clients send it; what it sends back is trusted and unlimited.
            max_msg_size=0,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=_WS_CLOSE_TIMEOUT_S),
        )
    except aiohttp.WSServerHandshakeError as exc:
        await _refuse_websocket(scope, send, exc.status, exc.headers)
        return
    except aiohttp.ClientError as exc:
        log.warning("AiohttpBridge: upstream WebSocket failed: %r", exc)
        await _refuse_websocket(scope, send, 502, None)
        return
    try:
        await send({"type": "websocket.accept", "subprotocol": ws.protocol})
        await _pump_websocket(ws, receive, send)
    finally:
        await ws.close()


async def _refuse_websocket(scope: Scope, send: Send, status: int,
                            headers: MultiMapping[str] | None) -> None:
    """Reports a handshake the app refused: its status where the ASGI server can send an HTTP
    response, else a close code (policy violation for auth failures)."""
    if status < 400:
        status = 502  # the app answered, but not with a WebSocket: nothing to pass on
    if "websocket.http.response" not in scope.get("extensions", {}):
        code = 1008 if status in (401, 403) else 1011
        await send({"type": "websocket.close", "code": code, "reason": _phrase(status)})
        return
    # The handshake error keeps the app's headers but not its body: the body is the phrase.
    body = f"{_phrase(status)}\n".encode()
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    kept = _response_headers(raw, _FRONT_OWNED | {"content-length", "content-type"})
    await send({"type": "websocket.http.response.start", "status": status, "headers": [
        *kept, (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]})
    await send({"type": "websocket.http.response.body", "body": body, "more_body": False})


def _phrase(status: int) -> str:
    with contextlib.suppress(ValueError):
        return http.HTTPStatus(status).phrase
    return "Error"


async def _pump_websocket(ws: aiohttp.ClientWebSocketResponse, receive: Receive,
                          send: Send) -> None:
    """Pumps both ways until either side ends, then ends the other side too."""
    upstream = asyncio.create_task(_pump_upstream(ws, send))
    client = asyncio.create_task(_pump_client(receive, ws))
    try:
        done, _ = await asyncio.wait({upstream, client}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await _cancel(upstream, client)
    if client in done and client.exception() is None:
        await ws.close(code=client.result())
        return
    code, reason = upstream.result() if upstream in done and upstream.exception() is None \
        else (1011, "")
    await ws.close()
    # The client may already be gone; nothing is left to tell it then.
    with contextlib.suppress(Exception):
        await send({"type": "websocket.close", "code": code, "reason": reason})


async def _pump_upstream(ws: aiohttp.ClientWebSocketResponse, send: Send) -> tuple[int, str]:
    """App -> client, until the app closes; returns the close code and reason to pass on."""
    while True:
        msg = await ws.receive()
        if msg.type is WSMsgType.TEXT:
            await send({"type": "websocket.send", "text": msg.data})
        elif msg.type is WSMsgType.BINARY:
            await send({"type": "websocket.send", "bytes": msg.data})
        elif msg.type is WSMsgType.CLOSE:
            return _sendable(msg.data, 1000), msg.extra or ""
        elif msg.type in (WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
            return _sendable(ws.close_code, 1011), ""


async def _pump_client(receive: Receive, ws: aiohttp.ClientWebSocketResponse) -> int:
    """Client -> app, until the client disconnects; returns the close code to pass on."""
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return _sendable(message.get("code"), 1001)
        if message["type"] != "websocket.receive":
            continue
        if message.get("text") is not None:
            await ws.send_str(message["text"])
        elif message.get("bytes") is not None:
            await ws.send_bytes(message["bytes"])


def _sendable(code: int | None, default: int) -> int:
    return code if code is not None and code not in _RESERVED_CLOSE_CODES else default
