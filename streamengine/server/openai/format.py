"""Response bodies built from the stream's updates: a whole completion, or chunk by chunk."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from msgspec import UNSET, UnsetType

from streamengine.server.openai import schemas as s
from streamengine.server.openai.endpoints import Job, LogprobEntry
from streamengine.server.streaming import SampleDelta, StepUpdate
from streamengine.server.tools import ToolStreams, finish_reason


def usage_of(update: StepUpdate | None) -> s.Usage:
    prompt, completion, cached = (
        (update.prompt_tokens, update.completion_tokens, update.cached_tokens) if update else (0, 0, 0)
    )
    return s.Usage(prompt, completion, prompt + completion, s.PromptTokensDetails(cached))


@dataclass(slots=True)
class CollectedChoice:
    """One sample's output so far, for a response that is not streamed."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: SampleDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason


@dataclass(slots=True)
class ResponseFormat:
    """Builds one job's bodies; `token_text` decodes one token id (for logprobs)."""

    job: Job
    model: str
    token_text: Callable[[int], str]
    # characters streamed so far per sample: completions' logprobs give text offsets
    _streamed_chars: dict[int, int] = field(default_factory=dict)
    _tool_streams: ToolStreams | None = None

    def completion(self, choices: dict[int, CollectedChoice], last: StepUpdate | None) -> s.Completion:
        job = self.job
        return s.Completion(
            id=job.response_id, object=job.endpoint.object, created=job.created, model=self.model,
            choices=[self._whole_choice(i, choices.get(i, CollectedChoice())) for i in range(job.params.n)],
            usage=usage_of(last),
        )

    def opening_chunks(self) -> list[s.Chunk]:
        return [self._chunk([choice]) for choice in self.job.endpoint.opening_choices(self.job.params.n)]

    def update_chunk(self, update: StepUpdate) -> s.Chunk | None:
        """The chunk for one update; None when it has no news for any sample."""
        choices = [self._delta_choice(delta) for delta in update.deltas]
        return self._chunk(choices) if choices else None

    def usage_chunk(self, last: StepUpdate | None) -> s.Chunk:
        return self._chunk([], usage_of(last))

    def _chunk(self, choices: list[s.Choice], usage: s.Usage | None = None) -> s.Chunk:
        job = self.job
        # with include_usage, null on every chunk but the last, as OpenAI does
        shown: s.Usage | None | UnsetType = usage if job.include_usage else UNSET
        return s.Chunk(job.response_id, job.endpoint.chunk_object, job.created, self.model, choices, shown)

    def _whole_choice(self, index: int, choice: CollectedChoice) -> s.Choice:
        logprobs = None
        if self.job.top_logprobs is not None:
            logprobs = self._logprobs(choice.token_ids, choice.logprobs, 0)
        text: str | None = "".join(choice.text)
        if self.job.tool_parser is None:
            return self.job.endpoint.choice(index, text, logprobs, choice.finish_reason)
        text, calls = self.job.tool_parser.parse(text or "")
        return self.job.endpoint.choice(index, text, logprobs, finish_reason(choice.finish_reason, bool(calls)),
                                        calls)

    def _delta_choice(self, delta: SampleDelta) -> s.Choice:
        start = self._streamed_chars.get(delta.index, 0)
        logprobs = None
        if self.job.top_logprobs is not None and delta.logprobs:
            logprobs = self._logprobs(delta.token_ids, delta.logprobs, start)
        self._streamed_chars[delta.index] = start + len(delta.text)
        # "abort"/"error" (not OpenAI's) only reach a client on shutdown or failure
        if self.job.tool_parser is None:
            return self.job.endpoint.delta_choice(delta.index, delta.text, logprobs, delta.finish_reason)
        if self._tool_streams is None:
            self._tool_streams = ToolStreams(self.job.tool_parser)
        parsed = self._tool_streams.feed(delta.index, delta.text, last=delta.finish_reason is not None)
        reason = finish_reason(delta.finish_reason, self._tool_streams.called(delta.index))
        return self.job.endpoint.delta_choice(delta.index, parsed.content, logprobs, reason, parsed.calls)

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], offset: int) -> s.Logprobs:
        k = self.job.top_logprobs or 0
        entries = []
        for token, alternatives in zip(token_ids, logprobs, strict=False):
            top = sorted(alternatives.items(), key=lambda kv: kv[1], reverse=True)[:k]
            entries.append(LogprobEntry(
                self.token_text(token), alternatives.get(token, float("-inf")),
                [(self.token_text(alt), lp) for alt, lp in top],
            ))
        return self.job.endpoint.logprobs(entries, offset)
