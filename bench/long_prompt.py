"""One long prompt next to a decoding stream: how long the stream waits between two tokens
while the prompt prefills, for several `max_prefill_chunk` values, and the prompt's TTFT.

Per chunk value a fresh `AsyncEngine` (same loaded weights, same KV budget) runs:

  1. a decode stream: a short prompt, greedy, `ignore_eos`, more tokens than the run needs;
  2. once it has produced `--warmup` tokens, one long prompt of `--prompt-len` random ordinary
     tokens (`max_tokens=1`);
  3. the decode stream's inter-token gaps: the times between its successive outputs (each
     brings at least one new token) from the long prompt's submission until the long prompt's
     first token. `gap_first` is the first step with the prompt in it (least context),
     `gap_last` the last one (the whole prompt as context): their ratio shows how much one
     step's time grows with the context its prefill tokens attend to.

TTFT is the long prompt's submission to its first output. "none" runs without a chunk cap:
each step takes up to `max_num_batched_tokens` prompt tokens.

    python bench/long_prompt.py --quick        # 2,000-token prompt, chunks none/256 (~1 min)
    python bench/long_prompt.py                # 8,000-token prompt, chunks none/256/128/64/32 (~15 min)
    python bench/long_prompt.py --chunks none,256 --prompt-len 8191 --json /tmp/lp.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

import torch  # noqa: E402
from common import model_folder, quiet_transformers, software  # noqa: E402
from traces import normal_token_ids  # noqa: E402

from streamengine import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from streamengine.models import load_model  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FULL_CHUNKS = "none,256,128,64,32"
QUICK_CHUNKS = "none,256"
END_SLACK_S = 0.01


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (exact for the max at q = 100; few samples stay honest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


async def decode_stream(engine: AsyncEngine, arrivals: list[tuple[float, int]], stop: asyncio.Event) -> None:
    """Records (time, tokens so far) of each output of a greedy stream until `stop` is set."""
    params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    async for out in engine.generate("Write a very long story about a lighthouse keeper.", params):
        arrivals.append((time.perf_counter(), len(out.outputs[0].token_ids)))
        if stop.is_set():
            return


async def one_run(engine: AsyncEngine, prompt: list[int], warmup: int) -> dict:
    arrivals: list[tuple[float, int]] = []
    stop = asyncio.Event()
    stream = asyncio.create_task(decode_stream(engine, arrivals, stop))
    while not arrivals or arrivals[-1][1] < warmup:
        await asyncio.sleep(0.005)
    submitted = time.perf_counter()
    async for _ in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=1)):
        break
    ttft = time.perf_counter() - submitted
    stop.set()
    await stream
    return summarize(arrivals, submitted, submitted + ttft, ttft)


def summarize(arrivals: list[tuple[float, int]], start: float, end: float, ttft: float) -> dict:
    """The decode stream's gaps between consecutive outputs, for the outputs that arrived
    after the long prompt's submission (`start`) up to the first one at or after its first
    token (`end`): what a client of the decode stream saw while the prompt prefilled."""
    times = [t for t, _ in arrivals]
    first = next(i for i, t in enumerate(times) if t > start)  # >= 1: warm-up tokens came before
    # The step that gives the prompt its first token also gives the stream a token; the two
    # consumers record their times in either order, well within END_SLACK_S of each other.
    last = next((i for i, t in enumerate(times) if t >= end - END_SLACK_S), len(times) - 1)
    gaps = [times[i] - times[i - 1] for i in range(first, last + 1)]
    # gaps[0] usually ends the step that was in flight at submission, without prompt tokens.
    prompt_steps = gaps[1:] or gaps
    return {
        "ttft_s": ttft,
        "num_gaps": len(gaps),
        "gap_max_ms": max(gaps) * 1e3,
        "gap_p99_ms": percentile(gaps, 99) * 1e3,
        "gap_p50_ms": statistics.median(gaps) * 1e3,
        "gap_first_ms": prompt_steps[0] * 1e3,
        "gap_last_ms": prompt_steps[-1] * 1e3,
        "decode_tokens_during_prefill": arrivals[last][1] - arrivals[first - 1][1],
        "gaps_ms": [round(g * 1e3, 1) for g in gaps],
    }


async def run_chunk(loaded, args, chunk: int | None, prompt: list[int]) -> dict:
    config = EngineConfig(
        model=str(args.model_folder), max_prefill_chunk=chunk, num_threads=args.threads,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_bytes=args.kv_cache_bytes,
    )
    async with AsyncEngine(config, loaded=loaded) as engine:
        await one_run(engine, prompt[-64:], warmup=2)  # warm up; no prefix of the prompt: no cache hit
        result = await one_run(engine, prompt, args.warmup)
    gc.collect()
    return {"max_prefill_chunk": chunk, **result}


def print_table(rows: list[dict], args) -> None:
    print(f"\nlong prompt: {args.prompt_len} tokens, max_num_batched_tokens {args.max_num_batched_tokens}, "
          f"threads {args.threads}")
    head = f"{'chunk':>6} {'TTFT s':>8} {'gaps':>5} {'max ms':>8} {'p99 ms':>8} {'p50 ms':>8} {'first ms':>9} {'last ms':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        chunk = "none" if r["max_prefill_chunk"] is None else r["max_prefill_chunk"]
        print(f"{chunk!s:>6} {r['ttft_s']:8.2f} {r['num_gaps']:5d} {r['gap_max_ms']:8.0f} {r['gap_p99_ms']:8.0f} "
              f"{r['gap_p50_ms']:8.0f} {r['gap_first_ms']:9.0f} {r['gap_last_ms']:8.0f}")


def parse_chunks(text: str) -> list[int | None]:
    return [None if c.strip() == "none" else int(c) for c in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"--prompt-len 2000 --chunks {QUICK_CHUNKS}")
    p.add_argument("--model", help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompt-len", type=int, help="long prompt tokens (default 8000, quick 2000)")
    p.add_argument("--chunks", help=f"comma-separated max_prefill_chunk values, 'none' = no cap (default {FULL_CHUNKS})")
    p.add_argument("--warmup", type=int, default=4, help="decode tokens before the long prompt arrives")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="default: the engine's (512 MiB)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "long_prompt.json")
    args = p.parse_args()
    args.prompt_len = args.prompt_len or (2000 if args.quick else 8000)
    chunks = parse_chunks(args.chunks or (QUICK_CHUNKS if args.quick else FULL_CHUNKS))
    args.model_folder = model_folder(args.model)
    quiet_transformers()
    torch.set_num_threads(args.threads)
    loaded = load_model(str(args.model_folder), "float32", "cpu")
    ids = normal_token_ids(loaded.tokenizer, loaded.model.config.vocab_size)
    rows = []
    for k, chunk in enumerate(chunks):
        rng = random.Random(args.seed * 1000 + k)  # a fresh prompt per run: no prefix-cache hits
        prompt = [rng.choice(ids) for _ in range(args.prompt_len)]
        rows.append(asyncio.run(run_chunk(loaded, args, chunk, prompt)))
        print(f"chunk {chunk}: TTFT {rows[-1]['ttft_s']:.1f} s, max gap {rows[-1]['gap_max_ms']:.0f} ms", flush=True)
    print_table(rows, args)
    report = {
        "prompt_len": args.prompt_len, "max_num_batched_tokens": args.max_num_batched_tokens,
        "threads": args.threads, "model": str(args.model_folder), "results": rows, "software": software(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
