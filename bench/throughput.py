"""Offline throughput at equal KV budget: streamengine vs transformers `generate` vs `generate_batch`.

One seeded synthetic trace (ShareGPT-like and/or Alpaca-like, see bench/traces.py) runs through:

  engine          AsyncEngine with `kv_cache_bytes=B`; every request submitted at once with
                  SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len).
  hf_generate     `model.generate` on static batches in arrival order, left-padded to the batch's
                  longest prompt, greedy with min_new_tokens = max_new_tokens = the batch's longest
                  output. A contiguous cache reserves max-length per sequence, so the batch size is
                  B // (KV bytes per token * (prompt cap + output cap of the trace, as scaled)):
                  it must reserve before it knows an answer's length. Only each request's own
                  output length counts as useful tokens.
  hf_generate_batch  transformers continuous batching (the ContinuousBatchingManager that
                  `generate_batch` drives), page_size = the engine's block size, `num_blocks` set so
                  its cache holds B bytes, the engine's token and sequence budgets. `generate_batch`
                  itself takes one max_new_tokens for all requests, so its manager is driven
                  directly to give each request its own max_new_tokens (EOS disabled).
  engine_kv16     (opt in with --systems) the engine with kv_cache_dtype="float16": the same B
                  bytes hold twice the tokens, and attention reads half the bytes per token.
  engine_kv8      (opt in) kv_cache_dtype="fp8" (e4m3, per-layer scales): four times float32's
                  tokens in B, twice float16's. `--kv-quality` adds what the narrower caches cost
                  in output quality (bench/kv_dtypes.py: greedy agreement with the float32 cache,
                  perplexity change) to the JSON.

Same weights (float32, CPU), same torch thread count. Each system is warmed up on a tiny input
first; only generation is timed (from the first submission to the last finished request), never
loading. Prints a table, writes JSON (--json) and a bar chart (--png).

    python bench/throughput.py --quick                       # < 3 min on a 2-core CPU
    python bench/throughput.py --trace sharegpt --num-requests 128   # full ShareGPT-like run
    python bench/throughput.py --trace sharegpt --systems engine,engine_kv16   # KV cache dtypes
    python bench/throughput.py --quick --systems engine,engine_kv16,engine_kv8 --kv-quality
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

import torch  # noqa: E402
from common import model_folder, quiet_transformers  # noqa: E402
from tqdm import tqdm  # noqa: E402
from traces import TRACES, TraceRequest, make_trace, normal_token_ids, summarize  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SYSTEMS = ("engine", "hf_generate", "hf_generate_batch", "engine_kv16", "engine_kv8")
DEFAULT_SYSTEMS = SYSTEMS[:3]
BASELINES = ("hf_generate", "hf_generate_batch")
LABELS = {
    "engine": "streamengine",
    "hf_generate": "HF generate (static)",
    "hf_generate_batch": "HF generate_batch (CB)",
    # Opt in (--systems ...,engine_kv16): the same engine with kv_cache_dtype="float16", so the
    # same KV bytes hold twice the tokens; its greedy tokens may differ from float32's.
    "engine_kv16": "streamengine, float16 KV",
    "engine_kv8": "streamengine, fp8 KV",
}
# Default KV budget in tokens of the model (scaled with the trace lengths). For SmolLM2-135M in
# float32 (45 KiB/token) this is ~1.05 GiB at full scale; at max-length reservation it holds a
# dozen ShareGPT sequences, while paging fits every live token of ~70 average ones.
DEFAULT_BUDGET_TOKENS = 24576
# (num_requests, length scale). Quick runs a prefix of the same seeded trace with every length
# (and the KV budget) scaled, so static batches keep the same size as at full scale.
QUICK = {"sharegpt": (24, 0.2), "alpaca": (24, 0.5)}
FULL = {"sharegpt": (128, 1.0), "alpaca": (256, 1.0)}
BLOCK_SIZE = 16
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(slots=True)
class SystemResult:
    system: str
    num_requests: int
    elapsed_s: float
    useful_output_tokens: int  # sum of each request's own output length
    generated_tokens: int  # what the system actually computed (padding included)
    details: dict = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tok_s(self) -> float:
        return self.useful_output_tokens / self.elapsed_s

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(requests_per_s=self.requests_per_s, output_tok_s=self.output_tok_s)
        return out


@dataclass(slots=True)
class Setup:
    folder: Path
    threads: int
    kv_bytes_per_token: int
    token_ids: list[int]
    eos_token_id: int
    pad_token_id: int


# -- setup ----------------------------------------------------------------------------------


def kv_bytes_per_token(config, dtype: torch.dtype = torch.float32) -> int:
    """K and V of one token over all layers: what a KV cache of any layout stores per token."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def make_setup(model: str | None, threads: int) -> Setup:
    from transformers import AutoConfig, AutoTokenizer

    folder = model_folder(model)
    config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return Setup(
        folder=folder,
        threads=threads,
        kv_bytes_per_token=kv_bytes_per_token(config),
        token_ids=normal_token_ids(tokenizer, config.vocab_size),
        eos_token_id=eos,
        pad_token_id=pad,
    )


