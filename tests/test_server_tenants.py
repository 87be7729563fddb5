"""The server's side of tenancy: a tenants file's keys run requests as their tenant, per-user
salts, pins at start, 429 past a tenant's rate, per-tenant metrics, /v1/tenants and the
KV map's owners. A recording stand-in engine shows what the server asks of the engine (the
real engine's tenancy is tested in the engine's own tests)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from dataclasses import dataclass, field

import pytest
from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from streamengine.errors import LimitExceededError
from streamengine.sample.outputs import CompletionOutput, RequestOutput
from streamengine.server import create_app
from streamengine.server.config import ServerConfig
from streamengine.server.protocol import kv_state_message
from streamengine.server.tenancy import system_prefix
from streamengine.server.tenants_file import TenantsFileError, parse_tenants
from streamengine.tenancy.tenants import DEFAULT_TENANT, Tenants

ADMIN = {"Authorization": "Bearer admin-key"}
KEY_A = {"Authorization": "Bearer key-a"}
KEY_B = {"Authorization": "Bearer key-b"}
LEGACY = {"Authorization": "Bearer legacy-key"}
SYSTEM_A = "You are bot A, a helpful assistant of the example platform."
SHARED_PREFIX = "Platform preamble: every bot on this server follows these rules. " * 2


def tenants_file(**b_limits):
    return parse_tenants({
        "shared_prefix": SHARED_PREFIX,
        "tenants": [
            {"name": "bot-a", "api_key": "key-a", "weight": 2.0, "system_prompt": SYSTEM_A},
            {"name": "bot-b", "api_key_sha256": hashlib.sha256(b"key-b").hexdigest(), **b_limits},
        ],
    })


@dataclass(slots=True)
class Pin:
    pin_id: str
    tenant: str | None
    shared: bool
    num_tokens: int
    num_blocks: int
    token_ids: list[int] = field(default_factory=list)


class TenantEngine:
    """Records each generate()'s tenant, salt and prompt; enforces tokens_per_minute with the
    engine's own registry; pins into a pool of `pool_blocks` 16-token blocks."""

    model_name = "tiny"
    block_size = 16

    def __init__(self, tokenizer, pool_blocks: int = 64) -> None:
        self.tokenizer = tokenizer
        self.registry = Tenants()
        self.pool_blocks = pool_blocks
        self.is_running = False
        self.calls: list[dict] = []
        self.pins: list[Pin] = []
        self.rejected: dict[str, int] = {}

    async def start(self) -> None:
        self.is_running = True

    async def stop(self) -> None:
        self.is_running = False

    def health(self) -> dict:
        return {"state": "ready"}

    def add_tenant(self, config) -> None:
        self.registry.add(config)

    @property
    def tenants(self):
        return [self.registry.get(name) for name in self.registry.names()]

    async def pin_prefix(self, prompt, tenant=None, shared=False):
        ids = list(prompt)
        blocks = len(ids) // self.block_size
        if blocks == 0:  # as the engine does
            raise ValueError(f"a pinned prefix needs at least one full block ({self.block_size} tokens)")
        if sum(p.num_blocks for p in self.pins) + blocks > self.pool_blocks // 2:
            raise LimitExceededError("max_pinned_fraction", "pinning this prefix would pass max_pinned_fraction")
        pin = Pin(f"pin-{len(self.pins)}", tenant, shared, len(ids), blocks, ids)
        self.pins.append(pin)
        return pin

    def pinned(self):
        return list(self.pins)

    def apply_chat_template(self, messages):
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> dict:
        tenants = {}
        for name in self.registry.names():
            mine = [c for c in self.calls if c["tenant"] == name]
            tenants[name] = {
                "weight": self.registry.get(name).weight, "virtual_time": 1.5 * len(mine),
                "num_running": 0, "num_waiting": 0, "num_requests": len(mine),
                "prompt_tokens": sum(len(c["prompt"]) for c in mine),
                "output_tokens": sum(c["max_tokens"] for c in mine),
                "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_blocks": 0,
                "num_pinned_blocks": sum(p.num_blocks for p in self.pins if p.tenant == name),
                "num_rejected": self.rejected.get(name, 0),
            }
        return {"num_running": 0, "num_waiting": 0, "num_total_blocks": self.pool_blocks,
                "num_free_blocks": self.pool_blocks, "block_size": self.block_size, "max_model_len": 4096,
                "num_requests": 0, "tenants": tenants}

    def kv_state(self) -> dict:
        return {"block_size": 16, "num_blocks": 4, "blocks": [4, 2, 3, 0], "tenants": ["bot-a", "bot-b", "*", None]}

    async def generate(self, prompt, params, request_id=None, cache_salt=None, tenant=None):
        name = tenant if tenant is not None else DEFAULT_TENANT
        try:
            self.registry.check_rate(name)
        except Exception:
            self.rejected[name] = self.rejected.get(name, 0) + 1
            raise
        ids = list(prompt)
        self.registry.record(name, len(ids) + params.max_tokens)
        self.calls.append({"tenant": tenant, "cache_salt": cache_salt, "prompt": ids, "max_tokens": params.max_tokens})
        for i in range(params.max_tokens):
            await asyncio.sleep(0)
            done = i == params.max_tokens - 1
            sample = CompletionOutput(0, f"t{i} ", [1000 + i], finish_reason="length" if done else None)
            yield RequestOutput(request_id, ids, [sample], done)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@contextlib.asynccontextmanager
