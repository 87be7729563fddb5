"""LoRA adapters: the engine's greedy tokens equal transformers + peft's (unmerged) on the
same base and adapter, for several ranks and target sets, each adapter alone and all of them
batched with base-model rows; adapters are made with peft, random, in a temporary folder.
Then loading errors, cache isolation between adapters, and run-time add and remove.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from conftest import make_adapter

from streamengine.config import EngineConfig
from streamengine.engine.core import EngineCore
from streamengine.lora.adapter import LoRAError
from streamengine.sample.sampling_params import SamplingParams

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers + peft's greedy tokens (the adapter unmerged), one prompt at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def engine_greedy(core: EngineCore, requests: dict[str, tuple[list[int], str | None]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for rid, (prompt, lora) in requests.items():
        core.add_request(rid, prompt, params, lora=lora)
    done = {}
    while core.has_work():
        for out in core.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        core.audit()
    return done


PROMPTS = [[1, 450, 3012, 88, 1200, 15, 902, 44, 7001, 32, 19, 5], [1, 77, 6000, 123, 9, 9, 410, 3000],
           [1, 2300, 17, 17, 17, 8080, 65, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311]]
CASES = {"r8_all": (8, ATTENTION + MLP), "r16_attention": (16, ATTENTION), "r64_mlp": (64, MLP),
         "r4_qv": (4, ["q_proj", "v_proj"])}


@pytest.fixture(scope="module")
def adapters(untied_llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(untied_llama_dir, root / name, rank, targets, seed)
            for seed, (name, (rank, targets)) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def references(untied_llama_dir, adapters) -> dict[tuple[str | None, int], list[int]]:
    """transformers + peft's greedy tokens for every (adapter or None, prompt)."""
    refs = {}
    for name in [None, *adapters]:
        for i, tokens in enumerate(peft_greedy(untied_llama_dir, adapters[name] if name else None, PROMPTS, 16)):
            refs[(name, i)] = tokens
    return refs


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
def test_batched_adapters_and_base_rows_give_peft_tokens(untied_llama_dir, adapters, references, model_impl):
    """Every adapter and the base model, every prompt, all in the same steps."""
    config = EngineConfig(model=str(untied_llama_dir), num_gpu_blocks=128, model_impl=model_impl,
                          lora_modules=tuple((n, str(p)) for n, p in adapters.items()), max_loras=4, max_lora_rank=64)
    core = EngineCore(config)
    requests = {f"{name}-{i}": (prompt, name) for name in [None, *adapters] for i, prompt in enumerate(PROMPTS)}
    done = engine_greedy(core, requests, 16)
    for (name, i), expected in references.items():
        assert done[f"{name}-{i}"] == expected, (name, i)
    # the adapters change the text (a test whose adapters did nothing would prove nothing)
    assert all(references[(name, 0)] != references[(None, 0)] for name in adapters)


def test_each_adapter_alone_and_more_adapters_than_slots(untied_llama_dir, adapters, references):
    """max_loras=2 for four adapters: requests wait for a slot, slots are reused, tokens unchanged."""
    config = EngineConfig(model=str(untied_llama_dir), num_gpu_blocks=128, max_loras=2, max_lora_rank=64,
                          lora_modules=tuple((n, str(p)) for n, p in adapters.items()))
    core = EngineCore(config)
    requests = {f"{name}-{i}": (prompt, name) for name in adapters for i, prompt in enumerate(PROMPTS)}
    done = engine_greedy(core, requests, 16)
    for name in adapters:
        for i in range(len(PROMPTS)):
            assert done[f"{name}-{i}"] == references[(name, i)], (name, i)
    assert core.runner.loras.num_loads >= len(adapters)


