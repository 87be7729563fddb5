"""Every request field OpenAI or vLLM defines for `/v1/chat/completions` and `/v1/completions`,
and what this server does with it: the table docs/server.md prints.

A field is implemented (a field of the endpoint's request Struct in schemas.py, read and
honoured) or refused: a request that gives a refused field a value that asks for something
gets a 400 naming it (`param`, code `unsupported_parameter`). A refused field still passes
with a value that asks for nothing (null, and where the table says so the field's default,
such as `store: false` or `priority: 0`), since clients send defaults they were never asked
about. A field meant for the other endpoint (`prompt` on chat, `messages` on completions) is
refused the same way. Only fields nobody defines pass unread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from streamengine.server.openai.errors import OpenAIError

EndpointName = Literal["chat", "completions"]
ENDPOINT_PATHS: dict[EndpointName, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

Inert = Callable[[Any], bool]
"""Whether a field's value asks for nothing."""


def _null(value: Any) -> bool:
    return value is None


def _allowing(*values: Any) -> Inert:
    """null, or one of `values` (a field's default, or what this server does anyway)."""
    def inert(value: Any) -> bool:
        return value is None or any(value == v and type(value) is type(v) for v in values)
    return inert


_EMPTY = _allowing("", [], {})


@dataclass(frozen=True, slots=True)
class Implemented:
    note: str = ""


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str
    inert: Inert = _null
    accepted: str = ""  # the values that pass, for the docs ("false", "0"); null always does


Status = Implemented | Refused


@dataclass(frozen=True, slots=True)
class FieldRule:
    name: str
    openai: frozenset[EndpointName]  # the endpoints OpenAI's API defines it for
    vllm: frozenset[EndpointName]  # the endpoints vLLM defines it for (any recent version)
    chat: Status
    completions: Status

    def status(self, endpoint: EndpointName) -> Status:
        return self.chat if endpoint == "chat" else self.completions


C: frozenset[EndpointName] = frozenset({"chat"})
P: frozenset[EndpointName] = frozenset({"completions"})
B: frozenset[EndpointName] = C | P
N: frozenset[EndpointName] = frozenset()
YES = Implemented()


def _only_on(endpoint: EndpointName) -> Refused:
    return Refused(f"a field of {ENDPOINT_PATHS[endpoint]}, not of this endpoint")


def _both(name: str, openai: frozenset[EndpointName], vllm: frozenset[EndpointName],
          status: Status = YES) -> FieldRule:
    return FieldRule(name, openai, vllm, status, status)


def _chat(name: str, openai: frozenset[EndpointName], vllm: frozenset[EndpointName],
          status: Status = YES) -> FieldRule:
    return FieldRule(name, openai, vllm, status, _only_on("chat"))


def _completions(name: str, openai: frozenset[EndpointName], vllm: frozenset[EndpointName],
                 status: Status = YES) -> FieldRule:
    return FieldRule(name, openai, vllm, _only_on("completions"), status)


_BEAM_NOTE = "with use_beam_search"
_NO_REASONING = "this server has no reasoning parser or reasoning budget"
_NO_MULTIMODAL = "this server serves text models only"
_NO_DISAGGREGATION = "no disaggregated prefill or encoder cache transfer here"