async def serve(engine, tenants=None, **options):
    options.setdefault("api_key", ["legacy-key"])
    options.setdefault("admin_keys", ["admin-key"])
    app = create_app(engine, ServerConfig(model_name="tiny", tenants=tenants or tenants_file(), **options))
    async with TestClient(TestServer(app)) as client:
        yield client


async def complete(client, headers, **body):
    resp = await client.post("/v1/completions", headers=headers,
                             json={"prompt": "Hello there", "max_tokens": 2, **body})
    return resp.status, await resp.json(), resp.headers


async def ws_generate(client, headers, **message):
    ws = await client.ws_connect("/v1/stream", headers=headers)
    assert json.loads((await ws.receive(timeout=10)).data)["type"] == "ready"
    await ws.send_json({"type": "generate", "id": "r", "prompt": "Hello there", "params": {"max_tokens": 2},
                        **message})
    while True:
        msg = await ws.receive(timeout=10)
        assert msg.type is WSMsgType.TEXT
        reply = json.loads(msg.data)
        if reply["type"] in ("done", "error"):
            await ws.close()
            return reply


# ---- tenants run as themselves ----------------------------------------------------------------


async def test_two_tenants_from_a_file_run_as_their_tenant(tokenizer):
    engine = TenantEngine(tokenizer)
    async with serve(engine) as client:
        assert (await complete(client, KEY_A))[0] == 200
        assert (await complete(client, KEY_B))[0] == 200  # a key given only as its SHA-256
        assert (await complete(client, LEGACY))[0] == 200
        assert (await ws_generate(client, KEY_B))["type"] == "done"
        assert (await complete(client, {"Authorization": "Bearer key-c"}))[0] == 401
    legacy = key_tenant("legacy-key")
    assert [c["tenant"] for c in engine.calls] == ["bot-a", "bot-b", legacy, "bot-b"]
    # a file tenant's private blocks take the tenant's own salt (None here: the engine's);
    # an --api-key key, a tenant of its own, keeps a secret salt of its own too
    salts = [c["cache_salt"] for c in engine.calls]
    assert salts[0] is None and salts[1] is None and salts[3] is None
    assert salts[2] is not None and salts[2] not in legacy
    # the file's tenants were registered at start; the legacy key's request ran as its own
    assert {t.name: t.weight for t in engine.tenants} == {"bot-a": 2.0, "bot-b": 1.0, legacy: 1.0}


