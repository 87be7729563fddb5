"""Tool calls streamed as OpenAI streams them, through the server's routes.

- A scripted engine writes given outputs in random pieces, so that a streamed and a whole
  response see the same outputs split differently: for both parsers, n > 1 samples and several
  calls per sample, the chunks (a call's id, type and name first, then only arguments text; no
  empty delta) add up exactly to the whole response, finish reasons included.
- SmolLM2 with a forced call (tool_choice "required" or named) cut by max_tokens at many points:
  `tool_calls` carries the partial arguments (a prefix of the uncut ones), `content` is null,
  and `finish_reason` is "length" unless only the closing markup was cut; streamed, whole and
  on the WebSocket alike.
"""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_openai import KEY, live_server
from test_server import connect, recv
from test_server_limits import ScriptedEngine

from streamengine import AsyncEngine, EngineConfig
from streamengine.sample.outputs import CompletionOutput, RequestOutput
from streamengine.server import create_app
from streamengine.server.config import ServerConfig

TOOLS = [{"type": "function", "function": {"name": f"fn_{i}", "parameters": {"type": "object"}}} for i in range(3)]
ASK = [{"role": "user", "content": "Look it up."}]


class ScriptedOutputs(ScriptedEngine):
    """Writes `outputs` (per sample: text and finish reason) in random pieces; a sample has
    news in a step only when it gets a piece, as the engine's delta outputs do."""

    def __init__(self, real: AsyncEngine, outputs: list[tuple[str, str]], seed: int) -> None:
        super().__init__(real)
        self.outputs = outputs
        self.rng = random.Random(seed)

    async def generate(self, prompt, params, request_id=None, cache_salt=None, **named):
        prompt_ids = list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt)
        assert params.n == len(self.outputs)
        sent = [0] * params.n
        while any(sent[i] < len(text) for i, (text, _) in enumerate(self.outputs)):
            await asyncio.sleep(0)
            samples = []
            for i, (text, reason) in enumerate(self.outputs):
                if sent[i] == len(text) or self.rng.random() < 0.3:
                    continue  # finished, or no news this step
                size = self.rng.choice([1, 1, 2, 3, 5, 8])
                piece, sent[i] = text[sent[i]:sent[i] + size], min(len(text), sent[i] + size)
                samples.append(CompletionOutput(i, piece, [1000 + sent[i]], reason if sent[i] == len(text) else None))
            if samples:
                yield RequestOutput(request_id, prompt_ids, samples, all(s == len(t) for s, (t, _) in
                                                                          zip(sent, self.outputs, strict=True)))


def _hermes_output(rng: random.Random, calls: int) -> str:
    blocks = [f'<tool_call>\n{{"name": "fn_{i}", "arguments": {_arguments(rng)}}}\n</tool_call>' for i in range(calls)]
    return "Let me check.\n" + "\n".join(blocks)


def _llama3_output(rng: random.Random, calls: int) -> str:
    objects = [f'{{"name": "fn_{i}", "parameters": {_arguments(rng)}}}' for i in range(calls)]
    return "<|python_tag|>" + "; ".join(objects)


def _arguments(rng: random.Random) -> str:
    value = {f"k{i}": rng.choice([rng.randint(0, 99), "Paris }", [1, {"a": "\\"}], None, "é😀"]) for i in range(3)}
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, separators=rng.choice([(",", ":"), (", ", ": ")]))


async def _post(session: aiohttp.ClientSession, base: str, body: dict) -> dict | list[dict]:
    """The response body, or for a stream its chunks."""
    async with session.post(f"{base}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status == 200, await response.text()
        if not body.get("stream"):
            return await response.json()
        chunks = []
        async for line in response.content:
            data = line.decode().strip().removeprefix("data: ")
            if data and data != "[DONE]":
                chunks.append(json.loads(data))
        return chunks


def _assemble(chunks: list[dict], n: int) -> list[dict]:
    """Per choice: content, calls and finish reason, checking each chunk as OpenAI sends them."""
    choices = [{"content": "", "calls": [], "finish_reason": None} for _ in range(n)]
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta, out = choice["delta"], choices[choice["index"]]
            assert delta or choice["finish_reason"] or choice["logprobs"], chunk  # no empty chunk
            assert out["finish_reason"] is None, chunk  # nothing after a choice's finish
            out["content"] += delta.get("content") or ""
            for part in delta.get("tool_calls", ()):
                if "id" in part:  # a call opens: id, type and name, arguments ""
                    assert part == {"index": len(out["calls"]), "id": part["id"], "type": "function",
                                    "function": {"name": part["function"]["name"], "arguments": ""}}, part
                    out["calls"].append([part["function"]["name"], ""])
                else:  # later parts: only the index and arguments text
                    assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}, part
                    assert part["function"]["arguments"], part
                    out["calls"][part["index"]][1] += part["function"]["arguments"]
            out["finish_reason"] = choice["finish_reason"]
    return choices


