"""Memory pressure: swap to the host pool and recompute give the same outputs as no pressure,
and every device and host block comes back."""

from __future__ import annotations

import asyncio

import pytest

from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.errors import RequestFailedError
from streamengine.kv.spec import kv_bytes_per_block

PROMPTS = [f"Request number {i} asks about {'many things ' * (i % 3 + 1)}" for i in range(6)]


async def run_all(folder, params_list, **cfg):
    async with AsyncEngine(EngineConfig(model=str(folder), **cfg)) as engine:

        async def one(prompt, params):
            async for out in engine.generate(prompt, params):  # noqa: B007
                pass
            return [c.token_ids for c in out.outputs]

        outs = await asyncio.gather(*(one(p, sp) for p, sp in zip(PROMPTS, params_list, strict=True)))
        return outs, engine.stats()


def swap_bytes(folder, blocks: int) -> int:
    import torch
    from transformers import AutoConfig

    return blocks * kv_bytes_per_block(AutoConfig.from_pretrained(folder), 16, torch.float32)


def mixed_params() -> list[SamplingParams]:
    # Half greedy, half seeded sampling (one with n=2, sharing its prompt blocks).
    return [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) if i % 2 == 0
        else SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True, n=2 if i == 1 else 1)
        for i in range(len(PROMPTS))
    ]


@pytest.fixture(scope="module")
def unpressured(tiny_llama_dir):
    outs, stats = asyncio.run(run_all(tiny_llama_dir, mixed_params(), num_gpu_blocks=256))
    assert stats["num_preemptions"] == 0
    return outs


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
async def test_outputs_identical_under_pressure(tiny_llama_dir, unpressured, mode):
    outs, stats = await run_all(
        tiny_llama_dir, mixed_params(), num_gpu_blocks=12, preemption_mode=mode,
        swap_space_bytes=swap_bytes(tiny_llama_dir, 64),
    )
    assert outs == unpressured
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swap_outs"] > 0
    if mode == "recompute":
        assert stats["num_swap_outs"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_swap_blocks_free"] == stats["num_swap_blocks"] == 64


async def test_swap_falls_back_to_recompute_when_host_pool_is_full(tiny_llama_dir, unpressured):
    outs, stats = await run_all(
        tiny_llama_dir, mixed_params(), num_gpu_blocks=12, preemption_mode="swap",
        swap_space_bytes=swap_bytes(tiny_llama_dir, 3),
    )
    assert outs == unpressured
    assert stats["num_swap_blocks_free"] == 3 and stats["num_free_blocks"] == 12


async def test_abort_while_swapped_frees_host_blocks(tiny_llama_dir):
    cfg = EngineConfig(
        model=str(tiny_llama_dir), num_gpu_blocks=10, preemption_mode="swap",
        swap_space_bytes=swap_bytes(tiny_llama_dir, 64),
    )
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    async with AsyncEngine(cfg) as engine:

        async def consume(prompt):
            async for _ in engine.generate(prompt, params):
                pass

        tasks = [asyncio.create_task(consume(p)) for p in PROMPTS]
        for _ in range(400):  # wait until somebody is swapped out, then cancel everyone
            await asyncio.sleep(0.01)
            if engine.stats()["num_swapped"] > 0:
                break
        assert engine.stats()["num_swapped"] > 0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.3)
        s = engine.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    assert s["num_swap_blocks_free"] == s["num_swap_blocks"]
    assert s["num_running"] == s["num_waiting"] == s["num_swapped"] == 0


async def test_request_larger_than_pool_fails_cleanly(tiny_llama_dir):
    cfg = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=4, swap_space_bytes=swap_bytes(tiny_llama_dir, 8))
    async with AsyncEngine(cfg) as engine:
        with pytest.raises(ValueError, match="maximum context length"):
            await anext(engine.generate("hello " * 80, SamplingParams(max_tokens=8)))
        ok = [o async for o in engine.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True))]
        assert ok[-1].finished


