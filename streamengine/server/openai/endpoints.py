"""What differs between `/v1/completions` and `/v1/chat/completions`, one object each.

An `Endpoint` turns its request body into a `Job` (prompt, sampling params, how many top
logprobs) and knows the shape of its choices and the names of its objects; everything else
(running the job, collecting or streaming it) is shared and lives in format.py and routes.py.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import msgspec
from msgspec import UNSET

from streamengine.errors import LimitExceededError
from streamengine.sampling_params import SamplingParams
from streamengine.server.openai import schemas as s
from streamengine.server.openai.errors import OpenAIError, validation_error
from streamengine.server.state import PromptTooLong, ServerState, new_request_id
from streamengine.server.tools import NO_TOOLS, ToolPlan, plan_tools
from streamengine.tool_calls import ToolCall, ToolCallDelta, ToolParser

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bounds
MAX_CHAT_TOP_LOGPROBS = 20

Body = TypeVar("Body", bound=s.RequestBase)

_PASSTHROUGH = (
    "n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k",
    "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output", "logit_bias",
)


@dataclass(slots=True)
class Job:
    """A prepared request: everything the route decided before talking to the engine."""

    endpoint: Endpoint[Any]
    response_id: str
    created: int
    prompt_ids: list[int]
    params: SamplingParams
    top_logprobs: int | None  # how many alternatives to report; None = no logprobs
    stream: bool
    include_usage: bool
    user: str | None = None  # OpenAI's `user`: salts the request's private blocks per user
    tool_parser: ToolParser | None = None  # reads tool calls out of each output; None: plain text


@dataclass(slots=True)
class Prepared:
    """What an endpoint makes of a decoded body."""

    prompt: str | list[int]
    params: SamplingParams
    top_logprobs: int | None  # how many alternatives to report; None = no logprobs
    tool_parser: ToolParser | None = None
    chat: bool = False  # the prompt was rendered by the chat template (see ServerState.tokenize)


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """One generated token's text and logprob, and the top alternatives, best first."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


class Endpoint(ABC, Generic[Body]):
    """One endpoint's body, checks and response shapes; a route uses one for each request."""

    body_type: type[Body]
    id_prefix: ClassVar[str]
    object: ClassVar[str]  # of a whole response
    chunk_object: ClassVar[str]  # of a streamed chunk

    async def job(self, state: ServerState, raw: bytes) -> Job:
        """Decodes and checks the body and tokenizes its prompt; OpenAIError if it is wrong."""
        body = decode_body(raw, self.body_type)
        check_model(state, body.model)
        prepared = self.prepare(state, body)
        response_id, created = new_request_id(self.id_prefix), int(time.time())
        prompt_ids = await tokenize(state, prepared.prompt, chat=prepared.chat)
        return Job(self, response_id, created, prompt_ids, prepared.params, prepared.top_logprobs, bool(body.stream),
                   body.include_usage, body.user, prepared.tool_parser)

    @abstractmethod
    def prepare(self, state: ServerState, body: Body) -> Prepared:
        """The prompt, the sampling params, how many top logprobs and the tool parser."""

    @abstractmethod
    def logprobs(self, entries: list[LogprobEntry], offset: int) -> s.Logprobs:
        """The logprobs of a choice; `offset`: characters of the choice sent before these."""

    @abstractmethod
    def choice(self, index: int, text: str | None, logprobs: s.Logprobs | None, finish_reason: str | None,
               tool_calls: list[ToolCall] | None = None) -> s.Choice:
        """One sample of a whole response."""

    @abstractmethod
    def delta_choice(self, index: int, text: str, logprobs: s.Logprobs | None, finish_reason: str | None,
                     tool_calls: list[ToolCallDelta] | None = None) -> s.Choice:
        """What one stream update adds to one sample."""

    def opening_choices(self, n: int) -> list[s.Choice]:
        """Choices sent, one per chunk, before any output."""
        return []


class Completions(Endpoint[s.CompletionRequest]):
    body_type = s.CompletionRequest
    id_prefix = "cmpl"
    object = chunk_object = "text_completion"

    def prepare(self, state: ServerState, body: s.CompletionRequest) -> Prepared:
        if body.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise OpenAIError(400, f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}", param="logprobs")
        prompt = _single_prompt(body.prompt)
        return Prepared(prompt, sampling_params(body, body.max_tokens, body.logprobs, body.structured), body.logprobs)

    def logprobs(self, entries: list[LogprobEntry], offset: int) -> s.CompletionLogprobs:
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        return s.CompletionLogprobs(
            tokens=[e.token for e in entries],
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[dict(e.top) for e in entries],
            text_offset=offsets,
        )

    def choice(self, index: int, text: str | None, logprobs: s.Logprobs | None, finish_reason: str | None,
               tool_calls: list[ToolCall] | None = None) -> s.CompletionChoice:
        return s.CompletionChoice(index, text or "", logprobs, finish_reason)

    def delta_choice(self, index: int, text: str, logprobs: s.Logprobs | None, finish_reason: str | None,
                     tool_calls: list[ToolCallDelta] | None = None) -> s.CompletionChoice:
        return s.CompletionChoice(index, text, logprobs, finish_reason)  # the same shape as a whole one


