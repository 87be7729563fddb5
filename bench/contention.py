"""Decode throughput on a CPU shared with a busy process, beside the same run on a quiet CPU.

An embedded engine always shares its CPU with the host application. This bench runs batch-1
and batch-16 greedy decode of the default model for each system, once quiet and once with one
competitor process spinning on a core (`python -c "while True: pass"`), and reports tokens/s
and the ratio contended / quiet. Each system runs in its own process (no thread settings carry
over), quiet and contended runs of one system back to back.

Systems:
- engine: the default configuration (the thread count follows the CPU available);
- engine_1t, engine_2t: the engine with its thread count fixed at 1 and at 2;
- hf: transformers' `generate` on the same weights (float32), torch's default threads.

    python bench/contention.py --quick          # under 3 minutes: 16 tokens a request
    python bench/contention.py                  # longer windows, steadier figures

JSON keys: per system and batch `tok_s_quiet`, `tok_s_contended`, `kept` (contended / quiet);
`engine_kept_b1`, `engine_kept_b16` (the goal: at least 0.45), `engine_vs_1t_contended_b1`,
`engine_vs_1t_contended_b16` (the goal: at least 1.0, never slower than one thread),
`engine_vs_hf_contended_b1`, `engine_vs_hf_contended_b16`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, save_figure, software, write_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("engine", "engine_1t", "engine_2t", "hf")
BATCHES = (1, 16)
PROMPT = "Write a long story about a lighthouse keeper and the sea."
COMPETITOR = "while True: pass"


# ---- workers (one process per system) -------------------------------------------------------


def engine_worker(threads: int | None, batches: list[int], seconds: float, max_tokens: int) -> dict:
    from streamengine import AsyncEngine, EngineConfig, SamplingParams

    async def run() -> dict:
        async with AsyncEngine(EngineConfig(num_threads=threads, seed=0)) as engine:
            prompt = engine.apply_chat_template([{"role": "user", "content": PROMPT}])
            params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)

            async def one(tag: str) -> int:
                last = None
                async for out in engine.generate(prompt, params, request_id=tag):
                    last = out
                return len(last.outputs[0].token_ids)

            rounds = itertools.count()

            async def round_(batch: int) -> int:
                tag = f"r{next(rounds)}"
                return sum(await asyncio.gather(*(one(f"{tag}-{i}") for i in range(batch))))

            await round_(2)  # warmup
            return {str(b): await _timed(functools.partial(round_, b), seconds) for b in batches}

    return asyncio.run(run())


async def _timed(round_, seconds: float) -> float:
    """Tokens per second over whole rounds, run until `seconds` have passed."""
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += await round_()
    return tokens / (time.perf_counter() - start)


def hf_worker(batches: list[int], seconds: float, max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamengine.models.loader import default_model_folder

    folder = default_model_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                         add_generation_prompt=True)

    def round_(batch: int) -> int:
        inputs = tokenizer([text] * batch, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=tokenizer.eos_token_id)
        return batch * (out.shape[1] - inputs["input_ids"].shape[1])

    async def timed_round(batch: int) -> int:
        return round_(batch)

    round_(2)  # warmup
    return {str(b): asyncio.run(_timed(functools.partial(timed_round, b), seconds)) for b in batches}


def worker_main(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker == "hf":
        result = hf_worker(batches, args.seconds, args.max_tokens)
    else:
        threads = {"engine": None, "engine_1t": 1, "engine_2t": 2}[args.worker]
        result = engine_worker(threads, batches, args.seconds, args.max_tokens)
    print(json.dumps(result))
    return 0


# ---- the driver ------------------------------------------------------------------------------


@contextlib.contextmanager
def competitor(on: bool):
    """One process spinning on a core while the block runs (nothing when `on` is False)."""
    proc = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if on else None
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def run_system(system: str, args: argparse.Namespace, contended: bool) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--worker", system, "--batches", ",".join(map(str, BATCHES)),
           "--seconds", str(args.seconds), "--max-tokens", str(args.max_tokens)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with competitor(contended):
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_report(results: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> dict:
    systems = {}
    for system, runs in results.items():
        systems[system] = {
            f"b{b}": {
                "tok_s_quiet": runs["quiet"][str(b)],
                "tok_s_contended": runs["contended"][str(b)],
                "kept": runs["contended"][str(b)] / runs["quiet"][str(b)],
            }
            for b in BATCHES
        }
    report: dict = {"quick": args.quick, "seconds_per_batch": args.seconds, "max_tokens": args.max_tokens,
                    "competitor": COMPETITOR, "systems": systems, "software": software()}
    engine = systems.get("engine")
    for b in BATCHES:
        if engine is None:
            break
        report[f"engine_kept_b{b}"] = engine[f"b{b}"]["kept"]
        for peer, key in (("engine_1t", "1t"), ("hf", "hf"), ("engine_2t", "2t")):
            if peer in systems:
                report[f"engine_vs_{key}_contended_b{b}"] = (
                    engine[f"b{b}"]["tok_s_contended"] / systems[peer][f"b{b}"]["tok_s_contended"])
    return report


def print_table(report: dict) -> None:
    print(f"{'system':<10} {'batch':>5} {'quiet tok/s':>12} {'contended':>10} {'kept':>6}")
    for system, rows in report["systems"].items():
        for batch, row in rows.items():
            print(f"{system:<10} {batch:>5} {row['tok_s_quiet']:>12.1f} {row['tok_s_contended']:>10.1f} "
                  f"{row['kept']:>6.2f}")
    for key, value in report.items():
        if key.startswith("engine_") and isinstance(value, float):
            print(f"{key}: {value:.2f}")


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(BATCHES), figsize=(5 * len(BATCHES), 3.6))
    for ax, b in zip(axes, BATCHES, strict=True):
        names = list(report["systems"])
        quiet = [report["systems"][n][f"b{b}"]["tok_s_quiet"] for n in names]
        busy = [report["systems"][n][f"b{b}"]["tok_s_contended"] for n in names]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], quiet, 0.4, label="quiet")
        ax.bar([i + 0.2 for i in x], busy, 0.4, label="one busy competitor")
        ax.set_xticks(list(x), names)
        ax.set_title(f"batch {b} decode")
        ax.set_ylabel("tokens/s")
    axes[-1].legend(loc="upper right")
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short windows: under 3 minutes")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--seconds", type=float, default=None, help="timed decode per batch size and run")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--worker", choices=SYSTEMS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--batches", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.seconds = args.seconds if args.seconds is not None else (2.0 if args.quick else 8.0)
    # A round runs whole, and the slowest contended rounds (2 fixed threads, transformers) decode
    # a few tokens a second: --quick keeps them short
    args.max_tokens = args.max_tokens if args.max_tokens is not None else (16 if args.quick else 96)
    suffix = "_quick" if args.quick else ""
    args.json = args.json or RESULTS / f"contention{suffix}.json"
    args.png = args.png or args.json.with_suffix(".png")
    args.systems = [s for s in args.systems.split(",") if s]
    if any(s not in SYSTEMS for s in args.systems):
        p.error(f"--systems must name some of {', '.join(SYSTEMS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for system in args.systems:
        results[system] = {"quiet": run_system(system, args, False),
                           "contended": run_system(system, args, True)}
        print(f"{system}: {results[system]}", file=sys.stderr)
    report = build_report(results, args)
    print_table(report)
    write_report(report, args.json, args.png, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
