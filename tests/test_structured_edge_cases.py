"""Structured outputs and tool calls at their edges, through the OpenAI HTTP route on the tiny
random Llama (SmolLM2's tokenizer): random weights write anything, so every valid output below
is the grammar's doing.

- GBNF grammars that llguidance's Python converter rejects with something other than its own
  error type (an undefined rule, no root rule, a trailing backslash, deep nesting) are a 400
  `invalid_grammar`, never a 500, and the engine keeps serving.
- A forced tool call (tool_choice named or "required") whose `parameters` use `$defs` /
  `definitions` with `$ref` (as pydantic writes nested models) compiles, and its arguments
  validate against the tool's schema.
- A forced call of a tool whose `parameters` do not say `"type": "object"` (only properties
  and required, as hand-written tools often do) still comes back as a call with an object of
  arguments, not as content holding `"arguments": "..."` or `false`; parameters whose type
  rules objects out are a 400 `invalid_grammar`.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer

from streamengine import AsyncEngine, EngineConfig
from streamengine.server import create_app
from streamengine.server.config import ServerConfig

ASK = [{"role": "user", "content": "Where?"}]
BAD_GBNF = {
    "undefined rule": "root ::= x",
    "no root rule": "item ::= \"a\"",
    "trailing backslash in a class": "root ::= [\\",
    "nested too deeply": "root ::= " + "(" * 3000 + "\"a\"" + ")" * 3000,
}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}}, "required": ["city"],
        "additionalProperties": False}
DEFS_PARAMS = {  # pydantic's shape for a model with a nested model field
    "type": "object",
    "properties": {"where": {"$ref": "#/$defs/City"}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["where", "days"],
    "additionalProperties": False,
    "$defs": {"City": CITY},
}
DEFINITIONS_PARAMS = {  # draft-07's name, with the whole parameters a reference
    "$ref": "#/definitions/Trip",
    "definitions": {
        "Trip": {"type": "object", "properties": {"to": {"$ref": "#/definitions/City"}}, "required": ["to"],
                 "additionalProperties": False},
        "City": CITY,
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": DEFS_PARAMS}},
    {"type": "function", "function": {"name": "book", "parameters": DEFINITIONS_PARAMS}},
]


@pytest.fixture
async def client(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=256, max_num_seqs=8)
    async with AsyncEngine(config) as engine:
        async with TestClient(TestServer(create_app(engine, ServerConfig(model_name="tiny")))) as http:
            yield http


async def chat(client, **body) -> tuple[int, dict]:
    response = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body})
    return response.status, await response.json()


@pytest.mark.parametrize("grammar", BAD_GBNF.values(), ids=BAD_GBNF.keys())
async def test_bad_gbnf_grammars_are_400_invalid_grammar(client, grammar):
    structured = {"type": "grammar", "syntax": "ebnf", "grammar": grammar}
    for stream in (False, True):  # the stream's error comes before any output: a 400 too
        status, body = await chat(client, structured=structured, max_tokens=4, stream=stream)
        assert status == 400, body
        assert body["error"]["code"] == "invalid_grammar", body
        assert body["error"]["message"].startswith("invalid structured-output spec"), body
    status, body = await chat(client, max_tokens=4)  # and the engine still serves
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body


def _arguments(call: dict) -> dict:
    (tool,) = [t for t in TOOLS if t["function"]["name"] == call["function"]["name"]]
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, tool["function"]["parameters"])  # resolves the $refs itself
    return arguments


@pytest.mark.parametrize("name", ["forecast", "book"])
async def test_named_tool_call_with_refs_to_defs_follows_the_schema(client, name):
    choice = {"type": "function", "function": {"name": name}}
    status, body = await chat(client, tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=1.0, seed=3, n=2)
    assert status == 200, body
    for sample in body["choices"]:
        assert sample["finish_reason"] == "tool_calls", sample
        (call,) = sample["message"]["tool_calls"]
        assert call["function"]["name"] == name
        arguments = _arguments(call)
        city = arguments["where"] if name == "forecast" else arguments["to"]
        assert city["city"] in ("Paris", "Oslo", "Lima")


async def test_required_tool_call_with_refs_to_defs_follows_the_schema(client):
    status, body = await chat(client, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=1.0,
                              seed=5, n=4)
    assert status == 200, body
    for sample in body["choices"]:
        assert sample["finish_reason"] == "tool_calls", sample
        (call,) = sample["message"]["tool_calls"]
        _arguments(call)


UNTYPED_PARAMS = {"properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"], "additionalProperties": False}


async def test_forced_call_of_a_tool_with_untyped_parameters_has_object_arguments(client):
    tools = [{"type": "function", "function": {"name": "temp", "parameters": UNTYPED_PARAMS}}]
    status, body = await chat(client, tools=tools, tool_choice="required", max_tokens=40, temperature=1.0,
                              seed=2, n=6)
    assert status == 200, body
    for sample in body["choices"]:
        assert sample["finish_reason"] == "tool_calls", sample
        assert sample["message"]["content"] is None, sample
        (call,) = sample["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) in ({"unit": "c"}, {"unit": "f"})


async def test_forced_call_of_a_tool_whose_parameters_exclude_objects_is_a_400(client):
    tools = [{"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}}]
    status, body = await chat(client, tools=tools, tool_choice="required", max_tokens=8)
    assert status == 400 and body["error"]["code"] == "invalid_grammar", body
