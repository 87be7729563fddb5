"""Structured outputs below the engine: specs, the grammar compiler (cache, timeout, bad specs),
matchers (accept, fork, stop) and the sampler's grammar mask, on SmolLM2's tokenizer."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import llguidance.hf
import msgspec
import pytest
import torch

from streamengine.errors import GrammarError, LimitExceededError
from streamengine.sample.sampler import Sampler, SamplingRow
from streamengine.sample.sampling_params import SamplingParams
from streamengine.structured.compiler import GrammarCompiler
from streamengine.structured.grammar import GrammarMatcher
from streamengine.structured.mask import TokenMasker
from streamengine.structured.params import (
    MAX_STRUCTURED_BYTES,
    Choice,
    Grammar,
    JsonObject,
    JsonSchema,
    Regex,
    structured_key,
)

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture(scope="module")
def shared(tokenizer):
    """One compiler for the tests that neither patch it nor depend on its cache's contents."""
    compiler = GrammarCompiler(tokenizer, VOCAB, timeout_s=30.0, cache_bytes=64 * 2**20)
    yield compiler
    compiler.shutdown()


def fresh(shared, **kw) -> GrammarCompiler:
    """A compiler with an empty cache that reuses `shared`'s llguidance tokenizer."""
    compiler = GrammarCompiler(shared.tokenizer, VOCAB, **{"timeout_s": 30.0, "cache_bytes": 64 * 2**20, **kw})
    compiler._lltok = shared._tokenizer()
    return compiler


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(matcher: GrammarMatcher) -> set[int]:
    bitmask = torch.full((1, VOCAB // 32), -1, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.view(-1).nonzero().view(-1).tolist())


# ---------------------------------------------------------------- specs


def test_spec_dicts_convert_and_bad_ones_name_the_problem():
    params = SamplingParams.from_dict({"structured": {"type": "regex", "pattern": "[0-9]+"}})
    assert params.structured == Regex("[0-9]+")
    assert SamplingParams(structured={"type": "json_object"}).structured == JsonObject()
    params = SamplingParams(structured=Choice(["a", "b"]), n=2)
    assert msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams) == params
    assert structured_key(Regex("a")) == structured_key(SamplingParams(structured={"type": "regex", "pattern": "a"}).structured)
    for bad, words in [
        ({"type": "regex"}, "pattern"),
        ({"type": "nope"}, "type"),
        ({"type": "regex", "pattern": "a", "extra": 1}, "extra"),
        ({"type": "choice", "choices": []}, "choices"),
        ({"type": "choice", "choices": ["a", ""]}, "non-empty"),
        ({"type": "grammar", "grammar": "start: x", "syntax": "peg"}, "syntax"),
        (Regex(5), "str"),  # a Struct built directly is type-checked too
    ]:
        with pytest.raises(ValueError, match=words):
            SamplingParams(structured=bad)
    with pytest.raises(LimitExceededError) as info:
        SamplingParams(structured=Regex("a" * MAX_STRUCTURED_BYTES))
    assert info.value.limit == "max_structured_bytes"


# ---------------------------------------------------------------- matchers


def test_matcher_accepts_forks_and_stops(shared, tokenizer):
    grammar = shared.compile(Regex("[a-z]+ [0-9]{2}"))
    m = grammar.matcher()
    for t in ids(tokenizer, "cat 4"):
        m.accept(t)
    fork = m.fork()
    assert not m.is_accepting and not m.is_stopped
    fork.accept(ids(tokenizer, "2")[0])
    assert fork.is_accepting and fork.is_stopped and allowed(fork) == {EOS}
    assert not m.is_stopped  # the fork advanced alone
    with pytest.raises(GrammarError, match="refused"):
        m.accept(ids(tokenizer, "x")[0])
    assert grammar.matcher().is_accepting is False  # a new matcher starts at the beginning


def test_an_accepting_matcher_allows_eos_and_stops_on_it(shared, tokenizer):
    m = shared.compile(Regex("[0-9]+")).matcher()
    m.accept(ids(tokenizer, "7")[0])
    assert m.is_accepting and not m.is_stopped and EOS in allowed(m)
    m.accept(EOS)
    assert m.is_stopped


@pytest.mark.parametrize("choices", [["yes", "no"], ['say "hi"', "back\\slash", "naïve", "two\nlines", "yes!"]])
def test_choice_takes_exactly_its_strings(shared, tokenizer, choices):
    grammar = shared.compile(Choice(choices))
    for text in choices:
        m = grammar.matcher()
        for t in ids(tokenizer, text):
            m.accept(t)
        assert m.is_accepting
    m = grammar.matcher()
    with pytest.raises(GrammarError):
        for t in ids(tokenizer, "maybe"):
            m.accept(t)


def test_json_schema_lark_and_ebnf_compile(shared, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    m = shared.compile(JsonSchema(schema)).matcher()
    for t in ids(tokenizer, '{"n": 12}'):  # json.dumps spacing, no free whitespace
        m.accept(t)
    assert m.is_stopped
    for spec in (Grammar('start: "a" "b"+'), Grammar('root ::= "a" "b"+', syntax="ebnf")):
        m = shared.compile(spec).matcher()
        for t in ids(tokenizer, "abb"):
            m.accept(t)
        assert m.is_accepting
    assert shared.compile(JsonSchema(True)).matcher() is not None


# ---------------------------------------------------------------- compiler


@pytest.mark.parametrize("spec, words", [
    (JsonSchema({"type": "foo"}), "Invalid type"),
    (JsonSchema(False), "allows no value"),
    (Regex("(("), "regex"),
    (Grammar("start: undefined_rule"), "undefined_rule"),
    (Grammar("root ::= ((", syntax="ebnf"), "Expected"),
])
def test_bad_specs_raise_grammar_error_and_fail_fast_from_the_cache(shared, spec, words, monkeypatch):
    compiler = fresh(shared)
    with pytest.raises(GrammarError, match=words):
        compiler.compile(spec)
    monkeypatch.setattr(compiler, "_build", lambda spec: pytest.fail("compiled again"))
    with pytest.raises(GrammarError, match=words):
        compiler.compile(spec)


def test_cache_returns_the_same_grammar(shared):
    compiler = fresh(shared)
    a, b = compiler.compile(Regex("a")), compiler.compile(Regex("b"))
    assert compiler.compile(Regex("a")) is a and compiler.compile(Regex("b")) is b
    assert compiler.stats()["grammar_cache_entries"] == 2


async def test_a_compile_past_the_timeout_fails_and_is_not_kept(shared, monkeypatch):
    """The caller gets GrammarError at the timeout; the compile goes on in its thread (it
    cannot be interrupted), the same spec sent meanwhile fails at once instead of starting a
    second compile, and what the late compile found is dropped: the spec compiles anew."""
    compiler = fresh(shared, timeout_s=0.05)
    release, finished = threading.Event(), threading.Event()
    build = compiler._build
    calls = []

    def slow_build(spec):
        calls.append(spec)
        release.wait(30)
        try:
            return build(spec)
        finally:
            finished.set()

    monkeypatch.setattr(compiler, "_build", slow_build)
    spec = Regex("[0-9]+")
    try:
        with pytest.raises(GrammarError, match=r"did not compile within 0\.05 s"):
            await compiler.compile_async(spec)
        with pytest.raises(GrammarError, match="did not compile within"):
            compiler.compile(spec)
        assert len(calls) == 1  # joined the compile still running, which is past its time
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while compiler.stats()["grammar_compiles_running"]:  # until the late compile has ended
        assert time.monotonic() < deadline, "a timed-out compile never finished"
        await asyncio.sleep(0.01)
    assert finished.is_set() and compiler.stats()["grammar_cache_entries"] == 0
    monkeypatch.setattr(compiler, "timeout_s", 30.0)
    grammar = await compiler.compile_async(spec)
    assert grammar.matcher() is not None and len(calls) == 2  # compiled again: nothing was kept
    compiler.shutdown()


async def test_compile_async_runs_off_the_event_loop(shared, monkeypatch):
    compiler = fresh(shared)
    started, release = threading.Event(), threading.Event()
    build = compiler._build

    def blocking_build(spec):
        started.set()
        release.wait(30)
        return build(spec)

    monkeypatch.setattr(compiler, "_build", blocking_build)
    task = asyncio.create_task(compiler.compile_async(Regex("x")))
    await asyncio.to_thread(started.wait, 30)
    assert not task.done()  # the loop runs this while the compile is blocked
    release.set()
    assert (await task).matcher() is not None
    compiler.shutdown()
    compiler.compile(Regex("y"))  # a compile after shutdown starts new threads


async def test_building_the_tokenizer_view_is_outside_the_timeout(tokenizer, monkeypatch):
    """The first compile of an engine builds llguidance's tokenizer view; however long that
    takes, the spec's own timeout starts after it."""
    real = llguidance.hf.from_tokenizer

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", slow)
    for compile_with in ("sync", "async"):
        compiler = GrammarCompiler(tokenizer, 49152, timeout_s=1.0, cache_bytes=2**20)
        spec = Regex(pattern="[0-9]+")
        grammar = compiler.compile(spec) if compile_with == "sync" else await compiler.compile_async(spec)
        assert grammar.matcher().is_accepting is False
        compiler.shutdown()


def test_logits_narrower_than_the_tokenizer_are_refused(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer) - 1, timeout_s=30.0, cache_bytes=2**20)
    with pytest.raises(GrammarError, match="narrower"):
        compiler.compile(Regex("a"))
    compiler.shutdown()


# ---------------------------------------------------------------- masking


def test_masker_masks_each_row_by_its_own_matcher(shared, tokenizer):
    grammar = shared.compile(Regex("[a-z]+ [0-9]"))
    behind, ahead = grammar.matcher(), grammar.matcher()
    for t in ids(tokenizer, "cat "):
        ahead.accept(t)
    logits = torch.randn(1, VOCAB).expand(3, -1)  # one row shared by three, as n > 1 gathers it
    masked = TokenMasker().apply(logits, [behind, None, ahead])
    assert set(torch.isfinite(masked[0]).nonzero().view(-1).tolist()) == allowed(behind)
    assert set(torch.isfinite(masked[2]).nonzero().view(-1).tolist()) == allowed(ahead)
    assert torch.equal(masked[1], logits[1])
    assert allowed(behind) != allowed(ahead)
    assert TokenMasker().apply(logits, [None, None, None]) is logits
    single = TokenMasker().apply(logits[:1], [ahead])  # one row: filled without the executor
    assert torch.equal(single[0], masked[2])


def test_host_and_device_masks_agree(shared, tokenizer):
    """The numpy form (CPU) and the torch form (GPUs) of the mask, both run on CPU tensors."""
    grammar = shared.compile(Regex("[a-z]+ [0-9]"))
    ahead = grammar.matcher()
    for t in ids(tokenizer, "cat "):
        ahead.accept(t)
    logits = torch.randn(3, VOCAB)
    masker = TokenMasker()
    host = masker.apply(logits, [grammar.matcher(), None, ahead])
    bitmask = masker._fill([(grammar.matcher(), 0), (ahead, 2)], VOCAB).clone()
    device = masker._mask_on_device(logits, [0, 2], bitmask)
    assert torch.equal(host, device) and torch.equal(host[1], logits[1])


def row(params: SamplingParams, matcher=None, seed: int | None = None) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, generator, [1], [], matcher=matcher)


