"""Structured outputs and tool calls through the real `openai` client and the WebSocket, with
the default SmolLM2 model (its outputs must be valid, not just well-shaped)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_openai import live_server
from test_server import connect, recv

from streamengine import AsyncEngine, EngineConfig
from streamengine.server import create_app
from streamengine.server.config import ServerConfig

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a city now.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                     "maxLength": 24}}, "required": ["city"]}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0, "max_tokens": 60}
FORCED_TIME_CALL = (
    'start: "<tool_call>\\n" %json {"type": "object", "properties": {"name": {"const": "get_time"}, '
    '"arguments": {"type": "object", "properties": {"city": {"const": "Oslo"}}, "required": ["city"], '
    '"additionalProperties": false}}, '
    '"required": ["name", "arguments"], "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", '
    '"key_separator": ": "}} "\\n</tool_call>"'
)


@pytest.fixture(scope="module")
def engine(smollm_dir):
    return AsyncEngine(EngineConfig(model=str(smollm_dir), num_gpu_blocks=256, max_num_seqs=8))


@contextlib.asynccontextmanager
async def serve(engine):
    """A live server and a client with room for a loaded machine (requests run concurrently)."""
    async with live_server(engine) as (client, base):
        yield client.with_options(timeout=180), base


def _validate_call(call, tools=TOOLS) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    (tool,) = [t for t in tools if t["function"]["name"] == call.function.name]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


async def _streamed_calls(stream) -> tuple[str, dict[int, dict], str | None]:
    """A stream's content, its calls reassembled by index, and its finish reason."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            entry = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += part.id or ""
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=50_000_000)


async def test_response_format_and_parse(engine):
    async with serve(engine) as (client, _):
        as_object, people, parsed, chosen = await asyncio.gather(
            client.chat.completions.create(
                model="tiny", response_format={"type": "json_object"}, **GREEDY,
                messages=[{"role": "user", "content": "Give a JSON object with the keys name and age of a person."}]),
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Invent a person."}], n=2, temperature=1.0,
                seed=3, max_tokens=GREEDY["max_tokens"],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}),
            client.chat.completions.parse(
                model="tiny", messages=[{"role": "user", "content": "Tell me about Paris."}], response_format=City,
                **GREEDY),
            client.completions.create(  # the engine's own spec, on the completions endpoint too
                model="tiny", prompt="Is the sky blue? Answer:", max_tokens=8, temperature=1.0, n=3, seed=1,
                extra_body={"structured": {"type": "choice", "choices": [" yes", " no", " maybe"]}}),
        )
        assert as_object.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(as_object.choices[0].message.content), dict)
        for choice in people.choices:
            assert choice.finish_reason == "stop" and choice.message.tool_calls is None
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        city = parsed.choices[0].message.parsed
        assert isinstance(city, City) and city.name
        assert all(c.text in (" yes", " no", " maybe") and c.finish_reason == "stop" for c in chosen.choices)


async def test_required_tool_call_whole_and_streamed(engine):
    async with serve(engine) as (client, _):
        chat, stream = await asyncio.gather(
            client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY),
            client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           stream=True, **GREEDY),
        )
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        arguments = _validate_call(call)
        content, calls, finish = await _streamed_calls(stream)
        assert finish == "tool_calls" and content == ""
        assert list(calls) == [0] and calls[0]["id"].startswith("call_")
        assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == (call.function.name, arguments)
        assert calls[0]["arguments"] == call.function.arguments  # the same text, streamed or not


async def test_named_tool_choice_then_the_tool_result(engine):
    async with serve(engine) as (client, _):
        chat = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, **GREEDY)
        assert chat.choices[0].finish_reason == "tool_calls"
        (call,) = chat.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        _validate_call(call)
        follow_up = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"time": "14:05"}'},
        ]
        answer = await client.chat.completions.create(
            model="tiny", messages=follow_up, tools=TOOLS, max_tokens=12, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert answer.usage.prompt_tokens > chat.usage.prompt_tokens  # the call and its result are in the prompt


async def test_auto_parses_a_call_the_model_writes_and_none_does_not(engine):
    # `structured` (this server's extension) makes the model write a Hermes call: with
    # tool_choice "auto" it comes back parsed, with "none" as plain content
    structured = {"type": "grammar", "grammar": FORCED_TIME_CALL}
    async with serve(engine) as (client, _):
        auto, none = await asyncio.gather(*(
            client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY,
                                           extra_body={"structured": structured})
            for choice in ("auto", "none")))
        choice = auto.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_time", {"city": "Oslo"})]
        assert none.choices[0].finish_reason == "stop" and none.choices[0].message.tool_calls is None
        assert none.choices[0].message.content == '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'


async def test_bad_requests_are_400s_with_a_clear_message(engine):
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        create_app(engine, ServerConfig(tool_parser="nope"))
    async with serve(engine) as (client, _):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(
                    model="tiny", messages=ASK, max_tokens=8, stream=stream,
                    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}})
            error = info.value.body
            assert error["code"] == "invalid_grammar" and "foo" in error["message"], error
        cases = [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
             "response_format.json_schema.schema", "needs json_schema.schema"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
             "tool_choice", "'nope', which is not among the tools"),
            ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
            ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
             "response_format", "only one of"),
        ]
        for fields, param, text in cases:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, **fields)
            assert info.value.body["param"] == param and text in info.value.body["message"], info.value.body


async def _ws_generate(ws, requests: list[dict]) -> dict[str, tuple[str, list[dict], dict]]:
    """Sends the requests at once; per id the text, the tool calls (their parts put together)
    and the `done` message."""
    for request in requests:
        await ws.send_json({"type": "generate", **request})
    out: dict[str, list] = {r["id"]: ["", [], None] for r in requests}
    while any(entry[2] is None for entry in out.values()):
        msg = await recv(ws, timeout=180)
        assert msg["type"] in ("delta", "done"), msg
        entry = out[msg["id"]]
        if msg["type"] == "done":
            entry[2] = msg
            continue
        entry[0] += msg["text"]
        for part in msg.get("tool_calls", []):
            if "id" in part:  # a call opens, with its name (and the arguments that came with it)
                assert part["index"] == len(entry[1]) and part["type"] == "function", part
                entry[1].append(part)
            else:
                entry[1][part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    return {key: tuple(entry) for key, entry in out.items()}


async def test_websocket_structured_and_tools(engine):
    app = create_app(engine, ServerConfig(model_name="tiny"))
    async with TestClient(TestServer(app)) as client:
        ws = await connect(client)
        out = await _ws_generate(ws, [
            {"id": "json", "messages": ASK, "params": {**GREEDY, "structured": {"type": "json_schema",
                                                                              "schema": PERSON}}},
            {"id": "tool", "messages": ASK, "tools": TOOLS, "params": GREEDY,
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        ])
        text, calls, done = out["json"]
        assert done["finish_reason"] == "stop" and calls == []
        jsonschema.validate(json.loads(text), PERSON)
        text, calls, done = out["tool"]
        assert done["finish_reasons"] == ["tool_calls"] and text == ""
        (call,) = calls
        assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_PARAMS)

        await ws.send_json({"type": "generate", "id": "bad", "prompt": "x",
                            "params": {"structured": {"type": "regex", "pattern": "("}}})
        error = await recv(ws)
        assert (error["type"], error["id"], error["code"]) == ("error", "bad", "invalid_grammar"), error
        await ws.send_json({"type": "generate", "id": "bad2", "prompt": "x", "tools": TOOLS})
        error = await recv(ws)
        assert (error["code"], error["message"]) == ("invalid_params", "`tools` and `tool_choice` need `messages`")
        await ws.close()
