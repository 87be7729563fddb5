"""Structured outputs through the engine, on the tiny random models (SmolLM2's tokenizer, full
vocabulary): random weights at temperature 1.0 would write anything, so every match below is
the grammar mask's doing. n > 1, beams, preemption, stop strings, logprobs, prefix caching,
the Triton path, and errors that leave the engine serving."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
import torch

from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.engine.core import EngineCore
from streamengine.errors import GrammarError
from streamengine.kv.spec import kv_bytes_per_block
from streamengine.structured.grammar import GrammarMatcher
from streamengine.structured.params import Choice, JsonSchema, Regex

WORD_NUM = "[a-z]{2,6} [0-9]{1,3}"
LONG_WORDS = "[a-z]{24,32}[.]"  # at most 33 tokens, enough to need several blocks each
CHOICES = ["red", "green apple", "blue"]
PROMPTS = [f"Request {i} asks about {'many things ' * (12 + i)}" for i in range(6)]  # 3+ blocks each


@pytest.fixture
async def engine(tiny_llama_dir):
    async with AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=128)) as eng:
        yield eng


async def final(engine: AsyncEngine, prompt, params: SamplingParams, **kw):
    async for out in engine.generate(prompt, params, **kw):  # noqa: B007
        pass
    return out


def texts(out) -> list[str]:
    return [c.text for c in out.outputs]


def sampled(pattern: str, **kw) -> SamplingParams:
    return SamplingParams(structured=Regex(pattern), temperature=1.0, max_tokens=64, **kw)


async def test_regex_and_choice_outputs_match_at_temperature_one(engine):
    regex, choice = await asyncio.gather(
        final(engine, "Say something", sampled(WORD_NUM, n=4, seed=1)),
        final(engine, "Pick a colour", SamplingParams(structured=Choice(CHOICES), temperature=1.0, n=4, seed=2)),
    )
    for c in regex.outputs:
        assert re.fullmatch(WORD_NUM, c.text) and c.finish_reason == "stop", c.text
    assert len(set(texts(regex))) > 1  # each sample walked its own matcher
    assert all(t in CHOICES for t in texts(choice)) and {c.finish_reason for c in choice.outputs} == {"stop"}


async def test_json_schema_output_parses_and_validates(engine):
    import json

    import jsonschema

    schema = {
        "type": "object", "additionalProperties": False, "required": ["name", "age"],
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    }
    out = await final(engine, "A person:", SamplingParams(structured=JsonSchema(schema), temperature=1.0, max_tokens=64, n=2, seed=3))
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


async def test_beam_search_keeps_a_matcher_per_beam(engine):
    out = await final(engine, "Pick", SamplingParams(structured=Choice(CHOICES), beam_width=4, n=3, temperature=0, max_tokens=16))
    assert all(t in CHOICES for t in texts(out)), texts(out)
    # Distinct hypotheses (one text may come in several tokenizations: the grammar allows each).
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    out = await final(engine, "Say", SamplingParams(structured=Regex(WORD_NUM), beam_width=3, n=2, temperature=0, max_tokens=32))
    assert all(re.fullmatch(WORD_NUM, t) for t in texts(out)), texts(out)


async def run_pressured(folder, **cfg):
    params = [sampled(LONG_WORDS, seed=i, n=2 if i == 1 else 1) for i in range(len(PROMPTS))]
    async with AsyncEngine(EngineConfig(model=str(folder), **cfg)) as engine:
        # Compiled up front, so every request arrives in the same step (a cache hit does not
        # leave the loop) and the pool is under pressure whatever the machine's speed.
        engine.core.grammars.compile(Regex(LONG_WORDS))
        outs = await asyncio.gather(*(final(engine, p, sp) for p, sp in zip(PROMPTS, params, strict=True)))
        return [texts(o) for o in outs], engine.stats()


@pytest.fixture(scope="module")
def unpressured(tiny_llama_dir):
    outs, stats = asyncio.run(run_pressured(tiny_llama_dir, num_gpu_blocks=256))
    assert stats["num_preemptions"] == 0
    return outs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
async def test_matcher_state_survives_preemption(tiny_llama_dir, unpressured, mode):
    from transformers import AutoConfig

    swap = 64 * kv_bytes_per_block(AutoConfig.from_pretrained(tiny_llama_dir), 16, torch.float32)
    outs, stats = await run_pressured(
        tiny_llama_dir, num_gpu_blocks=12, preemption_mode=mode, swap_space_bytes=swap
    )
    assert stats["num_preemptions"] > 0 and (stats["num_swap_outs"] > 0) == (mode == "swap")
    assert outs == unpressured  # seeded: the same tokens as without preemption
    assert all(re.fullmatch(LONG_WORDS, t) for o in outs for t in o)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_stop_strings_and_max_tokens_end_a_structured_output_early(engine):
    out = await final(engine, "Code", SamplingParams(structured=Regex("[0-9]{3}-[a-z]{3}"), stop=["-"], temperature=1.0, max_tokens=32))
    c = out.outputs[0]
    assert re.fullmatch("[0-9]{3}", c.text) and c.finish_reason == "stop" and c.stop_reason == "-", c.text
    out = await final(engine, "Long", SamplingParams(structured=Regex("[a-z]{40}"), temperature=1.0, max_tokens=3))
    assert out.outputs[0].finish_reason == "length" and re.fullmatch("[a-z]+", out.outputs[0].text)


async def test_the_grammar_ends_the_output_whatever_min_tokens_and_ignore_eos_say(engine):
    params = SamplingParams(structured=Choice(CHOICES), min_tokens=20, ignore_eos=True, temperature=1.0, max_tokens=30, n=3)
    out = await final(engine, "Pick", params)
    assert all(t in CHOICES for t in texts(out)) and {c.finish_reason for c in out.outputs} == {"stop"}


async def test_logprobs_are_of_the_masked_distribution(engine):
    spec = Regex(WORD_NUM)
    out = await final(engine, "Say", sampled(WORD_NUM, logprobs=5, n=2, seed=4))
    grammar = engine.core.grammars.compile(spec)
    bitmask = torch.empty(1, 49152 // 32, dtype=torch.int32)
    for c in out.outputs:
        matcher = grammar.matcher()
        for token, top in zip(c.token_ids, c.logprobs, strict=True):
            matcher.fill_bitmask(bitmask, 0)
            allowed = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)
            assert token in top and all(allowed[t] for t in top), (top, c.text)
            assert sum(torch.tensor(list(top.values())).exp()) <= 1.0 + 1e-5
            matcher.accept(token)


async def test_prefix_cache_hits_keep_outputs_constrained(engine):
    prompt = list(range(100, 140))  # two full blocks and a partial one
    first = await final(engine, prompt, sampled(WORD_NUM, seed=5))
    hits = engine.stats()["prefix_cache_hits"]
    second = await final(engine, prompt, sampled(WORD_NUM, seed=5))
    assert engine.stats()["prefix_cache_hits"] > hits
    assert texts(first) == texts(second) and re.fullmatch(WORD_NUM, texts(first)[0])


async def test_unconstrained_greedy_output_is_unchanged_beside_constrained_requests(engine):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = await final(engine, "Tell me a story", greedy)
    batched, _ = await asyncio.gather(
        final(engine, "Tell me a story", greedy), final(engine, "Other", sampled(LONG_WORDS, n=3, seed=6))
    )
    assert batched.outputs[0].token_ids == alone.outputs[0].token_ids


async def test_a_bad_schema_fails_alone_while_the_engine_serves(engine):
    good = asyncio.create_task(final(engine, "a good request", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    with pytest.raises(GrammarError, match="Invalid type"):
        await final(engine, "bad", SamplingParams(structured=JsonSchema({"type": "nope"})))
    assert len((await good).outputs[0].token_ids) == 20
    assert engine.core.requests == {}


async def test_a_compile_timeout_fails_alone_while_the_engine_serves(engine, monkeypatch):
    grammars = engine.core.grammars
    release = threading.Event()
    build = grammars._build
    monkeypatch.setattr(grammars, "_build", lambda spec: (release.wait(30), build(spec))[1])
    monkeypatch.setattr(grammars, "timeout_s", 0.05)
    good = asyncio.create_task(final(engine, "a good request", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    try:
        with pytest.raises(GrammarError, match="did not compile within 0.05 s"):
            await final(engine, "slow", sampled("[0-9]+"))
        assert len((await good).outputs[0].token_ids) == 20  # served while the compile hung
    finally:
        release.set()


def test_a_refused_token_fails_only_its_request(tiny_llama_dir):
    core = EngineCore(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64))
    core.add_request("bad", "x", SamplingParams(structured=Regex("[a-z]+"), max_tokens=8))
    core.add_request("good", "y", SamplingParams(structured=Regex("[a-z]+"), max_tokens=8))

    class Refusing(GrammarMatcher):
        def accept(self, token_id: int) -> None:
            raise GrammarError(f"token {token_id} is refused")

    row = core.requests["bad"].samples[0].row
    row.matcher = Refusing(row.matcher._ll)
    while core.has_work():
        core.step()
    failures = core.take_failures()
    assert isinstance(failures["bad"], GrammarError) and "refused" in str(failures["bad"])
    assert "good" not in failures and core.requests == {}
    assert core.stats()["num_free_blocks"] == core.stats()["num_total_blocks"]


def test_core_compiles_synchronously_and_refuses_a_bad_spec_whole(tiny_llama_dir):
    core = EngineCore(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64))
    with pytest.raises(GrammarError):
        core.add_request("bad", "x", SamplingParams(structured=Regex("((")))
    assert core.requests == {} and not core.has_work()
    core.add_request("ok", "x", SamplingParams(structured=Choice(["yes"]), max_tokens=8))
    outputs = []
    while core.has_work():
        outputs += core.step()
    assert outputs[-1].outputs[0].text == "yes"


async def test_triton_backend(tiny_llama_dir):
    """The Triton attention path (interpreted on CPU) with a constrained request."""
    if not torch.cuda.is_available():
        pytest.importorskip("triton")
    cfg = EngineConfig(model=str(tiny_llama_dir), attention_backend="triton", num_gpu_blocks=24, max_num_batched_tokens=24)
    async with AsyncEngine(cfg) as engine:
        out = await final(engine, [5, 6, 7, 8], SamplingParams(structured=Regex("[a-c]{3}"), max_tokens=5, n=2, seed=0))
    assert all(re.fullmatch("[a-c]{3}", t) for t in texts(out))

