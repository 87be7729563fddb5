"""No client can kill the engine: beam-search aborts, extreme parameters, faults inside one
request, a core restart after a fault that leaves the engine's state untrusted, the restart
limit, health(), admission control and the output cap."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.engine.core import EngineCore
from streamengine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    LimitExceededError,
    RequestFailedError,
)
from streamengine.sched.scheduler import Scheduler

BEAM = SamplingParams(beam_width=4, n=1, max_tokens=200, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
async def engine(tiny_llama_dir):
    async with AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=128)) as eng:
        yield eng


@pytest.fixture(scope="module")
def core(tiny_llama_dir) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=128))


def all_blocks_free(stats: dict) -> bool:
    return stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == stats["num_waiting"] == 0


async def collect(engine: AsyncEngine, prompt, params: SamplingParams, **kw) -> list:
    return [out async for out in engine.generate(prompt, params, **kw)]


async def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def run_to_end(core: EngineCore, max_steps: int = 2000) -> list:
    outputs = []
    for _ in range(max_steps):
        if not core.has_work():
            return outputs
        outputs += core.step()
    raise AssertionError("no progress")


# -- 1. aborting a beam search (beam_width > n) ------------------------------------------------


def test_core_abort_of_beam_search_frees_every_beam(core):
    core.add_request("beam", list(range(100, 140)), BEAM)
    for _ in range(6):
        core.step()
    assert len(core.requests["beam"].seqs) == 4  # four live beams, one finish reason (n=1)
    out = core.abort_request("beam")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"]
    assert all_blocks_free(core.stats())


def beam_live(engine: AsyncEngine, request_id: str) -> bool:
    req = engine.core.requests.get(request_id)
    return req is not None and len(req.seqs) == 4


async def test_abort_and_disconnect_of_beam_search_keep_the_engine_alive(engine):
    task = asyncio.create_task(collect(engine, "Tell me a story", BEAM, request_id="b1"))
    await wait_for(lambda: beam_live(engine, "b1"))
    await engine.abort("b1")
    outs = await task
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"

    gone = asyncio.create_task(collect(engine, "Another story", BEAM, request_id="b2"))
    await wait_for(lambda: beam_live(engine, "b2"))
    gone.cancel()  # a client disconnecting mid-search
    with pytest.raises(asyncio.CancelledError):
        await gone
    ok = await collect(engine, "still serving", SHORT)
    assert ok[-1].finished and len(ok[-1].outputs[0].token_ids) == 6
    await wait_for(lambda: all_blocks_free(engine.stats()))
    assert engine.is_running and engine.health()["num_restarts"] == 0


# -- 2. extreme length penalties -----------------------------------------------------------------


@pytest.mark.parametrize("penalty", [2000.0, -2000.0])
def test_extreme_length_penalty_finishes_normally(core, penalty):
    params = SamplingParams(beam_width=3, max_tokens=8, ignore_eos=True, length_penalty=penalty)
    core.add_request("lp", list(range(300, 320)), params)
    final = run_to_end(core)[-1]
    assert final.finished and len(final.outputs[0].token_ids) == 8
    assert final.outputs[0].finish_reason == "length"
    assert all_blocks_free(core.stats())


# -- 3. stop token ids: as many as the vocabulary, out of range, and many -------------------------


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory, smollm_dir):
    """A tiny Llama with a 32-token vocabulary: a beam search can hold every id as a stop id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    config = LlamaConfig(
        vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    folder = tmp_path_factory.mktemp("small_vocab")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    AutoTokenizer.from_pretrained(smollm_dir).save_pretrained(folder)
    return folder


def test_beam_search_with_every_token_a_stop_id(small_vocab_dir):
    core = EngineCore(EngineConfig(model=str(small_vocab_dir), num_gpu_blocks=32))
    params = SamplingParams(beam_width=2, max_tokens=8, stop_token_ids=list(range(32)))
    core.add_request("all-stops", [3, 4, 5, 6], params)
    final = run_to_end(core)[-1]
    out = final.outputs[0]
    assert final.finished and out.finish_reason == "stop" and len(out.token_ids) == 1
    assert all_blocks_free(core.stats())


def test_stop_token_ids_out_of_vocabulary_are_rejected(core):
    with pytest.raises(ValueError, match="stop_token_ids"):
        core.add_request("oov", "hello", SamplingParams(stop_token_ids=[5, core.vocab_size]))
    assert "oov" not in core.requests


def test_many_stop_token_ids_cost_linear_time(core):
    params = SamplingParams(beam_width=2, max_tokens=3, ignore_eos=True)
    # Past SamplingParams' own cap on purpose: intake and every beam step must stay linear in
    # the number of stop ids (a list scan per candidate froze the event loop for seconds).
    params.stop_token_ids = list(range(10, 15_010)) * 2
    start = time.perf_counter()
    req = core.add_request("many-stops", list(range(1000, 1020)), params)
    outputs = run_to_end(core)
    elapsed = time.perf_counter() - start
    assert set(req.beam.stop_token_ids) == set(range(10, 15_010))  # no eos: ignore_eos
    assert outputs[-1].finished
    assert elapsed < 2.0, f"took {elapsed:.2f} s"  # the list scans took ~10 s here


# -- 4. faults inside one request; restarts ----------------------------------------------------


def fail_for(core: EngineCore, name: str, request_id: str, monkeypatch) -> None:
    """Makes `core.<name>(req, ...)` raise for one request id."""
    original = getattr(core, name)

    def faulty(req, *args, **kwargs):
        rid = req if isinstance(req, str) else req.request_id
        if rid == request_id:
            raise RuntimeError(f"injected fault in {name}")
        return original(req, *args, **kwargs)

    monkeypatch.setattr(core, name, faulty)


async def test_postprocessing_fault_fails_only_that_request(engine, monkeypatch):
    fail_for(engine.core, "_append_token", "bad", monkeypatch)
    good = asyncio.create_task(collect(engine, "a good request", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
    with pytest.raises(RequestFailedError, match="injected fault in _append_token"):
        await collect(engine, "a bad request", SHORT, request_id="bad")
    outs = await good
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 30
    assert (await collect(engine, "after", SHORT))[-1].finished
    await wait_for(lambda: all_blocks_free(engine.stats()))
    health = engine.health()
    assert health["state"] == "ready" and health["num_restarts"] == 0


async def test_abort_fault_fails_only_that_request(engine, monkeypatch):
    fail_for(engine.core, "_release", "bad", monkeypatch)  # abort_request fails before freeing anything
    good = asyncio.create_task(collect(engine, "a good request", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
    bad = asyncio.create_task(collect(engine, "a bad request", LONG, request_id="bad"))
    await wait_for(lambda: "bad" in engine.core.requests and engine.core.requests["bad"].seqs[0].num_output_tokens > 0)
    await engine.abort("bad")
    with pytest.raises(RequestFailedError, match="bad"):
        await bad
    assert (await good)[-1].finished
    await wait_for(lambda: all_blocks_free(engine.stats()))
    assert engine.health()["num_restarts"] == 0


async def test_schedule_fault_restarts_the_core(engine, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="streamengine.engine.async_engine")
    inflight = asyncio.create_task(collect(engine, "in flight", LONG, request_id="victim"))
    await wait_for(lambda: "victim" in engine.core.requests and engine.core.requests["victim"].seqs[0].num_output_tokens > 0)
    runner, old_scheduler = engine.core.runner, engine.core.scheduler

    def broken() -> None:
        raise RuntimeError("injected scheduler fault")

    monkeypatch.setattr(old_scheduler, "schedule", broken)  # only this scheduler: a restart replaces it
    with pytest.raises(RequestFailedError, match="engine restarted: .*injected scheduler fault"):
        await inflight
    assert engine.health()["state"] == "restarting"
    ok = await collect(engine, "served after the restart", SHORT)
    assert ok[-1].finished and len(ok[-1].outputs[0].token_ids) == 6
    assert engine.core.scheduler is not old_scheduler and engine.core.runner is runner  # model and KV kept
    health = engine.health()
    assert health["state"] == "ready" and health["num_restarts"] == 1 and health["reason"] is None
    assert any("restart" in r.getMessage() and "injected scheduler fault" in r.getMessage() for r in caplog.records)
    await wait_for(lambda: all_blocks_free(engine.stats()))


async def test_block_bookkeeping_fault_restarts_the_core(engine, monkeypatch):
    bm = engine.core.block_manager
    original = bm.free

    def leaky_free(seq) -> None:
        if seq.request_id == "leak":
            raise RuntimeError("injected free fault")
        original(seq)

    monkeypatch.setattr(bm, "free", leaky_free)
    other = asyncio.create_task(collect(engine, "bystander", LONG))
    await asyncio.sleep(0)
    with pytest.raises(RequestFailedError, match="injected free fault"):
        await collect(engine, "finishes and leaks", SHORT, request_id="leak")
    with pytest.raises(RequestFailedError, match="engine restarted"):
        await other  # its blocks could not be trusted either
    assert engine.health()["num_restarts"] == 1
    assert (await collect(engine, "after", SHORT))[-1].finished
    assert all_blocks_free(engine.stats())


async def test_restarts_in_a_tight_loop_stop_the_engine(engine, monkeypatch):
    def broken(self) -> None:
        raise RuntimeError("scheduler always fails")

    monkeypatch.setattr(Scheduler, "schedule", broken)
    errors = []
    for i in range(10):
        try:
            await collect(engine, f"try {i}", SHORT)
        except (RequestFailedError, EngineDeadError) as exc:
            errors.append(exc)
            if isinstance(exc, EngineDeadError):
                break
    assert isinstance(errors[-1], EngineDeadError) and len(errors) == 6
    health = engine.health()
    assert health["state"] == "stopped" and "restarts" in health["reason"]
    with pytest.raises(EngineDeadError):
        await collect(engine, "too late", SHORT)


# -- 5. health ---------------------------------------------------------------------------------


async def test_health_reports_state_and_progress(tiny_llama_dir):
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64))
    health = engine.health()
    assert set(health) == {"state", "reason", "seconds_since_progress", "num_restarts", "num_requests"}
    assert health["state"] == "stopped" and health["reason"]
    await engine.start()
    assert engine.health()["state"] in ("starting", "ready")
    await asyncio.sleep(0.05)
    health = engine.health()
    assert health == {"state": "ready", "reason": None, "seconds_since_progress": 0.0, "num_restarts": 0, "num_requests": 0}
    gen = engine.generate("busy", LONG)
    await anext(gen)
    busy = engine.health()
    assert busy["num_requests"] == 1 and 0.0 <= busy["seconds_since_progress"] < 30.0
    await gen.aclose()
    await wait_for(lambda: engine.health()["num_requests"] == 0)
    assert engine.health()["seconds_since_progress"] == 0.0
    await engine.stop()
    assert engine.health()["state"] == "stopped"


# -- 6. admission control ----------------------------------------------------------------------


async def test_max_waiting_refuses_before_queuing(tiny_llama_dir):
    # 4: one tenant alone may hold half the queue (the other half is kept for other tenants)
    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, max_num_seqs=1, max_waiting=4)
    async with AsyncEngine(config) as engine:
        first = engine.generate("running", LONG)
        await anext(first)  # running: max_num_seqs=1 keeps the next two waiting
        queued = [asyncio.create_task(collect(engine, f"queued {i}", SHORT)) for i in range(2)]
        await wait_for(lambda: engine.stats()["num_waiting"] == 2)
        with pytest.raises(EngineOverloadedError, match="max_waiting") as info:
            await anext(engine.generate("one too many", SHORT, request_id="refused"))
        assert info.value.retry_after > 0
        assert "refused" not in engine.core.requests and engine.stats()["num_requests"] == 3
        await first.aclose()
        for task in queued:
            assert (await task)[-1].finished
    with pytest.raises(ValueError, match="max_waiting"):
        EngineConfig(max_waiting=0)


# -- 8. the output cap -------------------------------------------------------------------------


def test_max_tokens_cap(tiny_llama_dir, core):
    capped = EngineCore(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=128, max_tokens_cap=8), loaded=core.loaded)
    capped.add_request("none", "hello", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, n=2))
    final = run_to_end(capped)[-1]
    assert [len(c.token_ids) for c in final.outputs] == [8, 8]
    assert all(c.finish_reason == "length" for c in final.outputs)
    with pytest.raises(LimitExceededError, match="max_tokens_cap") as info:
        capped.add_request("over", "hello", SamplingParams(max_tokens=9))
    assert info.value.limit == "max_tokens_cap" and "over" not in capped.requests
    # Less room left in the context than the cap: max_tokens=None fills the context.
    room = 5
    prompt = list(range(1000, 1000 + capped.max_model_len - room))
    capped.add_request("full", prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(run_to_end(capped)[-1].outputs[0].token_ids) == room
    assert EngineConfig().max_tokens_cap == 4096
    with pytest.raises(ValueError, match="max_tokens_cap"):
        EngineConfig(max_tokens_cap=0)


# -- streams -------------------------------------------------------------------------------------


async def test_an_error_after_an_unread_output_still_reaches_the_consumer():
    from streamengine.engine.output_stream import RequestStream
    from streamengine.sample.outputs import RequestOutput

    stream = RequestStream()
    stream.put(RequestOutput("r", [1], [], finished=False))
    stream.put_error(RequestFailedError("engine restarted: test"))  # before the consumer read
    assert (await asyncio.wait_for(stream.get(), 5)).request_id == "r"
    with pytest.raises(RequestFailedError, match="engine restarted"):
        await asyncio.wait_for(stream.get(), 5)  # this error used to be lost: a hang
