"""The WebSocket protocol, security, metrics and shutdown, against the real engine (tiny model)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest
from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from streamengine import AsyncEngine, EngineConfig
from streamengine.server import create_app
from streamengine.server.config import ServerConfig
from streamengine.server.outbox import Outbox
from streamengine.server.protocol import CLOSE_UNAUTHORIZED
from streamengine.server.security import KeyRing, OriginPolicy, normalize_origin
from streamengine.server.state import STATE_KEY
from streamengine.server.streaming import SampleDelta

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
SHORT = {"max_tokens": 4, "ignore_eos": True, "temperature": 0}
# ~60 tokens: several full 16-token blocks, so prefix caching and sharing are visible
SHARED_PROMPT = " ".join(f"word{i}" for i in range(30))


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    # One engine (model loaded once) for the module; each test's app starts and stops it.
    return AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=96, max_num_seqs=16))


@contextlib.asynccontextmanager
async def serve(engine, **options):
    options.setdefault("model_name", "tiny")
    app = create_app(engine, ServerConfig(**options))
    async with TestClient(TestServer(app)) as client:
        yield client


async def recv(ws, timeout: float = 30.0) -> dict:
    msg = await ws.receive(timeout=timeout)
    if msg.type is not WSMsgType.TEXT:
        raise AssertionError(f"expected a text message, got {msg.type} {msg.data!r} {msg.extra!r}")
    return json.loads(msg.data)


async def connect(client, **kwargs):
    ws = await client.ws_connect("/v1/stream", **kwargs)
    ready = await recv(ws)
    assert ready["type"] == "ready" and ready["model"] == "tiny"
    return ws


async def collect(ws, ids: set[str]) -> dict[str, dict]:
    """Reads until every id in `ids` got `done`; returns per id text, tokens, deltas, done."""
    out = {i: {"text": "", "tokens": [], "deltas": 0, "done": None, "order": []} for i in ids}
    pending = set(ids)
    while pending:
        msg = await recv(ws)
        assert msg["type"] in ("delta", "done"), msg
        entry = out[msg["id"]]
        if msg["type"] == "delta":
            assert entry["done"] is None, "delta after done"
            entry["text"] += msg["text"]
            entry["tokens"] += msg["token_ids"]
            entry["deltas"] += 1
        else:
            entry["done"] = msg
            pending.discard(msg["id"])
    return out


async def wait_idle(engine, timeout: float = 10.0) -> dict:
    """Waits until the engine holds no request and every block is back in the free pool."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {stats}")
        await asyncio.sleep(0.02)


# ---- protocol ---------------------------------------------------------------------------------


async def test_multiplexed_requests_stream_concurrently(engine):
    async with serve(engine) as client:
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "a", "prompt": "The sky is", "params": {**SHORT, "max_tokens": 6}})
        await ws.send_json({"type": "generate", "id": "b", "messages": [{"role": "user", "content": "Hi"}],
                            "params": {**SHORT, "n": 2, "logprobs": 1}})
        results = await collect(ws, {"a", "b"})
        a, b = results["a"], results["b"]
        assert a["done"]["finish_reason"] == "length"
        assert len(a["tokens"]) == 6 == a["done"]["usage"]["completion_tokens"]
        assert a["done"]["usage"]["prompt_tokens"] == len(engine.tokenizer.encode("The sky is"))
        assert b["done"]["finish_reasons"] == ["length", "length"]
        assert b["done"]["usage"]["completion_tokens"] == 2 * 4
        # the same greedy request again on the same socket reproduces the text exactly
        await ws.send_json({"type": "generate", "id": "a", "prompt": "The sky is", "params": {**SHORT, "max_tokens": 6}})
        again = await collect(ws, {"a"})
        assert again["a"]["tokens"] == a["tokens"] and again["a"]["text"] == a["text"]
        await ws.close()
        await wait_idle(engine)


