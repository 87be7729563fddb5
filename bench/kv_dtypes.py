"""KV-cache element types side by side: what a byte budget holds, and what a narrower cache
costs in output quality. Used by bench/memory.py (capacity) and bench/throughput.py
(`--kv-quality`).

Capacity: the engine's own pool sizing (streamengine.kv.spec.plan_kv_cache) for each
`kv_cache_dtype` at the same `kv_cache_bytes`: blocks, tokens, and tokens per float16 token.

Quality, against the float32 cache on the same weights (greedy, fixed prompts):
  greedy_agreement    generated positions that equal the float32 cache's, counted up to each
                      request's first difference (after it the two contexts differ): strict.
  forced_agreement    teacher-forced: over the float32 cache's generated text, the positions
                      whose most likely next token is the same (each position sees the same
                      context, so one flip does not decide the rest).
  perplexity          of that generated text under each cache, from prompt logprobs
                      (SamplingParams.prompt_logprobs), and its change vs float32 in percent.
"""

from __future__ import annotations

import math
from pathlib import Path

KV_DTYPES = ("float32", "float16", "fp8", "fp8_e5m2")
QUALITY_DTYPES = ("float16", "fp8", "fp8_e5m2")
QUALITY_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain how a bicycle works.",
    "List three prime numbers and explain why they are prime.",
    "Once upon a time in a small village,",
    "def fibonacci(n):",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
)


def capacity(model_config, budget_bytes: int, block_size: int = 16) -> dict[str, dict]:
    """Per kv_cache_dtype: bytes per token, blocks and tokens at `budget_bytes`, and tokens
    relative to a float16 cache's."""
    from streamengine import EngineConfig
    from streamengine.kv.spec import plan_kv_cache

    out = {}
    for name in KV_DTYPES:
        spec = plan_kv_cache(EngineConfig(kv_cache_bytes=budget_bytes, kv_cache_dtype=name, block_size=block_size),
                             model_config)
        out[name] = {"bytes_per_token": spec.bytes_per_block // block_size, "num_blocks": spec.num_blocks,
                     "tokens": spec.num_blocks * block_size}
    for row in out.values():
        row["tokens_vs_float16"] = row["tokens"] / out["float16"]["tokens"]
    return out


def quality(folder: Path, max_tokens: int = 48, dtypes: tuple[str, ...] = QUALITY_DTYPES) -> dict:
    """Greedy and teacher-forced agreement with the float32 cache, and the perplexity change,
    for each of `dtypes` (one model load; each cache type gets its own engine core)."""
    from streamengine import EngineConfig, SamplingParams
    from streamengine.engine.core import EngineCore

    def core(kv_dtype: str, loaded=None) -> EngineCore:
        config = EngineConfig(model=str(folder), num_gpu_blocks=256, kv_cache_dtype=kv_dtype, seed=0)
        return EngineCore(config, loaded=loaded)

    base = core("auto")
    prompts = [base.intake.prompt_ids(p) for p in QUALITY_PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in _run(base, prompts, greedy)]
    texts = [p + r for p, r in zip(prompts, reference, strict=True)]
    ref_top, ref_lp = _scored(base, texts, [len(p) for p in prompts])
    result = {"prompts": len(prompts), "generated_tokens_each": max_tokens,
              "float32_perplexity": _perplexity(ref_lp), "cache_types": {}}
    for name in dtypes:
        other = core(name, base.loaded)
        tokens = [o.outputs[0].token_ids for o in _run(other, prompts, greedy)]
        top, lp = _scored(other, texts, [len(p) for p in prompts])
        ppl = _perplexity(lp)
        result["cache_types"][name] = {
            "greedy_agreement": _first_difference_agreement(tokens, reference),
            "forced_agreement": sum(a == b for a, b in zip(top, ref_top, strict=True)) / len(top),
            "perplexity": ppl,
            "perplexity_change_pct": 100.0 * (ppl / result["float32_perplexity"] - 1.0),
        }
    return result


def _run(core, prompts: list[list[int]], params) -> list:
    """Each prompt's final output, stepping the core until all finished."""
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
    final = {}
    while core.has_work():
        final.update((o.request_id, o) for o in core.step() if o.finished)
    return [final[str(i)] for i in range(len(prompts))]


def _scored(core, texts: list[list[int]], starts: list[int]) -> tuple[list[int], list[float]]:
    """Teacher-forced over each text from its `start`: the top token at every position and the
    logprob of the text's own token there (prompt logprobs, top 1)."""
    from streamengine import SamplingParams

    outs = _run(core, texts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    top, logprobs = [], []
    for out, ids, start in zip(outs, texts, starts, strict=True):
        for i in range(start, len(ids)):
            entry = out.prompt_logprobs[i]
            top.append(max(entry, key=entry.get))
            logprobs.append(entry[ids[i]])
    return top, logprobs


def _perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def _first_difference_agreement(runs: list[list[int]], reference: list[list[int]]) -> float:
    same = total = 0
    for run, ref in zip(runs, reference, strict=True):
        same += next((i for i, (a, b) in enumerate(zip(run, ref, strict=True)) if a != b), len(ref))
        total += len(ref)
    return same / total


def print_quality(q: dict) -> None:
    print(f"\nKV cache quality vs float32 ({q['prompts']} prompts x {q['generated_tokens_each']} greedy tokens; "
          f"float32 perplexity {q['float32_perplexity']:.3f}):")
    print(f"  {'cache':<10} {'greedy agree':>12} {'forced agree':>12} {'ppl':>8} {'ppl change':>10}")
    for name, r in q["cache_types"].items():
        print(f"  {name:<10} {r['greedy_agreement']:>12.3f} {r['forced_agreement']:>12.3f} "
              f"{r['perplexity']:>8.3f} {r['perplexity_change_pct']:>+9.2f}%")