RULES: tuple[FieldRule, ...] = (
    # -- OpenAI's fields, both endpoints
    _both("model", B, B, Implemented(
        "the served model's id (the tenant's LoRA adapter, if its config names one, or the base "
        "model), or a loaded LoRA adapter's name (runs the request under it); the response's model "
        "echoes it; another name is a 404 model_not_found")),
    _both("n", B, B),
    _both("temperature", B, B),
    _both("top_p", B, B),
    _both("stop", B, B),
    _both("seed", B, B),
    _both("stream", B, B),
    _both("stream_options", B, B, Implemented(
        "include_usage, and vLLM's continuous_usage_stats (the usage so far in every chunk); "
        "include_obfuscation true is a 400")),
    _both("logit_bias", B, B),
    _both("presence_penalty", B, B),
    _both("frequency_penalty", B, B),
    _both("user", B, B, Implemented("salts the request's prefix-cache blocks per user")),
    _both("logprobs", B, B, Implemented("chat: true/false; completions: 0-5 top alternatives")),
    _both("echo", P, B, Implemented(
        "completions: the prompt before each choice's text (its logprobs too, with logprobs); "
        "chat: the last message's content before the reply when it is the assistant's")),
    _both("response_format", C, B, Implemented("text, json_object, json_schema")),
    _both("best_of", P, B, Implemented(
        "equal to n, or the beam width with use_beam_search; another value is a 400 "
        "(sampling more and keeping the likeliest is not implemented)")),
    _completions("prompt", P, P, Implemented("a string, a list of strings, token ids, or a list of id lists")),
    _both("max_tokens", B, B, Implemented("completions: 0 with echo returns the prompt only")),
    _completions("suffix", P, P, Refused("fill-in-the-middle (suffix) is not implemented", _allowing(""),
                                         '""')),
    # -- OpenAI's chat fields
    _chat("messages", C, C, Implemented("text content (string or text parts)")),
    _chat("max_completion_tokens", C, C),
    _chat("top_logprobs", C, C),
    _chat("tools", C, C),
    _chat("tool_choice", C, C),
    _chat("parallel_tool_calls", C, C),
    _chat("audio", C, N, Refused("audio output is not supported")),
    _chat("modalities", C, N, Refused("only text output is supported", _allowing(["text"]), '["text"]')),
    _chat("functions", C, N, Refused("the legacy functions API is not supported: use tools")),
    _chat("function_call", C, N, Refused("the legacy functions API is not supported: use tool_choice")),
    _chat("prediction", C, N, Refused("predicted outputs are not implemented")),
    _chat("store", C, N, Refused("completions are not stored", _allowing(False), "false")),
    _chat("metadata", C, N, Refused("completions are not stored, so there is nothing to tag", _EMPTY, "{}")),
    _chat("service_tier", C, N, Refused("there is one service tier", _allowing("auto", "default"),
                                        '"auto", "default"')),
    _chat("prompt_cache_key", C, N, Refused(
        "OpenAI's cache routing hint has no meaning here: the prefix cache is shared per API key "
        "and `user` (see cache_salt)")),
    _chat("prompt_cache_options", C, N, Refused("OpenAI's prompt cache options have no meaning here")),
    _chat("prompt_cache_retention", C, N, Refused("cached prefixes live as long as the pool keeps them")),
    _chat("safety_identifier", C, N, Refused("no abuse monitoring here to pass it to")),
    _chat("moderation", C, N, Refused("no moderation here")),
    _chat("verbosity", C, N, Refused("not a model parameter this server can apply")),
    _chat("web_search_options", C, N, Refused("no web search here")),
    _chat("reasoning_effort", C, C, Refused(_NO_REASONING)),
    # -- vLLM's sampling fields
    _both("top_k", N, B),
    _both("min_p", N, B),
    _both("repetition_penalty", N, B),
    _both("min_tokens", N, B),
    _both("ignore_eos", N, B),
    _both("stop_token_ids", N, B),
    _both("skip_special_tokens", N, B),
    _both("include_stop_str_in_output", N, B),
    _both("use_beam_search", N, B, Implemented("beam width n (or best_of); deterministic")),
    _both("length_penalty", N, B, Implemented(_BEAM_NOTE + "; another value without it is a 400")),
    _both("early_stopping", N, B, Implemented(_BEAM_NOTE + "; true without it is a 400")),
    _both("prompt_logprobs", N, B, Implemented(
        "not with stream; completions: in each choice, chat: in the response (vLLM's shapes)")),
    _both("truncate_prompt_tokens", N, B, Implemented("keeps the last k prompt tokens; -1: the model's length")),
    _both("truncation_side", N, B, Implemented("left (the default) or right")),
    _both("add_special_tokens", N, B, Implemented("default true on completions, false on chat")),
    _both("spaces_between_special_tokens", N, B, Refused(
        "special tokens are decoded as the tokenizer writes them", _allowing(True), "true")),
    _both("allowed_token_ids", N, B, Refused("not implemented (logit_bias can ban or force tokens)")),
    _both("bad_words", N, B, Refused("not implemented", _EMPTY, "[]")),
    _both("logprob_token_ids", N, B, Refused("not implemented: logprobs gives the top alternatives")),
    _both("logits_processors", N, B, Refused("no code from requests is run")),
    _both("watermarking", N, B, Refused("not implemented", _allowing(False), "false")),
    _both("thinking_token_budget", N, B, Refused(_NO_REASONING, _allowing(-1), "-1")),
    _both("repetition_detection", N, B, Refused("not implemented")),
    _both("stream_interval", N, B, Refused("every step's tokens are sent as they come", _allowing(1), "1")),
    # -- vLLM's structured outputs
    _both("structured_outputs", N, B, Implemented(
        "json, regex, choice, grammar, json_object; disable_fallback and disable_any_whitespace "
        "accepted (no fallback, JSON is written compactly); whitespace_pattern and structural_tag refused")),
    _both("guided_json", N, B),
    _both("guided_regex", N, B),
    _both("guided_choice", N, B),
    _both("guided_grammar", N, B, Implemented("GBNF (a rule with ::=) or Lark")),
    _both("guided_decoding_backend", N, B, Refused(
        "the grammar backend is llguidance (vLLM's guidance backend)", _allowing("auto", "guidance"),
        '"auto", "guidance"')),
    _both("guided_whitespace_pattern", N, B, Refused("JSON is written without free whitespace")),
    _both("structural_tag", N, B, Refused("structural tags are not implemented")),
    _both("structured", N, N, Implemented("this server's own: the engine's spec, {\"type\": ...}")),
    # -- vLLM's chat template fields
    _chat("add_generation_prompt", N, C),
    _chat("continue_final_message", N, C),
    _chat("chat_template_kwargs", N, C, Implemented("passed to the template (reserved keys refused)")),
    _chat("documents", N, C, Implemented("passed to the template")),
    _chat("chat_template", N, C, Refused("templates are not taken from requests")),
    _chat("include_reasoning", N, C, Refused(_NO_REASONING, _allowing(True), "true")),
    _chat("return_prompt_text", N, C, Refused("not implemented", _allowing(False), "false")),
    _chat("media_io_kwargs", N, C, Refused(_NO_MULTIMODAL)),
    _chat("mm_processor_kwargs", N, C, Refused(_NO_MULTIMODAL)),
    _completions("prompt_embeds", N, P, Refused("prompts are text or token ids")),
    # -- vLLM's request plumbing
    _both("request_id", N, B, Implemented("the response's id: cmpl- or chatcmpl- and this id")),
    _both("cache_salt", N, B, Implemented("salts the prefix cache further (beside the key's and user's)")),
    _both("return_tokens_as_token_ids", N, B, Implemented("logprobs name each token token_id:N")),
    _both("priority", N, B, Refused("there is no priority scheduling", _allowing(0), "0")),
    _both("session_id", N, B, Refused("not implemented")),
    _both("return_token_ids", N, B, Refused("not implemented", _allowing(False), "false")),
    _both("return_token_offsets", N, B, Refused("not implemented", _allowing(False), "false")),
    _both("return_mm_kwargs", N, B, Refused(_NO_MULTIMODAL, _allowing(True), "true")),
    _both("routed_experts_prompt_start", N, B, Refused("not implemented", _allowing(0), "0")),
    _both("kv_transfer_params", N, B, Refused(_NO_DISAGGREGATION, _EMPTY, "{}")),
    _both("ec_transfer_params", N, B, Refused(_NO_DISAGGREGATION, _EMPTY, "{}")),
    _both("vllm_xargs", N, B, Refused("no request extensions here", _EMPTY, "{}")),
)

