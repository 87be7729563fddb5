"""LoRA adapters through the server: `model` naming an adapter on the OpenAI routes, the
adapters in /v1/models, vLLM's load and unload routes (admin keys only), a tenant's default
adapter, and the WebSocket's `params.lora`. Greedy tokens are compared with the engine's own
for the same adapter, asked directly (not through the server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer

from streamengine import AsyncEngine, EngineConfig
from streamengine.sample.sampling_params import SamplingParams
from streamengine.server import create_app
from streamengine.server.config import ServerConfig
from streamengine.tenancy.tenants import DEFAULT_TENANT, TenantConfig

PROMPT = [1, 450, 3012, 88, 1200, 15, 902, 44, 7001, 32, 19, 5]
MAX_TOKENS = 8
KEY, ADMIN = "user-key", "admin-key"
USER_AUTH, ADMIN_AUTH = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def engine(untied_llama_dir, tiny_lora_dirs):
    modules = tuple((name, str(path)) for name, path in tiny_lora_dirs.items())
    return AsyncEngine(EngineConfig(model=str(untied_llama_dir), num_gpu_blocks=96, max_num_seqs=8,
                                    lora_modules=modules, max_lora_rank=16))


@contextlib.asynccontextmanager
async def serve(engine, **options):
    app = create_app(engine, ServerConfig(model_name="tiny", **options))
    async with TestClient(TestServer(app)) as client:
        yield client


async def engine_tokens(engine, lora: str | None) -> list[int]:
    """The engine's own greedy tokens for PROMPT under `lora`, asked directly."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [out async for out in engine.generate(PROMPT, params, lora=lora)]
    return list(outputs[-1].outputs[0].token_ids)