def test_sampler_draws_only_allowed_tokens_and_leaves_other_rows_alone(shared, tokenizer):
    grammar = shared.compile(Regex("[0-9]{4}"))
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    hot = SamplingParams(temperature=1.0, top_p=0.9, logprobs=5, presence_penalty=0.5)
    greedy = SamplingParams(temperature=0.0)
    rows = [row(hot, grammar.matcher(), 1), row(hot, None, 2), row(greedy, grammar.matcher()), row(greedy)]
    out = Sampler()(logits, rows)
    digits = allowed(grammar.matcher())
    assert out.token_ids[0] in digits and out.token_ids[2] in digits
    assert out.token_ids[3] == int(logits[3].argmax())
    alone = Sampler()(logits[1:2], [row(hot, None, 2)])
    assert out.token_ids[1] == alone.token_ids[0] and out.logprobs[1] == alone.logprobs[0]
    # Logprobs are of the masked distribution: every top token is allowed, and they are
    # normalized over the allowed tokens only.
    assert set(out.logprobs[0]) <= digits
    expected = torch.log_softmax(logits[0, sorted(digits)], dim=-1)
    assert max(out.logprobs[0].values()) == pytest.approx(float(expected.max()), abs=1e-5)


def test_top_logprobs_leave_out_forbidden_tokens(shared):
    grammar = shared.compile(Choice(["a", "b"]))
    out = Sampler()(torch.randn(1, VOCAB), [row(SamplingParams(temperature=0.0, logprobs=20), grammar.matcher())])
    assert 1 <= len(out.logprobs[0]) < 20 and set(out.logprobs[0]) <= allowed(grammar.matcher())


