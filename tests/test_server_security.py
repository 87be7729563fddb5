"""Issue 12: Host and Origin checks (DNS rebinding, CSRF), CORS, admin-only global views,
liveness and readiness, and the graceful drain, against the real engine (tiny model)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import WSMsgType
from conftest import slow_down_steps
from test_server import serve, wait_idle

from streamengine import AsyncEngine, EngineConfig
from streamengine.server.state import STATE_KEY

SHORT = {"max_tokens": 4, "ignore_eos": True, "temperature": 0}
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
EVIL = "http://attacker.example"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=96, max_num_seqs=16))


def completion(max_tokens: int = 4, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": stream}


async def streaming_socket(client):
    """A WebSocket with one long request ("a") that has already streamed its first delta."""
    ws = await client.ws_connect("/v1/stream")
    assert json.loads((await ws.receive(timeout=30)).data)["type"] == "ready"
    await ws.send_json({"type": "generate", "id": "a", "prompt": "Once upon a time", "params": LONG})
    assert json.loads((await ws.receive(timeout=30)).data)["type"] == "delta"
    return ws


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- Host: DNS rebinding ---------------------------------------------------------------------


async def test_rebound_host_is_refused_on_http_and_websocket(engine):
    async with serve(engine) as client:
        rebound = {"Host": f"attacker.example:{client.port}", "Origin": f"{EVIL}:{client.port}"}
        for method, path in (("GET", "/v1/kv_state"), ("POST", "/v1/completions"), ("GET", "/"),
                             ("GET", "/metrics"), ("GET", "/v1/models")):
            resp = await client.request(method, path, headers={"Host": rebound["Host"]},
                                        json=completion() if method == "POST" else None)
            assert resp.status == 421, (path, resp.status)
            body = await resp.json()
            assert "--allowed-host" in body["error"]["message"] and body["error"]["code"] == "host_not_allowed"
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await client.ws_connect("/v1/stream", headers=rebound)
        assert info.value.status == 421


async def test_loopback_names_are_accepted_by_default(engine):
    async with serve(engine) as client:
        for host in ("localhost", "LOCALHOST.", "127.0.0.1", "[::1]", "chat.localhost", "localhost:1"):
            resp = await client.get("/v1/models", headers={"Host": host})
            assert resp.status == 200, host


async def test_allowed_hosts_add_names_and_star_allows_any(engine):
    async with serve(engine, allowed_hosts=["chat.example.com", "*.corp.example"]) as client:
        for host in ("chat.example.com:8000", "a.corp.example", "localhost"):
            assert (await client.get("/v1/models", headers={"Host": host})).status == 200, host
        for host in ("example.com", "corp.example", "chat.example.com.attacker.example"):
            assert (await client.get("/v1/models", headers={"Host": host})).status == 421, host
    async with serve(engine, allowed_hosts=["*"]) as client:
        assert (await client.get("/v1/models", headers={"Host": "anything.example"})).status == 200


def test_hosts_for_bind():
    from streamengine.server.security import HostPolicy, hosts_for_bind

    assert hosts_for_bind("0.0.0.0", []) == ["*"]
    assert hosts_for_bind("::", []) == ["*"]
    assert hosts_for_bind("0.0.0.0", ["api.example"]) == ["api.example"]
    assert hosts_for_bind("10.1.2.3", []) == ["10.1.2.3"]
    assert hosts_for_bind("fd00::5", ["x.example"]) == ["[fd00::5]", "x.example"]
    assert hosts_for_bind("127.0.0.1", []) == []
    policy = HostPolicy(hosts_for_bind("10.1.2.3", []))
    assert policy.allows("10.1.2.3:8000") and policy.allows("localhost:8000") and policy.allows(None)
    assert not policy.allows("10.1.2.4:8000")
    with pytest.raises(ValueError):
        HostPolicy(["bad host/name"])


# ---- Origin: cross-site requests, CORS ---------------------------------------------------------


async def test_cross_origin_text_plain_post_is_refused(engine):
    async with serve(engine) as client:
        # what a form or fetch(..., {mode: "no-cors"}) on another site can send without a preflight
        resp = await client.post("/v1/completions", data=json.dumps(completion()),
                                 headers={"Origin": EVIL, "Content-Type": "text/plain"})
        assert resp.status == 403
        body = await resp.json()
        assert "--allowed-origin" in body["error"]["message"] and body["error"]["code"] == "origin_not_allowed"
        assert (await client.get("/v1/kv_state", headers={"Origin": EVIL})).status == 403
        await wait_idle(engine)
        # the server's own page is same-origin
        own = f"http://127.0.0.1:{client.port}"
        resp = await client.post("/v1/completions", json=completion(), headers={"Origin": own})
        assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers


async def test_allowed_origin_gets_cors_headers_and_preflight(engine):
    origin = "https://chat.example.com"
    async with serve(engine, api_key="secret", allowed_origins=[origin]) as client:
        resp = await client.options("/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
        })  # a preflight carries no key: it must not need one
        assert resp.status == 204
        h = resp.headers
        assert h["Access-Control-Allow-Origin"] == origin and "Origin" in h["Vary"]
        assert "POST" in h["Access-Control-Allow-Methods"]
        allowed = {x.strip().lower() for x in h["Access-Control-Allow-Headers"].split(",")}
        assert {"authorization", "content-type", "x-stainless-os"} <= allowed
        assert int(h["Access-Control-Max-Age"]) > 0
        resp = await client.post("/v1/completions", json=completion(), headers={"Origin": origin, **bearer("secret")})
        assert resp.status == 200
        assert resp.headers["Access-Control-Allow-Origin"] == origin and "Origin" in resp.headers["Vary"]
        # errors carry the CORS headers too, so the page can read why it was refused
        resp = await client.get("/v1/models", headers={"Origin": origin})
        assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == origin
        resp = await client.options("/v1/completions", headers={
            "Origin": EVIL, "Access-Control-Request-Method": "POST"})
        assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers


# ---- admin-only global views ---------------------------------------------------------------------


async def test_global_views_are_refused_to_tenants_without_an_admin_key(engine):
    async with serve(engine, api_key=["tenant-key"]) as client:
        for path in ("/metrics", "/v1/kv_state"):
            resp = await client.get(path, headers=bearer("tenant-key"))
            assert resp.status == 403, path
            body = await resp.json()
            assert body["error"]["code"] == "admin_required" and "--admin-key" in body["error"]["message"]
        assert (await client.get("/v1/models", headers=bearer("tenant-key"))).status == 200


async def test_admin_key_reads_global_views_and_is_a_normal_key(engine):
    async with serve(engine, api_key=["tenant-key"], admin_keys=["admin-key"]) as client:
        for path in ("/metrics", "/v1/kv_state"):
            assert (await client.get(path, headers=bearer("admin-key"))).status == 200, path
            resp = await client.get(path, headers=bearer("tenant-key"))
            assert resp.status == 403
            assert "admin key" in (await resp.json())["error"]["message"]
        resp = await client.post("/v1/completions", json=completion(), headers=bearer("admin-key"))
        assert resp.status == 200
    async with serve(engine) as client:  # no keys: open as before
        assert (await client.get("/metrics")).status == 200
        assert (await client.get("/v1/kv_state")).status == 200


def test_keyring_admin_tenants():
    from streamengine.server.security import KeyRing

    ring = KeyRing(["t"], admin_keys=["a"])
    tenant, admin = ring.lookup("t"), ring.lookup("a")
    assert tenant is not None and admin is not None
    assert admin.is_admin and not tenant.is_admin and admin.cache_salt != tenant.cache_salt
    assert ring.has_admin and not KeyRing(["t"]).has_admin
    assert KeyRing(None, admin_keys=["a"]).enabled
    assert KeyRing(None).lookup(None).is_admin


# ---- /health and /ready ---------------------------------------------------------------------------


async def test_health_and_ready_are_public_and_say_why(engine):
    async with serve(engine, api_key="secret") as client:
        resp = await client.get("/health")
        body = await resp.json()
        assert resp.status == 200
        assert body["status"] == "ok" and body["engine"] == "ready" and body["auth_required"] is True
        resp = await client.get("/ready")
        assert resp.status == 200 and (await resp.json())["status"] == "ready"
        client.app[STATE_KEY].shutting_down = True
        resp = await client.get("/ready")
        body = await resp.json()
        assert resp.status == 503 and body["status"] == "draining" and "shutting down" in body["reason"]
        assert (await client.get("/health")).status == 200  # alive while draining
        client.app[STATE_KEY].shutting_down = False


async def test_health_answers_while_the_engine_is_busy(engine):
    async with serve(engine) as client:
        ws = await streaming_socket(client)
        started = time.monotonic()
        resp = await client.get("/health")
        assert resp.status == 200 and time.monotonic() - started < 2.0
        assert (await client.get("/ready")).status == 200
        await ws.close()
        await wait_idle(engine)


@pytest.mark.parametrize(("health", "status", "reason"), [
    ({"state": "restarting", "reason": "step failed: boom"}, "restarting", "boom"),
    ({"state": "starting", "reason": None}, "starting", "starting"),
    ({"state": "stopped", "reason": "gave up after 3 restarts"}, "stopped", "gave up"),
    ({"state": "ready", "seconds_since_progress": 500.0, "num_requests": 2}, "stalled", "500"),
])
async def test_ready_is_503_unless_the_engine_makes_progress(engine, monkeypatch, health, status, reason):
    full = {"state": "ready", "reason": None, "seconds_since_progress": 0.0, "num_restarts": 0,
            "num_requests": 0, **health}
    async with serve(engine, stall_timeout=120.0) as client:
        monkeypatch.setattr(engine, "health", lambda: full, raising=False)
        resp = await client.get("/ready")
        body = await resp.json()
        assert resp.status == 503 and body["status"] == status and reason in body["reason"]
        health_resp = await client.get("/health")
        assert (await health_resp.json())["engine"] == full["state"]
        monkeypatch.undo()


# ---- the graceful drain ------------------------------------------------------------------------


async def test_drain_lets_requests_finish_and_refuses_new_ones(engine):
    from streamengine.server.app import drain

    async with serve(engine) as client:
        resp = await client.post("/v1/completions", json=completion(max_tokens=48, stream=True))
        assert (await resp.content.readline()).startswith(b"data: {")
        draining = asyncio.ensure_future(drain(client.app, timeout=60.0))
        await asyncio.sleep(0.05)
        refused = await client.post("/v1/completions", json=completion())
        assert refused.status == 503 and int(refused.headers["Retry-After"]) >= 1
        assert (await refused.json())["error"]["code"] == "shutting_down"
        events = [line async for line in resp.content if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]\n"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        started = time.monotonic()
        await asyncio.wait_for(draining, 10)
        assert time.monotonic() - started < 5  # it ended when the last request did
        await wait_idle(engine)


async def test_drain_cuts_long_requests_at_the_timeout(engine, monkeypatch):
    from streamengine.server.app import drain

    slow_down_steps(monkeypatch, engine)  # 400 tokens take 8 s: both requests outlast the drain

    async with serve(engine) as client:
        resp = await client.post("/v1/completions", json=completion(max_tokens=400, stream=True))
        assert (await resp.content.readline()).startswith(b"data: {")
        ws = await streaming_socket(client)  # live in the engine before the drain starts
        started = time.monotonic()
        await drain(client.app, timeout=0.5)
        elapsed = time.monotonic() - started
        assert 0.5 <= elapsed < 5, elapsed
        events = [line async for line in resp.content if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]\n"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
        while True:
            msg = await ws.receive(timeout=10)
            if msg.type is not WSMsgType.TEXT:
                break
        assert msg.type is WSMsgType.CLOSE and msg.data == 1001 and "shutting down" in msg.extra
        assert engine.is_running  # the drain ends the work; stopping is the app's cleanup
        await wait_idle(engine, timeout=2.0)


async def test_a_second_signal_hurries_the_drain(engine):
    from streamengine.server.app import drain

    async with serve(engine) as client:
        await streaming_socket(client)  # the session keeps the socket open
        hurry = asyncio.Event()
        hurry.set()
        started = time.monotonic()
        await drain(client.app, timeout=60.0, hurry=hurry)
        assert time.monotonic() - started < 5
        await wait_idle(engine, timeout=2.0)
