"""Turns the state of a request's samples into the `RequestOutput` its stream yields.

With `output_kind="delta"` an output carries only what is new since the previous one: the
samples with new tokens, text or a finish reason, each with just that news. The cost is the
size of the news, whatever the length of the output so far. `"cumulative"` outputs carry every
sample in full, as the request stands.
"""

from __future__ import annotations

from streamengine.sample.outputs import CompletionOutput, RequestOutput
from streamengine.sample.request import Request, Sample


def make_output(req: Request) -> RequestOutput:
    if req.params.output_kind == "delta":
        completions = [c for s in req.samples if (c := _delta(s)) is not None]
    else:
        completions = [_cumulative(s) for s in req.samples]
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        outputs=completions,
        finished=req.finished,
        num_cached_tokens=req.num_cached_tokens,
        metrics=req.metrics.snapshot(),  # later steps stamp the request's own
        prompt_logprobs=_prompt_logprobs(req),
    )


def _prompt_logprobs(req: Request) -> list[dict[int, float] | None] | None:
    """The prompt's logprobs once all are computed: on every cumulative output (the same list,
    which no longer changes), on the first delta output only (as vLLM delivers them)."""
    if not req.prompt_logprobs_ready:
        return None
    if req.params.output_kind == "delta":
        if req.prompt_logprobs_sent:
            return None
        req.prompt_logprobs_sent = True
    return req.prompt_logprobs


def _cumulative(sample: Sample) -> CompletionOutput:
    return CompletionOutput(
        index=sample.index,
        text=sample.text,
        token_ids=list(sample.token_ids),
        finish_reason=sample.finish_reason,
        logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
        stop_reason=sample.stop_reason,
    )


def _delta(sample: Sample) -> CompletionOutput | None:
    """The sample's news since its last output, None if it has none. A finished sample's
    last delta carries its finish reason; after that it has no news."""
    if sample.finish_sent:
        return None
    start = sample.num_sent_tokens
    text = sample.text_since(sample.num_sent_chars)
    token_ids = sample.token_ids[start:]
    if not text and not token_ids and not sample.finished:
        return None
    sample.num_sent_chars += len(text)
    sample.num_sent_tokens = len(sample.token_ids)
    sample.finish_sent = sample.finished
    return CompletionOutput(
        index=sample.index,
        text=text,
        token_ids=token_ids,
        finish_reason=sample.finish_reason,
        logprobs=sample.logprobs[start:] if sample.logprobs is not None else None,
        stop_reason=sample.stop_reason,
    )
