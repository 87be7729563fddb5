"""`/v1/stream`: many concurrent generations per WebSocket, multiplexed by client-chosen id.

Slow readers. Every request task pushes into the connection's `Outbox` without ever waiting,
so neither the engine nor other clients can be stalled by one socket. A single writer task
drains the outbox. While the socket is busy, token deltas of the same (request, sample) merge
into one pending message (text concatenated, token ids appended): nothing is dropped, and the
backlog is bounded by the outputs themselves (max_tokens). Other messages (done, error,
kv_state) queue in order; more than `MAX_PENDING_CONTROL` of them unsent means the peer is
not reading at all, and the socket is closed with 1008 (policy violation, "client too slow").

Security. Browser handshakes from a disallowed Origin get HTTP 403. With API keys, a client
authenticates by `Authorization: Bearer` on the handshake, by offering the subprotocol
`bearer.<key>` (next to `streamengine.v1`), or by an `auth` message first; anything else first,
a wrong key, or silence for `AUTH_TIMEOUT_S` closes the socket with 4001.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiohttp import WSCloseCode, WSMsgType, web

from streamengine.sampling import SamplingParams
from streamengine.server import protocol as p
from streamengine.server.security import Tenant, bearer_token
from streamengine.server.state import (
    HARD_LIMIT_FACTOR,
    PromptTooLong,
    ServerState,
    get_state,
    new_request_id,
)
from streamengine.server.streaming import SampleDelta, StepUpdate, stream_request

log = logging.getLogger(__name__)

AUTH_TIMEOUT_S = 10.0
MAX_LIVE_REQUESTS = 256
MAX_PENDING_CONTROL = 1024
CLOSE_TOO_SLOW = WSCloseCode.POLICY_VIOLATION  # 1008


# ---- outbox ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _PendingDelta:
    request_id: str
    index: int
    text: list[str]
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None

    def merge(self, delta: SampleDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)

    def message(self) -> p.Delta:
        return p.Delta(self.request_id, self.index, "".join(self.text), self.token_ids, self.logprobs)


class Outbox:
    """Unsent messages of one socket, in order; deltas of one (request, sample) coalesce."""

    def __init__(self, on_overflow: Callable[[], None], max_control: int = MAX_PENDING_CONTROL) -> None:
        self._items: OrderedDict[tuple, _PendingDelta | p.ServerMessage] = OrderedDict()
        self._ready = asyncio.Event()
        self._serial = 0
        self._num_control = 0
        self._max_control = max_control
        self._on_overflow = on_overflow
        self.num_coalesced = 0  # deltas merged into an unsent one (observable by tests)

    def push_delta(self, request_id: str, delta: SampleDelta) -> None:
        key = ("delta", request_id, delta.index)
        pending = self._items.get(key)
        if pending is not None:
            pending.merge(delta)  # type: ignore[union-attr]
            self.num_coalesced += 1
            return
        logprobs = list(delta.logprobs) if delta.logprobs is not None else None
        self._items[key] = _PendingDelta(request_id, delta.index, [delta.text], list(delta.token_ids), logprobs)
        self._ready.set()

    def push(self, message: p.ServerMessage, *, replace_key: str | None = None) -> None:
        """Queue a non-delta message; with `replace_key`, a newer one replaces an unsent one."""
        if replace_key is not None and ("latest", replace_key) in self._items:
            self._items[("latest", replace_key)] = message
            return
        if self._num_control >= self._max_control:
            self._on_overflow()
            return
        self._serial += 1
        key = ("latest", replace_key) if replace_key is not None else ("msg", self._serial)
        self._items[key] = message
        self._num_control += 1
        self._ready.set()

    async def get(self) -> p.ServerMessage:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        key, item = self._items.popitem(last=False)
        if isinstance(item, _PendingDelta):
            return item.message()
        self._num_control -= 1
        return item

    def __len__(self) -> int:
        return len(self._items)


# ---- one connection -------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Live:
    engine_id: str
    task: asyncio.Task | None = None
    aborted: bool = False


class Connection:
    """One WebSocket: a reader loop (this handler), a writer task, one task per request."""

    def __init__(self, state: ServerState, ws: web.WebSocketResponse, tenant: Tenant | None) -> None:
        self.state = state
        self.ws = ws
        self.tenant = tenant  # None until authenticated
        self.codec = p.Codec()
        self.outbox = Outbox(self._too_slow)
        self.live: dict[str, _Live] = {}
        self._writer: asyncio.Task | None = None
        self._closing: asyncio.Task | None = None

    # -- lifecycle

    async def serve(self) -> None:
        self._writer = asyncio.create_task(self._write_loop(), name="ws-writer")
        try:
            if self.tenant is None and not await self._authenticate():
                return
            self.outbox.push(self._ready_message())
            async for msg in self.ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await self._on_message(msg.data)
                elif msg.type is WSMsgType.ERROR:
                    break  # aiohttp already closed it (e.g. 1009 above the hard size limit)
        finally:
            await self._teardown()

    async def close(self, code: int, reason: str) -> None:
        """Aborts every request of this socket, then closes it (used on server shutdown)."""
        await self._cancel_requests()
        with contextlib.suppress(Exception):
            await self.ws.close(code=code, message=reason.encode())

    async def _teardown(self) -> None:
        await self._cancel_requests()
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._writer
        if self._closing is not None:
            with contextlib.suppress(Exception):
                await self._closing

    async def _cancel_requests(self) -> None:
        # Cancelling a request task closes its engine stream, which aborts the request and
        # frees its blocks; gather waits until that has happened.
        tasks = [live.task for live in self.live.values() if live.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.live.clear()

    def _too_slow(self) -> None:
        if self._closing is None:
            log.warning("closing a WebSocket whose client does not read its messages")
            self._closing = asyncio.create_task(
                self.close(CLOSE_TOO_SLOW, "client too slow: send queue full")
            )

    async def _write_loop(self) -> None:
        while True:
            message = await self.outbox.get()
            try:
                await self.ws.send_str(self.codec.encode(message))
            except (ConnectionError, RuntimeError):
                return  # the reader loop sees the close and tears down

    # -- authentication

    async def _authenticate(self) -> bool:
        try:
            msg = await self.ws.receive(timeout=AUTH_TIMEOUT_S)
        except TimeoutError:
            await self._refuse("authentication timeout: send {\"type\": \"auth\", \"key\": ...} first")
            return False
        if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
            return False
        try:
            message = self.codec.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            message = None
        if not isinstance(message, p.Auth):
            await self._refuse("authentication required: the first message must be `auth`")
            return False
        tenant = self.state.keys.lookup(message.key)
        if tenant is None:
            await self._refuse("invalid API key")
            return False
        self.tenant = tenant
        return True

    async def _refuse(self, reason: str) -> None:
        await self.ws.close(code=p.CLOSE_UNAUTHORIZED, message=reason.encode())

    def _ready_message(self) -> p.Ready:
        stats = self.state.engine.stats()
        return p.Ready(
            model=self.state.model_name,
            block_size=int(stats.get("block_size", 0)),
            max_prompt_tokens=self.state.max_prompt_tokens,
        )

    # -- messages

    async def _on_message(self, data: str | bytes) -> None:
        if len(data) > self.state.max_message_bytes:
            self._error(
                None, p.MESSAGE_TOO_LARGE,
                f"message of {len(data)} bytes exceeds the limit of {self.state.max_message_bytes}",
            )
            return
        try:
            message = self.codec.decode(data)
        except msgspec.ValidationError as exc:  # a subclass of DecodeError: test it first
            self._error(self.codec.probe_id(data), p.BAD_MESSAGE, f"invalid message: {exc}")
            return
        except msgspec.DecodeError as exc:
            self._error(None, p.BAD_JSON, f"invalid JSON: {exc}")
            return
        if isinstance(message, p.Generate):
            self._on_generate(message)
        elif isinstance(message, p.Abort):
            await self._on_abort(message.id)
        elif isinstance(message, p.KvStateRequest):
            self._on_kv_state()
        elif isinstance(message, p.Auth) and self.state.keys.enabled:
            self._error(None, p.BAD_MESSAGE, "already authenticated")

    def _on_generate(self, msg: p.Generate) -> None:
        if msg.id in self.live:
            self._error(msg.id, p.DUPLICATE_ID, f"request id {msg.id!r} is already streaming")
            return
        if len(self.live) >= MAX_LIVE_REQUESTS:
            self._error(msg.id, p.TOO_MANY_REQUESTS, f"at most {MAX_LIVE_REQUESTS} live requests per socket")
            return
        try:
            params = self._check(msg)
        except ValueError as exc:
            self._error(msg.id, p.BAD_PARAMS, str(exc))
            return
        live = _Live(new_request_id("ws"))
        self.live[msg.id] = live
        live.task = asyncio.create_task(self._run(msg, live, params), name=f"ws-req-{msg.id}")

    @staticmethod
    def _check(msg: p.Generate) -> SamplingParams:
        if (msg.prompt is None) == (msg.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return SamplingParams.from_dict(msg.params)

    async def _prompt_ids(self, msg: p.Generate) -> list[int]:
        if msg.messages is not None:
            chat = [{"role": m.role, "content": m.content} for m in msg.messages]
            return await self.state.tokenize_async(self.state.chat_prompt(chat))
        return await self.state.tokenize_async(msg.prompt)  # type: ignore[arg-type]

    async def _run(self, msg: p.Generate, live: _Live, params: SamplingParams) -> None:
        client_id = msg.id
        last: StepUpdate | None = None
        try:
            prompt_ids = await self._prompt_ids(msg)
            if not live.aborted:  # an abort may arrive before generation starts
                last = await self._pump(client_id, live, prompt_ids, params)
            self.outbox.push(_done(client_id, last))
        except PromptTooLong as exc:
            self._error(client_id, p.PROMPT_TOO_LONG, str(exc))
        except ValueError as exc:  # tokenization or the engine's own checks (context length)
            self._error(client_id, p.BAD_PARAMS, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one request failing must not take the socket down
            log.exception("request %s failed", live.engine_id)
            self._error(client_id, p.ENGINE_ERROR, f"generation failed: {type(exc).__name__}")
        finally:
            if self.live.get(client_id) is live:
                del self.live[client_id]

    async def _pump(
        self, client_id: str, live: _Live, prompt_ids: list[int], params: SamplingParams
    ) -> StepUpdate | None:
        last: StepUpdate | None = None
        updates = stream_request(
            self.state.engine, prompt_ids, params,
            request_id=live.engine_id,
            cache_salt=self.tenant.cache_salt if self.tenant else None,
            recorder=self.state.metrics.recorder(),
        )
        async with contextlib.aclosing(updates):
            async for update in updates:
                last = update
                for delta in update.deltas:
                    if delta.token_ids or delta.text:
                        self.outbox.push_delta(client_id, delta)
                if live.aborted:
                    break  # closing the stream aborts the request in the engine
        return last

    async def _on_abort(self, client_id: str) -> None:
        live = self.live.get(client_id)
        if live is None:
            self._error(client_id, p.UNKNOWN_ID, f"no live request with id {client_id!r}")
            return
        live.aborted = True
        # The engine ends the stream with finish_reason "abort" and the request task sends
        # `done` as for any other ending; the flag covers a task that has not started yet.
        await self.state.engine.abort(live.engine_id)

    def _on_kv_state(self) -> None:
        kv_state = getattr(self.state.engine, "kv_state", None)
        if kv_state is None:
            self._error(None, p.BAD_MESSAGE, "this engine does not expose its KV-cache state")
            return
        self.outbox.push(p.kv_state_message(kv_state()), replace_key="kv_state")

    def _error(self, request_id: str | None, code: str, message: str) -> None:
        self.outbox.push(p.Error(request_id, code, message))


def _done(client_id: str, last: StepUpdate | None) -> p.Done:
    if last is None:
        return p.Done(client_id, "abort", p.Usage(0, 0, 0), ["abort"])
    # A stream that ended without a finish reason was cut short by an abort.
    reasons = [r or "abort" for r in last.finish_reasons] or ["abort"]
    usage = p.Usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
    return p.Done(client_id, reasons[0], usage, reasons)


# ---- the route ------------------------------------------------------------------------------


async def stream_handler(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    if not state.origins.allows(request.headers.get("Origin"), request.headers.get("Host")):
        raise web.HTTPForbidden(text="WebSocket origin not allowed (see --allowed-origin)\n")
    if state.shutting_down:
        raise web.HTTPServiceUnavailable(text="server shutting down\n")
    tenant, offered_key = _handshake_tenant(state, request)
    if offered_key and tenant is None:
        raise web.HTTPUnauthorized(text="invalid API key\n")
    ws = web.WebSocketResponse(
        protocols=(p.PROTOCOL_NAME,),
        max_msg_size=state.max_message_bytes * HARD_LIMIT_FACTOR,
        heartbeat=30.0,
    )
    await ws.prepare(request)
    conn = Connection(state, ws, tenant)
    state.connections.add(conn)
    try:
        await conn.serve()
    finally:
        state.connections.discard(conn)
    return ws


def _handshake_tenant(state: ServerState, request: web.Request) -> tuple[Tenant | None, bool]:
    """The tenant proven by the handshake itself, and whether a key was offered there."""
    if not state.keys.enabled:
        return state.keys.lookup(None), False
    key = _key_from_handshake(request)
    if key is None:
        return None, False
    return state.keys.lookup(key), True


def _key_from_handshake(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization")
    if auth:
        return bearer_token(auth) or ""
    for proto in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        proto = proto.strip()
        if proto.startswith(p.BEARER_PROTOCOL_PREFIX):
            return proto[len(p.BEARER_PROTOCOL_PREFIX) :]
    return None

