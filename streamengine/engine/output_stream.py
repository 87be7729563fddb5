"""One request's stream of outputs between the step loop and its consumer.

The step loop puts an output per step without ever waiting; the consumer takes them at its
own pace. A consumer slower than the engine gets the outputs it missed folded into one:
cumulative outputs replace each other (the newest says everything), delta outputs are
concatenated (nothing is lost), in one pass when the consumer reads.
"""

from __future__ import annotations

import asyncio

from streamengine.sample.outputs import CompletionOutput, RequestOutput


class RequestStream:
    __slots__ = ("_delta", "_pending", "_error", "_ready")

    def __init__(self, delta: bool = False) -> None:
        self._delta = delta
        self._pending: list[RequestOutput] = []
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self._pending and self._pending[-1].finished:
            return  # the request already ended: nothing may follow its final output
        if self._delta:
            self._pending.append(output)
        else:
            self._pending[:] = [output]
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        if self._pending:
            output = merge_deltas(self._pending) if len(self._pending) > 1 else self._pending[0]
            self._pending = []
            if self._error is None:  # an error that came after this output stays ready
                self._ready.clear()
            return output
        if self._error is None:  # _ready is only set by put or put_error
            raise RuntimeError("request stream woke up with nothing to deliver")
        raise self._error


def merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive delta outputs of one request as one: each sample's text, token ids and
    logprobs concatenated, its latest finish and stop reason; the prompt logprobs that one of
    them carried."""
    last = outputs[-1]
    parts: dict[int, list[CompletionOutput]] = {}
    for output in outputs:
        for completion in output.outputs:
            parts.setdefault(completion.index, []).append(completion)
    return RequestOutput(
        request_id=last.request_id,
        prompt_token_ids=last.prompt_token_ids,
        outputs=[_concat(chunks) for chunks in parts.values()],
        finished=last.finished,
        num_cached_tokens=last.num_cached_tokens,
        metrics=last.metrics,
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None),
    )


def _concat(chunks: list[CompletionOutput]) -> CompletionOutput:
    last = chunks[-1]
    logprobs = None
    if last.logprobs is not None:
        logprobs = [entry for c in chunks for entry in (c.logprobs or ())]
    return CompletionOutput(
        index=last.index,
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=last.finish_reason,
        logprobs=logprobs,
        stop_reason=last.stop_reason,
    )
