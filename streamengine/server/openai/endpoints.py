"""What differs between `/v1/completions` and `/v1/chat/completions`, one object each.

An `Endpoint` turns its request body into a `Job` (its prompts, sampling params, how many top
logprobs) and knows the shape of its choices and the names of its objects; everything else
(running the job, collecting or streaming it) is shared and lives in format.py and routes.py.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import msgspec
from msgspec import UNSET

from streamengine.errors import LimitExceededError
from streamengine.sample.sampling_params import SamplingParams
from streamengine.server.openai import schemas as s
from streamengine.server.openai.errors import OpenAIError, validation_error
from streamengine.server.openai.fields import EndpointName, check_refused, unsupported
from streamengine.server.openai.guided import guided_specs
from streamengine.server.openai.prompts import PromptJob, completion_prompts, prompt_job, truncation
from streamengine.server.state import (
    BadTemplateOptions,
    ChatTemplateOptions,
    ServerState,
    new_request_id,
)
from streamengine.server.tools import NO_TOOLS, ToolPlan, plan_tools
from streamengine.structured.tool_calls import ToolCall, ToolCallDelta, ToolParser

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bounds
MAX_CHAT_TOP_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 1024  # vLLM's bound

Body = TypeVar("Body", bound=s.RequestBase)

_PASSTHROUGH = (
    "n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k",
    "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output", "logit_bias",
)


@dataclass(slots=True)
class Job:
    """A prepared request: everything the route decided before talking to the engine. Each
    prompt runs as its own engine request; its choices are `n` in a row, prompt by prompt."""

    endpoint: Endpoint[Any]
    response_id: str
    created: int
    prompts: list[PromptJob]
    params: SamplingParams
    top_logprobs: int | None  # how many alternatives to report; None = no logprobs
    stream: bool
    include_usage: bool
    user: str | None = None  # OpenAI's `user`: salts the request's private blocks per user
    tool_parser: ToolParser | None = None  # reads tool calls out of each output; None: plain text
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage in every chunk
    cache_salt: str | None = None  # vLLM's, mixed into the key's and user's salt
    echo_only: bool = False  # max_tokens 0 with echo: the one token computed is not returned
    echo_logprobs: bool = False  # the prompt's logprobs lead each choice's (echo with logprobs)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives to report
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: tokens as "token_id:<id>"
    lora: str | None = None  # the LoRA adapter `model` names; None: the base model (or the tenant's adapter)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n


@dataclass(slots=True)
class Prepared:
    """What an endpoint makes of a decoded body."""

    prompts: list[str | list[int]]
    params: SamplingParams
    top_logprobs: int | None  # how many alternatives to report; None = no logprobs
    tool_parser: ToolParser | None = None
    # chat prompts are rendered by the template, which writes the special tokens itself
    add_special_tokens: bool = True
    echo: bool | str = False  # True: each prompt's text before its choices; a string: that text
    echo_only: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # Job fields of one endpoint only


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """One token's text and logprob, and the top alternatives, best first (a prompt's first
    token has neither: None)."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None


class Endpoint(ABC, Generic[Body]):
    """One endpoint's body, checks and response shapes; a route uses one for each request."""

    body_type: type[Body]
    name: ClassVar[EndpointName]
    id_prefix: ClassVar[str]
    object: ClassVar[str]  # of a whole response
    chunk_object: ClassVar[str]  # of a streamed chunk

    async def job(self, state: ServerState, raw: bytes) -> Job:
        """Decodes and checks the body and tokenizes its prompts; OpenAIError if it is wrong."""
        body = decode_body(raw, self.body_type)
        check_refused(self.name, raw)
        if body.stream_options is not None and body.stream_options.include_obfuscation:
            raise unsupported("stream_options.include_obfuscation", "streams are not padded")
        lora = check_model(state, body.model)
        prepared = self.prepare(state, body)
        cut = truncation(body.truncate_prompt_tokens, body.truncation_side)
        prompts = [await prompt_job(state, prompt, add_special_tokens=prepared.add_special_tokens, cut=cut,
                                    echo=prepared.echo) for prompt in prepared.prompts]
        return Job(self, _response_id(self.id_prefix, body.request_id), int(time.time()), prompts,
                   prepared.params, prepared.top_logprobs, bool(body.stream), body.include_usage, body.user,
                   prepared.tool_parser, continuous_usage=body.continuous_usage,
                   cache_salt=_cache_salt(body.cache_salt), echo_only=prepared.echo_only,
                   prompt_logprobs=body.prompt_logprobs, tokens_as_ids=bool(body.return_tokens_as_token_ids),
                   lora=lora, **prepared.extra)

    @abstractmethod
    def prepare(self, state: ServerState, body: Body) -> Prepared:
        """The prompts, the sampling params, how many top logprobs and the tool parser."""

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

    def opening_choices(self, job: Job) -> list[s.Choice]:
        """Choices sent, one per chunk, before any output."""
        return []


