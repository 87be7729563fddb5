"""Speculative decoding with a draft model: the same tokens as decoding one at a time, and a
draft KV cache that stays right through everything the target's cache goes through.

A draft that is the target itself proposes exactly the target's greedy choices as long as its
K/V (kept in the target's blocks) is right: near-full acceptance through prefix-cache hits,
chunked prefill, copy-on-write, swaps and recompute shows the draft's cache followed each of
them (a draft reading stale or missing K/V would propose other tokens). A random draft of
another shape shows exactness does not depend on the draft.
"""

from __future__ import annotations

import pytest
from test_speculative import FixedBar, assert_same_and_speculated, greedy, prompts, run

from streamengine.config import EngineConfig, SpeculativeConfig
from streamengine.engine.core import EngineCore
from streamengine.kv.spec import AttentionShape, plan_kv_cache
from streamengine.sample.sampling_params import SamplingParams


def draft_config(model_dir) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", model=str(model_dir), num_speculative_tokens=4)

def both(config: dict, requests, spec: SpeculativeConfig) -> tuple[dict, dict, EngineCore]:
    plain = run(EngineCore(EngineConfig(**config)), requests)
    spec_core = EngineCore(EngineConfig(**config, speculative=spec))
    spec_core.step_cost = FixedBar()  # drafts as long as allowed, whatever the timings say
    return plain, run(spec_core, requests), spec_core

@pytest.fixture
def base(tiny_llama_dir):
    return dict(model=str(tiny_llama_dir), num_gpu_blocks=256, seed=0)

SCENARIOS = {
    "prefix_caching": dict(enable_prefix_caching=True),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "chunked_prefill": dict(max_num_batched_tokens=24, max_prefill_chunk=8),
    "chunked_prefill_torch": dict(max_num_batched_tokens=24, max_prefill_chunk=8, attention_backend="torch"),
    "recompute": dict(num_gpu_blocks=10, preemption_mode="recompute"),
    "swap": dict(num_gpu_blocks=10, preemption_mode="swap", swap_space_bytes=64 << 20),
}

@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_draft_that_is_the_target_has_its_greedy_proposals_accepted(untied_llama_dir, scenario):
    # the prompts share their first tokens in pairs: later ones hit the earlier ones' blocks
    requests = {f"r{i}": (p, greedy(40)) for i, p in enumerate(prompts())}
    requests.update({f"again{i}": (p + [7, 8, 9], greedy(30)) for i, p in enumerate(prompts()[:2])})
    base = dict(model=str(untied_llama_dir), num_gpu_blocks=256, seed=0)
    plain, spec, core = both(dict(base, **SCENARIOS[scenario]), requests, draft_config(untied_llama_dir))
    assert_same_and_speculated(plain, spec, core)
    stats = core.spec_stats
    # Float sums in another order (a 1-row pass against a step's rows) may flip a near tie.
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens, stats
    assert stats.num_draft_tokens >= 100, stats
    if scenario in ("recompute", "swap"):
        assert core.scheduler.num_preemptions > 0

def test_a_random_draft_of_another_shape_keeps_the_same_tokens(base, tiny_qwen2_dir):
    """A Qwen2 draft (6 heads, other layers) beside a Llama target; greedy requests, a grammar's
    (its forced tokens and lookup, the draft not asked), and a sampled one beside them."""
    from streamengine.structured.params import Regex

    requests = {f"r{i}": (p, greedy(30 + 5 * i)) for i, p in enumerate(prompts())}
    requests["digits"] = (prompts()[1], greedy(20, structured=Regex(r"[0-9]{4,30}")))
    requests["sampled"] = (prompts()[0], SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True))
    config = dict(base, num_gpu_blocks=12, preemption_mode="swap", swap_space_bytes=64 << 20)
    plain, spec, core = both(config, requests, draft_config(tiny_qwen2_dir))
    assert_same_and_speculated(plain, spec, core)
    assert core.runner.draft.kv_caches[0][0].shape[1:] == (16, 2, 16)  # the draft's own block shape

def test_copy_on_write_copies_the_drafts_blocks_too(base, tiny_qwen2_dir):
    import torch

    core = EngineCore(EngineConfig(**base, speculative=draft_config(tiny_qwen2_dir)))
    runner = core.runner
    for key, value in runner.kv_caches + runner.draft.kv_caches:
        key[3].normal_(), value[3].normal_()
    runner._copy_blocks([(3, 5)])
    for key, value in runner.kv_caches + runner.draft.kv_caches:
        assert torch.equal(key[5], key[3]) and torch.equal(value[5], value[3])


def test_the_draft_shares_the_pool_bytes(tiny_llama_dir, tiny_qwen2_dir):
    from transformers import AutoConfig

    target, draft = AutoConfig.from_pretrained(tiny_llama_dir), AutoConfig.from_pretrained(tiny_qwen2_dir)
    config = EngineConfig(model=str(tiny_llama_dir), kv_cache_bytes=1 << 22, speculative=draft_config(tiny_qwen2_dir))
    alone, shared = plan_kv_cache(config, target), plan_kv_cache(config, target, draft)
    assert shared.draft_shape == AttentionShape.of(draft)
    assert shared.bytes_per_block == alone.bytes_per_block + shared.draft().bytes_per_block
    assert shared.num_blocks == (1 << 22) // shared.bytes_per_block < alone.num_blocks

def test_draft_config_errors_name_the_field(tiny_llama_dir, tmp_path, smollm_dir):
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig(method="ngram", model=str(tiny_llama_dir))
    assert SpeculativeConfig.from_mapping({"method": "draft", "model": "m"}).model == "m"
    with pytest.raises(FileNotFoundError):
        EngineCore(EngineConfig(model=str(tiny_llama_dir), speculative=draft_config(tmp_path / "missing")))
    # a draft whose tokenizer has one more token: its ids are not the target's
    from conftest import _TINY, _save_tiny
    from transformers import AutoTokenizer, LlamaConfig

    other = _save_tiny(LlamaConfig(**_TINY), tmp_path / "other", smollm_dir)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<not-in-the-target>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match="tokenizer"):
        EngineCore(EngineConfig(model=str(tiny_llama_dir), speculative=draft_config(other)))