async def test_delta_carries_index_and_logprobs(engine):
    async with serve(engine) as client:
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "x", "prompt": "Hello",
                            "params": {**SHORT, "n": 2, "temperature": 1.0, "seed": 3, "logprobs": 2}})
        seen: dict[int, int] = {}
        while True:
            msg = await recv(ws)
            if msg["type"] == "done":
                break
            assert msg["index"] in (0, 1)
            assert len(msg["logprobs"]) == len(msg["token_ids"])
            for token, entry in zip(msg["token_ids"], msg["logprobs"], strict=True):
                assert str(token) in entry and all(v <= 0 for v in entry.values())
            seen[msg["index"]] = seen.get(msg["index"], 0) + len(msg["token_ids"])
        assert seen == {0: 4, 1: 4}


async def test_abort_ends_request_and_frees_blocks(engine):
    async with serve(engine) as client:
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "long", "prompt": SHARED_PROMPT, "params": LONG})
        await ws.send_json({"type": "generate", "id": "other", "prompt": "Hello", "params": SHORT})
        first = await recv(ws)
        assert first["type"] == "delta"
        await ws.send_json({"type": "abort", "id": "long"})
        results = await collect(ws, {"long", "other"})
        done = results["long"]["done"]
        assert done["finish_reason"] == "abort"
        assert 0 < done["usage"]["completion_tokens"] < LONG["max_tokens"]
        assert results["other"]["done"]["finish_reason"] == "length"  # untouched by the abort
        await wait_idle(engine)
        # aborting something that is no longer live is an error, and the socket carries on
        await ws.send_json({"type": "abort", "id": "long"})
        assert (await recv(ws))["code"] == "unknown_id"


async def test_disconnect_aborts_all_requests_and_frees_blocks(engine):
    async with serve(engine) as client:
        ws = await connect(client)
        for i in range(3):
            await ws.send_json({"type": "generate", "id": f"r{i}", "prompt": f"{i} {SHARED_PROMPT}", "params": LONG})
        assert (await recv(ws))["type"] == "delta"
        assert engine.stats()["num_requests"] == 3
        assert engine.stats()["num_free_blocks"] < engine.stats()["num_total_blocks"]
        await ws.close()
        stats = await wait_idle(engine)
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        # The handler forgets the connection after its teardown, which may finish a moment
        # after the aborts that made the engine idle.
        connections = client.app[STATE_KEY].connections
        deadline = time.monotonic() + 5.0
        while connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not connections


async def test_every_bad_message_gets_an_error_and_the_socket_keeps_working(engine):
    async with serve(engine, max_prompt_tokens=20, max_message_bytes=4096) as client:
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "live", "prompt": "Hi", "params": LONG})
        cases = [
            ("{not json", None, "bad_json"),
            (json.dumps({"type": "launch", "id": "u"}), "u", "bad_message"),
            (json.dumps({"type": "generate", "prompt": "no id"}), None, "bad_message"),
            (json.dumps({"type": "generate", "id": 7, "prompt": "x"}), None, "bad_message"),
            (json.dumps({"type": "generate", "id": "e", "prompt": "x", "extra": 1}), "e", "bad_message"),
            (json.dumps({"type": "generate", "id": "t", "prompt": "x", "params": {"temperature": -1}}), "t", "invalid_params"),
            (json.dumps({"type": "generate", "id": "k", "prompt": "x", "params": {"max_tokens": "many"}}), "k", "invalid_params"),
            (json.dumps({"type": "generate", "id": "q", "prompt": "x", "params": {"bogus": 1}}), "q", "invalid_params"),
            # the WebSocket's deltas carry no prompt: refused by name, never silently dropped
            (json.dumps({"type": "generate", "id": "pl", "prompt": "x", "params": {"prompt_logprobs": 1}}), "pl", "invalid_params"),
            (json.dumps({"type": "generate", "id": "both", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}), "both", "invalid_params"),
            (json.dumps({"type": "generate", "id": "none"}), "none", "invalid_params"),
            (json.dumps({"type": "generate", "id": "empty", "prompt": ""}), "empty", "invalid_params"),
            (json.dumps({"type": "generate", "id": "ids", "prompt": [10**9]}), "ids", "invalid_params"),
            (json.dumps({"type": "generate", "id": "big", "prompt": "word " * 200}), "big", "prompt_too_long"),
            (json.dumps({"type": "generate", "id": "ctx", "prompt": "x", "params": {"max_tokens": 10**6}}), "ctx", "invalid_params"),
            (json.dumps({"type": "generate", "id": "live", "prompt": "x"}), "live", "duplicate_id"),
            (json.dumps({"type": "abort", "id": "ghost"}), "ghost", "unknown_id"),
            (json.dumps({"type": "generate", "id": "huge", "prompt": "x" * 6000}), None, "message_too_large"),
            (json.dumps([1, 2, 3]), None, "bad_message"),
        ]
        for raw, want_id, want_code in cases:
            await ws.send_str(raw)
            msg = await recv(ws)
            while msg["type"] == "delta" and msg["id"] == "live":
                msg = await recv(ws)
            assert msg["type"] == "error", (raw, msg)
            assert (msg["id"], msg["code"]) == (want_id, want_code), (raw, msg)
            assert msg["message"]
        await ws.send_bytes(json.dumps({"type": "generate", "id": "ok", "prompt": "Hello", "params": SHORT}).encode())
        await ws.send_json({"type": "abort", "id": "live"})
        results = await collect(ws, {"ok", "live"})
        assert results["ok"]["done"]["finish_reason"] == "length"
        assert results["live"]["done"]["finish_reason"] == "abort"
        assert not ws.closed