def _whole(body: dict) -> list[dict]:
    return [{"content": c["message"]["content"] or "",
             "calls": [[t["function"]["name"], t["function"]["arguments"]] for t in c["message"].get("tool_calls", ())],
             "finish_reason": c["finish_reason"]} for c in body["choices"]]


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir):
    return AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=32, max_num_seqs=4))


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
async def test_streamed_calls_add_up_to_the_whole_response(tiny_engine, parser):
    rng = random.Random(parser)
    write = _hermes_output if parser == "hermes" else _llama3_output
    for trial in range(4):
        full = write(rng, 3)
        cut = full[:rng.randint(len(full) // 2, len(full) - 1)]  # max_tokens, somewhere in the calls
        outputs = [(write(rng, 1), "stop"), (full, "stop"), (cut, "length"), ("No call needed.", "stop")]
        fake = ScriptedOutputs(tiny_engine, outputs, seed=trial)
        async with live_server(fake, tool_parser=parser) as (_, base), aiohttp.ClientSession() as session:
            body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "n": len(outputs)}
            whole = _whole(await _post(session, base, body))
            streamed = _assemble(await _post(session, base, {**body, "stream": True}), len(outputs))
        assert streamed == whole
        assert [c["finish_reason"] for c in whole[:2]] == ["tool_calls", "tool_calls"]
        assert [name for name, _ in whole[1]["calls"]] == ["fn_0", "fn_1", "fn_2"]
        assert whole[3] == {"content": "No call needed.", "calls": [], "finish_reason": "stop"}
        for _, arguments in whole[1]["calls"]:
            json.loads(arguments)  # the model's own JSON text, whole
        partial = whole[2]["calls"]
        assert [name for name, _ in partial] == [name for name, _ in whole[1]["calls"]][:len(partial)]
        assert all(full_args.startswith(args) for (_, args), (_, full_args) in zip(partial, whole[1]["calls"],
                                                                                    strict=False))


# ---- a forced call cut by max_tokens, with SmolLM2 -------------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a city now.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                     "maxLength": 24}}, "required": ["city"]}}},
]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = ["required", {"type": "function", "function": {"name": "get_time"}}]
MAX_TOKENS = [6, 12, 18, 24, 30, 36]


@pytest.fixture(scope="module")
def smollm(smollm_dir):
    return AsyncEngine(EngineConfig(model=str(smollm_dir), num_gpu_blocks=256, max_num_seqs=8))


def _check_cut(result: dict, whole_call: list[str]) -> str:
    """A cut forced call: never content; a prefix of the uncut call; which kind of cut it was."""
    assert result["content"] == "", result
    if not result["calls"]:
        assert result["finish_reason"] == "length", result
        return "before the name"
    ((name, arguments),) = result["calls"]
    assert name == whole_call[0] and whole_call[1].startswith(arguments), (result, whole_call)
    if arguments == whole_call[1]:
        assert result["finish_reason"] == "tool_calls", result
        return "in the closing markup"
    assert result["finish_reason"] == "length", result
    return "in the arguments"