def load_hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model


def warmup_trace(setup: Setup) -> list[TraceRequest]:
    ids = setup.token_ids
    return [TraceRequest(ids[:8], 4), TraceRequest(ids[8:13], 3)]


def progress(desc: str, total: int) -> tqdm:
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)


# -- system 1: this engine ------------------------------------------------------------------


def run_engine(
    setup: Setup, trace: list[TraceRequest], budget: int, name: str, system: str = "engine",
    kv_cache_dtype: str = "auto",
) -> SystemResult:
    from streamengine import AsyncEngine, EngineConfig

    config = EngineConfig(
        model=str(setup.folder),
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_bytes=budget,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        num_threads=setup.threads,
        seed=0,
    )
    engine = AsyncEngine(config)
    try:
        return asyncio.run(_engine_session(engine, setup, trace, name, system))
    finally:
        del engine
        gc.collect()


async def _engine_session(
    engine, setup: Setup, trace: list[TraceRequest], name: str, system: str
) -> SystemResult:
    async with engine:
        await _engine_batch(engine, warmup_trace(setup), None, "warmup")
        stats0 = engine.stats()
        peak = {"running": 0}
        watcher = asyncio.create_task(_watch_running(engine, peak))
        with progress(f"{name}: {system}", len(trace)) as bar:
            start = time.perf_counter()
            generated = await _engine_batch(engine, trace, bar, "r")
            elapsed = time.perf_counter() - start
        watcher.cancel()
        stats = engine.stats()
    return SystemResult(
        system,
        len(trace),
        elapsed,
        sum(r.output_len for r in trace),
        generated,
        {
            "num_total_blocks": stats["num_total_blocks"],
            "kv_capacity_tokens": stats["num_total_blocks"] * engine.config.block_size,
            "peak_running": peak["running"],
            "num_preemptions": stats["num_preemptions"] - stats0["num_preemptions"],
            "max_num_seqs": engine.config.max_num_seqs,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        },
    )


async def _engine_batch(engine, trace: list[TraceRequest], bar: tqdm | None, prefix: str) -> int:
    from streamengine import SamplingParams

    async def one(i: int, req: TraceRequest) -> int:
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=req.output_len)
        last = None
        async for out in engine.generate(req.prompt_token_ids, params, request_id=f"{prefix}{i}"):
            last = out
        if bar is not None:
            bar.update(1)
        return len(last.outputs[0].token_ids)

    counts = await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
    for req, n in zip(trace, counts, strict=True):
        if n != req.output_len:
            raise RuntimeError(f"engine produced {n} tokens for a request of {req.output_len}")
    return sum(counts)


async def _watch_running(engine, peak: dict[str, int]) -> None:
    while True:
        peak["running"] = max(peak["running"], engine.stats()["num_running"])
        await asyncio.sleep(0.05)


# -- system 2: transformers generate with static batches ------------------------------------


