"""Hostile structured-output specs cost their sender an error, never the engine its service.

What llguidance does with them (checked with llguidance 1.9.1 on SmolLM2's tokenizer): it
bounds its own work, so no small hostile spec found keeps it busy for long. A deeply nested
`oneOf` compiles at once (as `anyOf`, which streamengine/structured/json_schema.py makes of it); an `allOf` of several wide
`anyOf`s, whose intersection is the product of their branches, is refused ("schema too large",
"fuel exhausted", or an internal limit) once its fuel runs out; a huge enum and a huge regex
repetition compile at once (the lexer is lazy) and simply constrain (timings:
docs/performance.md, "Structured outputs"). So the slowest hostile spec found may end either
way within the short timeout set here, by the compiler's refusal or by the timeout, and the
timeout path itself is proven with a compile slowed on purpose (a patched `grammar_text` that
sleeps for one marked spec).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

import pytest

import streamengine.structured.grammar
from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine.errors import GrammarError, LimitExceededError
from streamengine.structured.params import MAX_STRUCTURED_BYTES, JsonSchema, Regex

# Long enough that ordinary specs and llguidance's own fast refusals finish well inside it on
# a loaded machine; the forced timeout below sleeps far past it.
TIMEOUT_S = 3.0
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def allof_product(groups: int, branches: int) -> dict:
    """An object that must match one of `branches` shapes in each of `groups` anyOfs: the
    compiler has to intersect branches ** groups combinations."""
    return {"allOf": [
        {"anyOf": [{"type": "object", "properties": {f"p{g}_{b}": {"type": "integer"}}, "required": [f"p{g}_{b}"]}
                   for b in range(branches)]}
        for g in range(groups)
    ]}


def nested_one_of(depth: int) -> dict:
    """`depth` levels of a two-way oneOf, each level a $ref to the one below (small on the wire)."""
    defs = {"L0": {"type": "integer"}}
    for i in range(1, depth + 1):
        below = {"$ref": f"#/$defs/L{i - 1}"}
        defs[f"L{i}"] = {"oneOf": [{"type": "object", "properties": {k: below}, "required": [k]} for k in ("a", "b")]}
    return {"$defs": defs, "$ref": f"#/$defs/L{depth}"}


def huge_enum(size: int) -> dict:
    return {"enum": [f"value_number_{i}" for i in range(size)]}


# The slowest small spec found: llguidance refuses it, late. Not strict: closed objects (the
# strict default) make its intersections empty, which llguidance refuses at once.
SLOWEST = JsonSchema(schema=allof_product(3, 22), strict=False)
SLEEPY = Regex(pattern="compiles (slowly)")  # the patched compile sleeps for this one
FAST_FAILURES = {"too_large_product": allof_product(4, 10)}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, grammar_compile_timeout_s=TIMEOUT_S)
    engine = AsyncEngine(config)
    warm_compiler(engine)
    return engine


def warm_compiler(engine: AsyncEngine) -> None:
    """Builds llguidance's view of the tokenizer (once per engine, outside any timeout) and
    caches a small spec, so each test's timing is its own spec's alone."""
    engine.core.grammars.compile(JsonSchema(schema=SMALL))


async def final_output(engine: AsyncEngine, prompt: str, params: SamplingParams):
    final = None
    async for out in engine.generate(prompt, params):
        final = out
    return final.outputs[0]


async def served(engine: AsyncEngine) -> None:
    """A new constrained request right now compiles (a spec never seen: no cache hit) and completes."""
    schema = {**SMALL, "title": uuid.uuid4().hex}
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=32, structured=JsonSchema(schema=schema))
    out = await final_output(engine, "Is it ok?", params)
    assert out.finish_reason == "stop" and json.loads(out.text) in ({"ok": True}, {"ok": False}), out.text


def test_the_hostile_specs_fit_the_size_limit():
    for schema in (SLOWEST.schema, *FAST_FAILURES.values(), huge_enum(3000)):
        assert len(json.dumps(schema)) < MAX_STRUCTURED_BYTES


async def hostile_beside_normal(engine: AsyncEngine, spec) -> GrammarError:
    """`spec` fails with GrammarError within the timeout (plus slack for a loaded machine)
    while a request submitted before it decodes to its end; the engine then serves anew."""
    normal = asyncio.create_task(final_output(
        engine, "Tell me a story", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)))
    await asyncio.sleep(0)  # submitted first: it is decoding while the hostile spec compiles
    began = time.monotonic()
    with pytest.raises(GrammarError) as failure:
        await final_output(engine, "Hi", SamplingParams(max_tokens=8, structured=spec))
    assert time.monotonic() - began < TIMEOUT_S + 4.0  # never the whole compile (SLEEPY: +6 s)
    out = await normal
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    await served(engine)  # while the hostile compile may still hold one compile thread
    return failure.value


async def test_slowest_hostile_schema_fails_in_time_while_a_normal_request_completes(engine):
    async with engine:
        await hostile_beside_normal(engine, SLOWEST)


async def test_compile_past_the_timeout_fails_with_the_timeout_error(engine, monkeypatch):
    grammar_text = streamengine.structured.grammar.grammar_text

    def sleepy(spec):
        if spec == SLEEPY:
            time.sleep(TIMEOUT_S + 6.0)
        return grammar_text(spec)

    monkeypatch.setattr(streamengine.structured.grammar, "grammar_text", sleepy)
    async with engine:
        error = await hostile_beside_normal(engine, SLEEPY)
        assert f"did not compile within {TIMEOUT_S:g} s" in str(error)


@pytest.mark.parametrize("name", FAST_FAILURES)
async def test_refused_schema_fails_fast_with_the_compilers_reason(engine, name):
    async with engine:
        with pytest.raises(GrammarError) as failure:
            await final_output(engine, "Hi", SamplingParams(structured=JsonSchema(schema=FAST_FAILURES[name])))
        # The compiler's own refusal, not the timeout: it came before TIMEOUT_S.
        assert "did not compile within" not in str(failure.value), failure.value
        await served(engine)


async def test_deeply_nested_one_of_compiles_and_constrains(engine):
    async with engine:
        out = await final_output(engine, "Nest", SamplingParams(
            temperature=1.0, seed=5, max_tokens=400, structured=JsonSchema(schema=nested_one_of(30))))
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        for _ in range(30):  # one key of the two at each level, nothing else
            assert isinstance(value, dict) and len(value) == 1 and set(value) <= {"a", "b"}, out.text
            (value,) = value.values()
        assert isinstance(value, int), out.text
        await served(engine)


async def test_huge_enum_over_the_size_limit_is_refused_before_compiling():
    schema = huge_enum(5000)
    assert len(json.dumps(schema)) > MAX_STRUCTURED_BYTES
    with pytest.raises(LimitExceededError) as failure:
        SamplingParams(structured=JsonSchema(schema=schema))
    assert failure.value.limit == "max_structured_bytes"


async def test_huge_enum_and_huge_repetition_compile_and_constrain(engine):
    enum = huge_enum(3000)
    async with engine:
        out = await final_output(engine, "Pick one", SamplingParams(
            temperature=1.0, seed=3, max_tokens=32, structured=JsonSchema(schema=enum)))
        assert out.finish_reason == "stop" and json.loads(out.text) in enum["enum"], out.text
        # 100,000 repetitions are not unrolled: the spec compiles at once, and max_tokens ends it.
        out = await final_output(engine, "Scream", SamplingParams(
            temperature=1.0, seed=4, max_tokens=12, structured=Regex(pattern="a{100000}")))
        assert out.finish_reason == "length" and re.fullmatch("a+", out.text), out.text
        await served(engine)
