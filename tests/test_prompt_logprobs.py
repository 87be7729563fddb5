"""Prompt logprobs (SamplingParams.prompt_logprobs, RequestOutput.prompt_logprobs): every
prompt position against transformers' own log-softmax on the same weights, through chunked
prefill, a prefix already cached, n > 1, beam search, a recompute preemption, and both output
kinds; a request that does not ask is untouched by one that does."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.engine.core import EngineCore
from streamengine.engine.output_stream import merge_deltas
from streamengine.sample.outputs import RequestOutput

# 47 tokens with SmolLM2's tokenizer: two full blocks of 16 a request may hit (the last token
# is always computed), and chunks of 8 over 6 steps.
PROMPT = (
    "The quick brown fox jumps over the lazy dog while the farmer counts his sheep, "
    "and the old clock on the wall of the kitchen strikes twelve times at noon. "
    "Then the children run out into the yard to play in the warm sun."
)
TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """log_softmax of transformers' float32 logits over a whole prompt: [len(ids), vocab]."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def logprobs(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def base_core(tiny_llama_dir) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64))


def make_core(base: EngineCore, **overrides) -> EngineCore:
    """A fresh core (its own pool, scheduler and cache) over the already loaded model."""
    config = EngineConfig(model=base.config.model, num_gpu_blocks=64, **overrides)
    return EngineCore(config, loaded=base.loaded)