async def test_long_prompts_are_tokenized_off_loop_and_limited(engine):
    long_prompt = "word " * 3000  # beyond INLINE_TOKENIZE_CHARS: tokenized in a worker thread
    # (200 tokens: 15,000 characters could fit them, so the prompt is tokenized, then refused)
    async with serve(engine, max_prompt_tokens=200) as client:
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "long", "prompt": long_prompt, "params": SHORT})
        msg = await recv(ws)
        assert (msg["type"], msg["id"], msg["code"]) == ("error", "long", "prompt_too_long")
        assert "has 3001 tokens" in msg["message"] and "limit of 200" in msg["message"]
        await ws.send_json({"type": "generate", "id": "ok", "prompt": "word " * 50, "params": SHORT})
        assert (await collect(ws, {"ok"}))["ok"]["done"]["usage"]["prompt_tokens"] <= 200


async def test_frame_over_the_hard_limit_closes_with_1009(engine):
    async with serve(engine, max_message_bytes=1024) as client:
        ws = await connect(client)
        await ws.send_str("x" * 1024 * 5)  # beyond 4x the soft limit: aiohttp refuses the frame
        msg = await ws.receive(timeout=10)
        assert msg.type is WSMsgType.CLOSE and msg.data == 1009


async def test_n_samples_share_prompt_blocks_in_kv_state(engine):
    async with serve(engine) as client:
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "n3", "prompt": f"share {SHARED_PROMPT}", "params": {**LONG, "n": 3, "temperature": 1.0}})
        assert (await recv(ws))["type"] == "delta"
        await ws.send_json({"type": "kv_state"})
        while (msg := await recv(ws))["type"] != "kv_state":
            pass
        assert msg["num_blocks"] == 96 and len(msg["blocks"]) == 96
        assert set(msg["blocks"]) <= set("0123")
        assert sum(msg["counts"].values()) == 96
        assert msg["counts"]["shared"] >= 3  # the full prompt blocks are referenced by all 3 samples
        assert msg["counts"]["shared"] == msg["blocks"].count("3")
        resp = await client.get("/v1/kv_state")
        assert resp.status == 200
        http_state = await resp.json()
        assert http_state["num_blocks"] == 96 and http_state["counts"]["used"] + http_state["counts"]["shared"] > 0
        await ws.send_json({"type": "abort", "id": "n3"})
        await wait_idle(engine)


