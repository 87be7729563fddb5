"""The cost of constrained decoding: decode tok/s with and without a JSON schema, and compile time.

Throughput: at each batch size (`--batches`, default 1 and 64) the same `batch` chat prompts are
submitted at once to one AsyncEngine, twice per repeat, interleaved:

  unconstrained   SamplingParams(temperature=0, max_tokens=M, ignore_eos=True)
  constrained     the same, with structured=JsonSchema(BENCH_SCHEMA)

A constrained sample ends when its schema completes, and an unconstrained one when its model
says so: left alone, the two would do different work (fewer rows per step as constrained rows
finish). So BENCH_SCHEMA is an array of exactly 64 small objects, which no output completes
within `max_tokens`, and the unconstrained run ignores EOS: every sample of both generates
exactly M tokens (the script checks), and tok/s = generated tokens / wall time from submission
to the last token compares the same batches step for step. The overhead is the ratio
unconstrained tok/s / constrained tok/s (median over `--repeats`; goal <= 1.10 at batch 64).
Before the clock runs, each batch's prompts are computed once (both modes then find them in
the prefix cache alike) and the schema is compiled (cached: its compile is measured below).

Compile time: each of the 20 JSON schemas of tests/structured_schemas.py compiled by a fresh
GrammarCompiler (no cache) per round, `--compile-rounds` rounds; p50 / p99 in milliseconds.
The first compile of a fresh compiler also builds llguidance's view of the tokenizer, once per
engine: it is done before timing and reported apart as `tokenizer_init_ms`.

    python bench/structured.py --quick     # < 3 min on a 2-core CPU
    python bench/structured.py             # longer outputs, more repeats
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

import numpy as np  # noqa: E402
from common import load_bench_model, software, write_report  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SCHEMAS_FILE = Path(__file__).resolve().parents[1] / "tests" / "structured_schemas.py"
MODES = ("unconstrained", "constrained")
GOAL_OVERHEAD_BATCH64 = 1.10  # the most unconstrained / constrained tok/s may be at batch 64
ITEM = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# Every item takes several tokens, so 64 of them outlast any max_tokens this script runs with.
BENCH_SCHEMA = {"type": "array", "items": ITEM, "minItems": 64, "maxItems": 64}
TOPICS = ("people in a club", "players of a team", "guests at a party", "students in a class",
          "members of a choir", "workers in a shop", "runners in a race", "authors at a fair")


def load_test_schemas() -> list[dict]:
    """The 20 schemas of tests/structured_schemas.py (a file of data, loaded by path)."""
    spec = importlib.util.spec_from_file_location("structured_schemas", SCHEMAS_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its slotted dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return [case.schema for case in module.SCHEMAS]


def chat_prompts(engine, batch: int) -> list[str]:
    return [engine.apply_chat_template([{"role": "user", "content": f"List the {TOPICS[i % len(TOPICS)]} "
                                         f"number {i} with their ages, as JSON."}]) for i in range(batch)]


def params_for(mode: str, max_tokens: int):
    from streamengine import SamplingParams
    from streamengine.structured.params import JsonSchema

    structured = JsonSchema(schema=BENCH_SCHEMA) if mode == "constrained" else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=mode == "unconstrained",
                          structured=structured)


async def final_output(engine, prompt: str, params) -> tuple[int, str]:
    final = None
    async for out in engine.generate(prompt, params):
        final = out
    sample = final.outputs[0]
    return len(sample.token_ids), sample.finish_reason


async def timed_run(engine, prompts: list[str], mode: str, max_tokens: int) -> dict:
    """All `prompts` at once in `mode`; raises unless every sample generated `max_tokens`."""
    params = params_for(mode, max_tokens)
    began = time.perf_counter()
    results = await asyncio.gather(*(final_output(engine, p, params) for p in prompts))
    wall = time.perf_counter() - began
    bad = [r for r in results if r != (max_tokens, "length")]
    if bad:
        raise RuntimeError(f"{mode}: {len(bad)} samples did not generate exactly {max_tokens} tokens: {bad[:3]}")
    tokens = sum(n for n, _ in results)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


async def throughput(engine, args) -> dict[str, dict]:
    by_batch = {}
    for batch in args.batches:
        prompts = chat_prompts(engine, batch)
        for mode in MODES:  # untimed: the prompts into the prefix cache, the schema into its cache
            await timed_run(engine, prompts, mode, 2)
        runs = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                runs[mode].append(await timed_run(engine, prompts, mode, args.max_tokens))
        by_batch[str(batch)] = summarize_batch(runs)
        print(f"batch {batch}: {by_batch[str(batch)]['overhead']:.3f}x", file=sys.stderr)
    return by_batch


def summarize_batch(runs: dict[str, list[dict]]) -> dict:
    tok_s = {mode: statistics.median(r["tok_s"] for r in runs[mode]) for mode in MODES}
    return {
        "unconstrained_tok_s": tok_s["unconstrained"],
        "constrained_tok_s": tok_s["constrained"],
        "overhead": tok_s["unconstrained"] / tok_s["constrained"],
        "runs": runs,
    }


def compile_times(tokenizer, vocab_size: int, schemas: list[dict], rounds: int) -> dict:
    from streamengine.structured.compiler import GrammarCompiler
    from streamengine.structured.params import JsonSchema, Regex

    times_ms, init_ms = [], []
    for _ in range(rounds):
        compiler = GrammarCompiler(tokenizer, vocab_size, timeout_s=60.0, cache_bytes=256 * 2**20)
        began = time.perf_counter()
        compiler.compile(Regex(pattern="x"))  # builds llguidance's tokenizer: once per engine
        init_ms.append(1e3 * (time.perf_counter() - began))
        for schema in schemas:
            began = time.perf_counter()
            compiler.compile(JsonSchema(schema=schema))
            times_ms.append(1e3 * (time.perf_counter() - began))
        compiler.shutdown()
    return {
        "compile_ms_p50": float(np.percentile(times_ms, 50)),
        "compile_ms_p99": float(np.percentile(times_ms, 99)),
        "compile_ms_max": max(times_ms),
        "num_compiles": len(times_ms),
        "tokenizer_init_ms": statistics.median(init_ms),
    }


def build_report(args, by_batch: dict[str, dict], compiles: dict) -> dict:
    def overhead(batch: int) -> float | None:
        return by_batch[str(batch)]["overhead"] if str(batch) in by_batch else None

    value = overhead(64)
    report = {
        "overhead_batch1": overhead(1),
        "overhead_batch64": value,
        **compiles,
        "goals": {"overhead_batch64": {"target": f"<= {GOAL_OVERHEAD_BATCH64:g}", "value": value,
                                       "met": value is not None and value <= GOAL_OVERHEAD_BATCH64}},
        "by_batch": by_batch,
        "bench_schema": BENCH_SCHEMA,
        "config": {"model": str(args.folder), **{k: getattr(args, k) for k in (
            "quick", "batches", "max_tokens", "repeats", "compile_rounds", "threads", "device")}, **software()},
    }
    report["all_goals_met"] = all(g["met"] for g in report["goals"].values())
    return report


def print_table(report: dict) -> None:
    c = report["config"]
    print(f"decode tok/s, {c['max_tokens']} tokens per sample, median of {c['repeats']}, {c['threads']} thread(s)")
    head = f"{'batch':>6} {'unconstrained':>14} {'constrained':>12} {'overhead':>9}"
    print(head)
    print("-" * len(head))
    for batch, b in report["by_batch"].items():
        print(f"{batch:>6} {b['unconstrained_tok_s']:14.1f} {b['constrained_tok_s']:12.1f} {b['overhead']:8.3f}x")
    print(f"compile, {report['num_compiles']} compiles of the test schemas: p50 {report['compile_ms_p50']:.2f} ms, "
          f"p99 {report['compile_ms_p99']:.2f} ms, max {report['compile_ms_max']:.2f} ms "
          f"(tokenizer init {report['tokenizer_init_ms']:.0f} ms, once per engine)")
    for key, g in report["goals"].items():
        value = "-" if g["value"] is None else f"{g['value']:.3f}"
        print(f"goal {key} {value} {g['target']}: {'met' if g['met'] else 'NOT met'}")


def write_png(report: dict, path: Path) -> None:
    from common import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    batches = list(report["by_batch"])
    xs = np.arange(len(batches))
    for i, mode in enumerate(MODES):
        ax.bar(xs + 0.4 * i, [report["by_batch"][b][f"{mode}_tok_s"] for b in batches], 0.4, label=mode)
    ax.set_xticks(xs + 0.2, [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tok/s")
    ax.set_title("JSON-schema constrained vs unconstrained decoding")
    ax.legend()
    save_figure(fig, path)


QUICK = {"max_tokens": 32, "repeats": 3, "compile_rounds": 5}
FULL = {"max_tokens": 64, "repeats": 5, "compile_rounds": 20}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="32 tokens per sample, 3 repeats, 5 compile rounds")
    p.add_argument("--model", help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="torch device of the engine")
    p.add_argument("--batches", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--max-tokens", type=int, help="tokens per sample (32 quick, 64 full)")
    p.add_argument("--repeats", type=int, help="timed runs per batch and mode (3 quick, 5 full)")
    p.add_argument("--compile-rounds", type=int, help="fresh compilers, each compiling every test schema")
    # One thread by default: on a machine shared with other busy processes two OpenMP threads on
    # two cores wait for each other at every parallel region (bench/README.md, throughput.py).
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    p.add_argument("--no-png", action="store_true")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if not args.batches or min(args.batches) < 1:
        p.error("--batches must name batch sizes >= 1")
    if min(args.max_tokens, args.repeats, args.compile_rounds, args.threads) < 1:
        p.error("--max-tokens, --repeats, --compile-rounds and --threads must be >= 1")
    suffix = "_quick" if args.quick else ""
    args.json = args.json or RESULTS_DIR / f"structured{suffix}.json"
    args.png = args.png or args.json.with_suffix(".png")
    return args


async def run_engine(loaded, args) -> dict[str, dict]:
    from streamengine import AsyncEngine, EngineConfig

    config = EngineConfig(model=str(args.folder), device=args.device, num_threads=args.threads,
                          max_num_seqs=max(args.batches))
    async with AsyncEngine(config, loaded=loaded) as engine:
        return await throughput(engine, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loaded = load_bench_model(args)
    by_batch = asyncio.run(run_engine(loaded, args))
    compiles = compile_times(loaded.tokenizer, loaded.model.config.vocab_size, load_test_schemas(), args.compile_rounds)
    report = build_report(args, by_batch, compiles)
    print_table(report)
    write_report(report, args.json, None if args.no_png else args.png, write_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