def bfloat16_copy(adapter: Path, folder: Path) -> Path:
    """The adapter with every weight rounded to bfloat16 (kept as float32 values)."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    weights = load_file(adapter / "adapter_model.safetensors")
    save_file({k: v.bfloat16().float() for k, v in weights.items()}, folder / "adapter_model.safetensors")
    return folder


def test_bfloat16_stacks_give_the_tokens_of_the_adapter_rounded_to_bfloat16(untied_llama_dir, adapters, tmp_path):
    """lora_dtype='bfloat16' stores the adapters rounded and reads them widened: its greedy tokens
    equal peft's on the same adapter with its weights rounded to bfloat16 first."""
    names = ["r8_all", "r64_mlp"]
    rounded = {name: bfloat16_copy(adapters[name], tmp_path / name) for name in names}
    config = EngineConfig(model=str(untied_llama_dir), num_gpu_blocks=128, max_lora_rank=64, lora_dtype="bfloat16",
                          lora_modules=tuple((n, str(adapters[n])) for n in names))
    core = EngineCore(config)
    done = engine_greedy(core, {f"{n}-{i}": (p, n) for n in names for i, p in enumerate(PROMPTS)}, 16)
    assert {t.dtype for stack in core.runner.loras.stacks.values() for t in (stack.a, stack.b)} == {torch.bfloat16}
    for name in names:
        assert [done[f"{name}-{i}"] for i in range(len(PROMPTS))] == peft_greedy(untied_llama_dir, rounded[name], PROMPTS, 16)


def test_blocks_computed_under_an_adapter_are_hit_by_that_adapter_only(untied_llama_dir, adapters):
    prompt = list(range(1000, 1064))  # four full blocks
    config = EngineConfig(model=str(untied_llama_dir), num_gpu_blocks=128, max_lora_rank=64,
                          lora_modules=tuple((n, str(p)) for n, p in adapters.items()))
    core = EngineCore(config)
    engine_greedy(core, {"a1": (prompt, "r8_all")}, 2)
    engine_greedy(core, {"base": (prompt, None), "b": (prompt, "r16_attention")}, 2)
    assert core.requests == {}
    hashes = {name: core_hashes(core, prompt, name) for name in (None, "r8_all", "r16_attention")}
    assert len({tuple(h) for h in hashes.values()}) == 3  # three identities, three sets of blocks
    before = core.block_manager.stats.hits
    engine_greedy(core, {"a2": (prompt, "r8_all")}, 2)
    assert core.block_manager.stats.hits - before == 48  # its own three full blocks (the last token computes)


def test_block_hashes_name_the_blocks_a_request_under_an_adapter_stores(untied_llama_dir, adapters):
    """block_hashes(lora=...) hashes as generate does: the adapter the request names, or its
    tenant's; the stored blocks' hashes (KV events) are exactly those, and the base model's differ."""
    from streamengine.kv.events import BlockStored
    from streamengine.tenancy.tenants import TenantConfig

    config = EngineConfig(model=str(untied_llama_dir), num_gpu_blocks=64, max_lora_rank=64,
                          lora_modules=(("a", str(adapters["r8_all"])),), tenants=(TenantConfig("bot", lora="a"),))
    core = EngineCore(config)
    core.record_kv_events(True)
    prompt = list(range(700, 748))  # three full blocks
    engine_greedy(core, {"x": (prompt, "a")}, 2)
    stored = [h for e in core.take_kv_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert core.block_hashes(prompt, lora="a") == stored[:3]
    assert core.block_hashes(prompt, tenant="bot") == core.block_hashes(prompt, tenant="bot", lora="a")
    assert core.block_hashes(prompt) != stored[:3]  # the base model's blocks are others
    with pytest.raises(LoRAError, match="no LoRA adapter named 'nope'"):
        core.block_hashes(prompt, lora="nope")


def test_a_failed_request_releases_its_adapter_so_a_removal_can_finish(untied_llama_dir, adapters):
    core = EngineCore(EngineConfig(model=str(untied_llama_dir), num_gpu_blocks=64, max_lora_rank=64,
                                   lora_modules=(("a", str(adapters["r8_all"])),)))
    core.add_request("x", PROMPTS[0], SamplingParams(max_tokens=8), lora="a")
    core.step()
    assert core.remove_lora("a") is False
    core.fail_request("x", "injected fault")
    assert "a" not in core.loras.adapters and not core.loras.removing


def core_hashes(core: EngineCore, prompt: list[int], lora: str | None) -> list[bytes]:
    from streamengine.engine.core_pins import salt_segments
    from streamengine.kv.block_hash import prompt_block_hashes

    adapter = core.loras.get(lora) if lora else None
    segments = salt_segments(core, prompt, "default", None, None, adapter)
    return prompt_block_hashes(prompt, 16, segments, segments[-1][1])


def test_bad_adapters_are_refused_at_load_by_name(untied_llama_dir, tiny_qwen2_dir, tmp_path, adapters):
    core = EngineCore(EngineConfig(model=str(untied_llama_dir), num_gpu_blocks=32, max_lora_rank=16))
    with pytest.raises(LoRAError, match="missing adapter_config.json"):
        core.add_lora("missing", str(tmp_path / "nothing"))
    with pytest.raises(LoRAError, match="max_lora_rank"):
        core.add_lora("big", str(adapters["r64_mlp"]))
    other = make_adapter(tiny_qwen2_dir, tmp_path / "qwen", 8, ATTENTION, 9)  # another base: other shapes
    with pytest.raises(LoRAError, match="another base model"):
        core.add_lora("qwen", str(other))
    dora = tmp_path / "dora"
    dora.mkdir()
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        (dora / file).write_bytes((adapters["r8_all"] / file).read_bytes())
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(dict(config, use_dora=True)))
    with pytest.raises(LoRAError, match="use_dora"):
        core.add_lora("dora", str(dora))
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2), lora="nope")
    assert core.requests == {} and core.loras.names() == []


