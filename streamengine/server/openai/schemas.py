"""OpenAI's request and response bodies as msgspec Structs.

Requests ignore unknown fields (OpenAI clients send many). Responses are encoded as they
are: a field that OpenAI sends as null is None here, and the chunks' `usage` is UNSET
(left out) unless the client asked for it.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

# ---- requests -------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class RequestBase(msgspec.Struct, kw_only=True):
    """The fields both endpoints take."""

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

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(RequestBase, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a list holding one of those
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False


class ChatCompletionRequest(RequestBase, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ---- responses ------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    """One sample of a completion, whole or (streamed) its new part."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class AssistantMessage(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


Choice = CompletionChoice | ChatChoice | ChatChunkChoice
Logprobs = CompletionLogprobs | ChatLogprobs


class Completion(msgspec.Struct):
    """A whole response (`stream` false)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class Chunk(msgspec.Struct):
    """One server-sent event of a streamed response."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None | UnsetType = UNSET  # with include_usage: null on all but the last
