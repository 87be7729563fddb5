"""OpenAI-compatible HTTP: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Request bodies are decoded with msgspec (unknown fields ignored, as OpenAI clients send many),
mapped onto the engine's SamplingParams, and streamed as server-sent events ending with
`data: [DONE]` when `stream` is true. Streaming responses start once the first output exists,
so a request the engine refuses still gets a plain status: 400 for bad params, a context too
long or an engine limit (`param` names the limit, code `limit_exceeded`), 429 with Retry-After
when the engine's queue is full, 500 with the engine's message when it fails the request, 504
past the server's request timeout. After the first chunk, a failure is reported in-band (an
`{"error": ...}` event, then `data: [DONE]`). A client that goes away mid-request has its
request aborted at the next engine step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from streamengine.errors import EngineError, EngineOverloadedError, LimitExceededError
from streamengine.sampling import SamplingParams
from streamengine.server.state import (
    TENANT_KEY,
    PromptTooLong,
    ServerState,
    get_state,
    new_request_id,
)
from streamengine.server.streaming import RequestTimeoutError, StepUpdate, stream_request

log = logging.getLogger(__name__)

# ---- errors -------------------------------------------------------------------------------


class OpenAIError(Exception):
    """Answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> web.Response:
        return error_response(self.status, self.message, type_=self.type, param=self.param, code=self.code,
                              headers=self.headers)

    def body(self) -> dict:
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    body = error_body(message, type_=type_, param=param, code=code)
    return web.json_response(body, status=status, headers=headers)


_STATUS_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
    429: "rate_limit_error", 503: "server_error",
}