async def test_slow_reader_coalesces_and_does_not_stall_others(engine):
    async with serve(engine) as client:
        slow = await connect(client)
        (slow_conn,) = client.app[STATE_KEY].connections
        fast = await connect(client)
        gate = asyncio.Event()
        real_send = slow_conn.ws.send_str

        async def blocked_send(data, *args, **kwargs):
            await gate.wait()  # a peer whose TCP window is shut
            return await real_send(data, *args, **kwargs)

        slow_conn.ws.send_str = blocked_send
        await slow.send_json({"type": "generate", "id": "s", "prompt": "Once upon", "params": {**SHORT, "max_tokens": 24}})
        await asyncio.sleep(0.2)
        await fast.send_json({"type": "generate", "id": "f", "prompt": "Hello", "params": {**SHORT, "max_tokens": 8}})
        fast_result = await asyncio.wait_for(collect(fast, {"f"}), 30)
        assert len(fast_result["f"]["tokens"]) == 8  # served while the slow socket is stuck
        await wait_idle(engine)  # the slow request finished in the engine too: nothing waited on it
        assert slow_conn.outbox.num_coalesced > 0
        gate.set()
        slow_result = (await collect(slow, {"s"}))["s"]
        assert len(slow_result["tokens"]) == 24
        assert slow_result["deltas"] < 24  # merged while the socket was busy
        assert slow_result["text"] == engine.tokenizer.decode(slow_result["tokens"], skip_special_tokens=True)


async def test_outbox_coalesces_deltas_and_bounds_its_bytes():
    overflowed = []
    box = Outbox(lambda: overflowed.append(True), max_bytes=64 * 1024)
    for i in range(50):
        box.push_delta("a", SampleDelta(0, f"t{i} ", [i], [{i: -1.0}], None), run="a")
        box.push_delta("a", SampleDelta(1, "x", [100 + i], None, None), run="a")
    box.push_delta("b", SampleDelta(0, "b", [7], None, None), run="b")
    assert len(box) == 3 and box.num_coalesced == 98
    assert 0 < box.pending_bytes < 64 * 1024
    first = json.loads(await box.get())
    assert (first["id"], first["index"]) == ("a", 0)
    assert first["text"] == "".join(f"t{i} " for i in range(50)) and first["token_ids"] == list(range(50))
    assert first["logprobs"] == [{str(i): -1.0} for i in range(50)]
    second = json.loads(await box.get())
    assert (second["index"], len(second["token_ids"])) == (1, 50)
    assert json.loads(await box.get())["id"] == "b"
    assert box.pending_bytes == 0  # the estimate returns to zero once everything is taken
    from streamengine.server.protocol import Error, KvState

    pushed = 0
    while not overflowed:  # other messages count against the same budget
        box.push(Error(None, "bad_json", "x" * 100))
        pushed += 1
    assert 100 < pushed < 64 * 1024 // 200
    # a peer that never reads is cut off rather than buffered forever: what it did not read
    # is dropped, and nothing more is queued for it
    assert len(box) == 0 and box.pending_bytes == 0
    box.push(Error(None, "bad_json", "x"))
    box.push_delta("a", SampleDelta(0, "late", [1], None, None), run="a")
    assert len(box) == 0 and overflowed == [True]
    box2 = Outbox(lambda: None)
    box2.push(KvState(16, 2, "00", {"free": 2}), replace_key="kv")
    box2.push(KvState(16, 2, "22", {"used": 2}), replace_key="kv")
    assert len(box2) == 1 and json.loads(await box2.get())["blocks"] == "22"
    assert box2.pending_bytes == 0


# ---- security ---------------------------------------------------------------------------------


async def test_disallowed_origin_is_refused_with_403(engine):
    async with serve(engine, allowed_origins=["https://chat.example.com"]) as client:
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await client.ws_connect("/v1/stream", headers={"Origin": "http://evil.example"})
        assert info.value.status == 403
        own = f"http://127.0.0.1:{client.port}"
        for origin in (own, "https://chat.example.com", "HTTPS://Chat.Example.com:443"):
            ws = await connect(client, headers={"Origin": origin})
            await ws.close()
        ws = await connect(client)  # no Origin: not a browser
        await ws.close()
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await client.ws_connect("/v1/stream", headers={"Origin": f"http://127.0.0.1:{client.port + 1}"})