class ChatCompletions(Endpoint[s.ChatCompletionRequest]):
    body_type = s.ChatCompletionRequest
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def prepare(self, state: ServerState, body: s.ChatCompletionRequest) -> Prepared:
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_CHAT_TOP_LOGPROBS:
            raise OpenAIError(400, f"top_logprobs must be between 0 and {MAX_CHAT_TOP_LOGPROBS}",
                              param="top_logprobs")
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        plan = _tool_plan(state, body)
        params = sampling_params(body, max_tokens, top_logprobs, _structured(body, plan))
        messages = [_message_dict(m, i) for i, m in enumerate(body.messages)]
        try:
            prompt = state.chat_prompt(messages, plan.functions)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
        return Prepared(prompt, params, top_logprobs, plan.parser, chat=True)

    def logprobs(self, entries: list[LogprobEntry], offset: int) -> s.ChatLogprobs:
        return s.ChatLogprobs([
            s.TokenLogprob(e.token, e.logprob, list(e.token.encode()),
                           [s.TopLogprob(alt, lp, list(alt.encode())) for alt, lp in e.top])
            for e in entries
        ])

    def choice(self, index: int, text: str | None, logprobs: s.Logprobs | None, finish_reason: str | None,
               tool_calls: list[ToolCall] | None = None) -> s.ChatChoice:
        calls = [s.ToolCall(c.id, s.FunctionCall(c.name, c.arguments)) for c in tool_calls or ()]
        return s.ChatChoice(index, s.AssistantMessage("assistant", text, calls or UNSET), logprobs, finish_reason)

    def delta_choice(self, index: int, text: str, logprobs: s.Logprobs | None, finish_reason: str | None,
                     tool_calls: list[ToolCallDelta] | None = None) -> s.ChatChunkChoice:
        calls = [s.DeltaToolCall(c.index, c.id, s.DeltaFunctionCall(c.name, c.arguments)) for c in tool_calls or ()]
        return s.ChatChunkChoice(index, s.ChatDelta(content=text or None, tool_calls=calls or None), logprobs,
                                 finish_reason)

    def opening_choices(self, n: int) -> list[s.Choice]:
        # OpenAI opens each choice with the role
        return [s.ChatChunkChoice(i, s.ChatDelta("assistant", ""), None, None) for i in range(n)]


COMPLETIONS = Completions()
CHAT_COMPLETIONS = ChatCompletions()


# ---- checks shared by both ----------------------------------------------------------------------


def decode_body(raw: bytes, body_type: type[Body]) -> Body:
    if not raw:
        raise OpenAIError(400, "request body must be a JSON object")
    try:
        return msgspec.json.decode(raw, type=body_type)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"invalid JSON body: {exc}") from None
    except RecursionError:  # msgspec's, even inside fields it skips
        raise OpenAIError(400, "invalid JSON body: nested too deeply", code="too_deep") from None


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{state.model_name}`.",
                          param="model", code="model_not_found")


def sampling_params(body: s.RequestBase, max_tokens: int | None, logprobs: int | None,
                    structured: dict[str, Any] | None) -> SamplingParams:
    fields: dict[str, Any] = {name: getattr(body, name) for name in _PASSTHROUGH if getattr(body, name) is not None}
    fields["max_tokens"] = max_tokens
    fields["logprobs"] = logprobs
    if body.stop is not None:
        fields["stop"] = body.stop
    if structured is not None:
        fields["structured"] = structured
    try:
        return SamplingParams.from_dict(fields)
    except LimitExceededError as exc:
        raise OpenAIError(400, str(exc), param=exc.limit, code="limit_exceeded") from None
    except ValueError as exc:
        raise validation_error(exc) from None


async def tokenize(state: ServerState, prompt: str | list[int], *, chat: bool = False) -> list[int]:
    try:
        return await state.tokenize_async(prompt, chat=chat)
    except PromptTooLong as exc:
        raise OpenAIError(400, str(exc), param="prompt", code="context_length_exceeded") from None
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="prompt") from None


def _single_prompt(prompt: str | list[Any]) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise OpenAIError(400, "prompt must be a string or a list of token ids; one prompt per request "
                      "(use n for several samples)", param="prompt")


def _tool_plan(state: ServerState, body: s.ChatCompletionRequest) -> ToolPlan:
    if body.tools is None and body.tool_choice is None:
        return NO_TOOLS
    try:
        return plan_tools(body.tools or (), body.tool_choice, parallel=body.parallel_tool_calls is True,
                          parser_name=state.tool_parser)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="tool_choice") from None


def _structured(body: s.ChatCompletionRequest, plan: ToolPlan) -> dict[str, Any] | None:
    """The request's structured output: from response_format, the `structured` extension or a
    forced tool call; at most one of them."""
    given = [spec for spec in (_response_format(body.response_format), body.structured, plan.structured)
             if spec is not None]
    if len(given) > 1:
        raise OpenAIError(400, "give only one of response_format, structured and a forced tool call "
                          "(tool_choice required or named)", param="response_format")
    return given[0] if given else None


def _response_format(response_format: s.ResponseFormat | None) -> dict[str, Any] | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "json_object"}
    schema = response_format.json_schema.schema if response_format.json_schema is not None else None
    if schema is None:
        raise OpenAIError(400, "response_format of type json_schema needs json_schema.schema",
                          param="response_format.json_schema.schema")
    strict = response_format.json_schema.strict  # None or true: unnamed properties refused
    return {"type": "json_schema", "schema": schema, "strict": strict}


def _message_dict(message: s.ChatMessage, i: int) -> dict[str, Any]:
    """A message as the chat template (through tool_prompt.py) takes it."""
    rendered: dict[str, Any] = {"role": message.role, "content": _message_text(message, i)}
    if message.tool_calls:
        rendered["tool_calls"] = msgspec.to_builtins(message.tool_calls)
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _message_text(message: s.ChatMessage, i: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise OpenAIError(400, f"only text content parts are supported, got {part.type!r}",
                              param=f"messages[{i}].content")
        texts.append(part.text)
    return "".join(texts)
