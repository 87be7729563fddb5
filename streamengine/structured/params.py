"""What a constrained request's output must match: a msgspec tagged union, one Struct per kind.

No torch and no llguidance here: the server validates a client's spec with this module alone;
streamengine/structured/grammar.py compiles it. A spec is given as `SamplingParams.structured`, as a
Struct or as a JSON-like dict whose `"type"` names the kind:

    {"type": "json_schema", "schema": {...}}        any JSON Schema (or true / false);
                                                    "strict": false allows unnamed properties
    {"type": "json_object"}                         any JSON object
    {"type": "regex", "pattern": "\\d+"}            the whole output matches the pattern
    {"type": "choice", "choices": ["yes", "no"]}    the output is one of the strings
    {"type": "grammar", "grammar": "start: ...", "syntax": "lark"}   Lark, or "ebnf" (GBNF)
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from streamengine.errors import LimitExceededError

MAX_STRUCTURED_BYTES = 64 * 1024
"""Largest spec, as JSON: bounds what one request can make the grammar compiler read."""
MAX_CHOICES = 1024


class _Spec(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True):
    pass


class JsonSchema(_Spec, tag="json_schema", omit_defaults=True):
    """A JSON Schema, held as json_schema.py describes: with `strict` absent or true, objects
    refuse the properties they do not name unless they allow them explicitly; with `strict`
    false, JSON Schema's own defaults (other properties allowed)."""

    schema: dict[str, Any] | bool
    strict: bool | None = None


class JsonObject(_Spec, tag="json_object"):
    """Any JSON object."""


class Regex(_Spec, tag="regex"):
    pattern: str


class Choice(_Spec, tag="choice"):
    choices: list[str]


class Grammar(_Spec, tag="grammar"):
    grammar: str
    syntax: Literal["lark", "ebnf"] = "lark"


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How constrained JSON is written (llguidance's JSON options): as json.dumps writes it, with
no free whitespace. A small model could otherwise spend its whole budget on newlines inside an
object, or pretty-print a tool call at twice the tokens. A schema's "x-guidance" key may
override it."""

StructuredOutput = JsonSchema | JsonObject | Regex | Choice | Grammar
_KINDS = (JsonSchema, JsonObject, Regex, Choice, Grammar)


def structured_key(spec: StructuredOutput) -> bytes:
    """The spec as JSON bytes, the compile cache's key. Key order is kept, not sorted: a
    schema's properties are generated in the order it lists them (a schema may put
    "reasoning" before "answer" on purpose), so two orders are two grammars."""
    return msgspec.json.encode(spec)


def as_structured(value: object) -> StructuredOutput:
    """`value` (a spec Struct, or a dict naming its "type") as a checked spec; ValueError naming
    what is wrong, LimitExceededError("max_structured_bytes") for a spec that is too large."""
    if isinstance(value, _KINDS):
        check_size(value)
        value = msgspec.to_builtins(value)  # a Struct built directly was never type-checked
    elif not isinstance(value, dict):
        raise ValueError(f"SamplingParams.structured must be a structured-output spec or None, got {value!r}")
    try:
        spec = msgspec.convert(value, StructuredOutput)
    except msgspec.ValidationError as exc:
        raise ValueError(f"SamplingParams.structured: {exc}") from None
    check_size(spec)
    if isinstance(spec, Choice):
        _check_choices(spec.choices)
    if isinstance(spec, Regex) and not spec.pattern or isinstance(spec, Grammar) and not spec.grammar:
        raise ValueError(f"SamplingParams.structured: a {type(spec).__name__.lower()} must not be empty")
    return spec


def check_size(spec: StructuredOutput) -> None:
    size = len(structured_key(spec))
    if size > MAX_STRUCTURED_BYTES:
        raise LimitExceededError(
            "max_structured_bytes",
            f"SamplingParams.structured is {size} bytes as JSON, more than the maximum of {MAX_STRUCTURED_BYTES}",
        )


def _check_choices(choices: list[str]) -> None:
    if not 1 <= len(choices) <= MAX_CHOICES:
        message = f"SamplingParams.structured.choices must hold 1 to {MAX_CHOICES} strings, got {len(choices)}"
        if len(choices) > MAX_CHOICES:
            raise LimitExceededError("max_choices", message)
        raise ValueError(message)
    if "" in choices:
        raise ValueError("SamplingParams.structured.choices must hold non-empty strings")
