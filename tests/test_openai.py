"""The OpenAI-compatible routes, driven by the real `openai` client against a live server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import slow_down_steps
from test_server_limits import ScriptedEngine

from streamengine import AsyncEngine, EngineConfig
from streamengine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    LimitExceededError,
    RequestFailedError,
)
from streamengine.server import create_app
from streamengine.server.config import ServerConfig

openai = pytest.importorskip("openai")

KEY = "test-key"
IGNORE_EOS = {"ignore_eos": True}  # a random model may sample EOS at any point


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=96, max_num_seqs=16))


@contextlib.asynccontextmanager
async def live_server(engine, **options):
    """A real server on a free loopback port, and an AsyncOpenAI client pointed at it."""
    options.setdefault("api_key", KEY)
    app = create_app(engine, ServerConfig(model_name="tiny", max_body_bytes=64 * 1024, **options))
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    base = f"http://127.0.0.1:{server.port}"
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=30)
    try:
        yield client, base
    finally:
        await client.close()
        await server.close()


async def wait_idle(engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats()["num_requests"] or engine.stats()["num_free_blocks"] != engine.stats()["num_total_blocks"]:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {engine.stats()}")
        await asyncio.sleep(0.02)


async def test_models_and_chat_with_n_samples(engine):
    async with live_server(engine) as (client, _):
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
            n=3, max_tokens=5, temperature=1.0, seed=7, extra_body=IGNORE_EOS,
        )
        assert chat.object == "chat.completion" and chat.model == "tiny"
        assert [c.index for c in chat.choices] == [0, 1, 2]
        for choice in chat.choices:
            assert choice.message.role == "assistant" and choice.message.content
            assert choice.finish_reason == "length"
        prompt_len = len(engine.tokenizer.encode(engine.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}])))
        assert chat.usage.prompt_tokens == prompt_len
        assert chat.usage.completion_tokens == 15
        assert chat.usage.total_tokens == prompt_len + 15
        assert chat.usage.prompt_tokens_details.cached_tokens == 0
        # seeded sampling is reproducible, and the repeated prompt now comes from the prefix cache
        again = await client.chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
            n=3, max_tokens=5, temperature=1.0, seed=7, extra_body=IGNORE_EOS,
        )
        assert [c.message.content for c in again.choices] == [c.message.content for c in chat.choices]
        assert again.usage.prompt_tokens_details.cached_tokens >= 16


async def test_completions_plain_and_streamed_agree(engine):
    async with live_server(engine) as (client, _):
        plain = await client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=6, temperature=0, extra_body=IGNORE_EOS,
        )
        assert plain.object == "text_completion" and plain.choices[0].finish_reason == "length"
        assert plain.usage.completion_tokens == 6
        stream = await client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
        )
        text, usage, reasons = "", None, []
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                reasons.append(choice.finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage
        assert text == plain.choices[0].text
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
        assert usage is not None and usage.completion_tokens == 6
        assert usage.prompt_tokens_details.cached_tokens >= 0


async def test_logit_bias_forces_a_token_and_checks_ids(engine):
    """OpenAI's logit_bias, keyed by token ids as strings: +100 makes greedy decoding pick that
    token at every step; an id past the vocabulary is a 400 naming logit_bias."""
    forced = 1000
    async with live_server(engine) as (client, _):
        r = await client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4, temperature=0,
                                            logit_bias={str(forced): 100}, extra_body=IGNORE_EOS)
        assert r.choices[0].text == engine.tokenizer.decode([forced] * 4)
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="tiny", prompt="a", max_tokens=2, logit_bias={"10000000": 5})
        assert "logit_bias" in str(info.value)


async def test_chat_streaming_n3_with_usage_and_stop(engine):
    async with live_server(engine) as (client, _):
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Tell me a story"}], n=3, max_tokens=8,
            temperature=1.0, seed=1, stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
        )
        texts, finish, roles, usage = ["", "", ""], [None] * 3, set(), None
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            for choice in chunk.choices:
                if choice.delta.role:
                    roles.add(choice.index)
                texts[choice.index] += choice.delta.content or ""
                finish[choice.index] = choice.finish_reason or finish[choice.index]
            if chunk.usage:
                usage = chunk.usage
        assert roles == {0, 1, 2} and all(texts) and finish == ["length"] * 3
        assert usage.completion_tokens == 24
        # a stop string ends the reply before it and is not included
        greedy = await client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0, logprobs=0, extra_body=IGNORE_EOS,
        )
        full = greedy.choices[0].text
        stop = next(t for t in greedy.choices[0].logprobs.tokens[2:] if t.strip())
        cut = await client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0, stop=stop, extra_body=IGNORE_EOS,
        )
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == full[: full.index(stop)]


async def test_logprobs_shapes(engine):
    async with live_server(engine) as (client, _):
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
            logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS,
        )
        content = chat.choices[0].logprobs.content
        assert len(content) == 3
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            # greedy: the sampled token is the most likely one
            assert entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert "".join(e.token for e in content) == chat.choices[0].message.content
        comp = await client.completions.create(
            model="tiny", prompt="Hi", max_tokens=3, temperature=0, logprobs=1, extra_body=IGNORE_EOS,
        )
        lp = comp.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
        assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


async def test_errors_have_openai_shape_and_status(engine):
    async with live_server(engine, max_prompt_tokens=50) as (client, base):
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=-1)
        assert bad.value.status_code == 400 and bad.value.param == "temperature"
        assert bad.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as long:
            await client.completions.create(model="tiny", prompt="word " * 100, max_tokens=2)
        assert long.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="tiny", prompt="x", max_tokens=10**6)
        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
        assert missing.value.code == "model_not_found"
        wrong = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
        await wrong.close()

        headers = {"Authorization": f"Bearer {KEY}"}
        async with aiohttp.ClientSession(base, headers=headers) as http:
            for body, status in ((b"{nope", 400), (b"", 400), (json.dumps({"prompt": 5}).encode(), 400),
                                 (json.dumps({"prompt": ["a", [1]]}).encode(), 400),
                                 (b"{" + b" " * 70_000 + b"}", 413)):
                async with http.post("/v1/completions", data=body, headers={"Content-Type": "application/json"}) as resp:
                    assert resp.status == status, body[:20]
                    error = (await resp.json())["error"]
                    assert set(error) == {"message", "type", "param", "code"} and error["message"]
            async with http.get("/v1/nothing") as resp:
                assert resp.status == 404 and (await resp.json())["error"]["type"] == "not_found_error"
            async with http.get("/v1/completions") as resp:
                assert resp.status == 405


async def test_client_disconnect_mid_stream_aborts(engine):
    async with live_server(engine) as (_, base):
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 500, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession(base, headers={"Authorization": f"Bearer {KEY}"}) as http:
            resp = await http.post("/v1/completions", json=body)
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            first = await resp.content.readline()
            assert first.startswith(b"data: {")
            assert engine.stats()["num_requests"] == 1
            resp.close()  # drop the connection mid-stream
        await wait_idle(engine)


async def test_shutdown_ends_streams_in_flight(engine):
    server = TestServer(create_app(engine, ServerConfig(model_name="tiny")), host="127.0.0.1", port=0)
    await server.start_server()
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 500, "stream": True, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
            async with http.post("/v1/completions", json=body) as resp:
                assert (await resp.content.readline()).startswith(b"data: {")
                closing = asyncio.ensure_future(server.close())
                events = [line async for line in resp.content if line.startswith(b"data: ")]
            await closing
    finally:
        await server.close()
    assert events[-1] == b"data: [DONE]\n"
    last = json.loads(events[-2][len(b"data: "):])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert not engine.is_running
    assert engine.stats()["num_requests"] == 0


# ---- limits and the engine's errors, over plain HTTP ---------------------------------------------

ROUTES = [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
]


@contextlib.asynccontextmanager
async def http_client(engine, **options):
    async with TestClient(TestServer(create_app(engine, ServerConfig(model_name="tiny", **options)))) as client:
        yield client


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


async def sse_events(resp) -> list:
    """The `data:` payloads of an event stream, JSON-decoded except the final [DONE]."""
    events = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):].strip()
            events.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return events


async def test_deeply_nested_bodies_are_400s(engine):
    bodies = {
        "/v1/completions": f'{{"prompt": {nested(1000)}, "max_tokens": 2}}',
        "/v1/chat/completions": f'{{"messages": [{{"role": "user", "content": "x"}}], "junk": {nested(1000)}}}',
    }
    async with http_client(engine) as http:
        for path, raw in bodies.items():
            resp = await http.post(path, data=raw, headers={"Content-Type": "application/json"})
            assert resp.status == 400, path
            error = (await resp.json())["error"]
            assert error["code"] == "too_deep" and error["type"] == "invalid_request_error"
        resp = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
        assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 2


async def test_sampling_limits_are_400_limit_exceeded(engine):
    async with http_client(engine) as http:
        for path, base in ROUTES:
            resp = await http.post(path, json={**base, "stop": ["x"] * 33})
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert (error["code"], error["param"]) == ("limit_exceeded", "max_stop_strings")


REFUSALS = [  # error raised by the engine on the first step, status, code, param, Retry-After
    (LimitExceededError("max_num_seqs", "n=40 is more than max_num_seqs=32"), 400, "limit_exceeded",
     "max_num_seqs", None),
    (EngineOverloadedError("the engine's queue is full", retry_after=2.5), 429, "overloaded", None, "3"),
    (EngineOverloadedError("the engine's queue is full", retry_after=0.2), 429, "overloaded", None, "1"),
    (RequestFailedError("step failed: out of memory"), 500, "engine_error", None, None),
    (EngineDeadError("engine stopped"), 500, "engine_error", None, None),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(("path", "base"), ROUTES, ids=["completions", "chat"])
async def test_engine_refusals_get_their_status(engine, path, base, stream):
    for error, status, code, param, retry_after in REFUSALS:
        fake = ScriptedEngine(engine, error=error)
        async with http_client(fake) as http:
            resp = await http.post(path, json={**base, "max_tokens": 4, "stream": stream})
            assert resp.status == status, error
            body = (await resp.json())["error"]
            assert (body["code"], body["param"]) == (code, param)
            assert str(error) in body["message"]  # the engine's own words
            assert resp.headers.get("Retry-After") == retry_after
        assert not fake.live


@pytest.mark.parametrize(("path", "base"), ROUTES, ids=["completions", "chat"])
async def test_engine_failure_mid_generation(engine, path, base):
    fake = ScriptedEngine(engine, error=RequestFailedError("step failed: out of memory"), fail_after=2)
    async with http_client(fake) as http:
        resp = await http.post(path, json={**base, "max_tokens": 8})
        assert resp.status == 500
        body = (await resp.json())["error"]
        assert body["code"] == "engine_error" and "out of memory" in body["message"]
        resp = await http.post(path, json={**base, "max_tokens": 8, "stream": True})
        assert resp.status == 200  # headers went out with the first chunk: the error is in-band
        events = await sse_events(resp)
        assert events[-1] == "[DONE]" and "choices" in events[0]
        error = events[-2]["error"]
        assert error["code"] == "engine_error" and "out of memory" in error["message"]
    assert not fake.live


@pytest.mark.parametrize(("path", "base"), ROUTES, ids=["completions", "chat"])
async def test_request_timeout_is_504_or_in_band_and_frees_blocks(engine, path, base, monkeypatch):
    body = {**base, "max_tokens": 900, "ignore_eos": True, "temperature": 0}  # the chat prompt is ~30 tokens
    slow_down_steps(monkeypatch, engine)  # 900 tokens take 18 s, far past the timeout
    async with http_client(engine, request_timeout=0.5) as http:
        resp = await http.post(path, json=body)
        assert resp.status == 504
        assert (await resp.json())["error"]["code"] == "timeout"
        await wait_idle(engine)
        resp = await http.post(path, json={**body, "stream": True})
        assert resp.status == 200
        events = await sse_events(resp)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
        assert any(e.get("choices") for e in events[:-2])  # it streamed before it timed out
        await wait_idle(engine)