def static_batch_size(setup: Setup, reserve: int, budget: int) -> int:
    """How many sequences a contiguous cache fits in `budget` when each reserves `reserve`
    tokens: the longest request the workload admits (prompt cap + output cap), since a
    contiguous system must reserve before it knows how long an answer will be."""
    return max(1, budget // (setup.kv_bytes_per_token * reserve))


def reserve_tokens(name: str, scale: float, max_len: int | None) -> int:
    """Max-length reservation for a trace: its prompt and output length caps, as scaled."""
    cap = max(1, round(TRACES[name].max_len * scale))
    return 2 * (min(cap, max_len) if max_len else cap)


def run_hf_generate(
    setup: Setup, trace: list[TraceRequest], budget: int, name: str, reserve: int = 0
) -> SystemResult:
    model = load_hf_model(setup.folder)
    if not reserve:  # no cap given: the trace's own longest prompt + longest output
        reserve = max(len(r.prompt_token_ids) for r in trace) + max(r.output_len for r in trace)
    batch_size = static_batch_size(setup, reserve, budget)
    try:
        _hf_generate_batch(model, setup, warmup_trace(setup))
        generated = 0
        with progress(f"{name}: hf generate", len(trace)) as bar:
            start = time.perf_counter()
            for i in range(0, len(trace), batch_size):
                batch = trace[i : i + batch_size]
                generated += _hf_generate_batch(model, setup, batch)
                bar.update(len(batch))
            elapsed = time.perf_counter() - start
    finally:
        del model
        gc.collect()
    return SystemResult(
        "hf_generate",
        len(trace),
        elapsed,
        sum(r.output_len for r in trace),
        generated,
        {
            "batch_size": batch_size,
            "num_batches": -(-len(trace) // batch_size),
            "reserved_tokens_per_seq": reserve,
        },
    )


def _hf_generate_batch(model, setup: Setup, batch: list[TraceRequest]) -> int:
    """One padded static batch; returns the tokens generated (every row runs to the longest)."""
    from transformers import GenerationConfig

    width = max(len(r.prompt_token_ids) for r in batch)
    new = max(r.output_len for r in batch)
    input_ids = torch.full((len(batch), width), setup.pad_token_id, dtype=torch.long)  # [B, width]
    mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, width]
    for row, req in enumerate(batch):  # left padding: the last prompt token sits at the end
        n = len(req.prompt_token_ids)
        input_ids[row, width - n :] = torch.tensor(req.prompt_token_ids)
        mask[row, width - n :] = 1
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        eos_token_id=setup.eos_token_id,
        pad_token_id=setup.pad_token_id,
    )
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
    got = out.shape[1] - width
    if got != new:
        raise RuntimeError(f"generate produced {got} new tokens, expected {new}")
    return got * len(batch)


# -- system 3: transformers continuous batching ----------------------------------------------


def cb_config(setup: Setup, budget: int):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    num_blocks = max(1, budget // (setup.kv_bytes_per_token * BLOCK_SIZE))  # whole-model pages
    return ContinuousBatchingConfig(
        page_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_batch_tokens=MAX_NUM_BATCHED_TOKENS,
        max_requests_per_batch=MAX_NUM_SEQS,
    )


def run_hf_generate_batch(
    setup: Setup, trace: list[TraceRequest], budget: int, name: str
) -> SystemResult:
    from transformers import GenerationConfig

    model = load_hf_model(setup.folder)
    # EOS -1: no stop token, each request runs exactly to its own max_new_tokens (like ignore_eos).
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=1, eos_token_id=-1, pad_token_id=setup.pad_token_id
    )
    cfg = cb_config(setup, budget)
    try:
        with (
            torch.inference_mode(),
            model.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cfg, block=True, timeout=30
            ) as manager,
        ):
            _cb_run(manager, warmup_trace(setup), None, "warmup")
            with progress(f"{name}: hf generate_batch", len(trace)) as bar:
                start = time.perf_counter()
                generated = _cb_run(manager, trace, bar, "r")
                elapsed = time.perf_counter() - start
            cache = manager.batch_processor.cache if manager.batch_processor is not None else None
            details = {
                "page_size": cfg.page_size,
                "num_blocks_requested": cfg.num_blocks,
                "kv_capacity_tokens": cache.num_blocks * cfg.page_size
                if cache is not None
                else None,
                "max_batch_tokens": cfg.max_batch_tokens,
                "max_requests_per_batch": cfg.max_requests_per_batch,
                "per_request_max_new_tokens": True,
            }
    finally:
        del model
        gc.collect()
    return SystemResult(
        "hf_generate_batch",
        len(trace),
        elapsed,
        sum(r.output_len for r in trace),
        generated,
        details,
    )


