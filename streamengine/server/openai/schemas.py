"""OpenAI's request and response bodies as msgspec Structs.

A request Struct holds the fields its endpoint implements (OpenAI's and vLLM's; fields.py
lists every field either defines and refuses the others by name). Unknown fields pass
unread, and every field takes null as its default (`n`, `stream`, `logprobs`, `echo` and
`include_usage` too: some clients send unset fields as null). Responses are encoded as they
are: a field that OpenAI sends as null is None here, and the chunks' `usage` is UNSET
(left out) unless the client asked for it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

# ---- requests -------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: the usage so far in every chunk
    include_obfuscation: bool | None = None  # OpenAI's stream padding: refused when true


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    """A call made by the assistant: in an earlier message of a request, or in a response."""

    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # role "tool": the call this is the result of


class FunctionDefinition(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # true or absent: unnamed keys refused in forced calls; false: JSON Schema's defaults


class Tool(msgspec.Struct):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionName(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    function: FunctionName
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(msgspec.Struct):
    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None  # true or absent: unnamed keys refused (json_schema.py); false: JSON Schema's defaults
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs`: one of json, regex, choice, grammar, json_object."""

    json: dict[str, Any] | bool | str | None = None  # a JSON schema, or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # GBNF or Lark
    json_object: bool | None = None
    # accepted: llguidance never falls back, and writes JSON without free whitespace
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None  # refused
    structural_tag: str | dict[str, Any] | None = None  # refused


class RequestBase(msgspec.Struct, kw_only=True):
    """The fields both endpoints take."""

    model: str | None = None
    n: int | None = 1  # None: 1 (SamplingParams' default)
    best_of: int | None = None  # n, or the beam width with use_beam_search
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[int, float] | None = None  # token id (a JSON string key) -> bias
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    echo: bool | None = False
    response_format: ResponseFormat | None = None
    # vLLM's extensions, accepted under the same names
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    use_beam_search: bool | None = False
    length_penalty: float | None = None
    early_stopping: bool | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool | None = None  # None: the endpoint's default
    request_id: str | None = None
    cache_salt: str | None = None
    return_tokens_as_token_ids: bool | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # the engine's structured output as a tagged object ({"type": "regex", "pattern": ...}, ...)
    structured: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats, which applies with include_usage."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(RequestBase, kw_only=True):
    prompt: str | list[Any]  # a string, a list of strings, token ids, or a list of id lists
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None


class ChatCompletionRequest(RequestBase, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat template fields
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None


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
    token_logprobs: list[float | None]  # None: the first token of an echoed prompt
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's Logprob: one token of a prompt position (the prompt's own, or an alternative)."""

    logprob: float
    rank: int | None  # 1 = the likeliest; None: the prompt's token, outside the top alternatives
    decoded_token: str


# vLLM's prompt_logprobs: per prompt position, token id -> its logprob (None at position 0)
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    """One sample of a completion, whole or (streamed) its new part."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, with prompt_logprobs


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
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET  # left out unless the output called tools


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None  # in a call's first chunk only
    arguments: str  # always sent, "" in the first chunk


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A part of call `index` in a stream, as OpenAI sends them: the first has the call's id,
    type and name (arguments ""), the later ones only `index` and arguments text."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


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
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # chat, with vLLM's prompt_logprobs


class Chunk(msgspec.Struct):
    """One server-sent event of a streamed response."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None | UnsetType = UNSET  # with include_usage: null on all but the last
