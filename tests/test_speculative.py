"""Speculative decoding (n-gram prompt lookup): the same tokens as decoding one at a time.

Each scenario runs the same requests through an engine with and without speculation and
compares every request's tokens and finish reason, while auditing the block bookkeeping after
every step and checking that every block comes back at the end. The prompts repeat themselves
and the tiny random model falls into loops, so proposals are made and accepted: each scenario
asserts that speculation really verified and accepted tokens (a test that never speculated
would prove nothing).
"""

from __future__ import annotations

import pytest

from streamengine.config import EngineConfig, SpeculativeConfig
from streamengine.engine.core import EngineCore
from streamengine.engine.speculation import speculates
from streamengine.sample.sampling_params import SamplingParams
from streamengine.spec.acceptance import PROBE_CEILING, ProposalGate, StepCost
from streamengine.spec.ngram import propose_ngram

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompts() -> list[list[int]]:
    """Prompts that quote themselves: a run of tokens, then the same run again."""
    out = []
    for i in range(4):
        run = list(range(300 + 40 * i, 300 + 40 * i + 23 + 3 * i))
        out.append(run + [11, 12] + run[: 9 + i])
    return out


def run(core: EngineCore, requests: dict[str, tuple[list[int] | str, SamplingParams]]) -> dict[str, tuple]:
    core.accepted_by_request = {}
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    final = {}
    for _ in range(2000):  # a bound, not a hang
        if not core.has_work():
            break
        for out in core.step():
            if out.finished:
                final[out.request_id] = (tuple(out.outputs[0].token_ids), out.outputs[0].finish_reason, out.outputs[0].text)
                core.accepted_by_request[out.request_id] = out.metrics.spec_accepted_tokens
        core.audit()  # refcounts match the block tables after every step
    assert not core.has_work()
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every block back, none held for a rejected proposal
    return final


class FixedBar:
    """A StepCost stand-in: every draft as long as the lookup gives (the verifier's worst case)."""

    def threshold(self, batch_size: int) -> float:
        return 0.0

    def observe(self, rows: int, seconds: float) -> None:
        pass


def both(config: dict, requests) -> tuple[dict, dict, EngineCore]:
    plain = run(EngineCore(EngineConfig(**config)), requests)
    spec_core = EngineCore(EngineConfig(**config, speculative=NGRAM))
    spec_core.step_cost = FixedBar()
    spec = run(spec_core, requests)
    return plain, spec, spec_core


def assert_same_and_speculated(plain: dict, spec: dict, core: EngineCore) -> None:
    assert spec == plain
    stats = core.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    assert sum(core.accepted_by_request.values()) == stats.num_accepted_tokens  # RequestOutput.metrics
    figures = core.stats()
    assert figures["spec_decode_num_accepted_tokens"] == stats.num_accepted_tokens
    assert sum(figures["spec_decode_num_accepted_tokens_per_pos"]) == stats.num_accepted_tokens


@pytest.fixture
def base(tiny_llama_dir):
    return dict(model=str(tiny_llama_dir), num_gpu_blocks=256, seed=0)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_outputs_identical_with_and_without_speculation(base, prefix_caching):
    requests = {f"r{i}": (p, greedy(30 + 7 * i)) for i, p in enumerate(prompts())}
    # a sampled request decodes as without speculation, beside those that speculate
    requests["sampled"] = (prompts()[0], SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True))
    plain, spec, core = both(dict(base, enable_prefix_caching=prefix_caching), requests)
    assert_same_and_speculated(plain, spec, core)
    stats = core.spec_stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections were verified too
    assert stats.accepted_per_pos[3] > 0  # whole drafts of 4 were accepted


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_identical_under_chunked_prefill_and_a_small_token_budget(base, backend):
    """Proposals are decode rows of their own: the C++ decode kernel's and PyTorch's alike."""
    requests = {f"r{i}": (p, greedy(25)) for i, p in enumerate(prompts())}
    config = dict(base, max_num_batched_tokens=24, max_prefill_chunk=8, attention_backend=backend)
    plain, spec, core = both(config, requests)
    assert_same_and_speculated(plain, spec, core)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_identical_under_preemption(base, mode):
    # 10 blocks of 16 tokens for four requests growing to ~70 tokens each: they preempt each other.
    requests = {f"r{i}": (p, greedy(40)) for i, p in enumerate(prompts())}
    config = dict(base, num_gpu_blocks=10, preemption_mode=mode, swap_space_bytes=(64 << 20) if mode == "swap" else 0)
    plain, spec, core = both(config, requests)
    assert_same_and_speculated(plain, spec, core)
    assert core.scheduler.num_preemptions > 0