def _engine_failure(exc: Exception) -> OpenAIError | None:
    """The OpenAI error for an exception out of the engine's stream; None if not the engine's."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, PromptTooLong):
        return OpenAIError(400, message, param="prompt", code="context_length_exceeded")
    if isinstance(exc, LimitExceededError):
        return OpenAIError(400, message, param=exc.limit, code="limit_exceeded")
    if isinstance(exc, ValueError):
        return OpenAIError(400, message, code="context_length_exceeded" if "context length" in message else None)
    if isinstance(exc, EngineOverloadedError):
        retry_after = str(max(1, math.ceil(exc.retry_after)))  # Retry-After takes whole seconds
        return OpenAIError(429, message, type_="rate_limit_error", code="overloaded",
                           headers={"Retry-After": retry_after})
    if isinstance(exc, RequestTimeoutError):
        return OpenAIError(504, message, type_="server_error", code="timeout")
    if isinstance(exc, EngineError):
        return OpenAIError(500, message, type_="server_error", code="engine_error")
    return None


def http_exception_response(exc: web.HTTPException) -> web.Response:
    """Any aiohttp HTTP error (404 route, 405, 413 body too large) in OpenAI's error shape."""
    code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(exc.status)
    message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
    return error_response(exc.status, message.strip(), type_=_STATUS_TYPES.get(exc.status, "server_error"),
                          code=code, headers={k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")})


_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def _validation_error(exc: msgspec.ValidationError | ValueError) -> OpenAIError:
    message = str(exc)
    param = None
    if match := _AT_PATH.search(message):
        param = match.group(1) or None
        message = message[: match.start()]
    elif match := re.match(r"SamplingParams\.(\w+)", message):
        param = match.group(1)
    return OpenAIError(400, message, param=param)


# ---- request bodies -------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM's extensions, accepted under the same names
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a list holding one of those
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


_PASSTHROUGH = (
    "n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k",
    "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output",
)


def _sampling_params(body: _Common, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    fields: dict[str, Any] = {name: getattr(body, name) for name in _PASSTHROUGH if getattr(body, name) is not None}
    fields["max_tokens"] = max_tokens
    fields["logprobs"] = logprobs
    if body.stop is not None:
        fields["stop"] = body.stop
    try:
        return SamplingParams.from_dict(fields)
    except LimitExceededError as exc:
        raise OpenAIError(400, str(exc), param=exc.limit, code="limit_exceeded") from None
    except ValueError as exc:
        raise _validation_error(exc) from None


def _decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    if not body:
        raise OpenAIError(400, "request body must be a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"invalid JSON body: {exc}") from None
    except RecursionError:  # msgspec's, even inside fields it skips
        raise OpenAIError(400, "invalid JSON body: nested too deeply", code="too_deep") from None


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{state.model_name}`.",
                          param="model", code="model_not_found")


def _message_text(message: ChatMessage, i: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise OpenAIError(400, f"only text content parts are supported, got {part.type!r}",
                              param=f"messages[{i}].content")
        texts.append(part.text)
    return "".join(texts)


# ---- one generation, collected or streamed -----------------------------------------------------


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class _Job:
    """A prepared request: everything the route decided before talking to the engine."""

    kind: str  # "chat" | "completion"
    response_id: str
    created: int
    prompt_ids: list[int]
    params: SamplingParams
    top_logprobs: int | None  # how many alternatives to report; None = no logprobs
    stream: bool
    include_usage: bool


def _usage(update: StepUpdate | None) -> dict:
    prompt, completion, cached = (
        (update.prompt_tokens, update.completion_tokens, update.cached_tokens) if update else (0, 0, 0)
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class _Runner:
    """Runs one job against the engine; owns the engine request id for shutdown aborts."""

    def __init__(self, state: ServerState, request: web.Request, job: _Job) -> None:
        self.state, self.request, self.job = state, request, job
        self.engine_id = new_request_id("http")
        tenant = request.get(TENANT_KEY)
        self.updates = stream_request(
            state.engine, job.prompt_ids, job.params,
            request_id=self.engine_id,
            cache_salt=tenant.cache_salt if tenant is not None else None,
            recorder=state.metrics.recorder(),
            timeout=state.request_timeout,
        )

    def client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    def token_text(self, token_id: int) -> str:
        return self.state.engine.tokenizer.decode([token_id])

    def logprob_entries(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """(token, its logprob, top alternatives sorted best first) per position."""
        k = self.job.top_logprobs or 0
        out = []
        for token, entry in zip(token_ids, logprobs, strict=False):
            top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]
            out.append((token, entry.get(token, float("-inf")), top))
        return out


async def _first_update(runner: _Runner) -> StepUpdate:
    """The first output; the engine's refusals (validation, limits, overload) surface here."""
    try:
        return await _mapped(anext(runner.updates))
    except StopAsyncIteration:
        raise OpenAIError(503, "the request ended before producing output (server shutting down?)",
                          type_="server_error") from None


async def _mapped(step: Any) -> StepUpdate:
    """Awaits one step of the stream, turning the engine's exceptions into OpenAIError."""
    try:
        return await step
    except Exception as exc:
        failure = _engine_failure(exc)
        if failure is None:
            raise
        raise failure from None


async def _updates(runner: _Runner, first: StepUpdate) -> AsyncIterator[StepUpdate]:
    """Every update, the first one included; the engine's failures come as OpenAIError."""
    yield first
    if first.finished:
        return
    while True:
        try:
            update = await _mapped(anext(runner.updates))
        except StopAsyncIteration:
            return
        yield update


async def run_job(state: ServerState, request: web.Request, job: _Job) -> web.StreamResponse:
    runner = _Runner(state, request, job)
    state.http_requests.add(runner.engine_id)
    try:
        async with contextlib.aclosing(runner.updates):
            first = await _first_update(runner)
            if job.stream:
                return await _stream(runner, first)
            return await _collect(runner, first)
    finally:
        state.http_requests.discard(runner.engine_id)


async def _collect(runner: _Runner, first: StepUpdate) -> web.Response:
    job = runner.job
    choices: dict[int, _Choice] = {}
    last = first
    async for update in _updates(runner, first):
        last = update
        for delta in update.deltas:
            choice = choices.setdefault(delta.index, _Choice())
            choice.text.append(delta.text)
            choice.token_ids.extend(delta.token_ids)
            if delta.logprobs:
                choice.logprobs.extend(delta.logprobs)
            choice.finish_reason = delta.finish_reason or choice.finish_reason
        if runner.client_gone():
            break  # leaving the loop aborts the request in the engine
    body = {
        "id": job.response_id,
        "object": "chat.completion" if job.kind == "chat" else "text_completion",
        "created": job.created,
        "model": runner.state.model_name,
        "choices": [_full_choice(runner, i, choices.get(i, _Choice())) for i in range(job.params.n)],
        "usage": _usage(last),
    }
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


def _full_choice(runner: _Runner, index: int, choice: _Choice) -> dict:
    text = "".join(choice.text)
    logprobs = _logprobs_block(runner, choice.token_ids, choice.logprobs, 0) if runner.job.top_logprobs is not None else None
    if runner.job.kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": choice.finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}


def _logprobs_block(runner: _Runner, token_ids: list[int], logprobs: list[dict[int, float]], offset: int) -> dict:
    entries = runner.logprob_entries(token_ids, logprobs)
    if runner.job.kind == "chat":
        return {"content": [
            {
                "token": (text := runner.token_text(token)),
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t := runner.token_text(alt)), "logprob": alt_lp, "bytes": list(t.encode())}
                    for alt, alt_lp in top
                ],
            }
            for token, lp, top in entries
        ]}
    tokens = [runner.token_text(token) for token, _, _ in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{runner.token_text(alt): alt_lp for alt, alt_lp in top} for _, _, top in entries],
        "text_offset": offsets,
    }


async def _stream(runner: _Runner, first: StepUpdate) -> web.StreamResponse:
    job, request = runner.job, runner.request
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
    })
    await response.prepare(request)
    encoder = msgspec.json.Encoder()
    offsets: dict[int, int] = {}

    async def send(payload: dict | str) -> None:
        data = payload.encode() if isinstance(payload, str) else encoder.encode(payload)
        await response.write(b"data: " + data + b"\n\n")

    try:
        if job.kind == "chat":
            for i in range(job.params.n):  # OpenAI opens each choice with the role
                await send(_chunk(runner, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]))
        last = first
        async for update in _updates(runner, first):
            last = update
            choices = [_delta_choice(runner, d, offsets) for d in update.deltas]
            if choices:
                await send(_chunk(runner, choices))
        if job.include_usage:
            await send(_chunk(runner, [], usage=_usage(last)))
        await send("[DONE]")
        await response.write_eof()
    except ConnectionError:
        pass  # the client left; returning closes the engine stream, which aborts the request
    except Exception as exc:  # headers are sent: report in-band, as OpenAI's streams do
        if not isinstance(exc, OpenAIError):
            log.exception("streaming request %s failed", runner.engine_id)
            exc = OpenAIError(500, f"generation failed: {type(exc).__name__}", type_="server_error")
        with contextlib.suppress(ConnectionError):
            await send(exc.body())
            await send("[DONE]")
    return response


def _chunk(runner: _Runner, choices: list[dict], usage: dict | None = None) -> dict:
    job = runner.job
    chunk = {
        "id": job.response_id,
        "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
        "created": job.created,
        "model": runner.state.model_name,
        "choices": choices,
    }
    if job.include_usage:
        chunk["usage"] = usage  # null on every chunk but the last, as OpenAI does
    return chunk


def _delta_choice(runner: _Runner, delta: Any, offsets: dict[int, int]) -> dict:
    logprobs = None
    if runner.job.top_logprobs is not None and delta.logprobs:
        start = offsets.get(delta.index, 0)
        logprobs = _logprobs_block(runner, delta.token_ids, delta.logprobs, start)
    offsets[delta.index] = offsets.get(delta.index, 0) + len(delta.text)
    reason = delta.finish_reason  # "abort"/"error" (not OpenAI's) only reach a client on shutdown or failure
    if runner.job.kind == "chat":
        content = {"content": delta.text} if delta.text else {}
        return {"index": delta.index, "delta": content, "logprobs": logprobs, "finish_reason": reason}
    return {"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": reason}


# ---- routes -------------------------------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    state = get_state(request)
    stats = state.engine.stats()
    model = {
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "streamengine",
        "max_model_len": stats.get("max_model_len"),
    }
    return web.json_response({"object": "list", "data": [model]})


async def completions(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    body: CompletionRequest = _decode(await request.read(), CompletionRequest)
    _check_model(state, body.model)
    if body.echo:
        raise OpenAIError(400, "echo is not supported", param="echo")
    if body.logprobs is not None and not 0 <= body.logprobs <= 5:
        raise OpenAIError(400, "logprobs must be between 0 and 5", param="logprobs")
    prompt = _single_prompt(body.prompt)
    params = _sampling_params(body, body.max_tokens, body.logprobs)
    job = _Job("completion", new_request_id("cmpl"), int(time.time()), await _tokenize(state, prompt), params,
               body.logprobs, body.stream, bool(body.stream_options and body.stream_options.include_usage))
    return await run_job(state, request, job)


def _single_prompt(prompt: str | list[Any]) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise OpenAIError(400, "prompt must be a string or a list of token ids; one prompt per request "
                      "(use n for several samples)", param="prompt")


async def _tokenize(state: ServerState, prompt: str | list[int]) -> list[int]:
    try:
        return await state.tokenize_async(prompt)
    except PromptTooLong as exc:
        raise OpenAIError(400, str(exc), param="prompt", code="context_length_exceeded") from None
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="prompt") from None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    body: ChatCompletionRequest = _decode(await request.read(), ChatCompletionRequest)
    _check_model(state, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise OpenAIError(400, "top_logprobs must be between 0 and 20", param="top_logprobs")
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = _sampling_params(body, max_tokens, top_logprobs)
    messages = [{"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(body.messages)]
    try:
        prompt = state.chat_prompt(messages)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="messages") from None
    job = _Job("chat", new_request_id("chatcmpl"), int(time.time()), await _tokenize(state, prompt), params,
               top_logprobs, body.stream, bool(body.stream_options and body.stream_options.include_usage))
    return await run_job(state, request, job)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