async def complete(client, model: str, headers: dict | None = None, **fields) -> dict:
    """A greedy completion of PROMPT; its token ids under "ids" (from logprobs named by id)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, **fields}
    resp = await client.post("/v1/completions", json=body, headers=headers)
    answer = await resp.json()
    answer["status"] = resp.status
    if resp.status == 200:
        answer["ids"] = [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]
    return answer


async def test_models_lists_the_adapters_with_their_parent(engine, tiny_lora_dirs):
    async with serve(engine) as client:
        data = (await (await client.get("/v1/models")).json())["data"]
        assert [card["id"] for card in data] == ["tiny", "lora-a", "lora-b"]
        assert data[0]["parent"] is None
        for card in data[1:]:
            assert card["object"] == "model" and card["parent"] == "tiny"
            assert card["root"] == str(tiny_lora_dirs[card["id"]])
        card = await (await client.get("/v1/models/lora-b")).json()
        assert card["id"] == "lora-b" and card["parent"] == "tiny"
        missing = await client.get("/v1/models/lora-z")
        assert missing.status == 404 and (await missing.json())["error"]["code"] == "model_not_found"


async def test_model_naming_an_adapter_runs_under_it(engine):
    async with serve(engine) as client:
        base = await complete(client, "tiny")
        expected = {name: await engine_tokens(engine, name) for name in ("lora-a", "lora-b")}
        assert base["ids"] == await engine_tokens(engine, None) and base["model"] == "tiny"
        for name, tokens in expected.items():
            answer = await complete(client, name)
            assert answer["status"] == 200 and answer["model"] == name  # the name requested, echoed
            assert answer["ids"] == tokens
            assert tokens != base["ids"]  # the adapter changes the text: the test can fail
        assert expected["lora-a"] != expected["lora-b"]
        chat = await client.post("/v1/chat/completions", json={
            "model": "lora-b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True})
        chunks = [json.loads(line[6:]) for line in (await chat.text()).splitlines()
                  if line.startswith("data: {")]
        assert chunks and all(chunk["model"] == "lora-b" for chunk in chunks)
        tokenized = await client.post("/tokenize", json={"model": "lora-a", "prompt": "Hello"})
        assert tokenized.status == 200


async def test_an_unknown_model_is_a_404_listing_what_is_served(engine):
    async with serve(engine) as client:
        answer = await complete(client, "lora-z")
        assert answer["status"] == 404
        error = answer["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert all(f"`{name}`" in error["message"] for name in ("lora-z", "tiny", "lora-a", "lora-b"))
        assert (await client.post("/tokenize", json={"model": "lora-z", "prompt": "x"})).status == 404


async def test_a_tenant_default_adapter_applies_when_the_base_model_is_named(engine):
    async with serve(engine) as client:
        engine.add_tenant(TenantConfig(DEFAULT_TENANT, lora="lora-b"))
        try:
            assert (await complete(client, "tiny"))["ids"] == await engine_tokens(engine, "lora-b")
            assert (await complete(client, "lora-a"))["ids"] == await engine_tokens(engine, "lora-a")
        finally:
            engine.add_tenant(TenantConfig(DEFAULT_TENANT))


async def test_per_tenant_metrics_name_the_tenants_adapter(engine):
    async with serve(engine) as client:
        engine.add_tenant(TenantConfig("bot-b", lora="lora-b"))
        text = await (await client.get("/metrics")).text()
        assert 'streamengine:tenant_lora_info{lora="lora-b",tenant="bot-b"} 1.0' in text
        assert not any(line.startswith("streamengine:tenant_lora_info{") and f'tenant="{DEFAULT_TENANT}"' in line
                       for line in text.splitlines())  # no adapter named: no series


async def test_load_use_and_unload_with_an_admin_key(engine, tiny_lora_dirs, monkeypatch):
    async with serve(engine, api_key=KEY, admin_keys=(ADMIN,)) as client:
        try:
            await load_use_and_unload(engine, client, str(tiny_lora_dirs["lora-a"]), monkeypatch)
        finally:  # the other tests expect the module's engine to hold lora-a and lora-b only
            if "lora-c" in engine.core.loras.adapters:
                await engine.remove_lora("lora-c")


async def load_use_and_unload(engine, client, path: str, monkeypatch) -> None:
    load = {"lora_name": "lora-c", "lora_path": path}
    refused = await client.post("/v1/load_lora_adapter", json=load, headers=USER_AUTH)
    assert refused.status == 403 and (await refused.json())["error"]["code"] == "admin_required"
    loaded = await client.post("/v1/load_lora_adapter", json=load, headers=ADMIN_AUTH)
    assert loaded.status == 200 and "lora-c" in await loaded.text()
    models = await (await client.get("/v1/models", headers=USER_AUTH)).json()
    assert "lora-c" in [card["id"] for card in models["data"]]
    answer = await complete(client, "lora-c", USER_AUTH)
    assert answer["ids"] == await engine_tokens(engine, "lora-a")  # the same files

    refused = await client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-c"}, headers=USER_AUTH)
    assert refused.status == 403 and "admin key" in (await refused.json())["error"]["message"]
    # unloading while a request runs on it: the request ends whole, then the adapter goes. After
    # its first step (the prompt, which samples the first token) the steps wait at a gate until
    # the unload has begun, so the request is still running then however slow the machine is.
    gate, steps = threading.Event(), []
    execute = engine.core.execute

    def gated_execute(step):
        steps.append(step)
        if len(steps) > 1:
            gate.wait(60)
        return execute(step)

    monkeypatch.setattr(engine.core, "execute", gated_execute)
    stream = await client.post("/v1/completions", headers=USER_AUTH, json={
        "model": "lora-c", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
        "stream": True, "logprobs": 0})
    first = await stream.content.readline()
    assert first.startswith(b"data: {")
    unload = asyncio.create_task(client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-c"},
                                             headers=ADMIN_AUTH))
    while "lora-c" not in engine.core.loras.removing:  # refused to new requests, kept for the running one
        assert not unload.done()
        await asyncio.sleep(0.005)
    assert (await complete(client, "lora-c", USER_AUTH))["status"] == 404
    gate.set()
    rest = (first + await stream.content.read()).decode()
    chunks = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"]) == 48
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    unloaded = await unload
    assert unloaded.status == 200 and "removed" in await unloaded.text()
    assert "lora-c" not in engine.core.loras.adapters
    again = await client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-c"}, headers=ADMIN_AUTH)
    assert again.status == 404 and (await again.json())["error"]["param"] == "lora_name"


async def test_bad_loads_are_400s_naming_the_field(engine, tiny_lora_dirs, tmp_path):
    async with serve(engine) as client:  # no keys: everyone is admin
        async def load(body) -> dict:
            resp = await client.post("/v1/load_lora_adapter", json=body)
            assert resp.status == 400, await resp.text()
            return (await resp.json())["error"]

        assert (await load({"lora_name": "x"}))["param"] == "lora_path"
        assert (await load({"lora_path": str(tmp_path)}))["param"] == "lora_name"
        assert (await load({"lora_name": 5, "lora_path": str(tmp_path)}))["param"] == "lora_name"
        error = await load({"lora_name": "x", "lora_path": str(tmp_path / "nothing")})
        assert error["param"] == "lora_path" and "missing adapter_config.json" in error["message"]
        error = await load({"lora_name": "lora-a", "lora_path": str(tiny_lora_dirs["lora-b"])})
        assert error["param"] == "lora_name" and "already loaded" in error["message"]
        assert (await load({"lora_name": "tiny", "lora_path": str(tiny_lora_dirs["lora-b"])}))["param"] == "lora_name"
        missing = await client.post("/v1/unload_lora_adapter", json={})
        assert missing.status == 400 and (await missing.json())["error"]["param"] == "lora_name"
        assert [a["name"] for a in engine.lora_adapters()] == ["lora-a", "lora-b"]


async def test_websocket_params_lora(engine):
    async with serve(engine) as client:
        expected = await engine_tokens(engine, "lora-a")
        ws = await client.ws_connect("/v1/stream")
        assert (await ws.receive_json())["type"] == "ready"
        params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        await ws.send_json({"type": "generate", "id": "a", "prompt": PROMPT, "params": {**params, "lora": "lora-a"}})
        tokens = []
        while (msg := await ws.receive_json(timeout=30))["type"] == "delta":
            tokens += msg["token_ids"]
        assert msg["type"] == "done" and tokens == expected
        for bad, why in (("lora-z", "no LoRA adapter named 'lora-z'"), (7, "params.lora must be")):
            await ws.send_json({"type": "generate", "id": "bad", "prompt": PROMPT, "params": {**params, "lora": bad}})
            error = await ws.receive_json(timeout=30)
            assert error["type"] == "error" and error["id"] == "bad" and error["code"] == "invalid_params"
            assert why in error["message"]
        await ws.close()