def test_max_tokens_and_stop_strings_landing_inside_an_accepted_run(base):
    prompt = prompts()[1]
    plain = run(EngineCore(EngineConfig(**base)), {"probe": (prompt, greedy(40))})
    text = plain["probe"][2]
    stop = text[len(text) // 2: len(text) // 2 + 3]  # ends the output mid-way, at a token nobody chose
    requests = {f"len{n}": (prompt, greedy(n)) for n in range(1, 14)}
    requests["stop"] = (prompt, greedy(40, stop=[stop]))
    plain, spec, core = both(base, requests)
    assert_same_and_speculated(plain, spec, core)
    assert plain["stop"][1] == "stop" and all(len(plain[f"len{n}"][0]) == n for n in range(1, 14))


def test_requests_whose_tokens_depend_on_more_than_their_logits_do_not_speculate():
    for params in (greedy(), greedy(logprobs=2), greedy(logit_bias={5: 1.0}), SamplingParams(temperature=0.7, top_k=5)):
        assert speculates(params), params
    assert not speculates(greedy(speculate=False))
    for params in (SamplingParams(temperature=0.7, seed=3), greedy(n=2), greedy(repetition_penalty=1.2),
                   greedy(min_tokens=3), greedy(beam_width=2)):
        assert not speculates(params), params


def test_greedy_logprobs_and_logit_bias_are_the_same_with_speculation(base):
    requests = {f"r{i}": (p, greedy(24, logprobs=3, logit_bias={300 + i: 0.5})) for i, p in enumerate(prompts())}
    cores = {}
    for name, spec in (("plain", None), ("spec", NGRAM)):
        core = cores[name] = EngineCore(EngineConfig(**base, speculative=spec))
        core.step_cost = FixedBar()
        for rid, (prompt, params) in requests.items():
            core.add_request(rid, prompt, params)
    outs = {name: {} for name in cores}
    for name, core in cores.items():
        while core.has_work():
            for out in core.step():
                if out.finished:
                    outs[name][out.request_id] = out.outputs[0]
    assert cores["spec"].spec_stats.num_accepted_tokens > 0
    for rid in requests:
        plain, spec = outs["plain"][rid], outs["spec"][rid]
        assert spec.token_ids == plain.token_ids
        for a, b in zip(plain.logprobs, spec.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)  # the same position's logits, another batch shape


def chi_square_p(counts_a: dict[int, int], counts_b: dict[int, int]) -> float:
    """The p-value of a chi-square test that two samples of tokens come from one distribution."""
    import torch

    # Tokens seen fewer than 10 times in both samples together share one cell, so that every
    # cell's expected count is large enough for the chi-square approximation.
    cells: dict[int, tuple[int, int]] = {}
    for t in set(counts_a) | set(counts_b):
        a, b = counts_a.get(t, 0), counts_b.get(t, 0)
        key = t if a + b >= 10 else -1
        pa, pb = cells.get(key, (0, 0))
        cells[key] = (pa + a, pb + b)
    n_a, n_b = sum(counts_a.values()), sum(counts_b.values())
    stat = 0.0
    for a, b in cells.values():
        for count, n in ((a, n_a), (b, n_b)):
            expected = (a + b) * n / (n_a + n_b)
            stat += (count - expected) ** 2 / expected
    dof = max(1, len(cells) - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def token_counts(config: dict, params: SamplingParams, num: int, spec: SpeculativeConfig | None) -> tuple[list, EngineCore]:
    """Per output position, how often each token came out of `num` requests of one prompt."""
    core = EngineCore(EngineConfig(**config, speculative=spec))
    core.step_cost = FixedBar()
    prompt = prompts()[0]
    for i in range(num):
        core.add_request(f"r{i}", prompt, params)
    counts: list[dict[int, int]] = [{} for _ in range(params.max_tokens)]
    while core.has_work():
        for out in core.step():
            if out.finished:
                for position, token in enumerate(out.outputs[0].token_ids):
                    counts[position][token] = counts[position].get(token, 0) + 1
    return counts, core


def test_sampled_tokens_keep_their_distribution_under_speculation(tiny_llama_dir):
    """Speculative sampling with a one-token-per-position draft: the tokens at every position
    are distributed as without speculation (chi-square, 600 requests each), while drafts are
    both accepted and rejected; the same test tells a different distribution apart."""
    config = dict(model=str(tiny_llama_dir), num_gpu_blocks=2048, max_num_seqs=600, max_num_batched_tokens=4096)
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=5, ignore_eos=True)
    plain, _ = token_counts(dict(config, seed=1), params, 600, None)
    spec, core = token_counts(dict(config, seed=2), params, 600, NGRAM)
    stats = core.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    for position in range(1, params.max_tokens):  # where drafts are verified
        assert chi_square_p(plain[position], spec[position]) > 1e-4, position
    colder = SamplingParams(temperature=0.5, top_k=4, max_tokens=5, ignore_eos=True)
    other, _ = token_counts(dict(config, seed=3), colder, 600, None)
    assert min(chi_square_p(plain[p], other[p]) for p in range(1, 5)) < 1e-4  # the test has power


def test_opted_out_requests_propose_nothing(base):
    core = EngineCore(EngineConfig(**base, speculative=NGRAM))
    core.step_cost = FixedBar()  # every draft as long as lookup gives: only the opt-out stops them
    run(core, {"r": (prompts()[0], greedy(30, speculate=False))})
    assert core.spec_stats.num_drafts == 0


def test_ngram_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3, 1, 3) == [4, 1, 2]
    assert propose_ngram([1, 2, 3, 9, 2, 3, 7, 2, 3], 2, 2, 2) == [7, 2]  # the most recent match
    # the most recent match that k tokens follow, over a later one with fewer after it
    assert propose_ngram([5, 6, 7, 5, 9, 5], 3, 1, 1) == [6, 7, 5]
    assert propose_ngram([5, 6, 7, 5, 9, 5], 6, 1, 1) == [9, 5]  # none has 6 after it: the most recent
    assert propose_ngram([1, 2, 3, 4, 5, 2, 3], 3, 1, 3) == [4, 5, 2]  # n = 2 after n = 3 fails
    assert propose_ngram([1, 2, 3], 3, 2, 3) == []
    assert propose_ngram([7, 8, 9, 1, 8, 9], 1, 3, 3) == []  # no 3-gram repeats
    # 512 then 0 pack as 00 02 00 00 00 00 00 00, holding 2's bytes across the boundary:
    # no match there, only at whole tokens
    assert propose_ngram([512, 0, 5, 2], 1, 1, 1) == []
    assert propose_ngram([2, 9, 512, 0, 5, 2], 1, 1, 1) == [9]