def _cb_run(manager, trace: list[TraceRequest], bar: tqdm | None, prefix: str) -> int:
    wanted = {}
    for i, req in enumerate(trace):
        rid = manager.add_request(
            list(req.prompt_token_ids),
            request_id=f"{prefix}{i}",
            max_new_tokens=req.output_len,
            eos_token_id=-1,
        )
        if rid is None:
            raise RuntimeError("continuous batching manager refused a request")
        wanted[rid] = req.output_len
    generated = 0
    pending = set(wanted)
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers continuous batching thread died")
            continue
        if result.request_id not in pending or not result.is_finished():
            continue
        if result.error is not None:
            raise RuntimeError(f"generate_batch request {result.request_id} failed: {result.error}")
        n = len(result.generated_tokens)
        if n != wanted[result.request_id]:
            raise RuntimeError(
                f"generate_batch produced {n} tokens, expected {wanted[result.request_id]}"
            )
        generated += n
        pending.discard(result.request_id)
        if bar is not None:
            bar.update(1)
    return generated


RUNNERS = {
    "engine": run_engine,
    "hf_generate": run_hf_generate,
    "hf_generate_batch": run_hf_generate_batch,
    "engine_kv16": functools.partial(run_engine, system="engine_kv16", kv_cache_dtype="float16"),
    "engine_kv8": functools.partial(run_engine, system="engine_kv8", kv_cache_dtype="fp8"),
}


# -- reporting ------------------------------------------------------------------------------


def run_trace(setup: Setup, args: argparse.Namespace, name: str) -> dict:
    default_n, default_scale = (QUICK if args.quick else FULL)[name]
    num = args.num_requests or default_n
    scale = args.scale if args.scale is not None else default_scale
    trace = make_trace(
        TRACES[name], num, setup.token_ids, seed=args.seed, scale=scale, max_len=args.max_len
    )
    budget = args.kv_cache_bytes or setup.kv_bytes_per_token * max(
        1, round(DEFAULT_BUDGET_TOKENS * scale)
    )
    reserve = reserve_tokens(name, scale, args.max_len)
    results = {
        s: RUNNERS[s](setup, trace, budget, name, reserve=reserve) if s == "hf_generate"
        else RUNNERS[s](setup, trace, budget, name)
        for s in args.systems
    }
    return {
        "trace": summarize(trace),
        "scale": scale,
        "seed": args.seed,
        "kv_cache_bytes": budget,
        "kv_budget_tokens": budget // setup.kv_bytes_per_token,
        "systems": {s: r.to_json() for s, r in results.items()},
    }


def speedups(report: dict) -> dict[str, float]:
    systems = report["systems"]
    if "engine" not in systems:
        return {}
    ours = systems["engine"]["output_tok_s"]
    ratios = {f"engine_vs_{s}": ours / r["output_tok_s"] for s, r in systems.items() if s in BASELINES}
    for narrow in ("engine_kv16", "engine_kv8"):
        if narrow in systems:
            ratios[f"{narrow}_vs_engine"] = systems[narrow]["output_tok_s"] / ours
    if "engine_kv8" in systems and "engine_kv16" in systems:
        ratios["engine_kv8_vs_engine_kv16"] = systems["engine_kv8"]["output_tok_s"] / systems["engine_kv16"]["output_tok_s"]
    return ratios


def print_table(reports: dict[str, dict]) -> None:
    head = (
        f"{'trace':<9} {'system':<24} {'req/s':>8} {'out tok/s':>10} {'engine x':>9} {'time s':>8}"
    )
    print(head)
    print("-" * len(head))
    for name, rep in reports.items():
        sys_ = rep["systems"]
        ours = sys_["engine"]["output_tok_s"] if "engine" in sys_ else None
        for s, r in sys_.items():
            ratio = f"{ours / r['output_tok_s']:.2f}" if ours else "-"
            print(
                f"{name:<9} {LABELS[s]:<24} {r['requests_per_s']:>8.3f} {r['output_tok_s']:>10.1f} "
                f"{ratio:>9} {r['elapsed_s']:>8.1f}"
            )
        t = rep["trace"]
        print(
            f"{'':<9} {t['num_requests']} requests, prompt mean {t['prompt_mean']:.0f} (max {t['prompt_max']}), "
            f"output mean {t['output_mean']:.0f} (max {t['output_max']}), KV budget "
            f"{rep['kv_cache_bytes'] / 2**20:.0f} MiB = {rep['kv_budget_tokens']} tokens"
        )


