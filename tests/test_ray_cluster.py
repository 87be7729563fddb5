"""The Ray Serve deployment end to end: a local cluster on 127.0.0.1, two replicas of a tiny
model behind the ingress, reached with the openai client, raw HTTP and the WebSocket.

One cluster serves the whole module (starting one costs tens of seconds on two cores); the
test that kills a replica runs last.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from streamengine.config import EngineConfig  # noqa: E402
from streamengine.server.tenants_file import parse_tenants  # noqa: E402

pytestmark = pytest.mark.ray

KEY_A, KEY_B, ADMIN_KEY = "key-a", "key-b", "key-admin"
# Long enough for several full blocks: the part a bot's conversations share.
SYSTEM = "You are the support bot of an example shop. " * 12
STREAM_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster_model_dir(tmp_path_factory, smollm_dir):
    """A random Llama wider and deeper than the tiny one: a step takes milliseconds, so a
    long stream is still being generated when a test kills or removes its replica."""
    from conftest import _TINY, _save_tiny
    from transformers import LlamaConfig

    config = LlamaConfig(**dict(_TINY, hidden_size=256, intermediate_size=1024, num_hidden_layers=6))
    return _save_tiny(config, tmp_path_factory.mktemp("cluster_llama"), smollm_dir)


@pytest.fixture(scope="module")
def cluster(cluster_model_dir):
    from ray import serve

    from streamengine.ray import ClusterOptions, deploy
    from streamengine.server.config import ServerConfig

    tenants = parse_tenants({"tenants": [
        {"name": "bot-a", "api_key": KEY_A}, {"name": "bot-b", "api_key": KEY_B},
    ]})
    config = EngineConfig(model=str(cluster_model_dir), num_gpu_blocks=256, tenants=tenants.tenants)
    options = ClusterOptions(
        replicas=2, router="cached", app_name="test", port=_free_port(), replica_cpus=1.0,
        # Room for the scale-down test's 600-token streams to end on a slow, loaded machine
        # (an AVX2-only CPU ran them past 30 s); a replica with nothing running leaves at once.
        tenants_file=tenants, graceful_shutdown_timeout_s=120.0, server=ServerConfig(admin_keys=(ADMIN_KEY,)),
    )
    ray.init(num_cpus=2, include_dashboard=False, namespace="streamengine", log_to_driver=False)
    try:
        app = deploy(config, options)
        _wait_ready(app.url)
        app.config, app.options = config, options  # for the test that scales it down
        yield app
        app.shutdown()
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait_ready(url: str, timeout: float = 60.0) -> None:
    """Until the ingress answers /ready (every replica already reported ready)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
                if json.loads(r.read())["status"] == "ready":
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("the ingress did not become ready")
        time.sleep(0.2)


async def _until_cached(cluster, timeout: float = 30.0) -> None:
    """Until some replica reports cached blocks to the directory."""
    deadline = time.monotonic() + timeout
    while not any(load["stats"]["num_cached_blocks"] for load in cluster.replica_loads().values()):
        assert time.monotonic() < deadline, "no replica reported cached blocks"
        await asyncio.sleep(0.1)


def _client(app, key: str):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{app.url}/v1", api_key=key, timeout=STREAM_TIMEOUT_S, max_retries=0)


async def _chat(client, user: str, max_tokens: int = 4):
    return await client.chat.completions.create(
        model=(await client.models.list()).data[0].id,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        max_tokens=max_tokens, temperature=0.0,
    )


def _cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


async def test_a_tenants_requests_follow_its_cached_prefix(cluster):
    """After one request computes bot A's system prompt, every later one of A lands on the
    replica holding it (its cached tokens cover the prompt); bot B sending the very same
    messages never hits A's blocks."""
    a = _client(cluster, KEY_A)
    first = await _chat(a, "Where is my order?")
    assert _cached(first) == 0
    prompt_tokens = first.usage.prompt_tokens
    await _until_cached(cluster)  # the replica's KV events are out (the router also remembers
    # where it placed the first request, so this is not needed for the placement itself)
    hits = [_cached(await _chat(a, f"Question number {i}: can I return it?")) for i in range(6)]
    shared = len(SYSTEM) // 8  # at least the system prompt's blocks, far from 0
    assert all(h >= shared for h in hits), (hits, prompt_tokens)
    b = _client(cluster, KEY_B)
    other = [_cached(await _chat(b, "Where is my order?")) for _ in range(2)]
    # B's second request may hit B's own first one, never A's: at most what B computed itself.
    assert other[0] == 0
    assert other[1] <= prompt_tokens


async def test_openai_client_streams_through_the_ingress(cluster):
    a = _client(cluster, KEY_A)
    models = await a.models.list()
    model = models.data[0].id
    whole = await a.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0.0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    stream = await a.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0.0,
                                        stream=True)
    pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert len(pieces) >= 2  # token by token, not one blob
    assert "".join(pieces) == whole.choices[0].text  # greedy: the same text either way