def test_drafts_are_as_long_as_their_chance_of_acceptance_pays():
    gate = ProposalGate()
    assert gate.draft_length(4, threshold=0.2) == 3  # a new request: c = 0.6, 0.6**3 = 0.216, 0.6**4 = 0.13
    assert gate.draft_length(4, threshold=0.5) == 1  # 0.6 > 0.5 > 0.36
    for _ in range(10):
        gate.record(4, 4)
    assert gate.continuation > 0.9 and gate.draft_length(4, threshold=0.5) == 4
    for _ in range(30):
        gate.record(4, 0)
    assert gate.continuation < 0.25


def test_a_gate_that_does_not_pay_probes_with_one_token_then_waits_longer_each_time():
    gate = ProposalGate()
    for _ in range(10):
        gate.record(4, 0)
    lengths = [gate.draft_length(4, threshold=0.5) for _ in range(17)]
    assert lengths == [1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]  # a probe, then waits of 2, 4, 8 steps
    # a bar above what accepted probes could ever build: no probes at all
    assert PROBE_CEILING < 0.96
    assert [ProposalGate().draft_length(4, threshold=0.96) for _ in range(5)] == [0] * 5


def test_step_cost_fits_fixed_and_per_row_time_and_sets_the_bar_by_batch_size():
    cost = StepCost()
    assert cost.ratio == 2.7  # the prior until steps are measured
    for rows in [1, 5, 2, 8, 3, 1, 6, 4] * 3:
        cost.observe(rows, 0.004 + 0.001 * rows)  # fixed 4 ms, 1 ms per row
    assert cost.ratio == pytest.approx(4.0)
    assert cost.threshold(1) == pytest.approx(0.2)
    assert cost.threshold(8) == pytest.approx(2 / 3)
    flat = StepCost()
    for _ in range(30):
        flat.observe(8, 0.01)  # every step the same size: nothing to fit, the prior stays
    assert flat.ratio == 2.7


def test_config_is_checked_by_name():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="'k'"):
        SpeculativeConfig.from_mapping({"k": 3})
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative={"method": "ngram"})