def test_origin_policy_rules():
    policy = OriginPolicy([])
    assert policy.allows(None, "anything")
    assert policy.allows("http://localhost:8000", "localhost:8000")
    assert policy.allows("http://example.com", "example.com:80")
    assert not policy.allows("http://localhost:8001", "localhost:8000")
    assert not policy.allows("null", "localhost:8000")
    assert OriginPolicy(["*"]).allows("http://x.test", "y")
    assert normalize_origin("HTTP://Example.COM:80/") == "http://example.com"
    assert normalize_origin("https://[::1]:8443") == "https://[::1]:8443"


async def test_websocket_requires_the_api_key(engine):
    async with serve(engine, api_key="secret") as client:
        # no auth: the first generate closes the socket with 4001
        ws = await client.ws_connect("/v1/stream")
        await ws.send_json({"type": "generate", "id": "a", "prompt": "Hi", "params": SHORT})
        msg = await ws.receive(timeout=10)
        assert msg.type is WSMsgType.CLOSE and msg.data == CLOSE_UNAUTHORIZED and "auth" in msg.extra
        # wrong key
        ws = await client.ws_connect("/v1/stream")
        await ws.send_json({"type": "auth", "key": "guess"})
        msg = await ws.receive(timeout=10)
        assert msg.type is WSMsgType.CLOSE and msg.data == CLOSE_UNAUTHORIZED and "invalid" in msg.extra
        # auth message first, then it works
        ws = await client.ws_connect("/v1/stream")
        await ws.send_json({"type": "auth", "key": "secret"})
        assert (await recv(ws))["type"] == "ready"
        await ws.send_json({"type": "generate", "id": "a", "prompt": "Hi", "params": SHORT})
        assert (await collect(ws, {"a"}))["a"]["done"]["finish_reason"] == "length"
        await ws.close()
        # the key in the handshake: Authorization header, or a bearer.<key> subprotocol
        ws = await connect(client, headers={"Authorization": "Bearer secret"})
        await ws.close()
        ws = await connect(client, protocols=("streamengine.v1", "bearer.secret"))
        assert ws.protocol == "streamengine.v1"
        await ws.close()
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await client.ws_connect("/v1/stream", headers={"Authorization": "Bearer nope"})
        assert info.value.status == 401


async def test_http_routes_require_the_api_key_except_health_and_page(engine):
    async with serve(engine, api_key="secret") as client:
        for path in ("/health", "/", "/static/app.js", "/static/style.css"):
            resp = await client.get(path)
            assert resp.status == 200, path
        assert (await (await client.get("/health")).json())["auth_required"] is True
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/kv_state"),
                             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            resp = await client.request(method, path, headers={"Authorization": "Bearer wrong"})
            assert resp.status == 401, path
            body = await resp.json()
            assert body["error"]["type"] == "authentication_error"
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            resp = await client.request(method, path)
            assert resp.status == 401
        resp = await client.get("/v1/models", headers={"Authorization": "Bearer secret"})
        assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "tiny"


async def test_tenants_never_share_prefix_cache_hits(engine):
    prompt = f"tenant test {SHARED_PROMPT}"
    async with serve(engine, api_key=["key-one", "key-two"]) as client:

        async def cached_tokens(key: str) -> int:
            ws = await connect(client, headers={"Authorization": f"Bearer {key}"})
            await ws.send_json({"type": "generate", "id": "a", "prompt": prompt, "params": SHORT})
            done = (await collect(ws, {"a"}))["a"]["done"]
            await ws.close()
            return done["usage"]["cached_prompt_tokens"]

        assert await cached_tokens("key-one") == 0
        assert await cached_tokens("key-one") >= 32  # the same tenant hits its own prefix
        assert await cached_tokens("key-two") == 0  # another tenant does not


