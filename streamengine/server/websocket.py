"""`/v1/stream`: many concurrent generations per WebSocket, multiplexed by client-chosen id.

Slow readers. Every request task pushes into the connection's `Outbox` without ever waiting,
so neither the engine nor other clients can be stalled by one socket. A single writer task
drains the outbox, and hands a message to the transport only while the transport holds less
than `WRITE_BUFFER_HIGH` unsent bytes; the kernel is told to hold at most
`streaming.KERNEL_UNSENT_BYTES` unsent (TCP_NOTSENT_LOWAT, where the OS has it). Everything else waits
in the outbox, where token deltas of the same (request, sample) merge into one pending message
(text concatenated, token ids and logprobs appended): nothing is dropped, and an aiohttp
heartbeat ping never queues behind more than those two small buffers and one message.

Memory bound. The outbox keeps an estimate of its unsent bytes (text length, 8 bytes per token
id, 24 per logprob entry, the exact encoded size of every other message, plus
`outbox.ITEM_OVERHEAD` per message); past `state.config.max_pending_bytes` (8 MiB by default) the socket's
requests are aborted, its unsent messages dropped, and it is closed with 1008 ("client too
slow"). So the output one socket holds is at most max_pending_bytes (as estimated; the Python
objects behind it take a small multiple) + the one message being written (no larger than the
estimate let it grow, give or take JSON escapes) + WRITE_BUFFER_HIGH + streaming.KERNEL_UNSENT_BYTES:
about 2 x 8 MiB + 128 KiB with the defaults. Its input is one frame of at most 4 x
max_message_bytes. The server holds at most `state.config.max_connections` (1024) authenticated
sockets, and apart from them at most `state.config.max_unauthenticated` (64) still to authenticate:
handshakes beyond either are answered 503, and a socket that authenticates by message while
the authenticated ones are at their limit is closed with 1013 (try again later). Request ids are capped at 256 characters
(protocol.MAX_ID_CHARS) and error texts at `MAX_ERROR_CHARS`, so no input is multiplied into
what a socket holds.

Security. Browser handshakes from a disallowed Origin get HTTP 403. With API keys, a client
authenticates by `Authorization: Bearer` on the handshake, by offering the subprotocol
`bearer.<key>` (next to `streamengine.v1`), or by an `auth` message first; anything else first,
a wrong key, or silence for `state.config.auth_timeout` (10 s) closes the socket with 4001. `kv_state` (the
global block map) needs an admin tenant; without keys everyone is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass

import msgspec
from aiohttp import WSCloseCode, WSMsgType, web

from streamengine.sample.sampling_params import SamplingParams
from streamengine.server import protocol as p
from streamengine.server.failures import classify
from streamengine.server.outbox import Outbox
from streamengine.server.security import Tenant
from streamengine.server.state import (
    CLIENT,
    ServerState,
    client_key,
    new_request_id,
)
from streamengine.server.streaming import SampleDelta, StepUpdate, stream_request
from streamengine.server.tools import NO_TOOLS, ToolPlan, ToolStreams, plan_tools
from streamengine.structured.tool_calls import ParsedDelta
from streamengine.tenancy.tenants import DEFAULT_TENANT

log = logging.getLogger(__name__)

MAX_LIVE_REQUESTS = 256
CLOSE_TOO_SLOW = WSCloseCode.POLICY_VIOLATION  # 1008
CLOSE_TRY_AGAIN = WSCloseCode.TRY_AGAIN_LATER  # 1013: authenticated, but no room for another socket
CLOSE_TIMEOUT_S = 10.0  # a peer that takes no close frame in this long has its transport aborted
WRITE_BUFFER_HIGH = 64 * 1024  # transport bytes above which the writer leaves messages merging
MAX_ERROR_CHARS = 512  # error texts may quote the input (a field name, a value): clip them


# ---- one connection -------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Live:
    engine_id: str
    lora: str | None = None  # params.lora: the adapter it runs under
    task: asyncio.Task | None = None
    aborted: bool = False


class Connection:
    """One WebSocket: a reader loop (this handler), a writer task, one task per request."""

    def __init__(self, state: ServerState, ws: web.WebSocketResponse, tenant: Tenant | None,
                 transport: asyncio.BaseTransport | None = None, remote: str | None = None) -> None:
        self.state = state
        self.ws = ws
        self.tenant = tenant  # None until authenticated
        self.remote = remote  # the peer's address: whose turn its jobs wait for without keys
        self.codec = p.Codec()
        self.outbox = Outbox(self._too_slow, state.config.max_pending_bytes, self.codec)
        self.live: dict[str, _Live] = {}
        self._transport = transport
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
                    break  # aiohttp already closed it (1009 above the hard size limit, 1007 bad UTF-8)
        finally:
            await self._teardown()

    async def close(self, code: int, reason: str, *, request_error: tuple[str, str] | None = None) -> None:
        """Aborts every request of this socket, then closes it (server shutdown, too slow).
        `request_error` (code, message): sent for each request aborted, after what was queued
        for it and before the close frame, so a client learns why each one ended."""
        cut = list(self.live)
        await self._cancel_requests()
        try:
            # A peer that reads nothing never takes the close frame: give up and drop it.
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                if request_error is not None and not self.outbox.overflowed:
                    for client_id in cut:
                        self._error(client_id, *request_error)
                    await self._flush()
                await self.ws.close(code=code, message=reason.encode())
        except TimeoutError:
            self._abort_transport()
        except Exception:  # noqa: BLE001 - the socket is going away either way
            log.debug("closing a WebSocket failed", exc_info=True)

    async def _flush(self) -> None:
        """Sends everything queued, in order, in place of the writer task (ended first, so the
        close frame that follows cannot overtake a message the writer still held)."""
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._writer
        while len(self.outbox):
            await self._transport_drained()
            await self.ws.send_str(await self.outbox.get())

    async def _teardown(self) -> None:
        # try/finally: when aiohttp cancels this handler (client gone, shutdown timeout) the
        # cancellation can land in the gather below; the writer must still be ended, not left
        # pending for the garbage collector.
        try:
            await self._cancel_requests()
        finally:
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
        if self._closing is not None:
            return
        log.warning("closing a WebSocket whose client does not read its messages")
        if self._writer is not None:
            self._writer.cancel()  # the outbox was dropped; only the close frame goes out now
        reason = f"client too slow: over {self.state.config.max_pending_bytes} bytes unsent"
        self._closing = asyncio.create_task(self.close(CLOSE_TOO_SLOW, reason))

    def _abort_transport(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    async def _write_loop(self) -> None:
        while True:
            await self._transport_drained()
            text = await self.outbox.get()
            try:
                await self.ws.send_str(text)
            except (ConnectionError, RuntimeError):
                return  # the reader loop sees the close and tears down

    async def _transport_drained(self) -> None:
        """Waits while the transport holds WRITE_BUFFER_HIGH bytes or more: messages not yet
        taken keep merging in the outbox instead of queueing ahead of heartbeat pings."""
        delay = 0.002
        while (transport := self._transport) is not None and not transport.is_closing():
            if transport.get_write_buffer_size() < WRITE_BUFFER_HIGH:  # type: ignore[attr-defined]
                return
            await asyncio.sleep(delay)  # polled: rare (a backed-up peer) and cheap
            delay = min(2 * delay, 0.05)

    # -- authentication

    async def _authenticate(self) -> bool:
        try:
            msg = await self.ws.receive(timeout=self.state.config.auth_timeout)
        except TimeoutError:
            await self._refuse("authentication timeout: send {\"type\": \"auth\", \"key\": ...} first")
            return False
        if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
            return False
        try:
            message = self.codec.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError, p.TooDeep):
            message = None
        if not isinstance(message, p.Auth):
            await self._refuse("authentication required: the first message must be `auth`")
            return False
        tenant = self.state.keys.lookup(message.key)
        if tenant is None:
            await self._refuse("invalid API key")
            return False
        state = self.state
        state.unauthenticated.discard(self)
        if len(state.connections) - len(state.unauthenticated) > state.config.max_connections:
            state.unauthenticated.add(self)  # uncounted again: it is closing
            await self.ws.close(code=CLOSE_TRY_AGAIN,
                                message=f"at most {state.config.max_connections} WebSocket connections".encode())
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
            max_prompt_tokens=self.state.config.max_prompt_tokens,
        )

    # -- messages

    async def _on_message(self, data: str | bytes) -> None:
        if self._closing is not None:
            return  # being closed (too slow): start no more work for it
        limit = self.state.config.max_message_bytes
        if (size := _size_over(data, limit)) is not None:
            self._error(None, p.MESSAGE_TOO_LARGE, f"message of {size} bytes exceeds the limit of {limit} bytes")
            return
        try:
            message = self.codec.decode(data)
        except p.TooDeep as exc:
            self._error(None, p.TOO_DEEP, str(exc))
            return
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
        elif isinstance(message, p.Auth):
            self._on_auth_again()

    def _on_auth_again(self) -> None:
        if self.state.keys.enabled:
            self._error(None, p.BAD_MESSAGE, "already authenticated")
        else:
            self._error(None, p.AUTH_NOT_REQUIRED, "this server has no API keys: no `auth` is needed")

    def _on_generate(self, msg: p.Generate) -> None:
        if self.state.shutting_down:
            self._error(msg.id, p.SHUTTING_DOWN, "the server is shutting down: no new requests")
            return
        if msg.id in self.live:
            self._error(msg.id, p.DUPLICATE_ID, f"request id {msg.id!r} is already streaming")
            return
        if len(self.live) >= MAX_LIVE_REQUESTS:
            self._error(msg.id, p.TOO_MANY_REQUESTS, f"at most {MAX_LIVE_REQUESTS} live requests per socket")
            return
        try:
            params, plan = self._check(msg)
            lora = self.state.lora_param(msg.params.get("lora"))
        except RecursionError:
            self._error(msg.id, p.TOO_DEEP, "params nested too deeply")
            return
        except ValueError as exc:  # LimitExceededError among them: a SamplingParams bound
            self.outbox.push(_failure(msg.id, "", exc))
            return
        live = _Live(new_request_id("ws"), lora)
        self.live[msg.id] = live
        live.task = asyncio.create_task(self._run(msg, live, params, plan), name="ws-request")

    def _check(self, msg: p.Generate) -> tuple[SamplingParams, ToolPlan]:
        if (msg.prompt is None) == (msg.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        plan = _tool_plan(msg, self.state.config.tool_parser)
        fields = dict(msg.params)
        fields.pop("lora", None)  # not a sampling parameter: ServerState.lora_param
        if fields.get("prompt_logprobs") is not None:
            raise ValueError("params.prompt_logprobs is not available on the WebSocket (its deltas carry no "
                             "prompt): use POST /v1/completions")
        if plan.structured is not None:
            if fields.get("structured") is not None:
                raise ValueError("give either params.structured or a forced tool call (tool_choice required "
                                 "or named), not both")
            fields["structured"] = plan.structured
        return SamplingParams.from_dict(fields), plan

    async def _prompt_ids(self, msg: p.Generate, plan: ToolPlan) -> list[int]:
        if msg.messages is not None:
            chat = [msgspec.to_builtins(m) for m in msg.messages]
            return await self.state.tokenize_async(self.state.chat_prompt(chat, plan.functions), chat=True)
        return await self.state.tokenize_async(msg.prompt)  # type: ignore[arg-type]

    async def _run(self, msg: p.Generate, live: _Live, params: SamplingParams, plan: ToolPlan) -> None:
        client_id = msg.id
        last: StepUpdate | None = None
        tools = ToolStreams(plan.parser) if plan.parser is not None else None
        if self.tenant is not None:  # (this task's own context: the socket's other tasks keep theirs)
            CLIENT.set(client_key(self.tenant, self.remote))
        try:
            prompt_ids = await self._prompt_ids(msg, plan)
            if not live.aborted:  # an abort may arrive before generation starts
                last = await self._pump(client_id, live, prompt_ids, params, msg.user, tools)
            self.outbox.push(_done(client_id, last, params.n, tools))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one request failing must not take the socket down
            self.outbox.push(_failure(client_id, live.engine_id, exc))
        finally:
            if self.live.get(client_id) is live:
                del self.live[client_id]

    async def _pump(
        self, client_id: str, live: _Live, prompt_ids: list[int], params: SamplingParams, user: str | None,
        tools: ToolStreams | None,
    ) -> StepUpdate | None:
        last: StepUpdate | None = None
        engine_tenant = self.tenant.engine_tenant if self.tenant else None
        updates = stream_request(
            self.state.engine, prompt_ids, params,
            request_id=live.engine_id,
            cache_salt=self.tenant.salt_for(user) if self.tenant else None,
            recorder=self.state.metrics.recorder(engine_tenant or DEFAULT_TENANT),
            timeout=self.state.config.request_timeout,
            tenant=engine_tenant,
            lora=live.lora,
        )
        async with contextlib.aclosing(updates):
            async for update in updates:
                last = update
                for delta in update.deltas:
                    if tools is not None:
                        self._push_parsed(client_id, live, delta, tools)
                    elif delta.token_ids or delta.text:
                        self.outbox.push_delta(client_id, delta, run=live.engine_id)
                if live.aborted:
                    break  # closing the stream aborts the request in the engine
        if tools is not None:  # left before a sample's last output: what its parser held back
            for index, parsed in tools.flush().items():
                self._push_tool_delta(client_id, live, SampleDelta(index, "", [], None, None), parsed)
        return last

    def _push_parsed(self, client_id: str, live: _Live, delta: SampleDelta, tools: ToolStreams) -> None:
        """A delta whose text went through the tool parser: content as text, calls apart."""
        self._push_tool_delta(client_id, live, delta, tools.feed(delta.index, delta.text,
                                                                 last=delta.finish_reason is not None))

    def _push_tool_delta(self, client_id: str, live: _Live, delta: SampleDelta, parsed: ParsedDelta) -> None:
        calls = [p.DeltaToolCall(index=c.index, id=c.id, type="function" if c.id is not None else None,
                                 function=p.DeltaFunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.calls]
        if delta.token_ids or parsed.content or calls:
            self.outbox.push_delta(client_id, dataclasses.replace(delta, text=parsed.content), calls or None,
                                   run=live.engine_id)

    async def _on_abort(self, client_id: str) -> None:
        live = self.live.get(client_id)
        if live is None:
            self._error(client_id, p.UNKNOWN_ID, "no live request with this id")
            return
        live.aborted = True
        # The engine ends the stream with finish_reason "abort" and the request task sends
        # `done` as for any other ending; the flag covers a task that has not started yet.
        await self.state.engine.abort(live.engine_id)

    def _on_kv_state(self) -> None:
        if self.tenant is None or not self.tenant.is_admin:
            self._error(None, p.FORBIDDEN, "kv_state shows every tenant's blocks: it needs an admin API key")
            return
        self.outbox.push(p.kv_state_message(self.state.engine.kv_state()), replace_key="kv_state")

    def _error(self, request_id: str | None, code: str, message: str) -> None:
        self.outbox.push(p.Error(request_id, code, _clip(message)))


def _failure(client_id: str, engine_id: str, exc: Exception) -> p.Error:
    """The structured error for a request that ended with `exc` (see protocol's codes)."""
    failure = classify(exc)
    if failure is None:  # not the request's fault nor the engine's: a bug, logged in full
        log.error("request %s failed", engine_id, exc_info=exc)
        return p.Error(client_id, p.ENGINE_ERROR, f"generation failed: {type(exc).__name__}")
    return p.Error(client_id, failure.code, _clip(failure.message), limit=failure.limit,
                   retry_after=failure.retry_after)


def _tool_plan(msg: p.Generate, parser_name: str) -> ToolPlan:
    if msg.tools is None and msg.tool_choice is None:
        return NO_TOOLS
    if msg.messages is None:
        raise ValueError("`tools` and `tool_choice` need `messages`")
    return plan_tools(msg.tools or (), msg.tool_choice, parallel=msg.parallel_tool_calls, parser_name=parser_name)


def _done(client_id: str, last: StepUpdate | None, num_samples: int, tools: ToolStreams | None = None) -> p.Done:
    """`done` with one finish reason per sample, also for a request aborted before output."""
    if last is None:
        return p.Done(client_id, "abort", p.Usage(0, 0, 0), ["abort"] * num_samples)
    # A stream that ended without a finish reason was cut short by an abort.
    reasons = [(tools.finish_reason(i, r) if tools is not None else r) or "abort"
               for i, r in enumerate(last.finish_reasons)]
    reasons += ["abort"] * (num_samples - len(reasons))
    usage = p.Usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
    return p.Done(client_id, reasons[0], usage, reasons)


def _size_over(data: str | bytes, limit: int) -> int | None:
    """The message's size in bytes when it is over `limit` (text counted in UTF-8), else None."""
    if isinstance(data, str):
        if len(data) * 4 <= limit:
            return None  # no character takes more than 4 bytes: no need to encode
        size = len(data.encode("utf-8", "surrogatepass"))
    else:
        size = len(data)
    return size if size > limit else None


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