def run(core: EngineCore, requests: dict[str, tuple[str | list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    """Adds every request, then steps until all finished; each request's outputs in order."""
    for request_id, (prompt, params) in requests.items():
        core.add_request(request_id, prompt, params)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while core.has_work():
        for out in core.step():
            outputs[out.request_id].append(out)
    return outputs


def assert_matches(prompt_logprobs, ids: list[int], expected: torch.Tensor, k: int) -> None:
    """Entry 0 is None; entry i holds prompt token i's logprob and the top k of position i-1's
    distribution, each equal to transformers' (top-k compared by value: a near tie between two
    ids may rank them either way in two float32 implementations)."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry, row = prompt_logprobs[i], expected[i - 1]
        assert ids[i] in entry and len(entry) in (k, k + 1), (i, entry)
        for token, lp in entry.items():
            assert math.isclose(lp, row[token].item(), abs_tol=TOL), (i, token, lp, row[token].item())
        if k:
            top = sorted(entry.values(), reverse=True)[:k]
            assert torch.allclose(torch.tensor(top), row.topk(k).values, atol=TOL), i
        if k and len(entry) == k + 1:  # the prompt token is outside the top k
            assert entry[ids[i]] <= row.topk(k).values[-1].item() + TOL


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, **kw)


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_every_prompt_position_matches_transformers(base_core, reference, model_impl):
    core = make_core(base_core, model_impl=model_impl)
    ids = core.intake.prompt_ids(PROMPT)
    outs = run(core, {"a": (PROMPT, greedy(prompt_logprobs=5))})["a"]
    assert_matches(outs[0].prompt_logprobs, ids, reference(ids), k=5)


def test_zero_alternatives_gives_each_prompt_tokens_own_logprob(base_core, reference):
    ids = base_core.intake.prompt_ids(PROMPT)
    plp = run(make_core(base_core), {"a": (PROMPT, greedy(prompt_logprobs=0))})["a"][0].prompt_logprobs
    assert_matches(plp, ids, reference(ids), k=0)
    assert all(list(entry) == [token] for entry, token in zip(plp[1:], ids[1:], strict=True))


def test_chunked_prefill_gives_every_chunks_positions(base_core, reference):
    core = make_core(base_core, max_prefill_chunk=8, max_num_batched_tokens=8)
    ids = core.intake.prompt_ids(PROMPT)
    core.add_request("a", PROMPT, greedy(prompt_logprobs=3))
    steps, first = 0, []
    while not first:
        first = core.step()
        steps += 1
    assert steps == math.ceil(len(ids) / 8) > 1  # the prompt took several steps
    assert_matches(first[0].prompt_logprobs, ids, reference(ids), k=3)


def test_a_cached_prompt_is_computed_again_in_full(base_core, reference):
    core = make_core(base_core, enable_prefix_caching=True)
    ids = core.intake.prompt_ids(PROMPT)
    assert run(core, {"warm": (PROMPT, greedy())})["warm"][-1].num_cached_tokens == 0
    again = run(core, {"plain": (PROMPT, greedy())})["plain"][-1]
    assert again.num_cached_tokens == 32  # the prompt is cached: a plain request hits it
    out = run(core, {"a": (PROMPT, greedy(prompt_logprobs=4))})["a"][-1]
    assert out.num_cached_tokens == 0
    assert_matches(out.prompt_logprobs, ids, reference(ids), k=4)
    assert out.outputs[0].token_ids == again.outputs[0].token_ids


def test_a_request_that_asks_leaves_its_blocks_to_the_cache(base_core):
    core = make_core(base_core, enable_prefix_caching=True)
    run(core, {"a": (PROMPT, greedy(prompt_logprobs=1))})
    assert run(core, {"b": (PROMPT, greedy())})["b"][-1].num_cached_tokens == 32


def test_parallel_samples_compute_the_prompts_logprobs_once(base_core, reference, monkeypatch):
    core = make_core(base_core)
    ids = core.intake.prompt_ids(PROMPT)
    rows = []
    compute = core.runner._prompt_logprobs

    def counted(hidden, prompt_rows):
        rows.append(len(prompt_rows.indices))
        return compute(hidden, prompt_rows)

    monkeypatch.setattr(core.runner, "_prompt_logprobs", counted)
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    outs = run(core, {"a": (PROMPT, params)})["a"]
    assert sum(rows) == len(ids) - 1
    assert [c.index for c in outs[-1].outputs] == [0, 1]
    assert_matches(outs[-1].prompt_logprobs, ids, reference(ids), k=2)


def test_beam_search_returns_the_prompts_logprobs_with_its_result(base_core, reference):
    ids = base_core.intake.prompt_ids(PROMPT)
    params = SamplingParams(beam_width=3, n=2, temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    outs = run(make_core(base_core), {"a": (PROMPT, params)})["a"]
    assert outs[-1].finished and len(outs[-1].outputs) == 2
    assert_matches(outs[-1].prompt_logprobs, ids, reference(ids), k=2)


def test_cumulative_outputs_all_carry_them(base_core):
    outs = run(make_core(base_core), {"a": (PROMPT, greedy(prompt_logprobs=1))})["a"]
    assert len(outs) == 4 and outs[0].prompt_logprobs is not None
    assert all(o.prompt_logprobs == outs[0].prompt_logprobs for o in outs)


def test_delta_outputs_carry_them_once_on_the_first(base_core, reference):
    ids = base_core.intake.prompt_ids(PROMPT)
    outs = run(make_core(base_core), {"a": (PROMPT, greedy(prompt_logprobs=2, output_kind="delta"))})["a"]
    assert len(outs) == 4
    assert_matches(outs[0].prompt_logprobs, ids, reference(ids), k=2)
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert merge_deltas(outs).prompt_logprobs == outs[0].prompt_logprobs  # a slow consumer's fold
    assert merge_deltas(outs[1:]).prompt_logprobs is None


async def test_the_async_engine_streams_them(tiny_llama_dir, reference):
    async with AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, max_prefill_chunk=16)) as engine:
        ids = engine.tokenizer(PROMPT).input_ids
        params = greedy(prompt_logprobs=1, output_kind="delta")
        outs = [out async for out in engine.generate(PROMPT, params)]
    assert [o.prompt_logprobs is not None for o in outs] == [True] + [False] * (len(outs) - 1)
    assert_matches(outs[0].prompt_logprobs, ids, reference(ids), k=1)


def test_a_recompute_preemption_mid_prompt_delivers_each_entry_once(base_core, reference):
    core = make_core(base_core, max_prefill_chunk=8, max_num_batched_tokens=8)
    ids = core.intake.prompt_ids(PROMPT)
    core.add_request("a", PROMPT, greedy(prompt_logprobs=3))
    for _ in range(3):
        assert core.step() == []  # 24 prompt positions computed, no output yet
    seq = core.requests["a"].seqs[0]
    assert len(core.requests["a"].prompt_logprobs) == 25
    core.scheduler.running.remove(seq)
    core.scheduler._preempt(seq)  # as the pool running out does it: the prompt starts over
    assert seq.num_computed_tokens == 0
    outs = []
    while core.has_work():
        outs.extend(core.step())
    assert_matches(outs[0].prompt_logprobs, ids, reference(ids), k=3)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_memory_pressure_changes_nothing(base_core, reference, mode):
    """Three prompts that do not fit the pool side by side: preemptions happen, and each
    request still gets its prompt logprobs, delivered as alone, and the tokens it gets alone."""
    params = [greedy(prompt_logprobs=2), greedy(prompt_logprobs=0, output_kind="delta"), greedy()]
    prompts = [PROMPT, PROMPT[::-1], PROMPT.upper()]
    for p in params:
        p.max_tokens = 30
    alone = [run(make_core(base_core), {"r": (t, p)})["r"] for t, p in zip(prompts, params, strict=True)]
    swap = {"swap_space_bytes": 2**22} if mode == "swap" else {}
    core = EngineCore(EngineConfig(model=base_core.config.model, num_gpu_blocks=10, preemption_mode=mode,
                                   max_prefill_chunk=16, **swap), loaded=base_core.loaded)
    busy = run(core, {f"r{i}": (t, p) for i, (t, p) in enumerate(zip(prompts, params, strict=True))})
    assert core.scheduler.num_preemptions > 0
    assert (core.scheduler.num_swap_outs > 0) == (mode == "swap")
    for i, want in enumerate(alone):
        got = busy[f"r{i}"]
        assert [o.prompt_logprobs is None for o in got] == [o.prompt_logprobs is None for o in want]
        assert sum(o.prompt_logprobs is not None for o in got) == [len(got), 1, 0][i]
        if params[i].prompt_logprobs is not None:
            ids = got[0].prompt_token_ids
            assert_matches(got[0].prompt_logprobs, ids, reference(ids), k=params[i].prompt_logprobs)
        final = merge_deltas(got) if i == 1 else got[-1]
        assert final.outputs[0].token_ids == (merge_deltas(want) if i == 1 else want[-1]).outputs[0].token_ids


def test_batch_mates_are_unaffected(base_core):
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    alone = run(make_core(base_core), {"b": ("Hello there, how are", plain)})["b"][-1]
    together = run(make_core(base_core), {
        "a": (PROMPT, greedy(prompt_logprobs=5)), "b": ("Hello there, how are", plain),
    })
    mate = together["b"][-1]
    assert mate.prompt_logprobs is None
    assert mate.outputs[0].token_ids == alone.outputs[0].token_ids
    for got, want in zip(mate.outputs[0].logprobs, alone.outputs[0].logprobs, strict=True):
        # by value: a near tie may rank two ids either way in batches of other shapes
        assert torch.allclose(torch.tensor(sorted(got.values())), torch.tensor(sorted(want.values())), atol=TOL)
    # and asking changes nothing the request generates
    asked = together["a"][-1].outputs[0].token_ids
    assert asked == run(make_core(base_core), {"a": (PROMPT, greedy())})["a"][-1].outputs[0].token_ids


def test_no_extra_logits_rows_for_requests_that_do_not_ask(base_core, monkeypatch):
    core = make_core(base_core)
    calls = []
    monkeypatch.setattr(core.runner, "_prompt_logprobs", lambda *a: calls.append(a) or [])
    outs = run(core, {"b": (PROMPT, greedy(logprobs=2))})["b"]
    assert calls == [] and all(o.prompt_logprobs is None for o in outs)


def test_a_one_token_prompt_has_only_the_empty_first_entry(base_core):
    ids = base_core.intake.prompt_ids("Hi")[:1]
    outs = run(make_core(base_core), {"a": (ids, greedy(prompt_logprobs=2))})["a"]
    assert outs[0].prompt_logprobs == [None]


@pytest.mark.parametrize("value", [-1, 21, True, "3", 1.5])
def test_bad_values_are_refused_by_name(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams.from_dict({"prompt_logprobs": value})


def test_valid_values_round_trip():
    assert SamplingParams().prompt_logprobs is None
    assert SamplingParams.from_dict({"prompt_logprobs": 20}).prompt_logprobs == 20
    assert SamplingParams(prompt_logprobs=0).clone().prompt_logprobs == 0