def test_unconstrained_batches_never_reach_the_masker(monkeypatch):
    sampler = Sampler()
    monkeypatch.setattr(sampler.masker, "apply", lambda *a: pytest.fail("masked an unconstrained batch"))
    logits = torch.randn(2, 64)
    out = sampler(logits, [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.7), seed=3)])
    assert out.token_ids[0] == int(logits[0].argmax())


def test_regex_outputs_fullmatch_when_drawn_at_temperature_one(shared, tokenizer):
    """Drawing token by token from random logits through the mask always spells a match."""
    pattern = "[a-z]{2,6}-[0-9]{1,3}"
    grammar = shared.compile(Regex(pattern))
    sampler, gen = Sampler(), torch.Generator().manual_seed(5)
    for trial in range(4):
        matcher, tokens = grammar.matcher(), []
        while not matcher.is_stopped and len(tokens) < 20:
            token = sampler(torch.randn(1, VOCAB, generator=gen), [row(SamplingParams(), matcher, trial)]).token_ids[0]
            matcher.accept(token)
            tokens.append(token)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert re.fullmatch(pattern, text), text


def test_property_order_is_part_of_the_cache_key(shared):
    """llguidance generates properties in the order a schema lists them, so a schema with its
    keys in another order is another grammar, not a cache hit on the first."""
    first = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}}}
    second = {"type": "object", "properties": {"answer": {"type": "integer"}, "reasoning": {"type": "string"}}}
    assert structured_key(JsonSchema(first)) != structured_key(JsonSchema(second))
    assert structured_key(JsonSchema(first)) == structured_key(JsonSchema(dict(first)))
    assert shared.compile(JsonSchema(first)) is not shared.compile(JsonSchema(second))
