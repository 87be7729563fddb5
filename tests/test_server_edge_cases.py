"""Server edge cases: clients that leave while queued, reused WebSocket ids, chat templates
that refuse a conversation, the drain, the BOS of chat prompts, explicit nulls. Each test
failed before its fix.

The servers here run as `python -m streamengine serve` runs them (a plain `web.AppRunner`,
which does not cancel a handler when its client leaves), not under aiohttp's TestServer
(which does, and so hides what happens to a request whose client is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp
import pytest
from aiohttp import web
from conftest import slow_down_steps

from streamengine import AsyncEngine, EngineConfig
from streamengine.server import create_app
from streamengine.server.config import ServerConfig
from streamengine.server.state import STATE_KEY

KEY = "hunt-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def one_slot_engine(tiny_llama_dir):
    # One running sequence at a time: a second request waits in the queue.
    return AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=96, max_num_seqs=1))


@contextlib.asynccontextmanager
async def production_server(engine, **options):
    """The app on a loopback port, run as `serve` runs it; yields (base url, app)."""
    app = create_app(engine, ServerConfig(model_name="tiny", api_key=KEY, **options))
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


async def wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    """Polls `predicate` (a generous timeout only turns a hang into a failure)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def open_raw_post(base: str, path: str, body: dict) -> asyncio.StreamWriter:
    """Sends a POST on a raw socket and returns its writer (abort it to vanish)."""
    host, port = base.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    writer.write(head.encode() + data)
    await writer.drain()
    return writer


# ---- a client that leaves while its request is queued ------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_while_queued_has_its_request_aborted(
        one_slot_engine, monkeypatch, caplog, stream):
    # Before: nothing watched the connection until the first output, so a request whose
    # client gave up (a timeout, a retry) stayed queued, was prefilled for no one, and a
    # streamed one then logged "unhandled error" from writing its headers to a closed socket.
    engine = one_slot_engine
    slow_down_steps(monkeypatch, engine, 0.05)  # the blocker runs for ~50 s unless aborted
    caplog.set_level(logging.ERROR)
    async with production_server(engine) as (base, app), aiohttp.ClientSession(headers=AUTH) as http:
        state = app[STATE_KEY]
        blocker = await http.post(f"{base}/v1/completions", json={
            "prompt": "a", "max_tokens": 1000, "ignore_eos": True, "stream": True})
        assert (await blocker.content.readline()).startswith(b"data: {")
        queued = await open_raw_post(base, "/v1/completions", {"prompt": "b", "max_tokens": 5, "stream": stream})
        await wait_for(lambda: engine.stats()["num_waiting"] == 1, "the second request to queue")
        queued.transport.abort()  # the client vanishes
        await wait_for(lambda: engine.stats()["num_waiting"] == 0, "the queued request to be aborted")
        assert engine.stats()["num_running"] == 1  # the blocker still runs: it was aborted, not served
        await wait_for(lambda: state.http_in_flight == 1, "the queued request's handler to end")
        blocker.close()
        await wait_for(lambda: engine.stats()["num_requests"] == 0, "the engine to be idle")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


# ---- a WebSocket id reused while the reader is behind -------------------------------------------