def test_grammar_forced_tokens_and_lookup_under_a_grammar_keep_the_same_tokens(base):
    """Jump-forward: a grammar's forced tokens are proposed and verified with lookup's, each
    row masked by the grammar's state after the proposals before it; proposals the grammar
    refuses are cut. Outputs equal those of decoding without speculation."""
    from streamengine.structured.params import JsonSchema, Regex

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                        "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}
    requests = {f"json{i}": (p, greedy(48, structured=JsonSchema(schema))) for i, p in enumerate(prompts()[:2])}
    # the prompt's tokens, which lookup proposes, are never digits: the grammar cuts them
    requests["digits"] = (prompts()[2], greedy(24, structured=Regex(r"[0-9]{4,30}")))
    requests["sampled"] = (prompts()[3], SamplingParams(temperature=0.9, top_k=3, max_tokens=30,
                                                        structured=JsonSchema(schema)))
    plain, spec, core = both(base, {k: v for k, v in requests.items() if k != "sampled"})
    assert_same_and_speculated(plain, spec, core)
    _, spec_sampled, sampled_core = both(base, {"sampled": requests["sampled"]})
    assert sampled_core.spec_stats.num_drafts > 0  # a sampled request under a grammar speculates too
    assert spec_sampled["sampled"][1] in ("stop", "length")


def test_output_history_keeps_outputs_per_tenant_and_user_and_drops_the_oldest():
    from streamengine.spec.history import OutputHistory

    history = OutputHistory(max_tokens=12, max_keys=2)
    history.add(("a", None), [1, 2, 3, 4, 5, 6])
    assert history.lookup(("a", None), [9, 2, 3], 3, 1, 2) == [4, 5, 6]  # stops at the output's end
    assert history.lookup(("b", None), [9, 2, 3], 3, 1, 2) == []  # another tenant's: never
    assert history.lookup(("a", "user-1"), [9, 2, 3], 3, 1, 2) == []  # another user's salt: never
    history.add(("a", None), [7, 8, 9, 10])
    history.add(("a", None), [11, 12, 13])  # 6 + 4 + 3 tokens > 12: the oldest output goes
    assert history.lookup(("a", None), [2, 3], 3, 1, 2) == []
    assert history.lookup(("a", None), [0, 8], 2, 1, 2) == [9, 10]
    history.add(("c", None), [1])  # a second key, then a third: the least recently used ("a") goes
    history.add(("d", None), [1])
    assert history.lookup(("a", None), [0, 8], 2, 1, 2) == []


def test_suffix_proposes_from_the_tenants_earlier_outputs_and_keeps_the_same_tokens(untied_llama_dir):
    """A second request of the same tenant, whose own tokens hold no repeat, is proposed the
    first one's output; another tenant's request is not. Outputs equal plain decoding."""
    from streamengine.tenancy.tenants import TenantConfig

    tenants = (TenantConfig("bot-a"), TenantConfig("bot-b"))
    prompt = list(range(1000, 1030))  # no token repeats, nor does the model's answer
    config = dict(model=str(untied_llama_dir), num_gpu_blocks=64, tenants=tenants)
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    outs = {}
    for name, speculative in (("plain", None), ("spec", spec)):
        core = EngineCore(EngineConfig(**config, speculative=speculative))
        core.step_cost = FixedBar()
        for rid, tenant in (("first", "bot-a"), ("second", "bot-a"), ("other", "bot-b")):
            before = core.spec_stats.num_accepted_tokens
            core.add_request(rid, prompt, greedy(12), tenant=tenant)
            while core.has_work():
                for out in core.step():
                    if out.finished:
                        outs[name, rid] = out.outputs[0].token_ids
            outs[name, rid, "accepted"] = core.spec_stats.num_accepted_tokens - before
        core.audit()
    assert all(outs["spec", rid] == outs["plain", rid] for rid in ("first", "second", "other"))
    assert outs["spec", "first", "accepted"] == 0  # nothing to look up in its own tokens
    assert outs["spec", "second", "accepted"] >= 8  # the first one's answer, from bot-a's history
    assert outs["spec", "other", "accepted"] == 0  # bot-b is never proposed bot-a's outputs


def test_prometheus_exposes_the_counters_under_vllms_spec_decode_names():
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from streamengine.server.metrics import _EngineStatsCollector

    stats = {"spec_decode_num_drafts": 5, "spec_decode_num_draft_tokens": 14, "spec_decode_num_accepted_tokens": 9,
             "spec_decode_num_accepted_tokens_per_pos": [5, 3, 1]}
    registry = CollectorRegistry()
    registry.register(_EngineStatsCollector(lambda: stats))
    text = generate_latest(registry).decode()
    for line in ("streamengine:spec_decode_num_drafts_total 5.0", "streamengine:spec_decode_num_draft_tokens_total 14.0",
                 "streamengine:spec_decode_num_accepted_tokens_total 9.0",
                 'streamengine:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1.0'):
        assert line in text, line
