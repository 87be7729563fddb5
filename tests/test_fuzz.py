"""Protocol fuzzing: WebSocket messages and OpenAI request bodies drawn from the msgspec schemas
of the structs the server decodes them into, then mutated (wrong types, huge integers, NaN-like
numbers, deep nesting, unknown fields, truncation, invalid UTF-8, binary frames, oversize).

Whatever arrives, the server answers with a structured error or a normal reply (or, for the
two frames RFC 6455 says to refuse, closes with 1007 or 1009), never with a 5xx or an engine
error; and afterwards the engine still serves a normal request and has every block free.
One server and one socket are reused across examples (reconnecting after a close), so the
whole run takes seconds. hypothesis-jsonschema does not work with this hypothesis version,
so a small schema walker below builds the strategies.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import uvloop
from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamengine import AsyncEngine, EngineConfig
from streamengine.sample.sampling_params import SamplingParams
from streamengine.server import create_app
from streamengine.server import openai as oa
from streamengine.server import protocol as p
from streamengine.server.config import ServerConfig
from streamengine.server.websocket import MAX_ERROR_CHARS

WS_ERROR_CODES = {
    p.BAD_JSON, p.TOO_DEEP, p.BAD_MESSAGE, p.BAD_PARAMS, p.DUPLICATE_ID, p.UNKNOWN_ID,
    p.MESSAGE_TOO_LARGE, p.PROMPT_TOO_LONG, p.TOO_MANY_REQUESTS, p.LIMIT_EXCEEDED,
    p.AUTH_NOT_REQUIRED,
}  # not engine_error, timeout, overloaded: no input may make the engine fail
CLOSE_BAD_UTF8, CLOSE_TOO_BIG = 1007, 1009
MAX_MESSAGE_BYTES = 16 * 1024  # aiohttp refuses frames over 4x this with 1009
MAX_BODY_BYTES = 64 * 1024
SENTINEL = "fuzz-sentinel"
FUZZ = settings(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- strategies from the schemas ----------------------------------------------------------------

LEAF = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.integers(),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
SCALARS = {
    "string": lambda node: st.text(max_size=min(node.get("maxLength", 24), 24)),
    # mostly plausible values, so that many requests are valid and run; the rest probe ranges
    "integer": lambda node: st.integers(max(node.get("minimum", 0), 0), min(node.get("maximum", 4), 4))
    | st.integers(node.get("minimum", -3), node.get("maximum", 40)),
    "number": lambda node: st.floats(0.0, 1.0) | st.floats(-3.0, 3.0),
    "boolean": lambda node: st.booleans(),
    "null": lambda node: st.none(),
}


def from_schema(node: dict, defs: dict, overrides: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Values valid for a JSON schema as msgspec writes it ($ref, anyOf, enum, objects...);
    `overrides` replaces the strategy of any property by name (to keep generations short)."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(defs[name], defs, overrides))
    if "anyOf" in node:
        return st.one_of([from_schema(option, defs, overrides) for option in node["anyOf"]])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node.get("type")
    if kind == "object":
        return _object(node, defs, overrides)
    if kind == "array":
        return st.lists(from_schema(node.get("items", {}), defs, overrides), max_size=3)
    return SCALARS[kind](node) if kind in SCALARS else JSON


def _object(node: dict, defs: dict, overrides: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    properties = node.get("properties")
    if properties is None:  # dict[str, Any]
        return st.dictionaries(st.text(max_size=8), JSON, max_size=3)
    fields = {k: overrides[k] if k in overrides else from_schema(v, defs, overrides)
              for k, v in properties.items()}
    required = st.fixed_dictionaries({k: v for k, v in fields.items() if k in node.get("required", ())})
    optional = sorted(k for k in fields if k not in node.get("required", ()))
    # A few optional fields at a time: with all twenty, nearly every request would be invalid.
    some = st.lists(st.sampled_from(optional), max_size=4, unique=True) if optional else st.just([])
    chosen = some.flatmap(lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys}))
    return st.tuples(required, chosen).map(lambda parts: {**parts[0], **parts[1]})


def schema_strategy(kind: Any, overrides: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    schema = msgspec.json.schema(kind)
    return from_schema(schema, schema.get("$defs", {}), overrides)


SHORT_RUN = {  # valid requests stay a few tokens long; mutations still reach the limits
    "max_tokens": st.integers(1, 4), "n": st.integers(1, 3), "beam_width": st.integers(1, 2),
    "max_completion_tokens": st.none() | st.integers(1, 4), "model": st.sampled_from([None, "tiny", "gpt-x"]),
}
PARAMS = schema_strategy(SamplingParams, {**SHORT_RUN, "max_tokens": st.none() | st.integers(1, 4)})
WS_MESSAGES = schema_strategy(p.ClientMessage, {"params": PARAMS, "id": st.text(max_size=10)})
HTTP_BODIES = {  # a body without max_tokens runs 16 tokens (chat: up to the context): keep it short
    path: schema_strategy(body, SHORT_RUN).map(lambda b: {"max_tokens": 2, **b})
    for path, body in (("/v1/completions", oa.CompletionRequest), ("/v1/chat/completions", oa.ChatCompletionRequest))
}


# ---- mutations ------------------------------------------------------------------------------------

NAN_LIKE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "-0", "00", "+1", ".5"]
HUGE = [2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]
BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"]
MUTATIONS = ["none", "none", "wrong_type", "huge_int", "nan", "deep", "unknown_field", "truncate",
             "not_object", "binary", "bad_utf8", "bad_utf8_text", "oversize", "too_big"]


@dataclass(slots=True)
class Frame:
    data: str | bytes
    opcode: WSMsgType  # TEXT or BINARY
    message: Any  # the value sent, where it is still JSON (to see if it may start a request)
    close_code: int | None = None  # the close this frame must cause, if any


def _slot(draw, message: dict) -> tuple[dict, str]:
    """A (container, key) to overwrite: a top-level field, a nested object's field, or a new one."""
    boxes = [message] + [v for v in message.values() if isinstance(v, dict)]
    box = draw(st.sampled_from(boxes))
    key = draw(st.sampled_from(sorted(box)) | st.text(max_size=6)) if box else draw(st.text(max_size=6))
    return box, key