async def test_a_reused_id_never_merges_into_the_previous_runs_unsent_delta(one_slot_engine):
    # Before: unsent deltas merged by (client id, sample), so with a reader behind, a second
    # run of id "a" (legal once the first ended) merged its tokens into the first run's
    # pending delta, ahead of the first run's `done`: 6 tokens, done, then a done with none.
    from test_server import serve
    from test_server_limits import ScriptedEngine, send_many, slow_socket

    class Counting(ScriptedEngine):
        short_runs = 0  # runs of max_tokens 3 that ended

        async def generate(self, prompt, params, request_id=None, cache_salt=None):
            async for out in super().generate(prompt, params, request_id, cache_salt):
                self.short_runs += out.finished and params.max_tokens == 3
                yield out

    fake = Counting(one_slot_engine, tokens_per_step=4, step_s=0.002)  # (the real one lends its tokenizer)
    async with serve(fake) as client, slow_socket(client) as (slow, conn):
        # fill the socket and its transport, so what follows waits in the outbox
        ids = await send_many(slow, 16, {"max_tokens": 1000, "n": 2, "logprobs": 2})
        await wait_for(lambda: conn.outbox.pending_bytes > 128 * 1024, "the reader to fall behind")
        for run, prompt in enumerate(("first", "second"), 1):
            await slow.send_json({"type": "generate", "id": "a", "prompt": prompt, "params": {"max_tokens": 3}})
            await wait_for(lambda run=run: fake.short_runs == run and "a" not in conn.live, f"run {run} of 'a' to end")
        events = []  # (type, tokens) of id "a", in the order sent
        pending = set(ids)
        while pending or sum(kind == "done" for kind, _ in events) < 2:
            msg = json.loads((await slow.receive(timeout=30)).data)
            if msg["id"] == "a":
                events.append((msg["type"], len(msg.get("token_ids", ()))))
            elif msg["type"] == "done":
                pending.discard(msg["id"])
    first_done = events.index(("done", 0))
    assert sum(n for _, n in events[:first_done]) == 3, events
    assert sum(n for _, n in events[first_done + 1:]) == 3, events
    assert events[-1] == ("done", 0)


# ---- a chat template that refuses the conversation ----------------------------------------------

# Like Llama 2's, Mistral's and Gemma's templates: roles must alternate, else raise_exception.
ALTERNATING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}assistant:"
)


async def test_a_conversation_the_chat_template_refuses_is_a_400_not_a_500(one_slot_engine, monkeypatch):
    # Before: the template's own exception (jinja's TemplateError, not a ValueError) escaped:
    # HTTP 500 "internal server error" (logged as a server bug), WebSocket engine_error.
    engine = one_slot_engine
    monkeypatch.setattr(engine.tokenizer, "chat_template", ALTERNATING_TEMPLATE)
    two_users = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi again"}]
    async with production_server(engine) as (base, _), aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(f"{base}/v1/chat/completions", json={"messages": two_users, "max_tokens": 2}) as resp:
            body = await resp.json()
            assert resp.status == 400, body
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "messages"
        assert "must alternate" in body["error"]["message"]
        async with http.ws_connect(f"{base}/v1/stream") as ws:
            assert (await ws.receive_json(timeout=30))["type"] == "ready"
            await ws.send_json({"type": "generate", "id": "c", "messages": two_users, "params": {"max_tokens": 2}})
            error = await ws.receive_json(timeout=30)
            assert error["type"] == "error" and error["code"] == "invalid_params", error
            assert "must alternate" in error["message"]
            # a conversation the template takes is still served
            await ws.send_json({"type": "generate", "id": "ok", "messages": two_users[:1], "params": {"max_tokens": 2}})
            while (msg := await ws.receive_json(timeout=30))["type"] == "delta":
                pass
            assert msg["type"] == "done" and msg["finish_reason"] == "length", msg


# ---- a drain that cuts a request still compiling its grammar --------------------------------------


async def test_the_drain_aborts_a_request_that_reaches_the_engine_after_the_cut(one_slot_engine, monkeypatch):
    # Before: the cut aborted each HTTP request once. One still compiling its grammar was not
    # in the engine yet, so that abort found nothing; the request then ran on through the
    # drain's grace period, and past the drain itself.
    from streamengine.server.app import drain

    engine = one_slot_engine
    slow_down_steps(monkeypatch, engine, 0.05)  # 400 tokens take 20 s unless aborted
    compiling, release = asyncio.Event(), asyncio.Event()
    compile_async = engine.core.grammars.compile_async

    async def held_compile(spec, tenant=None):
        compiling.set()
        await release.wait()
        return await compile_async(spec, tenant)

    monkeypatch.setattr(engine.core.grammars, "compile_async", held_compile)
    aborted: list[str] = []
    abort = engine.abort

    async def recording_abort(request_id):
        aborted.append(request_id)
        await abort(request_id)

    monkeypatch.setattr(engine, "abort", recording_abort)
    async with production_server(engine) as (base, app), aiohttp.ClientSession(headers=AUTH) as http:
        state = app[STATE_KEY]
        body = {"prompt": "a", "max_tokens": 400, "ignore_eos": True, "stream": True,
                "structured": {"type": "regex", "pattern": "[a-z ]+"}}
        post = asyncio.ensure_future(http.post(f"{base}/v1/completions", json=body))
        await asyncio.wait_for(compiling.wait(), 20)
        (engine_id,) = state.http_requests
        draining = asyncio.ensure_future(drain(app, timeout=0.1))
        await wait_for(lambda: engine_id in aborted, "the drain's cut")
        release.set()  # the compile ends after the cut: the request reaches the engine now
        resp = await post
        events = [line async for line in resp.content if line.startswith(b"data: ")]
        await asyncio.wait_for(draining, 30)
        assert events[-1] == b"data: [DONE]\n"
        finish = json.loads(events[-2][6:])["choices"][0]["finish_reason"]
        assert finish == "abort"
        await wait_for(lambda: engine.stats()["num_requests"] == 0, "the engine to be idle", timeout=5)


