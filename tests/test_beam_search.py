"""Beam search equals transformers' `generate(num_beams=k, do_sample=False)`, and parallel
samples and beams share physical blocks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamengine import EngineConfig, SamplingParams
from streamengine.engine.core import EngineCore

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def add(a, b):"]


def hf_beam(folder, prompt_ids: list[int], width: int, max_new: int, **kw) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            num_beams=width, do_sample=False, max_new_tokens=max_new, **kw,
        )[0, len(prompt_ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    for i, t in enumerate(out):  # the returned beam is padded after its EOS
        if t in eos:
            return out[: i + 1]
    return out


def run_core(core: EngineCore, prompt, params: SamplingParams):
    req = core.add_request("r", prompt, params)
    peak_used = peak_logical = 0
    final = None
    for _ in range(10_000):  # a scheduler that stops making progress fails instead of hanging
        if not core.has_work():
            break
        for out in core.step():
            final = out
        s = core.stats()
        peak_used = max(peak_used, s["num_used_blocks"])
        peak_logical = max(peak_logical, s["num_logical_blocks"])
    assert req.finished
    return final, peak_used, peak_logical


@pytest.fixture(scope="module")
def tiny_core(tiny_llama_dir):
    return EngineCore(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=256))


@pytest.mark.parametrize("width", [2, 4])
def test_tiny_llama_beam_matches_transformers(tiny_llama_dir, tiny_core, width):
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        expected = hf_beam(tiny_llama_dir, ids, width, 24)
        out, _, _ = run_core(tiny_core, ids, SamplingParams(beam_width=width, max_tokens=24))
        assert out.outputs[0].token_ids == expected, prompt
    s = tiny_core.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]


def test_length_penalty_and_early_stopping_match_transformers(tiny_llama_dir, tiny_core):
    ids = AutoTokenizer.from_pretrained(tiny_llama_dir).encode(PROMPTS[1])
    expected = hf_beam(tiny_llama_dir, ids, 3, 20, length_penalty=0.5, early_stopping=True)
    params = SamplingParams(beam_width=3, max_tokens=20, length_penalty=0.5, early_stopping=True)
    out, _, _ = run_core(tiny_core, ids, params)
    assert out.outputs[0].token_ids == expected


@pytest.mark.slow
def test_smollm_beam_matches_transformers(smollm_dir):
    core = EngineCore(EngineConfig(model=str(smollm_dir), num_gpu_blocks=128))
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt)
        expected = hf_beam(smollm_dir, ids, 4, 24)
        out, _, _ = run_core(core, ids, SamplingParams(beam_width=4, max_tokens=24))
        assert out.outputs[0].token_ids == expected, prompt


def test_beams_share_blocks(tiny_core):
    prompt = list(range(1000, 1000 + 70))  # 4 full blocks + a partial one
    params = SamplingParams(beam_width=4, max_tokens=40, ignore_eos=True)
    out, used, logical = run_core(tiny_core, prompt, params)
    assert len(out.outputs[0].token_ids) == 40
    assert used < logical * 0.63, (used, logical)  # >= 37% saved, the paper's low end for beams


def test_parallel_samples_share_prompt_blocks(tiny_core):
    prompt = list(range(2000, 2000 + 70))
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    out, used, logical = run_core(tiny_core, prompt, params)
    assert [len(c.token_ids) for c in out.outputs] == [20] * 4
    # Without sharing each sample holds its own copy of the 70-token prompt: 4 x 6 blocks.
    assert logical >= 4 * 6 and used <= logical - 3 * 4, (used, logical)
    s = tiny_core.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_under_memory_pressure(tiny_llama_dir, tiny_core, mode):
    """Beams are preempted (and idle beams make room for siblings) without changing the result."""
    from streamengine.kv.spec import kv_bytes_per_block

    prompt = list(range(3000, 3000 + 20))
    params = SamplingParams(beam_width=4, max_tokens=30, ignore_eos=True)
    expected, _, _ = run_core(tiny_core, prompt, params)
    swap = 32 * kv_bytes_per_block(tiny_core.loaded.model.config, 16, torch.float32)
    small = EngineCore(
        EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=5, preemption_mode=mode, swap_space_bytes=swap),
        loaded=tiny_core.loaded,
    )
    out, _, _ = run_core(small, prompt, params)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    s = small.stats()
    assert s["num_preemptions"] > 0
    assert s["num_free_blocks"] == s["num_total_blocks"] and s["num_swap_blocks_free"] == s["num_swap_blocks"]


def test_beams_with_fewer_allowed_tokens_than_beams_take_only_allowed_ones():
    """A grammar may leave fewer allowed continuations than beams: then the first step keeps
    continuations of the starting beams that stand for the one live beam (forks of it), and
    every hypothesis is made of allowed tokens."""
    from streamengine.sample.beam_search import BeamSearch, BeamSearchState
    from streamengine.sequence import Sequence

    state = BeamSearchState(width=3, prompt_len=1, max_length=10, stop_token_ids=frozenset({2}))
    seqs = iter(range(1, 10))
    beam = BeamSearch(state, Sequence(0, "r", [5], None, 0.0, group_size=3), num_results=3)

    def fork(parent: Sequence) -> Sequence:
        return Sequence(next(seqs), "r", [5], None, 0.0, token_ids=list(parent.token_ids), group_size=3)

    only_token_3 = torch.full((6,), float("-inf"))
    only_token_3[3] = 0.0
    beam.add_logprobs(beam.seqs[0], only_token_3)
    assert beam.advance(fork, drop=lambda seq: None) is None
    assert len(beam.seqs) == 3  # forks of the one live beam, not of beams that do not exist
    assert torch.isfinite(state.running_scores).tolist() == [True, True, True]  # dummies ~ -1e9
    only_eos = torch.full((3, 6), float("-inf"))
    only_eos[:, 2] = 0.0
    for seq, row in zip(beam.seqs, only_eos, strict=True):
        beam.add_logprobs(seq, row)
    results = beam.advance(fork, drop=lambda seq: None)
    assert results is not None
    finished = [r.token_ids for r in results if r.finish_reason == "stop"]
    assert finished and all(tokens == [3, 2] for tokens in finished)