def test_a_tenants_file_sets_the_n_and_best_of_caps():
    parsed = parse_tenants({"tenants": [{"name": "bot-a", "api_key": "key-a", "max_n": 4, "max_best_of": 2}]})
    assert (parsed.tenants[0].max_n, parsed.tenants[0].max_best_of) == (4, 2)
    with pytest.raises(TenantsFileError, match=r"tenants\[0\] \('bot-a'\): max_n must be an integer"):
        parse_tenants({"tenants": [{"name": "bot-a", "api_key": "key-a", "max_n": "4"}]})


def key_tenant(key: str, admin: bool = False) -> str:
    """The engine tenant an --api-key (or --admin-key) key runs as."""
    digest = hashlib.sha256(b"streamengine-tenant\0" + key.encode()).hexdigest()
    return f"{'admin' if admin else 'key'}-{digest[:16]}"


async def test_each_api_key_is_a_tenant_of_its_own_with_the_default_entrys_limits(tokenizer):
    """Two --api-key keys: each runs as its own engine tenant, so each has its own rate (the
    tenants file's `default` entry: 5 tokens a minute, per key) and its own fair share.
    Before the fix every --api-key key ran as the one `default` tenant: the first key's
    traffic used up the second's rate, and one key could take every key's share."""
    engine = TenantEngine(tokenizer)
    tenants = parse_tenants({"tenants": [
        {"name": "bot-a", "api_key": "key-a"}, {"name": DEFAULT_TENANT, "tokens_per_minute": 5}]})
    one, two = {"Authorization": "Bearer key-one"}, {"Authorization": "Bearer key-two"}
    async with serve(engine, tenants=tenants, api_key=["key-one", "key-two"]) as client:
        assert (await complete(client, one))[0] == 200  # its prompt and 2 tokens: under 5
        assert (await complete(client, one))[0] == 200
        assert (await complete(client, one))[0] == 429  # key-one's minute is used up
        assert (await complete(client, two))[0] == 200  # key-two's is its own
        assert (await complete(client, ADMIN))[0] == 200
    assert [c["tenant"] for c in engine.calls] == [key_tenant("key-one")] * 2 + [
        key_tenant("key-two"), key_tenant("admin-key", admin=True)]
    configs = {t.name: t for t in engine.tenants}
    assert configs[key_tenant("key-two")].tokens_per_minute == 5


async def test_the_user_field_salts_per_user_and_per_tenant(tokenizer):
    engine = TenantEngine(tokenizer)
    async with serve(engine) as client:
        for headers, user in ((KEY_A, "u1"), (KEY_A, "u2"), (KEY_A, "u1"), (KEY_B, "u1"), (LEGACY, "u1")):
            assert (await complete(client, headers, user=user))[0] == 200
        assert (await ws_generate(client, KEY_A, user="u1"))["type"] == "done"
        assert (await ws_generate(client, KEY_A, user="u2"))["type"] == "done"
    a1, a2, a1_again, b1, legacy1, ws_a1, ws_a2 = (c["cache_salt"] for c in engine.calls)
    assert a1 == a1_again == ws_a1 and a2 == ws_a2  # one user, one salt, on both protocols
    assert len({a1, a2, b1, legacy1}) == 4  # users apart; the same name in another tenant apart
    assert all(salt is not None and "u1" not in salt and "u2" not in salt for salt in (a1, a2, b1, legacy1))


# ---- pins at start ------------------------------------------------------------------------------


