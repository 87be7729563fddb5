"""The aiohttp handlers: decode the body (endpoints.py), run it, answer whole or streamed."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from streamengine import __version__
from streamengine.server.failures import classify
from streamengine.server.openai.batch import first_outputs, merged
from streamengine.server.openai.endpoints import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    Endpoint,
    Job,
    model_not_found,
)
from streamengine.server.openai.errors import OpenAIError, failure_error
from streamengine.server.openai.format import CollectedChoice, ResponseFormat, prompt_only
from streamengine.server.openai.lora import load_lora_adapter, unload_lora_adapter
from streamengine.server.openai.tokenize import detokenize, tokenize
from streamengine.server.state import TENANT_KEY, ServerState, get_state, new_request_id
from streamengine.server.streaming import StepUpdate, limit_kernel_unsent, stream_request
from streamengine.tenancy.tenants import DEFAULT_TENANT

log = logging.getLogger(__name__)

T = TypeVar("T")

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _Runner:
    """Runs one job against the engine: one engine request per prompt, side by side (batch.py);
    owns their engine request ids for shutdown aborts."""

    def __init__(self, state: ServerState, request: web.Request, job: Job) -> None:
        self.state, self.request, self.job = state, request, job
        self.engine_ids = [new_request_id("http") for _ in job.prompts]
        caller = request.get(TENANT_KEY)
        engine_tenant = caller.engine_tenant if caller is not None else None
        salt = cache_salt(caller.salt_for(job.user) if caller is not None else None, job.cache_salt)
        self.streams = [
            stream_request(
                state.engine, prompt.ids, job.params,
                request_id=engine_id,
                cache_salt=salt,
                recorder=state.metrics.recorder(engine_tenant or DEFAULT_TENANT),
                timeout=state.config.request_timeout,
                tenant=engine_tenant,
                lora=job.lora,
            )
            for prompt, engine_id in zip(job.prompts, self.engine_ids, strict=True)
        ]
        token_text = _token_id_text if job.tokens_as_ids else self._token_text
        self.format = ResponseFormat(job, job.lora or state.model_name, token_text)  # the name requested

    @property
    def engine_id(self) -> str:
        """The engine request ids, for logs."""
        return ", ".join(self.engine_ids)

    def client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    def _token_text(self, token_id: int) -> str:
        return self.state.engine.tokenizer.decode([token_id])

    async def first(self) -> list[StepUpdate]:
        """Every prompt's first output; the engine's refusals (validation, limits, overload)
        surface here, for any prompt, before a byte is sent."""
        try:
            return await _mapped(first_outputs(self.streams))
        except StopAsyncIteration:
            raise OpenAIError(503, "the request ended before producing output (server shutting down?)",
                              type_="server_error") from None

    async def all(self, firsts: list[StepUpdate]) -> AsyncIterator[tuple[int, StepUpdate]]:
        """Every update, the first ones included, as (prompt index, update); the engine's
        failures come as OpenAIError."""
        async with contextlib.aclosing(merged(self.streams, firsts)) as updates:
            while True:
                try:
                    prompt, update = await _mapped(anext(updates))
                except StopAsyncIteration:
                    return
                if self.job.echo_only:
                    update = prompt_only(update)
                self.format.observe(prompt, update)
                yield prompt, update


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"  # vLLM's return_tokens_as_token_ids


def cache_salt(salt: str | None, requested: str | None) -> str | None:
    """The request's prefix-cache salt: the key's (or its user's), with vLLM's `cache_salt`
    mixed in, so requests share blocks only when both agree."""
    if requested is None:
        return salt
    return hashlib.sha256(f"{salt or ''}\0{requested}".encode()).hexdigest()


async def _mapped(step: Awaitable[T]) -> T:
    """Awaits one step of the streams, turning the engine's exceptions into OpenAIError."""
    try:
        return await step
    except Exception as exc:
        failure = classify(exc)
        if failure is None:
            raise
        raise failure_error(failure) from None


async def _run(state: ServerState, request: web.Request, job: Job) -> web.StreamResponse:
    runner = _Runner(state, request, job)
    for engine_id in runner.engine_ids:  # watched by watch_http_clients
        state.http_requests[engine_id] = runner.client_gone
    try:
        async with contextlib.AsyncExitStack() as streams:
            for stream in runner.streams:
                streams.push_async_callback(stream.aclose)
            firsts = await runner.first()
            if job.stream:
                return await _stream(runner, firsts)
            return await _collect(runner, firsts)
    finally:
        for engine_id in runner.engine_ids:
            state.http_requests.pop(engine_id, None)


async def _collect(runner: _Runner, firsts: list[StepUpdate]) -> web.Response:
    choices: dict[int, CollectedChoice] = {}
    async for prompt, update in runner.all(firsts):
        for delta in update.deltas:
            choices.setdefault(runner.format.choice_index(prompt, delta.index), CollectedChoice()).add(delta)
        if runner.client_gone():
            break  # leaving the loop aborts the requests in the engine
    # Built and encoded in a worker thread: a body of n=128 samples with 20 top logprobs per
    # token takes long enough to stall every other stream and probe if the loop built it.
    body = await asyncio.to_thread(_encoded_completion, runner.format, choices)
    return web.Response(body=body, content_type="application/json")


def _encoded_completion(format_: ResponseFormat, choices: dict[int, CollectedChoice]) -> bytes:
    return msgspec.json.encode(format_.completion(choices))


class _ReaderStalled(Exception):
    """The client took none of a chunk within the server's write timeout."""


async def _stream(runner: _Runner, firsts: list[StepUpdate]) -> web.StreamResponse:
    response = web.StreamResponse(headers=_SSE_HEADERS)
    encoder = msgspec.json.Encoder()
    write_timeout = runner.state.config.write_timeout

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
        async for prompt, update in runner.all(firsts):
            if (chunk := runner.format.update_chunk(prompt, update)) is not None:
                await send(chunk)
        if runner.job.include_usage:
            await send(runner.format.usage_chunk())
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


def _model_card(state: ServerState, name: str, root: str, parent: str | None) -> dict[str, Any]:
    return {
        "id": name, "object": "model", "created": state.created, "owned_by": "streamengine", "root": root,
        "parent": parent, "max_model_len": state.engine.stats().get("max_model_len"),
    }


def _model_cards(state: ServerState) -> dict[str, dict[str, Any]]:
    """The base model's card, then each LoRA adapter's (its parent the base model, its root its folder)."""
    cards = {state.model_name: _model_card(state, state.model_name, state.engine.model_name, None)}
    for name, path in sorted(state.lora_adapters().items()):
        cards.setdefault(name, _model_card(state, name, path, state.model_name))
    return cards


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": list(_model_cards(get_state(request)).values())})


async def retrieve_model(request: web.Request) -> web.Response:
    """`GET /v1/models/{id}` (`client.models.retrieve`), the base model or an adapter; 404
    model_not_found for another id."""
    state = get_state(request)
    model = request.match_info["model"]
    card = _model_cards(state).get(model)
    if card is None:
        raise model_not_found(state, model)
    return web.json_response(card)


async def version(_: web.Request) -> web.Response:
    """`GET /version`, as vLLM's: the server's version."""
    return web.json_response({"version": __version__})


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
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)  # ids may hold a slash (org/name)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/version", version)