class Completions(Endpoint[s.CompletionRequest]):
    body_type = s.CompletionRequest
    name = "completions"
    id_prefix = "cmpl"
    object = chunk_object = "text_completion"

    def prepare(self, state: ServerState, body: s.CompletionRequest) -> Prepared:
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise OpenAIError(400, f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}", param="logprobs")
        prompts = completion_prompts(body.prompt)
        echo = bool(body.echo)
        echo_only = echo and body.max_tokens == 0  # the prompt alone (OpenAI's way to score it)
        echo_logprobs = echo and body.logprobs is not None
        # the prompt's logprobs for echo come from the engine's prompt_logprobs, as in vLLM
        wanted = [k for k in (body.prompt_logprobs, body.logprobs if echo_logprobs else None) if k is not None]
        params = sampling_params(body, 1 if echo_only else body.max_tokens, body.logprobs,
                                 _structured(body, NO_TOOLS), prompt_logprobs=max(wanted, default=None))
        return Prepared(prompts, params, body.logprobs, add_special_tokens=body.add_special_tokens is not False,
                        echo=echo, echo_only=echo_only, extra={"echo_logprobs": echo_logprobs})

    def logprobs(self, entries: list[LogprobEntry], offset: int) -> s.CompletionLogprobs:
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        return s.CompletionLogprobs(
            tokens=[e.token for e in entries],
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[dict(e.top) if e.top is not None else None for e in entries],
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
    name = "chat"
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
        params = sampling_params(body, max_tokens, top_logprobs, _structured(body, plan),
                                 prompt_logprobs=body.prompt_logprobs)
        messages = [message_dict(m, i) for i, m in enumerate(body.messages)]
        try:
            prompt = state.chat_prompt(messages, plan.functions, template_options(body))
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
        echo = _chat_echo(messages) if body.echo else False
        return Prepared([prompt], params, top_logprobs, plan.parser, add_special_tokens=bool(body.add_special_tokens),
                        echo=echo)

    def logprobs(self, entries: list[LogprobEntry], offset: int) -> s.ChatLogprobs:
        # chat never reports prompt tokens, the only entries without a logprob
        return s.ChatLogprobs([
            s.TokenLogprob(e.token, e.logprob or 0.0, list(e.token.encode()),
                           [s.TopLogprob(alt, lp, list(alt.encode())) for alt, lp in e.top or ()])
            for e in entries
        ])

    def choice(self, index: int, text: str | None, logprobs: s.Logprobs | None, finish_reason: str | None,
               tool_calls: list[ToolCall] | None = None) -> s.ChatChoice:
        calls = [s.ToolCall(c.id, s.FunctionCall(c.name, c.arguments)) for c in tool_calls or ()]
        return s.ChatChoice(index, s.AssistantMessage("assistant", text, calls or UNSET), logprobs, finish_reason)

    def delta_choice(self, index: int, text: str, logprobs: s.Logprobs | None, finish_reason: str | None,
                     tool_calls: list[ToolCallDelta] | None = None) -> s.ChatChunkChoice:
        calls = [s.DeltaToolCall(index=c.index, id=c.id, type="function" if c.id is not None else None,
                                 function=s.DeltaFunctionCall(name=c.name, arguments=c.arguments))
                 for c in tool_calls or ()]
        return s.ChatChunkChoice(index, s.ChatDelta(content=text or None, tool_calls=calls or None), logprobs,
                                 finish_reason)

    def opening_choices(self, job: Job) -> list[s.Choice]:
        # OpenAI opens each choice with the role; an echo of the assistant's last message follows it
        echo = job.prompts[0].echo or ""
        return [s.ChatChunkChoice(i, s.ChatDelta("assistant", echo), None, None) for i in range(job.num_choices)]


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


def check_model(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names, None for the base model (or no `model`);
    404 model_not_found for a name that is neither."""
    if model is None or model == state.model_name:
        return None
    if model in state.lora_adapters():
        return model
    raise model_not_found(state, model)


def model_not_found(state: ServerState, model: str) -> OpenAIError:
    served = ", ".join(f"`{name}`" for name in (state.model_name, *sorted(state.lora_adapters())))
    return OpenAIError(404, f"The model `{model}` does not exist; this server serves {served}.",
                       param="model", code="model_not_found")


def sampling_params(body: s.RequestBase, max_tokens: int | None, logprobs: int | None,
                    structured: dict[str, Any] | None, *, prompt_logprobs: int | None = None) -> SamplingParams:
    fields: dict[str, Any] = {name: getattr(body, name) for name in _PASSTHROUGH if getattr(body, name) is not None}
    fields["max_tokens"] = max_tokens
    fields["logprobs"] = logprobs
    if body.stop is not None:
        fields["stop"] = body.stop
    if structured is not None:
        fields["structured"] = structured
    if body.prompt_logprobs is not None and body.stream:  # as vLLM: no place for them in a stream
        raise OpenAIError(400, "prompt_logprobs are not available with stream", param="prompt_logprobs")
    if prompt_logprobs is not None:  # vLLM's field, or what echo with logprobs needs
        fields["prompt_logprobs"] = prompt_logprobs
    fields.update(_search(body))
    try:
        return SamplingParams.from_dict(fields)
    except LimitExceededError as exc:
        raise OpenAIError(400, str(exc), param=exc.limit, code="limit_exceeded") from None
    except ValueError as exc:
        raise validation_error(exc) from None


def _search(body: s.RequestBase) -> dict[str, Any]:
    """Beam search (vLLM's use_beam_search: n beams, or best_of), or checks that nothing
    asks for it: best_of beyond n, length_penalty and early_stopping mean beams."""
    n = body.n or 1
    if body.use_beam_search:
        width = body.best_of if body.best_of is not None else n
        if width < n:
            raise OpenAIError(400, f"best_of ({width}) must be >= n ({n})", param="best_of")
        # one beam is greedy decoding, which is what SamplingParams runs at temperature 0
        fields: dict[str, Any] = {"beam_width": width} if width > 1 else {"temperature": 0.0}
        if body.length_penalty is not None:
            fields["length_penalty"] = body.length_penalty
        if body.early_stopping is not None:
            fields["early_stopping"] = body.early_stopping
        return fields
    if body.best_of is not None and body.best_of != n:
        raise unsupported("best_of", "best_of other than n needs use_beam_search here (sampling best_of and "
                          "returning the n most likely is not implemented)")
    if body.length_penalty not in (None, 1.0):
        raise OpenAIError(400, "length_penalty applies only with use_beam_search", param="length_penalty")
    if body.early_stopping:
        raise OpenAIError(400, "early_stopping applies only with use_beam_search", param="early_stopping")
    return {}


def template_options(body: s.ChatCompletionRequest) -> ChatTemplateOptions:
    try:
        return ChatTemplateOptions(body.add_generation_prompt is not False, bool(body.continue_final_message),
                                   dict(body.chat_template_kwargs or {}), body.documents)
    except BadTemplateOptions as exc:
        raise OpenAIError(400, str(exc), param=exc.param) from None


def _response_id(prefix: str, request_id: str | None) -> str:
    return new_request_id(prefix) if request_id is None else f"{prefix}-{request_id}"


def _cache_salt(salt: str | None) -> str | None:
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise OpenAIError(400, f"cache_salt must have 1 to {MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
    return salt


def _chat_echo(messages: list[dict[str, Any]]) -> str:
    """vLLM's chat echo: the last message's content leads the reply when it is the assistant's
    (a reply the model continues), else nothing."""
    last = messages[-1] if messages else {}
    return last.get("content") or "" if last.get("role") == "assistant" else ""


def _tool_plan(state: ServerState, body: s.ChatCompletionRequest) -> ToolPlan:
    if body.tools is None and body.tool_choice is None:
        return NO_TOOLS
    try:
        return plan_tools(body.tools or (), body.tool_choice, parallel=body.parallel_tool_calls is True,
                          parser_name=state.config.tool_parser)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="tool_choice") from None


def _structured(body: s.RequestBase, plan: ToolPlan) -> dict[str, Any] | None:
    """The request's structured output: from response_format, the `structured` extension,
    vLLM's structured_outputs or guided_* fields, or a forced tool call; at most one of them."""
    given = [(name, spec) for name, spec in (
        ("response_format", _response_format(body.response_format)),
        ("structured", body.structured),
        *guided_specs(body),
        ("tool_choice", plan.structured),
    ) if spec is not None]
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise OpenAIError(400, "give only one of response_format, structured, structured_outputs, the guided_* "
                          f"fields and a forced tool call (tool_choice required or named); this request gives "
                          f"{names}", param=given[0][0])
    return given[0][1] if given else None


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


def message_dict(message: s.ChatMessage, i: int) -> dict[str, Any]:
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