def write_png(reports: dict[str, dict], path: Path) -> None:
    from common import pyplot, save_figure

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(3.2 + 2.6 * len(reports), 4.2))
    shown = [s for s in SYSTEMS if any(s in rep["systems"] for rep in reports.values())]
    width = 0.8 / len(shown)
    colors = {"engine": "#2b7bba", "hf_generate": "#e08a2c", "hf_generate_batch": "#7a9e3a", "engine_kv16": "#17476e",
              "engine_kv8": "#0b2540"}
    for j, s in enumerate(shown):
        xs, ys = [], []
        for i, rep in enumerate(reports.values()):
            if s in rep["systems"]:
                xs.append(i + (j - (len(shown) - 1) / 2) * width)
                ys.append(rep["systems"][s]["output_tok_s"])
        bars = ax.bar(xs, ys, width, label=LABELS[s], color=colors[s])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(reports)), [_xlabel(n, r) for n, r in reports.items()])
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # headroom for the legend above the bars
    ax.set_ylabel("useful output tokens / s")
    ax.set_title("Throughput at equal KV budget (CPU, float32)")
    ax.legend(fontsize=8, loc="upper center", ncols=len(shown))
    save_figure(fig, path)


def _xlabel(name: str, rep: dict) -> str:
    ratios = ", ".join(f"{v:.1f}x" for v in speedups(rep).values())
    return f"{name}\n(engine: {ratios})" if ratios else name


def build_json(reports: dict[str, dict], setup: Setup, args: argparse.Namespace) -> dict:
    import transformers

    primary = reports.get("sharegpt") or next(iter(reports.values()))
    top = {
        f"{s}_tok_s": primary["systems"][s]["output_tok_s"]
        for s in SYSTEMS
        if s in primary["systems"]
    }
    return {
        **top,
        "primary_trace": "sharegpt" if "sharegpt" in reports else next(iter(reports)),
        "speedups": speedups(primary),
        "traces": {name: {**rep, "speedups": speedups(rep)} for name, rep in reports.items()},
        "config": {
            "model": str(setup.folder),
            "quick": args.quick,
            "threads": setup.threads,
            "kv_bytes_per_token": setup.kv_bytes_per_token,
            "block_size": BLOCK_SIZE,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_average_at_end": os.getloadavg()[0],
        },
    }


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="24 requests per trace, lengths scaled (< 3 min)"
    )
    p.add_argument("--trace", choices=("sharegpt", "alpaca", "both"), default="both")
    p.add_argument("--model", help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests", type=int, help="requests per trace (default: by mode)")
    p.add_argument("--scale", type=float, help="multiply every drawn length (default: by mode)")
    p.add_argument("--max-len", type=int, help="cap on each prompt and each output length")
    p.add_argument("--kv-cache-bytes", type=int, help="KV budget B shared by all systems")
    p.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help="comma-separated subset of " + ",".join(SYSTEMS),
    )
    p.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads for every system",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-quality", action="store_true",
                   help="also measure greedy agreement and perplexity of float16/fp8 caches vs float32 (kv_dtypes.py)")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "throughput.json")
    p.add_argument("--png", type=Path, default=None, help="the plot (default: beside --json, same name)")
    args = p.parse_args(argv)
    args.png = args.png or args.json.with_suffix(".png")  # never over a committed plot
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad or not args.systems:
        p.error(f"--systems must name some of {', '.join(SYSTEMS)}; got {bad or 'nothing'}")
    for name in ("num_requests", "max_len", "kv_cache_bytes", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.scale is not None and not args.scale > 0:
        p.error("--scale must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_transformers()
    setup = make_setup(args.model, args.threads)
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1) - 0.5:
        print(
            f"warning: load average {load:.1f} on {os.cpu_count()} CPUs: other processes compete; "
            "with more than one torch thread every matmul may wait a scheduler slice (try --threads 1)",
            file=sys.stderr,
        )
    names = ["sharegpt", "alpaca"] if args.trace == "both" else [args.trace]
    reports = {name: run_trace(setup, args, name) for name in names}
    print_table(reports)
    data = build_json(reports, setup, args)
    if args.kv_quality:
        import kv_dtypes

        data["kv_quality"] = kv_dtypes.quality(setup.folder)
        kv_dtypes.print_quality(data["kv_quality"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    write_png(reports, args.png)
    print(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