async def test_bad_requests_get_the_servers_errors(cluster):
    import openai

    a = _client(cluster, KEY_A)
    model = (await a.models.list()).data[0].id
    with pytest.raises(openai.BadRequestError):
        await a.completions.create(model=model, prompt="Hi", max_tokens=4, temperature=-1.0)
    with pytest.raises(openai.AuthenticationError):
        await _client(cluster, "wrong-key").models.list()


async def test_websocket_streams_through_the_ingress(cluster):
    import aiohttp

    async with aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {KEY_A}"}
        async with session.ws_connect(f"{cluster.url}/v1/stream", headers=headers) as ws:
            ready = json.loads((await ws.receive(timeout=30)).data)
            assert ready["type"] == "ready"
            await ws.send_json({"type": "generate", "id": "w", "prompt": "Once upon a time",
                                "params": {"max_tokens": 6, "temperature": 0.0}})
            tokens, done = [], None
            while done is None:
                msg = json.loads((await ws.receive(timeout=30)).data)
                if msg["type"] == "delta":
                    tokens += msg["token_ids"]
                elif msg["type"] == "done":
                    done = msg
                else:
                    assert msg["type"] in ("stats", "kv_state"), msg
            assert done["finish_reason"] == "length" and len(tokens) == 6
            # An abort crosses the ingress and the replica: the stream ends as "abort".
            await ws.send_json({"type": "generate", "id": "long", "prompt": "Once upon a time",
                                "params": {"max_tokens": 900, "ignore_eos": True}})
            aborted = None
            while aborted is None:
                msg = json.loads((await ws.receive(timeout=30)).data)
                if msg["type"] == "delta" and msg["id"] == "long":
                    await ws.send_json({"type": "abort", "id": "long"})
                elif msg["type"] == "done":
                    aborted = msg
            assert aborted["id"] == "long" and aborted["finish_reason"] == "abort"
            assert aborted["usage"]["completion_tokens"] < 900


async def test_an_adapter_added_on_the_cluster_serves_the_engines_tokens_and_goes_everywhere_at_removal(
        cluster, cluster_model_dir, tmp_path_factory):
    """Loaded through the ingress at run time, the adapter is loaded by the replica a request
    goes to, which generates the single engine's greedy tokens under it; unloading returns
    once no replica holds it, and a request naming it is refused from then on."""
    import aiohttp
    from conftest import make_adapter

    from streamengine.engine.async_engine import AsyncEngine
    from streamengine.sample.sampling_params import SamplingParams

    # A strong adapter (scaling 32): this model's greedy text barely moves under a weak one.
    path = str(make_adapter(cluster_model_dir, tmp_path_factory.mktemp("cluster_lora") / "tune", 8,
                            ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], seed=5, alpha=256))
    prompt = list(range(300, 340))  # two full blocks, hashed with the adapter's identity
    config = EngineConfig(model=str(cluster_model_dir), num_gpu_blocks=64, lora_modules=(("tune", path),))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        expected = [o async for o in engine.generate(prompt, params, lora="tune")][-1].outputs[0].token_ids
        base = [o async for o in engine.generate(prompt, params)][-1].outputs[0].token_ids
    assert list(expected) != list(base)  # the adapter changes the tokens: the check below means something
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    ws_params = {"lora": "tune", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{cluster.url}/v1/load_lora_adapter", headers=admin,
                                json={"lora_name": "tune", "lora_path": path}) as r:
            assert r.status == 200, await r.text()
        done, tokens = await _ws_generate(session, cluster.url, prompt, ws_params)
        assert done["type"] == "done" and tokens == list(expected)
        deadline = time.monotonic() + 30
        while not any("tune" in load.get("loras", {}) for load in cluster.replica_loads().values()):
            assert time.monotonic() < deadline, "no replica reported the adapter"
            await asyncio.sleep(0.1)
        async with session.post(f"{cluster.url}/v1/unload_lora_adapter", headers=admin,
                                json={"lora_name": "tune"}) as r:
            assert r.status == 200, await r.text()
        assert not any("tune" in load.get("loras", {}) for load in cluster.replica_loads().values())
        refused, _ = await _ws_generate(session, cluster.url, prompt, ws_params)
        assert refused["type"] == "error" and "no LoRA adapter named 'tune'" in refused["message"], refused