def test_keyring():
    ring = KeyRing(["a-key", "b-key"])
    a, b = ring.lookup("a-key"), ring.lookup("b-key")
    assert a is not None and b is not None and a.cache_salt != b.cache_salt
    assert ring.lookup("c-key") is None and ring.lookup(None) is None and ring.lookup("") is None
    assert KeyRing(None).lookup(None).cache_salt is None
    with pytest.raises(ValueError):
        KeyRing([" padded "])


# ---- metrics, health, shutdown ---------------------------------------------------------------


async def test_metrics_parse_and_count_tokens(engine):
    async with serve(engine) as client:
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "m", "prompt": "Count me", "params": SHORT})
        done = (await collect(ws, {"m"}))["m"]["done"]
        resp = await client.get("/metrics")
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                     "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                     "prompt_tokens", "generation_tokens", "time_to_first_token_seconds",
                     "inter_token_latency_seconds", "e2e_request_latency_seconds",
                     "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
            assert f"streamengine:{name}" in families, name

        def value(family: str, sample: str) -> float:
            return next(s.value for s in families[f"streamengine:{family}"].samples if s.name == f"streamengine:{sample}")

        assert value("generation_tokens", "generation_tokens_total") == done["usage"]["completion_tokens"] == 4
        assert value("prompt_tokens", "prompt_tokens_total") == done["usage"]["prompt_tokens"]
        assert value("time_to_first_token_seconds", "time_to_first_token_seconds_count") == 1
        assert value("inter_token_latency_seconds", "inter_token_latency_seconds_count") == 3
        assert value("e2e_request_latency_seconds", "e2e_request_latency_seconds_count") == 1
        for stage in ("queue", "prefill", "decode"):
            assert value(f"request_{stage}_time_seconds", f"request_{stage}_time_seconds_count") == 1, stage
        # The engine's stages sit inside the server's view of the same request.
        engine_ttft = value("request_queue_time_seconds", "request_queue_time_seconds_sum") + value(
            "request_prefill_time_seconds", "request_prefill_time_seconds_sum")
        assert 0 < engine_ttft <= value("time_to_first_token_seconds", "time_to_first_token_seconds_sum")
        per_tenant = families["streamengine:tenant_request_queue_time_seconds"].samples
        assert [(s.labels["tenant"], s.value) for s in per_tenant if s.name.endswith("_count")] == [("default", 1)]
        assert value("num_requests_running", "num_requests_running") == 0
        assert value("prefix_cache_queries", "prefix_cache_queries_total") == engine.stats()["prefix_cache_queries"]
        assert 0.0 <= value("kv_cache_usage_perc", "kv_cache_usage_perc") <= 1.0
        # a second app in the same process has its own registry: no clash, its own counts
        other = create_app(engine, ServerConfig(model_name="other"))
        assert other[STATE_KEY].metrics.registry is not client.app[STATE_KEY].metrics.registry
        assert b"streamengine:generation_tokens_total 0.0" in other[STATE_KEY].metrics.render()


async def test_health(engine):
    async with serve(engine) as client:
        resp = await client.get("/health")
        body = await resp.json()
        assert resp.status == 200 and body["status"] == "ok" and body["auth_required"] is False


async def test_graceful_shutdown_closes_sockets_going_away_and_aborts(engine):
    app = create_app(engine, ServerConfig(model_name="tiny"))
    server = TestServer(app)
    client = TestClient(server)
    await client.start_server()
    try:
        ws = await connect(client)
        await ws.send_json({"type": "generate", "id": "a", "prompt": SHARED_PROMPT, "params": LONG})
        assert (await recv(ws))["type"] == "delta"
        await server.close()
        while True:
            msg = await ws.receive(timeout=10)
            if msg.type is not WSMsgType.TEXT:
                break
        assert msg.type is WSMsgType.CLOSE and msg.data == 1001
        assert not engine.is_running
        stats = engine.stats()
        assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        await client.close()