async def test_swap_restores_a_float16_cache_exactly(tiny_llama_dir):
    # Swapped blocks come back bit for bit, so a float16 cache under pressure gives the
    # outputs of the same cache without pressure (recompute would not promise that: it
    # rebuilds K/V from the float32 prefill instead of reading the rounded cache).
    free, _ = await run_all(tiny_llama_dir, mixed_params(), num_gpu_blocks=256, kv_cache_dtype="float16")
    outs, stats = await run_all(
        tiny_llama_dir, mixed_params(), num_gpu_blocks=12, preemption_mode="swap", kv_cache_dtype="float16",
        swap_space_bytes=swap_bytes(tiny_llama_dir, 64),
    )
    assert outs == free
    assert stats["num_swap_outs"] > 0
    assert stats["num_swap_blocks_free"] == stats["num_swap_blocks"] == 128  # float16: twice the blocks


# -- swap preemption beside a pinned prefix ----------------------------------------------------

SYSTEM = list(range(1000, 1128))  # 8 blocks: half of a 16-block pool, pinned for tenant a


async def _tokens(engine, prompt, params, tenant):
    out = [o async for o in engine.generate(prompt, params, tenant=tenant)][-1]
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize(("mode", "n", "num_requests"), [("swap", 1, 2), ("auto", 2, 1), ("auto", 2, 2)])
async def test_swap_beside_a_pinned_prefix_serves_everyone(tiny_llama_dir, mode, n, num_requests):
    """Requests opening with tenant a's pinned system prompt need more blocks in all (16) than
    the pool leaves beside the pin (8): they are admitted on the credit of their pinned hit,
    and preempted by swap ("auto" swaps every n >= 2 sample) when they outgrow the pool
    together. Before the fix swap-out copied the pinned blocks to the host and swap-in wanted
    private device blocks for all of them, more than the pool minus the pin: nothing ran, the
    step was empty, and the core restarted, failing every request in flight (tenant b's too)."""
    cfg = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=16, preemption_mode=mode,
                       swap_space_bytes=swap_bytes(tiny_llama_dir, 64))
    wide = SamplingParams(n=n, temperature=0.8, seed=1, max_tokens=100, ignore_eos=True)
    small = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    async with AsyncEngine(cfg) as engine:
        await engine.pin_prefix(SYSTEM, tenant="a")
        prompts = [SYSTEM + list(range(2000 + 16 * i, 2016 + 16 * i)) for i in range(num_requests)]
        results = await asyncio.gather(
            *(_tokens(engine, p, wide, "a") for p in prompts), _tokens(engine, [5, 6, 7], small, "b"),
        )
        s = engine.stats()
        assert engine.health()["num_restarts"] == 0
    assert s["num_swap_outs"] > 0
    assert [[len(t) for t in r] for r in results] == [[100] * n] * num_requests + [[30]]
    assert s["num_free_blocks"] == 16 - 8 and s["num_pinned_blocks"] == 8
    assert s["num_swap_blocks_free"] == s["num_swap_blocks"] == 64


async def test_a_request_the_emptiest_pool_refuses_fails_alone(tiny_llama_dir, monkeypatch):
    """Whatever makes a pool holding nothing else refuse a request (here its allocations are
    made to fail; unfittable()'s count of blocks sees nothing wrong), it fails alone once the
    step would be empty. Before the fix the empty step restarted the core, failing the
    request in flight beside it too."""
    async with AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=16)) as engine:
        bm = engine.core.block_manager
        allocate = bm.allocate_slots
        monkeypatch.setattr(bm, "allocate_slots", lambda seq, *a, **k: seq.request_id != "doomed" and allocate(seq, *a, **k))
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        other = asyncio.ensure_future(_tokens(engine, [5, 6, 7], params, "b"))
        await asyncio.sleep(0)  # queued first
        with pytest.raises(RequestFailedError, match="no longer fits in the KV pool"):
            async for _ in engine.generate([8, 9, 10], params, request_id="doomed", tenant="a"):
                pass
        assert [len(t) for t in await other] == [30]
        assert engine.health()["num_restarts"] == 0
        assert engine.stats()["num_free_blocks"] == 16
