"""The aiohttp handlers: decode the body (endpoints.py), run it, answer whole or streamed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgspec
from aiohttp import web

from streamengine.server.failures import classify
from streamengine.server.openai.endpoints import CHAT_COMPLETIONS, COMPLETIONS, Endpoint, Job
from streamengine.server.openai.errors import OpenAIError, failure_error
from streamengine.server.openai.format import CollectedChoice, ResponseFormat
from streamengine.server.state import TENANT_KEY, ServerState, get_state, new_request_id
from streamengine.server.streaming import StepUpdate, stream_request
from streamengine.server.websocket import limit_kernel_unsent
from streamengine.tenants import DEFAULT_TENANT

log = logging.getLogger(__name__)

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _Runner:
    """Runs one job against the engine; owns the engine request id for shutdown aborts."""

    def __init__(self, state: ServerState, request: web.Request, job: Job) -> None:
        self.state, self.request, self.job = state, request, job
        self.engine_id = new_request_id("http")
        caller = request.get(TENANT_KEY)
        engine_tenant = caller.engine_tenant if caller is not None else None
        self.updates = stream_request(
            state.engine, job.prompt_ids, job.params,
            request_id=self.engine_id,
            cache_salt=caller.salt_for(job.user) if caller is not None else None,
            recorder=state.metrics.recorder(engine_tenant or DEFAULT_TENANT),
            timeout=state.request_timeout,
            tenant=engine_tenant,
        )
        self.format = ResponseFormat(job, state.model_name, self._token_text)

    def client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    def _token_text(self, token_id: int) -> str:
        return self.state.engine.tokenizer.decode([token_id])

    async def first(self) -> StepUpdate:
        """The first output; the engine's refusals (validation, limits, overload) surface here."""
        try:
            return await _mapped(anext(self.updates))
        except StopAsyncIteration:
            raise OpenAIError(503, "the request ended before producing output (server shutting down?)",
                              type_="server_error") from None

    async def all(self, first: StepUpdate) -> AsyncIterator[StepUpdate]:
        """Every update, the first one included; the engine's failures come as OpenAIError."""
        yield first
        if first.finished:
            return
        while True:
            try:
                update = await _mapped(anext(self.updates))
            except StopAsyncIteration:
                return
            yield update


async def _mapped(step: Awaitable[StepUpdate]) -> StepUpdate:
    """Awaits one step of the stream, turning the engine's exceptions into OpenAIError."""
    try:
        return await step
    except Exception as exc:
        failure = classify(exc)
        if failure is None:
            raise
        raise failure_error(failure) from None


async def _run(state: ServerState, request: web.Request, job: Job) -> web.StreamResponse:
    runner = _Runner(state, request, job)
    state.http_requests[runner.engine_id] = runner.client_gone  # watched by watch_http_clients
    try:
        async with contextlib.aclosing(runner.updates):
            first = await runner.first()
            if job.stream:
                return await _stream(runner, first)
            return await _collect(runner, first)
    finally:
        state.http_requests.pop(runner.engine_id, None)


async def _collect(runner: _Runner, first: StepUpdate) -> web.Response:
    choices: dict[int, CollectedChoice] = {}
    last = first
    async for update in runner.all(first):
        last = update
        for delta in update.deltas:
            choices.setdefault(delta.index, CollectedChoice()).add(delta)
        if runner.client_gone():
            break  # leaving the loop aborts the request in the engine
    # Built and encoded in a worker thread: a body of n=128 samples with 20 top logprobs per
    # token takes long enough to stall every other stream and probe if the loop built it.
    body = await asyncio.to_thread(_encoded_completion, runner.format, choices, last)
    return web.Response(body=body, content_type="application/json")


def _encoded_completion(format_: ResponseFormat, choices: dict[int, CollectedChoice], last: StepUpdate) -> bytes:
    return msgspec.json.encode(format_.completion(choices, last))


class _ReaderStalled(Exception):
    """The client took none of a chunk within the server's write timeout."""


async def _stream(runner: _Runner, first: StepUpdate) -> web.StreamResponse:
    response = web.StreamResponse(headers=_SSE_HEADERS)
    encoder = msgspec.json.Encoder()
    write_timeout = runner.state.write_timeout

    async def send(payload: msgspec.Struct | dict | str) -> None:
        data = payload.encode() if isinstance(payload, str) else encoder.encode(payload)
        # write() waits only while the transport's buffer is full: a reader that stalls makes it
        # wait for good, while the engine goes on computing its tokens.
        try:
            async with asyncio.timeout(write_timeout):
                await response.write(b"data: " + data + b"\n\n")
        except TimeoutError:
            raise _ReaderStalled from None

    try:
        # Inside the try: a client that left before the first output fails the headers' write.
        await response.prepare(runner.request)
        limit_kernel_unsent(runner.request.transport)  # so a stalled reader makes writes wait
        for chunk in runner.format.opening_chunks():
            await send(chunk)
        last = first
        async for update in runner.all(first):
            last = update
            if (chunk := runner.format.update_chunk(update)) is not None:
                await send(chunk)
        if runner.job.include_usage:
            await send(runner.format.usage_chunk(last))
        await send("[DONE]")
        await response.write_eof()
    except ConnectionError:
        pass  # the client left; returning closes the engine stream, which aborts the request
    except _ReaderStalled:
        log.warning("dropping streamed request %s: its client took nothing for %g s (write timeout)",
                    runner.engine_id, write_timeout)
        if (transport := runner.request.transport) is not None:
            transport.abort()  # its unsent bytes are dropped; returning aborts the request
    except Exception as exc:  # headers are sent: report in-band, as OpenAI's streams do
        if not isinstance(exc, OpenAIError):
            log.exception("streaming request %s failed", runner.engine_id)
            exc = OpenAIError(500, f"generation failed: {type(exc).__name__}", type_="server_error")
        with contextlib.suppress(ConnectionError, _ReaderStalled):
            await send(exc.body())
            await send("[DONE]")
    return response


# ---- routes -------------------------------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    state = get_state(request)
    stats = state.engine.stats()
    model = {
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "streamengine",
        "max_model_len": stats.get("max_model_len"),
    }
    return web.json_response({"object": "list", "data": [model]})


async def _serve(request: web.Request, endpoint: Endpoint[Any]) -> web.StreamResponse:
    state = get_state(request)
    job = await endpoint.job(state, await request.read())
    return await _run(state, request, job)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, CHAT_COMPLETIONS)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