async def test_forced_call_cut_by_max_tokens_is_a_partial_call(smollm):
    async with live_server(smollm) as (_, base), aiohttp.ClientSession() as session:
        async def ask(choice, max_tokens: int, stream: bool):
            body = {"model": "tiny", "messages": WEATHER_ASK, "tools": FORCED_TOOLS, "tool_choice": choice,
                    "temperature": 0, "max_tokens": max_tokens, "stream": stream}
            reply = await _post(session, base, body)
            return _assemble(reply, 1)[0] if stream else _whole(reply)[0]

        uncut = await asyncio.gather(*(ask(choice, 80, False) for choice in CHOICES))
        cuts = await asyncio.gather(*(ask(choice, m, stream) for choice in CHOICES for m in MAX_TOKENS
                                      for stream in (False, True)))
    seen = set()
    for c, choice in enumerate(CHOICES):
        whole = uncut[c]
        assert whole["finish_reason"] == "tool_calls" and whole["content"] == "", whole
        ((name, arguments),) = whole["calls"]
        json.loads(arguments)
        assert choice == "required" or name == choice["function"]["name"]
        for m in range(len(MAX_TOKENS)):
            result, streamed = cuts[(c * len(MAX_TOKENS) + m) * 2:(c * len(MAX_TOKENS) + m) * 2 + 2]
            assert streamed == result, (MAX_TOKENS[m], streamed, result)  # the same, streamed or not
            seen.add(_check_cut(result, whole["calls"][0]))
    assert seen == {"before the name", "in the arguments", "in the closing markup"}


async def test_websocket_forced_call_cut_by_max_tokens(smollm):
    app = create_app(smollm, ServerConfig(model_name="tiny"))
    async with TestClient(TestServer(app)) as client:
        ws = await connect(client)
        for max_tokens in (24, 80):
            await ws.send_json({"type": "generate", "id": str(max_tokens), "messages": WEATHER_ASK,
                                "tools": FORCED_TOOLS, "tool_choice": "required",
                                "params": {"temperature": 0, "max_tokens": max_tokens}})
        results: dict[str, dict] = {}
        while len([r for r in results.values() if "finish_reason" in r]) < 2:
            msg = await recv(ws, timeout=180)
            entry = results.setdefault(msg["id"], {"content": "", "calls": []})
            if msg["type"] == "done":
                entry["finish_reason"] = msg["finish_reasons"][0]
                continue
            assert msg["type"] == "delta", msg
            entry["content"] += msg["text"]
            for part in msg.get("tool_calls", ()):
                if "id" in part:  # opens the call; parts that arrived with it are merged in
                    assert part["index"] == len(entry["calls"]) and part["type"] == "function", part
                    entry["calls"].append([part["function"]["name"], part["function"]["arguments"]])
                else:
                    assert set(part) == {"index", "function"}, part
                    entry["calls"][part["index"]][1] += part["function"]["arguments"]
        await ws.close()
    whole = results["80"]
    assert whole["finish_reason"] == "tool_calls" and whole["content"] == "" and len(whole["calls"]) == 1
    json.loads(whole["calls"][0][1])
    assert _check_cut(results["24"], whole["calls"][0]) == "in the arguments"


def test_websocket_outbox_merges_the_parts_of_a_call():
    """Deltas of one sample that wait unsent are merged, and so are the parts of each call: one
    entry per call, opened by its id and name, its arguments joined in order."""
    from streamengine.server import protocol as p
    from streamengine.server.outbox import Outbox
    from streamengine.server.streaming import SampleDelta

    def part(index: int, arguments: str, name: str | None = None) -> p.DeltaToolCall:
        return p.DeltaToolCall(index=index, id=f"call_{index}" if name else None, type="function" if name else None,
                               function=p.DeltaFunctionCall(name=name, arguments=arguments))

    box = Outbox(lambda: None)
    pushes = [[part(0, "", "a")], [part(0, '{"x": ')], [part(0, "1}"), part(1, "", "b")], [part(1, "{}")]]
    for i, calls in enumerate(pushes):
        box.push_delta("r", SampleDelta(0, "", [i], None, None), calls, run="r")
    message = json.loads(asyncio.run(box.get()))
    assert message["token_ids"] == [0, 1, 2, 3] and "text" in message
    assert message["tool_calls"] == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
        {"index": 1, "id": "call_1", "type": "function", "function": {"name": "b", "arguments": "{}"}},
    ]
    assert box.pending_bytes == 0
    box.push_delta("r", SampleDelta(0, "", [4], None, None), [part(1, " ")], run="r")  # a later part alone
    assert json.loads(asyncio.run(box.get()))["tool_calls"] == [{"index": 1, "function": {"arguments": " "}}]
