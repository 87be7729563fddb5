"""Weight precisions for float checkpoints, in one process on the default model's float32
weights (the converted folder):

  float32    as loaded (`weight_format="dequantized"`: float32 panels)
  int8       every weight matrix quantized to Q8_0 at load (`weight_format="int8"`; not exact)
  bfloat16   the same weights rounded to bfloat16 values first (standing in for a bfloat16
             checkpoint), which `"auto"` keeps as bfloat16 (exact), against the float32
             panels of those same values

Reports the int8 mode's greedy agreement with float32 over a set of prompts (the share of the
float model's tokens it reproduces before its first different token, and how many whole
outputs are identical), and batch-1 decode speed of each.

    python bench/precisions.py --json bench/results/precisions.json
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from common import default_model_folder, quiet_transformers, software, write_report

TOPICS = ["the sea", "a lighthouse", "prime numbers", "the French revolution", "photosynthesis", "a chess opening",
          "black holes", "bread baking", "the Roman empire", "machine learning", "volcanoes", "jazz music",
          "the moon landing", "honey bees", "sorting algorithms", "the water cycle"]


async def greedy(engine, prompt: str, max_tokens: int, ignore_eos: bool = False) -> tuple[list[int], list[float]]:
    from streamengine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    tokens, times = [], []
    async for out in engine.generate(prompt, params):
        tokens = out.outputs[0].token_ids
        times.append(time.perf_counter())
    return tokens, times


async def measure(weight_format: str, loaded, args) -> dict:
    from streamengine import AsyncEngine, EngineConfig

    config = EngineConfig(num_threads=args.threads, weight_format=weight_format, enable_prefix_caching=False)
    async with AsyncEngine(config, loaded=loaded) as engine:
        prompts = [engine.apply_chat_template([{"role": "user", "content": f"Tell me about {t}."}]) for t in TOPICS]
        outputs = [(await greedy(engine, p, args.max_tokens))[0] for p in prompts]
        speeds = []
        for _ in range(args.reps):
            _, times = await greedy(engine, prompts[0], args.decode_tokens + 1, ignore_eos=True)
            speeds.append(args.decode_tokens / (times[-1] - times[0]))
        return {"weight_format": engine.weight_format, "outputs": outputs, "b1_tok_s": max(speeds)}


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Share of the reference's tokens reproduced before the first different one, and whole
    outputs identical."""
    matched = sum(next((i for i, (a, b) in enumerate(zip(r, o, strict=False)) if a != b), min(len(r), len(o)))
                  for r, o in zip(reference, other, strict=True))
    return {"prefix_agreement": matched / sum(len(r) for r in reference),
            "identical_outputs": sum(r == o for r, o in zip(reference, other, strict=True)),
            "num_prompts": len(reference)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--decode-tokens", type=int, default=128, help="batch-1 decode steps timed")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    import torch

    from streamengine.models import load_model

    torch.set_num_threads(args.threads)
    quiet_transformers()
    loaded = load_model(str(default_model_folder()), "float32", "cpu")
    exact = asyncio.run(measure("dequantized", loaded, args))
    int8 = asyncio.run(measure("int8", loaded, args))
    loaded.model.to(torch.bfloat16).to(torch.float32)  # now a bfloat16 checkpoint's values
    halves = asyncio.run(measure("auto", loaded, args))
    halves_float32 = asyncio.run(measure("dequantized", loaded, args))
    report = {**agreement(exact["outputs"], int8["outputs"]), "float_b1_tok_s": exact["b1_tok_s"],
              "int8_b1_tok_s": int8["b1_tok_s"], "bf16_weight_format": halves["weight_format"],
              "bf16_b1_tok_s": halves["b1_tok_s"], "bf16_as_float32_b1_tok_s": halves_float32["b1_tok_s"],
              "bf16_identical_to_float32": halves["outputs"] == halves_float32["outputs"],
              "max_tokens": args.max_tokens, "threads": args.threads, "software": software()}
    print(f"int8: greedy agreement {report['prefix_agreement']:.1%} of the float model's tokens, "
          f"{report['identical_outputs']}/{report['num_prompts']} outputs identical; batch-1 decode "
          f"float32 {exact['b1_tok_s']:.1f} tok/s, int8 {int8['b1_tok_s']:.1f} tok/s; bfloat16 values: kept as "
          f"{halves['weight_format']} {halves['b1_tok_s']:.1f} tok/s vs float32 panels "
          f"{halves_float32['b1_tok_s']:.1f} tok/s, outputs identical: {report['bf16_identical_to_float32']}")
    if args.json:
        write_report(report, Path(args.json), None, lambda *_: None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
