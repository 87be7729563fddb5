"""One request's stream as deltas: the shared core of the WebSocket and OpenAI routes.

The engine yields cumulative text and token ids (one update per step, several tokens at once
when it coalesced for a slow consumer); clients want what is new. `stream_request` turns the
one into the other, records the request's metrics, enforces the server's request timeout
(`RequestTimeoutError`), and aborts the request in the engine whenever the stream ends early
(disconnect, cancellation, error, timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from streamengine.server.metrics import RequestRecorder


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


@dataclass(slots=True)
class StepUpdate:
    deltas: list[SampleDelta]
    finished: bool
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # all samples, so far
    finish_reasons: list[str | None]  # per sample index, so far


@dataclass(slots=True)
class _SampleCursor:
    text_len: int = 0
    num_tokens: int = 0
    finish_reason: str | None = None


@dataclass(slots=True)
class DeltaTracker:
    """Remembers how much of each sample has been sent, so each update carries only news."""

    cursors: dict[int, _SampleCursor] = field(default_factory=dict)

    def update(self, out: Any) -> StepUpdate:
        deltas: list[SampleDelta] = []
        for sample in out.outputs:
            cursor = self.cursors.setdefault(sample.index, _SampleCursor())
            delta = self._advance(cursor, sample)
            if delta is not None:
                deltas.append(delta)
        completion = sum(c.num_tokens for c in self.cursors.values())
        reasons = [self.cursors[i].finish_reason for i in sorted(self.cursors)]
        return StepUpdate(
            deltas=deltas,
            finished=bool(out.finished),
            prompt_tokens=len(out.prompt_token_ids),
            cached_tokens=int(out.num_cached_tokens or 0),
            completion_tokens=completion,
            finish_reasons=reasons,
        )

    @staticmethod
    def _advance(cursor: _SampleCursor, sample: Any) -> SampleDelta | None:
        if cursor.finish_reason is not None:
            return None  # already reported finished: later updates repeat the same sample
        new_ids = list(sample.token_ids[cursor.num_tokens :])
        new_text = sample.text[cursor.text_len :]
        logprobs = None
        if sample.logprobs is not None:
            logprobs = list(sample.logprobs[cursor.num_tokens : cursor.num_tokens + len(new_ids)])
        if not new_ids and not new_text and sample.finish_reason is None:
            return None
        cursor.num_tokens = len(sample.token_ids)
        cursor.text_len = len(sample.text)
        cursor.finish_reason = sample.finish_reason
        return SampleDelta(sample.index, new_text, new_ids, logprobs, sample.finish_reason)


async def stream_request(
    engine: Any,
    prompt: str | list[int],
    params: Any,
    *,
    request_id: str,
    cache_salt: str | None,
    recorder: RequestRecorder,
    timeout: float | None = None,
) -> AsyncIterator[StepUpdate]:
    """Deltas of one engine request. Leaving early (break, cancel, error) aborts it.

    The engine's own errors (ValueError for bad params or a long prompt, LimitExceededError,
    EngineOverloadedError on the first step; EngineError later) propagate unchanged. With
    `timeout`, an update not produced within that many seconds of the start ends the stream
    with RequestTimeoutError (and the request is aborted).
    """
    tracker = DeltaTracker()
    stream = engine.generate(prompt, params, request_id=request_id, cache_salt=cache_salt)
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    finished = False
    try:
        while not finished:
            out = await _next_output(stream, deadline, timeout)
            if out is None:
                return
            update = tracker.update(out)
            longest = max((len(d.token_ids) for d in update.deltas), default=0)
            new_tokens = sum(len(d.token_ids) for d in update.deltas)
            recorder.on_step(update.prompt_tokens, new_tokens, longest, update.finished)
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


async def _close_quietly(engine: Any, stream: Any, request_id: str) -> None:
    # Closing the engine's iterator aborts the request; the explicit abort is a belt-and-braces
    # guarantee that its blocks are freed even if the iterator was never started.
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
    with contextlib.suppress(Exception):
        await engine.abort(request_id)
