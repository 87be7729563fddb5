"""One request's stream as deltas: the shared core of the WebSocket and OpenAI routes.

The engine is asked for delta outputs (what is new since the previous one; several tokens at
once when it coalesced for a slow consumer), which is what clients are sent. `stream_request`
adds the running totals the routes report (usage, finish reasons), records the request's
metrics, enforces the server's request timeout (`RequestTimeoutError`), and aborts the request in the engine whenever the stream ends early
(disconnect, cancellation, error, timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from streamengine.sample.outputs import RequestMetrics, RequestOutput
from streamengine.sample.sampling_params import SamplingParams
from streamengine.server.metrics import RequestRecorder

if TYPE_CHECKING:
    from streamengine.engine.client import EngineClient


class RequestTimeoutError(Exception):
    """The request ran longer than the server's `request_timeout`; it has been aborted."""

    def __init__(self, timeout: float) -> None:
        super().__init__(f"request timed out after {timeout:g} s (the server's request timeout)")
        self.timeout = timeout


@dataclass(slots=True)
class SampleDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (vLLM's)


@dataclass(slots=True)
class StepUpdate:
    deltas: list[SampleDelta]
    finished: bool
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # all samples, so far
    finish_reasons: list[str | None]  # per sample index, so far
    metrics: RequestMetrics | None = None  # the engine's stage times, as of this step
    # With SamplingParams.prompt_logprobs, in the update that first has them: per prompt
    # position, the prompt token's logprob and the top alternatives (None at position 0).
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(slots=True)
class _Progress:
    """Totals over a request's delta outputs: tokens so far, finish reason per sample."""

    finish_reasons: list[str | None]
    completion_tokens: int = 0

    def update(self, out: RequestOutput) -> StepUpdate:
        deltas = [
            SampleDelta(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
            for c in out.outputs
        ]
        for delta in deltas:
            self.completion_tokens += len(delta.token_ids)
            self.finish_reasons[delta.index] = delta.finish_reason
        return StepUpdate(
            deltas=deltas,
            finished=out.finished,
            prompt_tokens=len(out.prompt_token_ids),
            cached_tokens=out.num_cached_tokens,
            completion_tokens=self.completion_tokens,
            finish_reasons=list(self.finish_reasons),
            metrics=out.metrics,
            prompt_logprobs=out.prompt_logprobs,
        )


async def stream_request(
    engine: EngineClient,
    prompt: str | list[int],
    params: SamplingParams,
    *,
    request_id: str,
    cache_salt: str | None,
    recorder: RequestRecorder,
    timeout: float | None = None,
    tenant: str | None = None,
    lora: str | None = None,
) -> AsyncIterator[StepUpdate]:
    """Deltas of one engine request. Leaving early (break, cancel, error) aborts it.

    `tenant` None runs it as the engine's default tenant, and `lora` None under the tenant's
    adapter or the base model; either None is left out of the `generate` call (engines and
    stand-ins without the argument work).

    The engine's own errors (ValueError for bad params or a long prompt, LimitExceededError,
    EngineOverloadedError on the first step; EngineError later) propagate unchanged. With
    `timeout`, an update not produced within that many seconds of the start ends the stream
    with RequestTimeoutError (and the request is aborted).
    """
    progress = _Progress([None] * params.n)
    params = msgspec.structs.replace(params, output_kind="delta")
    named = {name: value for name, value in (("tenant", tenant), ("lora", lora)) if value is not None}
    stream = engine.generate(prompt, params, request_id=request_id, cache_salt=cache_salt, **named)
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    finished = False
    try:
        while not finished:
            out = await _next_output(stream, deadline, timeout)
            if out is None:
                return
            update = progress.update(out)
            longest = max((len(d.token_ids) for d in update.deltas), default=0)
            new_tokens = sum(len(d.token_ids) for d in update.deltas)
            recorder.on_step(update.prompt_tokens, new_tokens, longest, update.finished, update.metrics)
            finished = update.finished
            yield update
    finally:
        if not finished:
            await _close_quietly(engine, stream, request_id)


async def _next_output(stream: AsyncIterator[Any], deadline: float | None, timeout: float | None) -> Any:
    """The engine's next output, None at its end; RequestTimeoutError past the deadline."""
    try:
        if deadline is None:
            return await anext(stream)
        return await _next_before(stream, deadline, timeout or 0.0)
    except StopAsyncIteration:
        return None


async def _next_before(stream: AsyncIterator[Any], deadline: float, timeout: float) -> Any:
    # Checked first: a deadline already past may never fire if the step does not suspend.
    if asyncio.get_running_loop().time() >= deadline:
        raise RequestTimeoutError(timeout)
    scope = asyncio.timeout_at(deadline)
    try:
        async with scope:
            return await anext(stream)  # a timeout cancels the engine's generator: it aborts
    except TimeoutError:
        if scope.expired():
            raise RequestTimeoutError(timeout) from None
        raise


async def _close_quietly(engine: EngineClient, stream: Any, request_id: str) -> None:
    # Closing the engine's iterator aborts the request; the explicit abort is a belt-and-braces
    # guarantee that its blocks are freed even if the iterator was never started.
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
    with contextlib.suppress(Exception):
        await engine.abort(request_id)


KERNEL_UNSENT_BYTES = 64 * 1024  # TCP_NOTSENT_LOWAT: unsent bytes the kernel may hold


def limit_kernel_unsent(transport: asyncio.BaseTransport | None) -> None:
    """Caps what the kernel keeps unsent for this socket (TCP_NOTSENT_LOWAT). Without it the
    kernel takes megabytes from a peer with a small window (about 3 MB on loopback), and every
    heartbeat ping queues behind them (and a streamed response's writes never wait, so a reader
    that stalled goes unnoticed); data in flight is not limited, so throughput is kept."""
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if option is None or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, option, KERNEL_UNSENT_BYTES)