async def test_the_shared_prefix_and_system_prompts_are_pinned_at_start(tokenizer):
    engine = TenantEngine(tokenizer)
    async with serve(engine) as client:
        shared, bot_a = engine.pins
        assert (shared.tenant, shared.shared) == (None, True)
        assert shared.token_ids == tokenizer.encode(tenants_file().shared_prefix, add_special_tokens=True)
        assert (bot_a.tenant, bot_a.shared) == ("bot-a", False)
        # the pinned tokens are exactly what a chat request with that system message starts with
        resp = await client.post("/v1/chat/completions", headers=KEY_A, json={
            "messages": [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "Hi!"}],
            "max_tokens": 2})
        assert resp.status == 200
        prompt = engine.calls[-1]["prompt"]
        assert len(bot_a.token_ids) >= 16 and prompt[: len(bot_a.token_ids)] == bot_a.token_ids
    assert system_prefix(engine.tokenizer, SYSTEM_A).count(SYSTEM_A) == 1


async def test_a_refused_pin_stops_the_start_naming_the_tenant(tokenizer):
    engine = TenantEngine(tokenizer, pool_blocks=2 * len(tokenizer.encode(SHARED_PREFIX)) // 16)  # room for it alone
    app = create_app(engine, ServerConfig(model_name="tiny", tenants=tenants_file()))
    server = TestServer(app)
    with pytest.raises(TenantsFileError, match=r"cannot pin the system_prompt of tenant 'bot-a'.*max_pinned_fraction"):
        await server.start_server()
    await server.close()
    assert not engine.is_running  # the engine the app started is stopped again


# ---- rate limit ---------------------------------------------------------------------------------


async def test_past_its_rate_a_tenant_gets_429_and_the_others_go_on(tokenizer):
    engine = TenantEngine(tokenizer)
    async with serve(engine, tenants=tenants_file(tokens_per_minute=5)) as client:
        assert (await complete(client, KEY_B, max_tokens=6))[0] == 200  # more than the 5 tokens a minute
        status, body, headers = await complete(client, KEY_B)
        assert status == 429
        assert int(headers["Retry-After"]) >= 1
        error = body["error"]
        assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "rate_limit_exceeded",
                                                                 "tokens_per_minute")
        assert "'bot-b'" in error["message"]
        streamed = await client.post("/v1/completions", headers=KEY_B,
                                     json={"prompt": "Hi", "max_tokens": 2, "stream": True})
        assert streamed.status == 429 and "Retry-After" in streamed.headers
        reply = await ws_generate(client, KEY_B)
        assert (reply["type"], reply["code"], reply["limit"]) == ("error", "overloaded", "tokens_per_minute")
        assert reply["retry_after"] > 0
        assert (await complete(client, KEY_A))[0] == 200
    assert engine.rejected == {"bot-b": 3}


# ---- metrics and the tenants view -------------------------------------------------------------