# ---- chat prompts and the tokenizer's BOS ---------------------------------------------------------

BOS_TEMPLATE = (  # as Llama's and Mistral's templates do, the rendered text starts with the BOS
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)


async def test_a_chat_prompt_gets_the_bos_its_template_wrote_and_no_second_one(one_slot_engine, monkeypatch):
    # Before: chat prompts, whose template already wrote the BOS, were encoded with
    # add_special_tokens=True, so a tokenizer that adds a BOS itself (Llama, Mistral, Gemma)
    # gave them two. SmolLM2's adds none, which hid it; this tokenizer is made to add one.
    engine = one_slot_engine
    tokenizer = engine.tokenizer
    plain_encode = tokenizer.encode
    bos = tokenizer.bos_token_id

    def encode_adding_bos(text, add_special_tokens=True, **kwargs):
        return ([bos] if add_special_tokens else []) + plain_encode(text, add_special_tokens=False, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode_adding_bos)
    monkeypatch.setattr(tokenizer, "chat_template", BOS_TEMPLATE)
    messages = [{"role": "user", "content": "Hello there"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(tokenizer.bos_token)
    chat_ids = plain_encode(rendered, add_special_tokens=False)
    assert chat_ids[0] == bos and chat_ids[1] != bos
    async with production_server(engine) as (base, _), aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(f"{base}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["prompt_tokens"] == len(chat_ids)
        async with http.ws_connect(f"{base}/v1/stream") as ws:
            assert (await ws.receive_json(timeout=30))["type"] == "ready"
            await ws.send_json({"type": "generate", "id": "c", "messages": messages, "params": {"max_tokens": 1}})
            while (msg := await ws.receive_json(timeout=30))["type"] == "delta":
                pass
            assert msg["type"] == "done" and msg["usage"]["prompt_tokens"] == len(chat_ids), msg
        # a plain completion prompt still gets the tokenizer's BOS, as the engine gives one
        async with http.post(f"{base}/v1/completions", json={"prompt": "Hello there", "max_tokens": 1}) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["prompt_tokens"] == 1 + len(plain_encode("Hello there"))


# ---- explicit nulls, which OpenAI's API takes for "the default" -----------------------------------


@pytest.mark.parametrize(("path", "base", "nulls"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
     {"n": None, "stream": None, "logprobs": None, "stream_options": {"include_usage": None}}),
    ("/v1/completions", {"prompt": "Hi"}, {"n": None, "stream": None, "echo": None}),
])
async def test_explicit_nulls_mean_the_defaults(one_slot_engine, path, base, nulls):
    # Before: `"n": null`, `"stream": null`, `"logprobs": null`, `"echo": null` and
    # `stream_options.include_usage: null`, all nullable in OpenAI's API (and accepted by
    # vLLM), were 400 "Expected `int`, got `null`": clients that send unset fields as null
    # (rather than leaving them out, as the Python client does) could not be served.
    async with production_server(one_slot_engine) as (base_url, _), aiohttp.ClientSession(headers=AUTH) as http:
        for name, value in nulls.items():
            body = {**base, "max_tokens": 2, name: value}
            async with http.post(f"{base_url}{path}", json=body) as resp:
                reply = await resp.json()
                assert resp.status == 200, (name, reply)
            assert len(reply["choices"]) == 1 and reply["usage"]["completion_tokens"] >= 1, (name, reply)
            assert reply["choices"][0].get("logprobs") is None
