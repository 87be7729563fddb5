"""ClusterEngine's fault handling against a stand-in DeploymentHandle (no cluster): a
replica lost before the first output is retried, one lost mid-stream ends the request with a
clear error, abort ends it with finish_reason "abort", and a replica's own error arrives as
the original exception. Then LoRA adapters on a cluster: the ingress's checks and a replica's
loading on first use."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from streamengine.config import EngineConfig  # noqa: E402
from streamengine.errors import RequestFailedError  # noqa: E402
from streamengine.lora.adapter import LoRAError, files_digest  # noqa: E402
from streamengine.ray.cluster_engine import ClusterEngine  # noqa: E402
from streamengine.ray.directory import ReplicaDirectory  # noqa: E402
from streamengine.ray.replica import PinSpec  # noqa: E402
from streamengine.ray.request import ClusterAdapter  # noqa: E402
from streamengine.sample.outputs import CompletionOutput, RequestOutput  # noqa: E402
from streamengine.sample.sampling_params import SamplingParams  # noqa: E402
from streamengine.tenancy.tenants import TenantConfig  # noqa: E402

LOST = ray.exceptions.ActorDiedError()


class _Response:
    """One streamed call: yields `outputs`, raising `error` after `fail_after` of them."""

    def __init__(self, outputs, error=None, fail_after=0, hang=False):
        self.outputs, self.error, self.fail_after, self.hang = outputs, error, fail_after, hang
        self.cancelled = asyncio.Event()

    def cancel(self):
        self.cancelled.set()

    async def _gen(self):
        for i, out in enumerate(self.outputs):
            if self.error is not None and i == self.fail_after:
                raise self.error
            yield out
        if self.error is not None and self.fail_after >= len(self.outputs):
            raise self.error
        if self.hang:  # a long stream: runs until cancelled, which Ray reports as an error
            await self.cancelled.wait()
            raise ray.serve.exceptions.RequestCancelledError("cancelled")

    def __aiter__(self):
        return self._gen()


class _Handle:
    """Hands out the scripted responses in order; records each request sent."""

    def __init__(self, responses):
        self.responses = list(responses)
        self.requests = []
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, request):
        self.requests.append(request)
        return self.responses.pop(0)


def _out(rid, tokens, finished=False, reason=None):
    return RequestOutput(rid, [1, 2, 3], [CompletionOutput(0, "x" * len(tokens), tokens, reason)], finished)


@pytest.fixture
def make_engine(tiny_llama_dir):
    async def make(responses, **config):
        handle = _Handle(responses)
        engine = ClusterEngine(handle, "t", EngineConfig(model=str(tiny_llama_dir), **config))
        await engine.start()
        return engine, handle
    return make


async def _all(engine, **kwargs):
    return [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=2), request_id="r", **kwargs)]


async def test_a_replica_lost_before_any_output_is_retried(make_engine):
    done = [_out("r", [9]), _out("r", [9, 10], True, "length")]
    engine, handle = await make_engine([_Response([], LOST), _Response(done)])
    outs = await _all(engine)
    assert [o.outputs[0].token_ids for o in outs] == [[9], [9, 10]] and outs[-1].finished
    assert len(handle.requests) == 2 and handle.requests[0] is handle.requests[1]
    await engine.stop()


async def test_a_replica_lost_mid_stream_fails_the_request_with_a_clear_error(make_engine):
    engine, handle = await make_engine([_Response([_out("r", [9]), _out("r", [9, 10])], LOST, fail_after=1)])
    with pytest.raises(RequestFailedError, match="replica serving this request failed: ActorDiedError"):
        await _all(engine)
    assert len(handle.requests) == 1  # output had streamed: never replayed elsewhere
    await engine.stop()


async def test_retries_are_bounded(make_engine):
    engine, handle = await make_engine([_Response([], LOST) for _ in range(3)])
    with pytest.raises(RequestFailedError):
        await _all(engine)
    assert len(handle.requests) == 3
    await engine.stop()


async def test_abort_ends_the_stream_with_an_abort_output(make_engine):
    response = _Response([_out("r", [9])], hang=True)
    engine, _ = await make_engine([response])
    stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=50, output_kind="delta"), request_id="r")
    first = await anext(stream)
    assert first.outputs[0].token_ids == [9]
    await engine.abort("r")
    last = await asyncio.wait_for(anext(stream), 5)
    assert last.finished and last.outputs[0].finish_reason == "abort" and last.outputs[0].token_ids == []
    assert response.cancelled.is_set()
    await engine.stop()


async def test_a_replicas_own_error_arrives_as_itself(make_engine):
    class _TaskError(ray.exceptions.RayTaskError):
        def __init__(self, cause):
            self.cause = cause

    engine, _ = await make_engine([_Response([], _TaskError(ValueError("prompt too long")))])
    with pytest.raises(ValueError, match="prompt too long"):
        await _all(engine)
    await engine.stop()


async def test_requests_carry_the_engines_salt_segments(make_engine):
    pin = PinSpec("p", tuple(range(100, 132)), "bot", False)
    tenants = (TenantConfig("bot", cache_salt="s3cret"),)
    engine, handle = await make_engine([_Response([_out("r", [9], True, "length")])], tenants=tenants)
    engine._pinned = [engine._mirror_pin(pin)]
    prompt = list(range(100, 132)) + [7, 8]
    outs = [o async for o in engine.generate(prompt, SamplingParams(max_tokens=1), tenant="bot", cache_salt="u1")]
    assert outs[-1].finished
    # The bot's pinned blocks under its salt, the user's messages under tenant + user salt:
    # exactly what the engine's Pins.segments gives.
    assert handle.requests[0].salt_segments == ((0, "s3cret"), (32, "s3cret\x00user:u1"))
    await engine.stop()


async def test_tenants_and_pins_are_fixed_at_deploy_time(make_engine):
    engine, _ = await make_engine([], tenants=(TenantConfig("bot"),))
    engine.add_tenant(TenantConfig("bot"))  # the deployed one: accepted
    with pytest.raises(ValueError, match="set when it is deployed"):
        engine.add_tenant(TenantConfig("other"))
    with pytest.raises(ValueError, match="set when it is deployed"):
        await engine.pin_prefix(list(range(40)), tenant="bot")
    await engine.stop()


class _DirectoryActor:
    """A ReplicaDirectory called as its Ray actor is (`directory.method.remote(...)`)."""

    def __init__(self):
        self.directory = ReplicaDirectory()

    def __getattr__(self, name):
        return SimpleNamespace(remote=getattr(self.directory, name))


async def test_cluster_adapters_are_checked_at_add_and_refused_as_the_engine_refuses_them(
        make_engine, tiny_lora_dirs, tmp_path):
    engine, handle = await make_engine([_Response([_out("r", [9], True, "length")])])
    actor = _DirectoryActor()
    engine._loras._directory = lambda: actor
    with pytest.raises(LoRAError, match="no LoRA adapter named 'tune' is loaded"):  # the engine's words
        await _all(engine, lora="tune")
    with pytest.raises(LoRAError, match="missing adapter_config.json"):  # checked here, not on first use
        await engine.add_lora("tune", str(tmp_path / "nothing"))
    path = str(tiny_lora_dirs["lora-a"])
    await engine.add_lora("tune", path)
    with pytest.raises(LoRAError, match="already loaded"):
        await engine.add_lora("tune", str(tiny_lora_dirs["lora-b"]))
    assert engine.lora_adapters() == [{"name": "tune", "path": path}]
    tune = ClusterAdapter("tune", path, files_digest(path))
    assert (await actor.directory.adapters()) == {"tune": tune}  # where replicas read it
    await _all(engine, lora="tune")
    assert handle.requests[0].lora == tune  # what a replica lacking it loads
    await engine.remove_lora("tune")  # no replica reports it: returns at once
    assert engine.lora_adapters() == [] and (await actor.directory.adapters()) == {"tune": None}
    with pytest.raises(LoRAError, match="no LoRA adapter named 'tune' is loaded"):
        await _all(engine, lora="tune")
    await engine.stop()


async def test_a_replica_loads_an_adapter_on_first_use_and_drops_what_the_cluster_removed(
        untied_llama_dir, tiny_lora_dirs, tmp_path):
    from streamengine.engine.async_engine import AsyncEngine
    from streamengine.ray.adapters import ReplicaLoRAs

    path = str(tiny_lora_dirs["lora-a"])
    tune = ClusterAdapter("tune", path, files_digest(path))
    async with AsyncEngine(EngineConfig(model=str(untied_llama_dir), num_gpu_blocks=64)) as engine:
        loras = ReplicaLoRAs(engine, "r0")
        await asyncio.gather(loras.ensure(tune), loras.ensure(tune))  # one load: a second would be refused
        assert loras.held() == {"tune": tune.digest}
        lost = ClusterAdapter("lost", str(tmp_path / "nothing"), "0")
        with pytest.raises(RequestFailedError, match="replica r0 could not load LoRA adapter 'lost' .*missing"):
            await loras.ensure(lost)
        loras.apply({"tune": ClusterAdapter("tune", path, "other files")})  # replaced on the cluster
        await asyncio.wait_for(asyncio.gather(*loras._dropping.values()), 10)
        assert loras.held() == {}
        await loras.ensure(tune)
        loras.apply({"other": None})  # nothing it holds
        assert loras.held() == {"tune": tune.digest} and not loras._dropping
        await loras.close()
