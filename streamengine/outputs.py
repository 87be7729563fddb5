"""What a request's stream yields, one output per step: each sample's text, token ids and
logprobs so far (output_kind "cumulative"), or only what is new since the previous output
("delta")."""

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
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
