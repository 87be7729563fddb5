"""The grammar mask's time budget: a request whose masks are too slow fails alone."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from streamengine.errors import GrammarError
from streamengine.structured.cache import _MALLOC_TRIM, HeapTrim
from streamengine.structured.mask import MaskAccount, TokenMasker

VOCAB = 64


class FakeMatcher:
    """Allows tokens below `allowed`; each fill advances the fake clock by `cost` seconds."""

    def __init__(self, clock: list[float], cost: float, account: MaskAccount | None, allowed: int = 8) -> None:
        self.clock, self.cost, self.account, self.allowed = clock, cost, account, allowed
        self.fills = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.clock[0] += self.cost
        self.fills += 1
        bitmask[row] = 0
        bitmask[row, 0] = (1 << self.allowed) - 1


def test_a_request_over_its_budget_stops_being_masked_and_others_are_not_charged():
    clock = [0.0]
    masker = TokenMasker(clock=lambda: clock[0])
    slow = MaskAccount("hostile", budget_s=0.1)
    cheap = MaskAccount("quiet", budget_s=0.1)
    slow_rows = [FakeMatcher(clock, 0.04, slow) for _ in range(8)]  # 8 samples of one request
    cheap_row = FakeMatcher(clock, 0.001, cheap)
    logits = torch.zeros(9, VOCAB)
    masked = masker.apply(logits, [*slow_rows[:4], cheap_row, *slow_rows[4:]])
    # Three slow rows fit in 0.1 s; the third takes it over and the rest are never filled.
    assert [m.fills for m in slow_rows] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert slow.error is not None and "grammar_mask_budget_ms" in slow.error
    assert cheap.error is None and cheap_row.fills == 1
    assert torch.isinf(masked[4, 8:]).all() and not torch.isinf(masked[4, :8]).any()
    # A row left unfilled allows every token (an all -inf row would make the sampler's NaN).
    assert not torch.isinf(masked[5]).any()
    assert masker.seconds_by_tenant == pytest.approx({"hostile": 0.12, "quiet": 0.001})


def test_the_budget_is_per_step():
    clock = [0.0]
    masker = TokenMasker(clock=lambda: clock[0])
    account = MaskAccount("t", budget_s=0.1)
    rows = [FakeMatcher(clock, 0.03, account) for _ in range(3)]  # 0.09 s a step: under
    for _ in range(5):
        masker.apply(torch.zeros(3, VOCAB), rows)
    assert account.error is None and account.total_s == pytest.approx(0.45)


def test_accept_raises_the_budget_error(smollm_dir):
    from transformers import AutoTokenizer

    from streamengine.structured.compiler import GrammarCompiler
    from streamengine.structured.params import Regex

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    compiled = GrammarCompiler(tokenizer, len(tokenizer), 10.0, 1 << 20).compile(Regex("[ab]+"))
    account = MaskAccount("t", budget_s=0.1)
    matcher = compiled.matcher(account)
    token = tokenizer.encode("a", add_special_tokens=False)[0]
    matcher.accept(token)
    account.charge(0, 0.2)
    with pytest.raises(GrammarError, match="grammar_mask_budget_ms"):
        matcher.fork().accept(token)  # forks (beams) share the request's account


async def test_a_slow_grammar_fails_alone_and_its_batch_mate_finishes(tiny_llama_dir):
    """A regex whose masks take milliseconds a row, sampled 8 ways under a 1 ms budget, fails
    with GrammarError; a plain request in the same steps finishes."""
    from streamengine import EngineConfig

    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=64, grammar_mask_budget_ms=1.0)
    earlier = _grammar_objects()  # another test's compiler may still hold its own
    gc.disable()  # what the failed request leaves must be freed by reference counts alone
    try:
        await _fail_a_slow_grammar_beside_a_plain_request(config, earlier)
    finally:
        gc.enable()


def _grammar_objects() -> list:
    from streamengine.structured.grammar import CompiledGrammar, GrammarMatcher

    return [o for o in gc.get_objects() if type(o) in (GrammarMatcher, CompiledGrammar)]


async def _fail_a_slow_grammar_beside_a_plain_request(config, earlier: list) -> None:
    from streamengine import AsyncEngine, SamplingParams

    async with AsyncEngine(config) as engine:
        hostile = SamplingParams(n=8, max_tokens=40, temperature=1.0, seed=0,
                                 structured={"type": "regex", "pattern": "(a{100}){100}"})
        quiet = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

        async def run(params, tenant):
            last = None
            async for out in engine.generate([1, 2, 3, 4], params, tenant=tenant):
                last = out
            return last

        outcome, plain = await asyncio.gather(run(hostile, "hostile"), run(quiet, "quiet"),
                                              return_exceptions=True)
        assert isinstance(outcome, GrammarError), outcome
        assert "grammar_mask_budget_ms" in str(outcome)
        assert len(plain.outputs[0].token_ids) == 24
        tenants = engine.stats()["tenants"]
        assert tenants["hostile"]["grammar_mask_seconds"] > 0.001
        assert engine.stats()["num_requests"] == 0
        # The failed request's lexer states are freed and the heap handed back once.
        assert engine.core._heap_trim.num_trims >= 1
        # Freed without a cyclic collection: its matchers, and the grammar its failure dropped
        # from the cache (a kept traceback, or a compile thread's last job, used to hold them).
        assert [o for o in _grammar_objects() if not any(o is e for e in earlier)] == []


@pytest.mark.skipif(_MALLOC_TRIM is None, reason="needs glibc's malloc_trim")
def test_heap_trim_runs_at_most_once_per_interval():
    clock = [10.0]
    trim = HeapTrim(interval_s=2.0, clock=lambda: clock[0])
    assert trim.maybe() and not trim.maybe()
    clock[0] += 1.9
    assert not trim.maybe()
    clock[0] += 0.2
    assert trim.maybe() and trim.num_trims == 2