def samples_of(text: str) -> dict[tuple[str, str], float]:
    """(sample name, tenant) -> value of every sample with a `tenant` label."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "tenant" in sample.labels and "le" not in sample.labels:
                out[(sample.name, sample.labels["tenant"])] = sample.value
    return out


async def test_per_tenant_metrics_parse(tokenizer):
    engine = TenantEngine(tokenizer)
    async with serve(engine, tenants=tenants_file(tokens_per_minute=5)) as client:
        for headers in (KEY_A, KEY_A, KEY_B, KEY_B, LEGACY):
            await complete(client, headers, max_tokens=3)
        assert (await client.get("/metrics", headers=KEY_A)).status == 403
        resp = await client.get("/metrics", headers=ADMIN)
        assert resp.status == 200
        got = samples_of(await resp.text())
    p = "streamengine:tenant_"
    prompt_len = len(tokenizer.encode("Hello there", add_special_tokens=True))
    assert got[(p + "prompt_tokens_total", "bot-a")] == 2 * prompt_len
    assert got[(p + "generation_tokens_total", "bot-a")] == 6
    assert got[(p + "num_rejected_total", "bot-b")] == 1 and got[(p + "num_rejected_total", "bot-a")] == 0
    assert got[(p + "time_to_first_token_seconds_count", "bot-a")] == 2
    assert got[(p + "time_to_first_token_seconds_count", "bot-b")] == 1  # the refused one has no first token
    assert got[(p + "time_to_first_token_seconds_count", key_tenant("legacy-key"))] == 1
    assert got[(p + "pinned_blocks", "bot-a")] >= 1 and got[(p + "virtual_time", "bot-a")] == 3.0
    for name in ("num_requests_running", "num_requests_waiting", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "kv_blocks"):
        assert (p + name, "bot-b") in got, name


async def test_the_tenants_view_needs_the_admin_key_and_keeps_salts_secret(tokenizer):
    engine = TenantEngine(tokenizer)
    tenants = tenants_file(tokens_per_minute=1000)
    async with serve(engine, tenants=tenants) as client:
        await complete(client, KEY_A)
        assert (await client.get("/v1/tenants")).status == 401
        assert (await client.get("/v1/tenants", headers=KEY_A)).status == 403
        assert (await client.get("/v1/tenants", headers=LEGACY)).status == 403
        resp = await client.get("/v1/tenants", headers=ADMIN)
        assert resp.status == 200
        text = await resp.text()
    body = json.loads(text)
    by_name = {t["name"]: t for t in body["data"]}
    assert set(by_name) == {"bot-a", "bot-b"}
    a, b = by_name["bot-a"], by_name["bot-b"]
    assert (a["weight"], b["weight"]) == (2.0, 1.0) and a["share"] == pytest.approx(2 / 3)
    assert a["usage"]["num_requests"] == 1 and a["virtual_time"] == 1.5
    assert b["limits"]["tokens_per_minute"] == 1000
    assert [p["tenant"] for p in a["pinned"]] == ["bot-a"] and a["num_pinned_blocks"] == a["pinned"][0]["num_blocks"]
    assert [p["shared"] for p in body["shared_pinned"]] == [True]
    for config in tenants.tenants:
        assert config.salt not in text


# ---- the KV map -------------------------------------------------------------------------------


def test_kv_state_carries_pinned_blocks_and_owners_and_keeps_the_old_shape():
    message = kv_state_message({"block_size": 16, "num_blocks": 5, "blocks": [4, 2, 3, 1, 0],
                                "tenants": ["bot-b", "bot-a", "*", None, None]})
    assert message.blocks == "42310" and message.counts["pinned"] == 1 and message.counts["free"] == 1
    assert message.tenants == ["*", "bot-a", "bot-b"]
    assert [message.tenants[i] if i >= 0 else None for i in message.owners] == ["bot-b", "bot-a", "*", None, None]
    import msgspec

    old = json.loads(msgspec.json.encode(kv_state_message({"block_size": 16, "num_blocks": 2, "blocks": [2, 0]})))
    assert "tenants" not in old and "owners" not in old and old["counts"]["used"] == 1


async def test_kv_state_over_the_websocket_names_tenants_for_admins(tokenizer):
    engine = TenantEngine(tokenizer)
    async with serve(engine) as client:
        ws = await client.ws_connect("/v1/stream", headers=ADMIN)
        assert json.loads((await ws.receive(timeout=10)).data)["type"] == "ready"
        await ws.send_json({"type": "kv_state"})
        msg = json.loads((await ws.receive(timeout=10)).data)
        await ws.close()
    assert msg["type"] == "kv_state" and msg["blocks"] == "4230"
    assert [msg["tenants"][i] if i >= 0 else None for i in msg["owners"]] == ["bot-a", "bot-b", "*", None]


# ---- the real engine ----------------------------------------------------------------------------


async def test_the_real_engine_serves_a_tenants_file(tiny_llama_dir):
    from streamengine import AsyncEngine, EngineConfig

    tenants = tenants_file(tokens_per_minute=20)
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=96, tenants=tenants.tenants))
    chat = {"messages": [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "Hi!"}],
            "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    async with serve(engine, tenants=tenants) as client:
        assert {p.tenant for p in engine.pinned()} == {None, "bot-a"}
        resp = await client.post("/v1/chat/completions", headers=KEY_A, json={**chat, "user": "u1"})
        assert resp.status == 200
        usage = (await resp.json())["usage"]
        # the pinned system prompt is a hit for any user of bot-a
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 16
        assert (await complete(client, KEY_B, max_tokens=30, ignore_eos=True))[0] == 200
        status, body, headers = await complete(client, KEY_B)
        assert status == 429 and "Retry-After" in headers and body["error"]["code"] == "rate_limit_exceeded"
        figures = engine.stats()["tenants"]
        # (bot-a's pin was computed as a one-token request of bot-a: at least its 3, then)
        assert figures["bot-a"]["output_tokens"] >= 3 and figures["bot-b"]["output_tokens"] == 30
        assert figures["bot-b"]["num_rejected"] == 1
        got = samples_of(await (await client.get("/metrics", headers=ADMIN)).text())
        assert got[("streamengine:tenant_generation_tokens_total", "bot-b")] == 30
        assert got[("streamengine:tenant_num_rejected_total", "bot-b")] == 1
        view = await (await client.get("/v1/tenants", headers=ADMIN)).json()
        by_name = {t["name"]: t for t in view["data"]}
        assert by_name["bot-a"]["num_pinned_blocks"] >= 1 and by_name["bot-a"]["pinned"]
        assert view["shared_pinned"][0]["num_blocks"] >= 1


# ---- hostile tenants files ----------------------------------------------------------------------


def test_a_tenants_file_nested_too_deeply_is_a_tenants_file_error(tmp_path):
    from streamengine.server.tenants_file import load_tenants_file

    for text in ("x = " + "[" * 5000 + "]" * 5000, "x = " + "{a = " * 5000 + "1" + "}" * 5000):
        path = tmp_path / "deep.toml"
        path.write_text(text)
        with pytest.raises(TenantsFileError, match="nested too deeply"):
            load_tenants_file(path)


def test_an_endless_file_as_tenants_file_is_refused_by_its_size():
    from streamengine.server.tenants_file import MAX_FILE_BYTES, load_tenants_file

    with pytest.raises(TenantsFileError, match=f"larger than {MAX_FILE_BYTES} bytes"):
        load_tenants_file("/dev/zero")


@pytest.mark.parametrize("cluster", [[], ["--replicas", "2"]], ids=["one engine", "ray"])
def test_a_system_prompt_shorter_than_a_block_is_refused_before_the_model_loads(tiny_llama_dir, tmp_path,
                                                                                 monkeypatch, capsys, cluster):
    from streamengine import __main__ as cli

    def no_engine(*_a, **_k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr("streamengine.ray.app.serve_cluster", no_engine)  # (imports the engine first)
    monkeypatch.setattr("streamengine.engine.async_engine.AsyncEngine", no_engine)
    path = tmp_path / "tenants.toml"
    path.write_text(f'[[tenants]]\nname = "bot-a"\napi_key = "key-a"\nsystem_prompt = "Hi."\n'
                    f'[[tenants]]\nname = "bot-b"\napi_key = "key-b"\nsystem_prompt = "{SYSTEM_A}"\n')
    assert cli.main(["serve", "--tenants", str(path), "--model", str(tiny_llama_dir), *cluster]) == 2
    err = capsys.readouterr().err
    assert "the system_prompt of tenant 'bot-a'" in err and "shorter than one KV block (16 tokens)" in err


def test_a_key_lookup_costs_one_probe_among_20000_keys(monkeypatch):
    import hmac

    from streamengine.server import security

    keys = [f"sk-{i:05d}" for i in range(20_000)]
    ring = security.KeyRing(keys, admin_keys=["admin"])
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(security.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    assert ring.lookup("sk-12345").name == security._tenant_for("sk-12345", is_admin=False).name
    assert ring.lookup("admin").is_admin and ring.lookup("sk-nope") is None and ring.lookup("") is None
    assert len(compared) <= 3  # one comparison at most per lookup, not one per key