RULES_BY_NAME: dict[str, FieldRule] = {rule.name: rule for rule in RULES}


def implemented(endpoint: EndpointName) -> frozenset[str]:
    """The fields the endpoint reads: exactly its request Struct's fields."""
    return frozenset(r.name for r in RULES if isinstance(r.status(endpoint), Implemented))


def check_refused(endpoint: EndpointName, raw: bytes) -> None:
    """400 for the first refused field the body gives a value that asks for something.

    `raw`: the body as sent, already known to be a JSON object (decoded into its Struct)."""
    fields = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    for name, value in fields.items():
        rule = RULES_BY_NAME.get(name)
        if rule is None:
            continue  # nobody defines it
        status = rule.status(endpoint)
        if isinstance(status, Refused) and not status.inert(msgspec.json.decode(value)):
            raise unsupported(name, status.reason)


def unsupported(param: str, reason: str) -> OpenAIError:
    return OpenAIError(400, f"`{param}` is not supported by this server: {reason}", param=param,
                       code="unsupported_parameter")


# ---- the docs' table ---------------------------------------------------------------------------


def markdown_table(rules: Iterable[FieldRule] = RULES) -> str:
    """The compatibility table of docs/server.md (a test keeps the two equal)."""
    lines = ["| field | OpenAI | vLLM | here |", "|---|---|---|---|"]
    for rule in rules:
        lines.append(f"| `{rule.name}` | {_where(rule.openai)} | {_where(rule.vllm)} | {_here(rule)} |")
    return "\n".join(lines) + "\n"


def _where(endpoints: frozenset[EndpointName]) -> str:
    return {B: "both", C: "chat", P: "completions", N: "—"}[endpoints]


def _here(rule: FieldRule) -> str:
    if rule.chat == rule.completions:
        return _status_text(rule.chat)
    return f"chat: {_status_text(rule.chat)}; completions: {_status_text(rule.completions)}"


def _status_text(status: Status) -> str:
    if isinstance(status, Implemented):
        return "implemented" + (f": {status.note}" if status.note else "")
    if status.reason.startswith("a field of /v1/"):
        return "400 (the other endpoint's field)"
    accepted = f"; {status.accepted} accepted" if status.accepted else ""
    return f"400: {status.reason}{accepted}"