def _deep(depth: int, in_objects: bool) -> str:
    return '{"a":' * depth + "1" + "}" * depth if in_objects else "[" * depth + "]" * depth


@st.composite
def mutated(draw, messages: st.SearchStrategy) -> Frame:
    message = draw(messages)
    mutation = draw(st.sampled_from(MUTATIONS))
    placeholder, raw = '"@@fuzz@@"', None  # a value spliced into the JSON text afterwards
    if mutation == "not_object":
        message = draw(JSON)
    elif mutation in ("wrong_type", "huge_int", "unknown_field") and isinstance(message, dict):
        box, key = _slot(draw, message)
        box[key] = draw(JSON) if mutation != "huge_int" else draw(st.sampled_from(HUGE))
    elif mutation in ("nan", "deep", "bad_utf8", "bad_utf8_text", "oversize", "too_big"):
        box, key = _slot(draw, message)
        box[key] = "@@fuzz@@"
        raw = {
            "nan": lambda: draw(st.sampled_from(NAN_LIKE)),
            "deep": lambda: _deep(draw(st.sampled_from([50, 900, 1500, 4000])), draw(st.booleans())),
            "bad_utf8": lambda: b'"x' + draw(st.sampled_from(BAD_UTF8)) + b'"',
            "bad_utf8_text": lambda: b'"x' + draw(st.sampled_from(BAD_UTF8)) + b'"',
            "oversize": lambda: json.dumps("x" * (MAX_MESSAGE_BYTES + 100)),
            "too_big": lambda: json.dumps("x" * (4 * MAX_MESSAGE_BYTES + 100)),
        }[mutation]()
    text = json.dumps(message, ensure_ascii=draw(st.booleans()))
    if mutation == "truncate" and len(text) > 1:
        text = text[: draw(st.integers(1, len(text) - 1))]
    data: str | bytes = text
    if raw is not None:
        data = text.encode().replace(placeholder.encode(), raw if isinstance(raw, bytes) else raw.encode())
    binary = mutation in ("binary", "bad_utf8") or (isinstance(data, bytes) and mutation != "bad_utf8_text"
                                                     and draw(st.booleans()))
    opcode = WSMsgType.BINARY if binary else WSMsgType.TEXT
    close = {"bad_utf8_text": CLOSE_BAD_UTF8, "too_big": CLOSE_TOO_BIG}.get(mutation)
    return Frame(data, opcode, message if raw is None and mutation != "truncate" else None, close)


def generate_id(message: Any) -> str | None:
    """The id of the request this message may start (else None)."""
    if isinstance(message, dict) and message.get("type") == "generate" and isinstance(message.get("id"), str):
        return message["id"]
    return None


# ---- one server for the whole run -------------------------------------------------------------------