async def _ws_generate(session, url: str, prompt: list[int], params: dict) -> tuple[dict, list[int]]:
    """One request over the WebSocket: its last message (done or error) and its tokens."""
    async with session.ws_connect(f"{url}/v1/stream", headers={"Authorization": f"Bearer {KEY_A}"}) as ws:
        assert json.loads((await ws.receive(timeout=30)).data)["type"] == "ready"
        await ws.send_json({"type": "generate", "id": "g", "prompt": prompt, "params": params})
        tokens = []
        while True:
            msg = json.loads((await ws.receive(timeout=STREAM_TIMEOUT_S)).data)
            if msg["type"] == "delta":
                tokens += msg["token_ids"]
            elif msg["type"] in ("done", "error"):
                return msg, tokens


async def test_y_a_replica_killed_mid_stream_ends_its_request_and_others_go_on(cluster):
    """Killing the replica serving a long stream ends that stream with an error (never a
    hang); new requests are served by the replica left."""
    a = _client(cluster, KEY_A)
    model = (await a.models.list()).data[0].id
    # Idle first, as the reports show it: a report still counting an earlier test's request
    # would make the wrong replica look like the one streaming.
    deadline = time.monotonic() + 30
    while any(load["stats"]["num_running"] for load in cluster.replica_loads().values()):
        assert time.monotonic() < deadline, "the replicas never went idle"
        await asyncio.sleep(0.1)
    stream = await a.completions.create(model=model, prompt="Tell me a story.", max_tokens=900,
                                        temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    received = 0
    killed: str | None = None
    error: Exception | None = None

    async def consume():
        nonlocal received, error, killed
        try:
            async for _chunk in stream:
                received += 1
                if received == 5:
                    killed = await asyncio.to_thread(_kill_busy_replica, cluster)
        except Exception as exc:  # the stream's end: an error event or a cut connection
            error = exc

    await asyncio.wait_for(consume(), STREAM_TIMEOUT_S)
    assert killed is not None and received >= 5
    # The stream ended early: an error reached the client, or it stopped well short of 900.
    assert error is not None or received < 900, received
    deadline = time.monotonic() + 10
    while killed in cluster.replica_loads():  # the router tells the directory it is gone
        assert time.monotonic() < deadline, "the directory still lists the dead replica"
        await asyncio.sleep(0.1)
    after = await asyncio.wait_for(_chat(a, "Still there?"), STREAM_TIMEOUT_S)
    assert after.choices[0].message.content is not None


def _kill_busy_replica(cluster) -> str:
    """Kills the one replica running a request; returns its id."""
    deadline = time.monotonic() + 10
    while True:
        busy = [rid for rid, load in cluster.replica_loads().items() if load["stats"]["num_running"] > 0]
        if len(busy) == 1:
            break
        assert time.monotonic() < deadline, f"not one busy replica: {busy}"
        time.sleep(0.02)
    actor = ray.get_actor(f"SERVE_REPLICA::test#EngineReplica#{busy[0]}", namespace="serve")
    ray.kill(actor, no_restart=True)
    return busy[0]


async def test_z_a_replica_scaled_down_finishes_its_streams_first(cluster):
    """Streams running on both replicas; the deployment scales to one replica meanwhile:
    every stream still ends normally with all its tokens."""
    import dataclasses

    from ray import serve

    from streamengine.ray import build_app

    await asyncio.to_thread(cluster.wait_ready)  # the replica killed before has been replaced
    a = _client(cluster, KEY_A)
    model = (await a.models.list()).data[0].id
    n_tokens = 600

    async def one(i: int):
        stream = await a.completions.create(
            model=model, prompt=f"Story {i}:", max_tokens=n_tokens, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
        )
        usage, reason = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return reason, usage.completion_tokens

    # New streams until both replicas run some (the router may not list the replica that
    # replaced the killed one yet).
    # Two in flight at a time; on a loaded machine a stream may outlast the whole wait, so a
    # new pair starts whenever fewer than two are unfinished, not only when both are.
    streams: list[asyncio.Task] = []
    deadline = time.monotonic() + 120
    while not _both_busy(cluster):
        assert time.monotonic() < deadline, f"the streams never ran on both replicas: {_running(cluster)}"
        if sum(not t.done() for t in streams) < 2:
            streams += [asyncio.create_task(one(len(streams) + i)) for i in range(2)]
        await asyncio.sleep(0.05)
    smaller = dataclasses.replace(cluster.options, replicas=1)
    await asyncio.to_thread(serve.run, build_app(cluster.config, smaller), name="test", route_prefix="/")
    results = await asyncio.wait_for(asyncio.gather(*streams), 3 * STREAM_TIMEOUT_S)
    assert results == [("length", n_tokens)] * len(streams)
    assert len(cluster.replica_loads()) == 1


def _running(cluster) -> dict[str, int]:
    return {rid: load["stats"]["num_running"] for rid, load in cluster.replica_loads().items()}


def _both_busy(cluster) -> bool:
    loads = cluster.replica_loads()
    return len(loads) == 2 and all(load["stats"]["num_running"] > 0 for load in loads.values())