def test_an_adapter_added_at_run_time_and_removed_once_its_requests_end(untied_llama_dir, adapters, references):
    core = EngineCore(EngineConfig(model=str(untied_llama_dir), num_gpu_blocks=64, max_lora_rank=64))
    core.add_lora("late", str(adapters["r8_all"]))
    with pytest.raises(LoRAError, match="already loaded"):
        core.add_lora("late", str(adapters["r8_all"]))
    core.add_request("x", PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), lora="late")
    core.step()
    assert core.remove_lora("late") is False  # a request still runs on it
    with pytest.raises(ValueError, match="no LoRA adapter named 'late'"):
        core.add_request("y", PROMPTS[1], SamplingParams(max_tokens=2), lora="late")
    done = {}
    while core.has_work():
        for out in core.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert done["x"] == references[("r8_all", 0)]
    assert core.loras.names() == [] and "late" not in core.loras.adapters


def test_kv_events_say_which_adapter_computed_the_blocks(untied_llama_dir, adapters):
    from streamengine.kv.events import BlockStored

    config = EngineConfig(model=str(untied_llama_dir), num_gpu_blocks=64, max_lora_rank=64,
                          lora_modules=(("a", str(adapters["r8_all"])),))
    core = EngineCore(config)
    core.record_kv_events(True)
    engine_greedy(core, {"base": (list(range(500, 540)), None), "lora": (list(range(600, 640)), "a")}, 2)
    stored = [e for e in core.take_kv_events() if isinstance(e, BlockStored)]
    by_first_token = {e.token_ids[0]: e.lora_id for e in stored}
    assert by_first_token == {500: None, 600: core.loras.get("a").lora_id}
    assert {e.lora_id for e in core.kv_snapshot() if isinstance(e, BlockStored)} == {None, core.loras.get("a").lora_id}


async def test_async_engine_runs_adapters_by_request_and_by_tenant_and_removes_them_when_idle(
        untied_llama_dir, adapters, references):
    from streamengine.engine.async_engine import AsyncEngine
    from streamengine.tenancy.tenants import TenantConfig

    config = EngineConfig(model=str(untied_llama_dir), num_gpu_blocks=64, max_lora_rank=64,
                          tenants=(TenantConfig("bot", lora="tenant-own"),))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        await engine.add_lora("tenant-own", str(adapters["r16_attention"]))
        await engine.add_lora("other", str(adapters["r8_all"]))
        assert [a["name"] for a in engine.lora_adapters()] == ["other", "tenant-own"]

        async def tokens(**kw) -> list[int]:
            outs = [out async for out in engine.generate(PROMPTS[0], params, **kw)]
            return list(outs[-1].outputs[0].token_ids)

        assert await tokens(lora="other") == references[("r8_all", 0)]
        assert await tokens(tenant="bot") == references[("r16_attention", 0)]  # the tenant's own adapter
        assert await tokens(tenant="bot", lora="other") == references[("r8_all", 0)]  # the request names another
        assert await tokens() == references[(None, 0)]
        # removal waits for the request running on it, and refuses new ones at once
        long = engine.generate(PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True), lora="other")
        first = await anext(long)
        removal = asyncio.ensure_future(engine.remove_lora("other"))
        await asyncio.sleep(0)  # the removal starts; 199 tokens are still to come
        assert not removal.done()
        with pytest.raises(ValueError, match="no LoRA adapter named 'other'"):
            await tokens(lora="other")
        rest = [out async for out in long]
        await asyncio.wait_for(removal, 10)
        assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 200 and not first.finished
        assert [a["name"] for a in engine.lora_adapters()] == ["tenant-own"]
