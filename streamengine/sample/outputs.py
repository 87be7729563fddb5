"""What a request's stream yields, one output per step: each sample's text, token ids and
logprobs so far (output_kind "cumulative"), or only what is new since the previous output
("delta"), and when the request reached each stage (`RequestMetrics`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while running, then "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None = None  # per generated token: top-k ids -> logprob
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """When a request reached each stage, in seconds of the engine process's `time.monotonic()`
    clock: subtract one of a request's times from another, never from another process's clock.
    A stage not reached yet is None. Each output carries a copy as of its step.

    A request's time to first token splits into `queue_time` (waiting for admission: the pool,
    the running slots, or other tenants' turn) and `prefill_time` (its prompt's chunks computed
    beside the other requests' steps), which tells which of the two a slow first token was."""

    arrival_time: float
    first_scheduled_time: float | None = None  # the first step that computed any of its tokens
    first_token_time: float | None = None  # the step whose output carried its first token(s)
    finished_time: float | None = None  # the step it finished in, or when it was aborted
    # Speculative decoding: its proposed tokens verified, and of those accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def snapshot(self) -> RequestMetrics:
        return RequestMetrics(self.arrival_time, self.first_scheduled_time, self.first_token_time, self.finished_time,
                              self.spec_draft_tokens, self.spec_accepted_tokens)

    @property
    def queue_time(self) -> float | None:
        return _between(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_time(self) -> float | None:
        return _between(self.first_scheduled_time, self.first_token_time)

    @property
    def time_to_first_token(self) -> float | None:
        return _between(self.arrival_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return _between(self.first_token_time, self.finished_time)


def _between(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None  # when the request reached each stage, as of this output
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (it
    # has no context), else {token id: logprob} of that token and its position's top
    # alternatives. None unless asked (or when an abort came before the prompt was computed);
    # "cumulative" outputs all carry it (one list, shared: do not modify it), "delta" outputs
    # only the first.
    prompt_logprobs: list[dict[int, float] | None] | None = None
