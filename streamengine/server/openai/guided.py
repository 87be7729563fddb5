"""vLLM's ways of constraining an output, as the engine's structured specs.

vLLM takes `structured_outputs` (its StructuredOutputsParams: one of `json`, `regex`,
`choice`, `grammar`, `json_object`) and, in older versions, the same as top-level fields
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. Each becomes one spec of
structured/params.py (the path `response_format` takes), named by the field that gave it, so
a request that gives two ways can be told which two.
"""

from __future__ import annotations

import json
import re
from typing import Any

from streamengine.server.openai import schemas as s
from streamengine.server.openai.errors import OpenAIError
from streamengine.server.openai.fields import unsupported

Spec = dict[str, Any]

_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)
_OPTIONS = ("json", "regex", "choice", "grammar", "json_object")


def guided_specs(body: s.RequestBase) -> list[tuple[str, Spec | None]]:
    """(field, spec or None) for each of vLLM's fields, in a fixed order."""
    return [
        ("structured_outputs", _structured_outputs(body.structured_outputs)),
        ("guided_json", None if body.guided_json is None else _json_spec(body.guided_json, "guided_json")),
        ("guided_regex", None if body.guided_regex is None else {"type": "regex", "pattern": body.guided_regex}),
        ("guided_choice", None if body.guided_choice is None else {"type": "choice", "choices": body.guided_choice}),
        ("guided_grammar", None if body.guided_grammar is None else grammar_spec(body.guided_grammar)),
    ]


def grammar_spec(text: str) -> Spec:
    """vLLM's `grammar` is GBNF (xgrammar's, `root ::= ...`) or, with its guidance backend,
    Lark: a rule written with `::=` says which, as llguidance itself tells them apart."""
    syntax = "ebnf" if _GBNF_RULE.search(text) else "lark"
    return {"type": "grammar", "grammar": text, "syntax": syntax}


def _structured_outputs(params: s.StructuredOutputsParams | None) -> Spec | None:
    if params is None:
        return None
    for option, reason in (("whitespace_pattern", "JSON is written without free whitespace"),
                           ("structural_tag", "structural tags are not implemented")):
        if getattr(params, option) is not None:
            raise unsupported(f"structured_outputs.{option}", reason)
    given = [name for name in _OPTIONS if _given(params, name)]
    if len(given) != 1:
        raise OpenAIError(400, f"structured_outputs needs exactly one of {', '.join(_OPTIONS)}; "
                          f"got {', '.join(given) or 'none'}", param="structured_outputs")
    option = given[0]
    value = getattr(params, option)
    if option == "json":
        return _json_spec(value, "structured_outputs.json")
    if option == "regex":
        return {"type": "regex", "pattern": value}
    if option == "choice":
        return {"type": "choice", "choices": value}
    if option == "grammar":
        return grammar_spec(value)
    return {"type": "json_object"}


def _given(params: s.StructuredOutputsParams, option: str) -> bool:
    value = getattr(params, option)
    return value is True if option == "json_object" else value is not None


def _json_spec(schema: dict[str, Any] | bool | str, param: str) -> Spec:
    """vLLM takes the schema as an object or as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise OpenAIError(400, f"{param} is not a JSON schema: {exc}", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise OpenAIError(400, f"{param} must be a JSON schema (an object or a boolean)", param=param)
    return {"type": "json_schema", "schema": schema}