class Harness:
    """The app on a loop of its own (asyncio.Runner keeps it across examples) and one socket."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        self.client: TestClient | None = None
        self.ws: Any = None
        self.run(self._start())

    def run(self, coro: Any) -> Any:
        return self.runner.run(asyncio.wait_for(coro, 60))

    def close(self) -> None:
        self.run(self.client.close())
        self.runner.close()

    async def _start(self) -> None:
        app = create_app(self.engine, ServerConfig(model_name="tiny", max_message_bytes=MAX_MESSAGE_BYTES,
                         max_body_bytes=MAX_BODY_BYTES, request_timeout=30.0))
        self.client = TestClient(TestServer(app))
        await self.client.start_server()
        await self._connect()

    async def _connect(self) -> None:
        self.ws = await self.client.ws_connect("/v1/stream")
        assert (await self._recv())["type"] == "ready"

    async def _recv(self) -> dict:
        msg = await self.ws.receive(timeout=30)
        assert msg.type is WSMsgType.TEXT, (msg.type, msg.data, msg.extra)
        return json.loads(msg.data)

    async def _reply(self) -> dict:
        reply = await self._recv()
        assert reply["type"] in ("delta", "done", "error", "kv_state"), reply
        if reply["type"] == "error":
            assert reply["code"] in WS_ERROR_CODES, reply
            assert reply["message"] and len(reply["message"]) <= MAX_ERROR_CHARS, reply
            assert reply["id"] is None or len(reply["id"]) <= p.MAX_ID_CHARS
        return reply

    async def _until_sentinel(self) -> list[dict]:
        """Every reply up to the answer to a sentinel abort (which follows all earlier ones)."""
        await self.ws.send_json({"type": "abort", "id": SENTINEL})
        replies = []
        while not ((reply := await self._reply())["type"] == "error" and reply["id"] == SENTINEL):
            replies.append(reply)
        return replies

    async def ws_example(self, frame: Frame) -> None:
        await self.ws.send_frame(frame.data if isinstance(frame.data, bytes) else frame.data.encode(), frame.opcode)
        if frame.close_code is not None:
            msg = await self.ws.receive(timeout=30)
            assert msg.type is WSMsgType.CLOSE and msg.data == frame.close_code, (msg.type, msg.data)
            await self._connect()
            return
        replies = await self._until_sentinel()
        request_id = generate_id(frame.message)
        assert replies or request_id is not None, frame  # answered, or a request runs
        if request_id is not None and request_id != SENTINEL and not _ended(replies, request_id):
            await self.ws.send_json({"type": "abort", "id": request_id})  # keep examples short
            while not _ended(replies, request_id):
                replies.append(await self._reply())
            await self._until_sentinel()  # a late `unknown_id` for that abort, if it finished first

    async def http_example(self, path: str, body: bytes) -> None:
        resp = await self.client.post(path, data=body, headers={"Content-Type": "application/json"})
        assert resp.status in (200, 400, 404, 413), (resp.status, await resp.text(), body[:300])
        if resp.status != 200:
            error = (await resp.json())["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        elif resp.content_type == "text/event-stream":
            events = [line async for line in resp.content if line.startswith(b"data: ")]
            assert events[-1] == b"data: [DONE]\n" and not any(b'"error"' in e[:12] for e in events), events[-2:]
        else:
            assert (await resp.json())["choices"]

    async def still_serves(self) -> None:
        await self.ws.send_json({"type": "generate", "id": "after", "prompt": "Hello",
                                 "params": {"max_tokens": 3, "ignore_eos": True}})
        replies: list[dict] = []
        while not _ended(replies, "after"):
            replies.append(await self._reply())
        assert replies[-1]["type"] == "done" and replies[-1]["usage"]["completion_tokens"] == 3
        resp = await self.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
        assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 2
        for _ in range(500):
            stats = self.engine.stats()
            if stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"engine not idle after the fuzz run: {self.engine.stats()}")


def _ended(replies: list[dict], request_id: str) -> bool:
    return any(r["type"] in ("done", "error") and r["id"] == request_id for r in replies)


@pytest.fixture(scope="module")
def harness(tiny_llama_dir):
    # A short context: a request that asks for "until the context is full" ends soon.
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=128, max_num_seqs=8,
                                      max_model_len=128))
    harness = Harness(engine)
    yield harness
    harness.close()


def test_fuzz_websocket_messages(harness):
    @settings(FUZZ, max_examples=500)
    @given(mutated(WS_MESSAGES))
    def example(frame: Frame) -> None:
        harness.run(harness.ws_example(frame))

    example()
    harness.run(harness.still_serves())


def test_fuzz_openai_bodies(harness):
    @settings(FUZZ, max_examples=200)
    @given(st.sampled_from(sorted(HTTP_BODIES)).flatmap(lambda path: st.tuples(st.just(path), mutated(HTTP_BODIES[path]))))
    def example(case: tuple[str, Frame]) -> None:
        path, frame = case
        body = frame.data if isinstance(frame.data, bytes) else frame.data.encode()
        harness.run(harness.http_example(path, body))

    example()
    harness.run(harness.still_serves())
