"""Response bodies built from the stream's updates: a whole completion, or chunk by chunk."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from msgspec import UNSET, UnsetType

from streamengine.server.openai import schemas as s
from streamengine.server.openai.endpoints import ChatCompletions, Completions, Job, LogprobEntry
from streamengine.server.streaming import SampleDelta, StepUpdate
from streamengine.server.tools import ToolStreams, finish_reason


@dataclass(slots=True)
class CollectedChoice:
    """One sample's output so far, for a response that is not streamed."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: SampleDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason


def prompt_only(update: StepUpdate) -> StepUpdate:
    """`update` without its generated tokens: max_tokens 0 with echo, which OpenAI answers with
    the prompt alone (the engine computes one token, which is neither returned nor counted)."""
    deltas = [SampleDelta(d.index, "", [], [] if d.logprobs is not None else None,
                          "length" if d.finish_reason is not None else None) for d in update.deltas]
    return replace(update, deltas=deltas, completion_tokens=0)


@dataclass(slots=True)
class ResponseFormat:
    """Builds one job's bodies; `token_text` names one token id (for logprobs).

    Updates come tagged with their prompt (`observe`): prompt p's sample i is choice
    p * n + i, and the usage is the sum of every prompt's last update."""

    job: Job
    model: str
    token_text: Callable[[int], str]
    # characters streamed so far per choice: completions' logprobs give text offsets
    _streamed_chars: dict[int, int] = field(default_factory=dict)
    _tool_streams: ToolStreams | None = None
    _last: dict[int, StepUpdate] = field(default_factory=dict)  # per prompt
    _prompt_logprobs: dict[int, list[dict[int, float] | None]] = field(default_factory=dict)  # per prompt
    _opened: set[int] = field(default_factory=set)  # choices whose first chunk is out

    def observe(self, prompt: int, update: StepUpdate) -> None:
        self._last[prompt] = update
        if update.prompt_logprobs is not None:
            self._prompt_logprobs[prompt] = update.prompt_logprobs

    def choice_index(self, prompt: int, sample: int) -> int:
        return prompt * self.job.params.n + sample

    def usage(self) -> s.Usage:
        updates = self._last.values()
        prompt = sum(u.prompt_tokens for u in updates)
        completion = sum(u.completion_tokens for u in updates)
        cached = sum(u.cached_tokens for u in updates)
        return s.Usage(prompt, completion, prompt + completion, s.PromptTokensDetails(cached))

    def completion(self, choices: dict[int, CollectedChoice]) -> s.Completion:
        job = self.job
        body = s.Completion(
            id=job.response_id, object=job.endpoint.object, created=job.created, model=self.model,
            choices=[self._finished_choice(i, choices.get(i, CollectedChoice())) for i in range(job.num_choices)],
            usage=self.usage(),
        )
        if job.prompt_logprobs is not None and isinstance(job.endpoint, ChatCompletions):
            body.prompt_logprobs = self._vllm_prompt_logprobs(0)  # chat: in the response, as vLLM's
        return body

    def opening_chunks(self) -> list[s.Chunk]:
        return [self._chunk([choice]) for choice in self.job.endpoint.opening_choices(self.job)]

    def update_chunk(self, prompt: int, update: StepUpdate) -> s.Chunk | None:
        """The chunk for one update of one prompt; None when it has no news for any choice."""
        choices = [choice for delta in update.deltas if (choice := self._streamed_choice(prompt, delta)) is not None]
        return self._chunk(choices) if choices else None

    def usage_chunk(self) -> s.Chunk:
        return self._chunk([], self.usage())

    def _chunk(self, choices: list[s.Choice], usage: s.Usage | None = None) -> s.Chunk:
        job = self.job
        if job.continuous_usage and usage is None:
            usage = self.usage()  # vLLM's continuous_usage_stats: the usage so far in every chunk
        # with include_usage, null on every chunk but the last, as OpenAI does
        shown: s.Usage | None | UnsetType = usage if job.include_usage else UNSET
        return s.Chunk(job.response_id, job.endpoint.chunk_object, job.created, self.model, choices, shown)

    def _finished_choice(self, index: int, collected: CollectedChoice) -> s.Choice:
        choice = self._whole_choice(index, collected)
        choice.stop_reason = collected.stop_reason
        prompt = index // self.job.params.n
        echo = self.job.prompts[prompt].echo
        if isinstance(choice, s.CompletionChoice):
            if echo is not None:
                if isinstance(choice.logprobs, s.CompletionLogprobs):
                    choice.logprobs.text_offset = [o + len(echo) for o in choice.logprobs.text_offset]
                self._lead_with_prompt(prompt, choice, echo)
            if self.job.prompt_logprobs is not None:
                choice.prompt_logprobs = self._vllm_prompt_logprobs(prompt)
        elif isinstance(choice, s.ChatChoice) and echo is not None:
            choice.message.content = echo + (choice.message.content or "")
        return choice

    def _streamed_choice(self, prompt: int, delta: SampleDelta) -> s.Choice | None:
        index = self.choice_index(prompt, delta.index)
        echo = self.job.prompts[prompt].echo if isinstance(self.job.endpoint, Completions) else None
        first = index not in self._opened
        if first and echo is not None:
            self._streamed_chars.setdefault(index, len(echo))  # the generated text's offsets follow it
        choice = self._delta_choice(replace(delta, index=index))
        if choice is None:
            return None
        choice.stop_reason = delta.stop_reason
        self._opened.add(index)
        if first and echo is not None and isinstance(choice, s.CompletionChoice):
            self._lead_with_prompt(prompt, choice, echo)
        return choice

    def _lead_with_prompt(self, prompt: int, choice: s.CompletionChoice, echo: str) -> None:
        """Echo: the prompt's text before the choice's, and its tokens' logprobs before the
        choice's (the first token's are null, as OpenAI's are)."""
        choice.text = echo + choice.text
        if not self.job.echo_logprobs:
            return
        lead = self.job.endpoint.logprobs(self._prompt_entries(prompt), 0)
        if not isinstance(lead, s.CompletionLogprobs):
            return  # echo with logprobs is a completions feature
        if isinstance(choice.logprobs, s.CompletionLogprobs):
            own = choice.logprobs
            lead.tokens += own.tokens
            lead.token_logprobs += own.token_logprobs
            lead.top_logprobs += own.top_logprobs
            lead.text_offset += own.text_offset
        choice.logprobs = lead

    def _prompt_entries(self, prompt: int) -> list[LogprobEntry]:
        ids = self.job.prompts[prompt].ids
        logprobs = self._prompt_logprobs.get(prompt) or [None] * len(ids)
        k = self.job.top_logprobs or 0
        entries = []
        for token, alternatives in zip(ids, logprobs, strict=True):
            if alternatives is None:
                entries.append(LogprobEntry(self.token_text(token), None, None))
                continue
            top = sorted(alternatives.items(), key=lambda kv: kv[1], reverse=True)[:k]
            entries.append(LogprobEntry(self.token_text(token), alternatives.get(token, float("-inf")),
                                        [(self.token_text(alt), lp) for alt, lp in top]))
        return entries

    def _vllm_prompt_logprobs(self, prompt: int) -> s.PromptLogprobs:
        """vLLM's prompt_logprobs: per position, the top alternatives ranked, and the prompt's
        own token (ranked among them, or with rank null when it is not one of them)."""
        ids = self.job.prompts[prompt].ids
        k = self.job.prompt_logprobs or 0
        out: s.PromptLogprobs = []
        for token, alternatives in zip(ids, self._prompt_logprobs.get(prompt) or [None] * len(ids), strict=True):
            if alternatives is None:
                out.append(None)
                continue
            top = sorted(alternatives.items(), key=lambda kv: kv[1], reverse=True)[:k]
            ranked = {t: s.PromptLogprob(lp, rank, self.token_text(t)) for rank, (t, lp) in enumerate(top, 1)}
            own = ranked.pop(token, None) or s.PromptLogprob(alternatives.get(token, float("-inf")), None,
                                                             self.token_text(token))
            out.append({token: own, **ranked})
        return out

    def _whole_choice(self, index: int, choice: CollectedChoice) -> s.Choice:
        logprobs = None
        if self.job.top_logprobs is not None:
            logprobs = self._logprobs(choice.token_ids, choice.logprobs, 0)
        text: str | None = "".join(choice.text)
        if self.job.tool_parser is None:
            return self.job.endpoint.choice(index, text, logprobs, choice.finish_reason)
        parsed = self.job.tool_parser.parse(text or "")
        return self.job.endpoint.choice(index, parsed.content, logprobs,
                                        finish_reason(choice.finish_reason, parsed.ending), parsed.calls)

    def _delta_choice(self, delta: SampleDelta) -> s.Choice | None:
        """What `delta` adds to its choice; None when that is nothing (no text, calls, logprobs
        or finish reason: a parser or the detokenizer holding text back)."""
        start = self._streamed_chars.get(delta.index, 0)
        logprobs = None
        if self.job.top_logprobs is not None and delta.logprobs:
            logprobs = self._logprobs(delta.token_ids, delta.logprobs, start)
        self._streamed_chars[delta.index] = start + len(delta.text)
        # "abort"/"error" (not OpenAI's) only reach a client on shutdown or failure
        text, calls, reason = delta.text, None, delta.finish_reason
        if self.job.tool_parser is not None:
            if self._tool_streams is None:
                self._tool_streams = ToolStreams(self.job.tool_parser)
            parsed = self._tool_streams.feed(delta.index, delta.text, last=delta.finish_reason is not None)
            text, calls = parsed.content, parsed.calls
            reason = self._tool_streams.finish_reason(delta.index, delta.finish_reason)
        if not (text or calls or logprobs is not None or reason is not None):
            return None
        return self.job.endpoint.delta_choice(delta.index, text, logprobs, reason, calls)

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
