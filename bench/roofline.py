"""Decode throughput against this machine's roofline.

Measures, with the same torch thread count as the engine:

  matmul rate     best GFLOP/s of `torch.mm` on large square float32 matrices
  read bandwidth  best GB/s of `x.sum()` over a float32 tensor far larger than the caches
                  (the copy bandwidth, read + write, is reported beside it)

and derives the model's bounds for one decode step of B requests at context length L:

  bytes  = weight bytes read per step + B * L * KV bytes per token     (bandwidth term)
  flops  = B * (2 * matmul parameters + 4 * layers * heads * head_dim * L)  (compute term)
  bound  = max(bytes / bandwidth, flops / matmul rate) seconds per step

so batch 1 sits on the bandwidth bound (every weight streamed once per token) and large
batches on the compute bound; `roofline_tok_s` is the large-batch ceiling, matmul rate /
(2 * matmul parameters). Tied input/output embeddings count once (the output projection reads
them); an untied input table only serves row lookups and is left out.

The packed-weight bound is the same bandwidth term with the weights as a GGUF file stores them
(`--gguf`, default: the default model's file when `--model` is not given): each tensor's
blocks, e.g. Q4_1 20 bytes and Q8_0 34 bytes per 32 weights, read from the file's tensor types.
When EngineConfig has `weight_format`, batch 1 is also timed with `weight_format="packed"` on
that file, against this bound.

Then it drives `EngineCore` synchronously: B requests with short random prompts, greedy,
`ignore_eos`, steps until every request is past its prefill (a step that schedules exactly one
token for each of the B requests), a few warm-up decode steps, then K timed decode steps
(schedule + forward + sampling + postprocess: everything a step costs). Throughput is B * K /
elapsed; each batch size is reported as a fraction of its own bound and of the compute
ceiling.

    python bench/roofline.py --quick        # batch 1, 32, 128; < 3 min on a 2-core CPU
    python bench/roofline.py                # batch 1, 8, 32, 64, 128
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

import torch  # noqa: E402
from common import model_folder, quiet_transformers, software, write_report  # noqa: E402
from tqdm import tqdm  # noqa: E402
from traces import normal_token_ids  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FULL_BATCHES = (1, 8, 32, 64, 128)
QUICK_BATCHES = (1, 32, 128)
BLOCK_SIZE = 16


# -- the machine ----------------------------------------------------------------------------


@dataclass(slots=True)
class MachineRates:
    threads: int
    matmul_gflops: float
    matmul_n: int
    read_gb_s: float
    copy_gb_s: float  # (read + write) bytes / s of a tensor copy
    bandwidth_bytes: int


def _best_time(fn, reps: int) -> float:
    fn()  # warm-up: allocation, thread pool start
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul(n: int, reps: int) -> float:
    """Best fp32 GFLOP/s of an n x n by n x n product (2 n^3 FLOPs)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)  # [n, n]
    b = torch.randn(n, n, generator=gen)  # [n, n]
    out = torch.empty(n, n)
    seconds = _best_time(lambda: torch.mm(a, b, out=out), reps)
    return 2 * n**3 / seconds / 1e9


def measure_bandwidth(num_bytes: int, reps: int) -> tuple[float, float]:
    """Best read GB/s (a reduction touches every byte once) and copy GB/s (read + write)."""
    x = torch.ones(num_bytes // 4)  # [num_bytes / 4] fp32, far beyond the last-level cache
    read_s = _best_time(lambda: x.sum(), reps)
    y = torch.empty_like(x)
    copy_s = _best_time(lambda: y.copy_(x), reps)
    return num_bytes / read_s / 1e9, 2 * num_bytes / copy_s / 1e9


def measure_machine(threads: int, quick: bool, n: int, mib: int) -> MachineRates:
    num_bytes = mib * 2**20
    gflops = measure_matmul(n, reps=3 if quick else 5)
    read, copy = measure_bandwidth(num_bytes, reps=5 if quick else 10)
    return MachineRates(threads, gflops, n, read, copy, num_bytes)


# -- the model ------------------------------------------------------------------------------


@dataclass(slots=True)
class ModelCost:
    num_params: int  # unique parameters (tied embeddings once)
    matmul_params: int  # parameters a decode token multiplies with
    weight_bytes: int  # bytes of weights streamed per decode step
    flops_per_token: float  # 2 * matmul_params
    attn_flops_per_ctx_token: float  # QK^T and PV, all layers, per context token
    kv_bytes_per_token: int  # K and V of one token, all layers

    def step_bound_s(self, rates: MachineRates, batch: int, context: float) -> tuple[float, float]:
        """(bandwidth term, compute term) of one decode step, seconds."""
        num_bytes = self.weight_bytes + batch * context * self.kv_bytes_per_token
        flops = batch * (self.flops_per_token + context * self.attn_flops_per_ctx_token)
        return num_bytes / (rates.read_gb_s * 1e9), flops / (rates.matmul_gflops * 1e9)

    def bound_tok_s(self, rates: MachineRates, batch: int, context: float) -> float:
        return batch / max(self.step_bound_s(rates, batch, context))


def model_cost(model) -> ModelCost:
    cfg = model.config
    params = {p.data_ptr(): p for p in model.parameters()}  # tied weights share storage
    num_params = sum(p.numel() for p in params.values())
    itemsize = next(iter(params.values())).element_size()
    inp = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == inp.data_ptr()
    matmul_params = num_params if tied else num_params - inp.numel()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    layers = cfg.num_hidden_layers
    return ModelCost(
        num_params=num_params,
        matmul_params=matmul_params,
        weight_bytes=matmul_params * itemsize,
        flops_per_token=2.0 * matmul_params,
        attn_flops_per_ctx_token=4.0 * layers * heads * head_dim,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * itemsize,
    )


@dataclass(slots=True)
class PackedWeights:
    file: str
    weight_bytes: int  # bytes of GGUF blocks streamed per decode step
    bytes_by_type: dict[str, int]  # e.g. {"Q4_1": ..., "Q8_0": ..., "F32": ...}


def packed_weights(gguf_path: Path) -> PackedWeights:
    """Bytes one decode step streams when every weight stays in its GGUF block format.

    Same rule as model_cost: an untied token embedding only serves row lookups and is left
    out; tied (no output.weight tensor), it is the output projection and counts once.
    """
    from gguf import GGML_QUANT_SIZES, GGUFReader

    tensors = GGUFReader(gguf_path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    by_type: dict[str, int] = {}
    for t in tensors:
        if t.name == "token_embd.weight" and not tied:
            continue
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_elements) // block * type_size
    return PackedWeights(str(gguf_path), sum(by_type.values()), by_type)


# -- the engine -----------------------------------------------------------------------------


@dataclass(slots=True)
class DecodeResult:
    batch: int
    steps: int
    tok_s: float  # batch * steps / elapsed
    step_ms_mean: float
    step_ms_median: float
    step_ms_min: float
    mean_context: float  # average context length over the timed steps
    prefill_steps: int
    cpu_per_wall: float  # process CPU seconds / wall seconds while timed: ~threads when not contended
    step_ms: list[float] = field(default_factory=list)


def measure_decode(
    loaded, folder: Path, batch: int, prompt_len: int, warmup: int, steps: int, threads: int,
    token_ids: list[int], bar: tqdm, model_impl: str = "auto", attention_backend: str = "auto",
    weight_format: str | None = None,
) -> DecodeResult:
    """`weight_format` set: the engine loads `folder` (a GGUF file) itself with that format."""
    from streamengine import EngineConfig, SamplingParams
    from streamengine.engine.core import EngineCore

    max_tokens = warmup + steps + 2  # nobody finishes inside the timed window
    blocks = batch * math.ceil((prompt_len + max_tokens) / BLOCK_SIZE) + 4
    config = EngineConfig(
        model=str(folder), dtype="float32", device="cpu", block_size=BLOCK_SIZE,
        num_gpu_blocks=blocks, max_num_seqs=batch,
        max_num_batched_tokens=max(2048, prompt_len), enable_prefix_caching=False,
        num_threads=threads, seed=0, model_impl=model_impl, attention_backend=attention_backend,
        **({"weight_format": weight_format} if weight_format else {}),
    )
    core = EngineCore(config, None if weight_format else loaded)
    try:
        rng = random.Random(f"roofline:{batch}")
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        for i in range(batch):
            prompt = [token_ids[rng.randrange(len(token_ids))] for _ in range(prompt_len)]
            core.add_request(f"r{i}", prompt, params)
        prefill_steps = _run_until_decode(core, batch)
        for _ in range(warmup):
            _decode_step(core, batch)
        times = []
        cpu0 = time.process_time()
        for _ in range(steps):
            times.append(_decode_step(core, batch))
            bar.update(1)
        cpu = time.process_time() - cpu0
    finally:
        del core
        gc.collect()
    elapsed = sum(times)
    # Context grows by one per step: the timed window spans these lengths (prompt + outputs).
    first = prompt_len + 1 + warmup
    return DecodeResult(
        batch=batch, steps=steps, tok_s=batch * steps / elapsed,
        step_ms_mean=1e3 * elapsed / steps, step_ms_median=1e3 * statistics.median(times),
        step_ms_min=1e3 * min(times), mean_context=first + (steps - 1) / 2,
        prefill_steps=prefill_steps, cpu_per_wall=cpu / sum(times), step_ms=[round(1e3 * t, 3) for t in times],
    )


def _is_decode(plan, batch: int) -> bool:
    return len(plan.scheduled) == batch and all(s.num_new_tokens == 1 for s in plan.scheduled)


def _run_until_decode(core, batch: int, max_steps: int = 1000) -> int:
    """Steps until the next plan is pure decode for all `batch` requests; returns steps taken."""
    for taken in range(max_steps):
        step = core.schedule()
        if _is_decode(step.plan, batch):
            core.process(step, core.execute(step))
            return taken + 1
        if step.plan.is_empty:
            raise RuntimeError("engine ran out of work before reaching steady decode")
        core.process(step, core.execute(step))
    raise RuntimeError(f"no pure decode step within {max_steps} steps (prefill stuck?)")


def _decode_step(core, batch: int) -> float:
    start = time.perf_counter()
    step = core.schedule()
    if not _is_decode(step.plan, batch):
        raise RuntimeError(
            f"expected a decode step of {batch} tokens, got {step.plan.num_batched_tokens} tokens "
            f"for {len(step.plan.scheduled)} requests (preemption or early finish?)"
        )
    core.process(step, core.execute(step))
    return time.perf_counter() - start


# -- report ---------------------------------------------------------------------------------


def batch1_context(args) -> float:
    """Mean context of batch 1's timed steps (as measure_decode computes it)."""
    return args.prompt_len + 1 + args.warmup + (args.steps - 1) / 2


def packed_report(args, rates: MachineRates, cost: ModelCost, packed: PackedWeights,
                  measured: DecodeResult | None) -> dict:
    """Batch 1's bound with the weights streamed as GGUF blocks, and the packed engine against it."""
    packed_cost = replace(cost, weight_bytes=packed.weight_bytes)
    bw_s, compute_s = packed_cost.step_bound_s(rates, 1, batch1_context(args))
    bound_ms = 1e3 * max(bw_s, compute_s)
    return {
        "packed_weight_bytes": packed.weight_bytes,
        "packed_bytes_by_type": packed.bytes_by_type,
        "packed_gguf": packed.file,
        # Weights as blocks / read bandwidth alone; the bound is the larger of it and the compute term.
        "packed_bandwidth_bound_batch1_tok_s": 1 / bw_s,
        "packed_bound_batch1_tok_s": 1e3 / bound_ms,
        "packed_bound_term": "bandwidth" if bw_s >= compute_s else "compute",
        "batch1_packed_bound_ms": bound_ms,
        "packed_bandwidth_term_ms": 1e3 * bw_s,
        "packed_compute_term_ms": 1e3 * compute_s,
        "packed_decode": asdict(measured) if measured else None,
        "packed_decode_tok_s_batch1": measured.tok_s if measured else None,
        "batch1_packed_step_ms": measured.step_ms_median if measured else None,
        "batch1_packed_step_over_bound": measured.step_ms_median / bound_ms if measured else None,
    }


def build_report(args, folder: Path, rates: MachineRates, cost: ModelCost, results: list[DecodeResult]) -> dict:

    by_batch = {str(r.batch): r.tok_s for r in results}
    roofline = rates.matmul_gflops * 1e9 / cost.flops_per_token
    rows = {}
    for r in results:
        bw_s, compute_s = cost.step_bound_s(rates, r.batch, r.mean_context)
        bound = cost.bound_tok_s(rates, r.batch, r.mean_context)
        rows[str(r.batch)] = {
            **asdict(r),
            "bound_tok_s": bound,
            "bound_step_ms": 1e3 * max(bw_s, compute_s),
            "bandwidth_term_ms": 1e3 * bw_s,
            "compute_term_ms": 1e3 * compute_s,
            "fraction_of_bound": r.tok_s / bound,
            "fraction_of_compute_roofline": r.tok_s / roofline,
            # Diagnostic for a shared machine: throughput per CPU-second of this process against
            # the roofline per thread (the probes take the best run, the engine its average).
            "fraction_of_roofline_per_cpu_s": (r.tok_s / r.cpu_per_wall) / (roofline / rates.threads),
        }
    top = max(results, key=lambda r: r.batch)
    one = next((r for r in results if r.batch == 1), None)
    report = {
        "decode_tok_s_by_batch": by_batch,
        "roofline_tok_s": roofline,
        "efficiency_at_max_batch": top.tok_s / roofline,
        "max_batch": top.batch,
        "batch1_step_ms": one.step_ms_median if one else None,
        "batch1_bound_ms": rows["1"]["bound_step_ms"] if one else None,
        "batch1_step_over_bound": one.step_ms_median / rows["1"]["bound_step_ms"] if one else None,
        "bandwidth_bound_batch1_tok_s": 1e3 / rows["1"]["bound_step_ms"] if one else None,
        "machine": asdict(rates),
        "model": {**asdict(cost), "folder": str(folder)},
        "batches": rows,
        "config": {
            "quick": args.quick,
            "prompt_len": args.prompt_len,
            "steps": args.steps,
            "warmup_steps": args.warmup,
            "threads": args.threads,
            "model_impl": args.model_impl,
            "attention_backend": args.attention_backend,
            "gguf": str(args.gguf) if args.gguf else None,
            **software(),
        },
    }
    return report


def print_table(report: dict) -> None:
    m, c = report["machine"], report["model"]
    load = report["config"]["load_avg"][0]
    if load > report["config"]["threads"] + 0.5:
        print(f"warning: load average {load:.1f} on {os.cpu_count()} CPUs: other work skews these numbers")
    print(
        f"machine: fp32 matmul {m['matmul_gflops']:.1f} GFLOP/s (n={m['matmul_n']}), read "
        f"{m['read_gb_s']:.1f} GB/s, copy {m['copy_gb_s']:.1f} GB/s, {m['threads']} threads"
    )
    print(
        f"model: {c['num_params'] / 1e6:.1f}M params, {c['weight_bytes'] / 1e6:.0f} MB weights/step, "
        f"{c['flops_per_token'] / 1e9:.3f} GFLOP/token, KV {c['kv_bytes_per_token'] / 1024:.1f} KiB/token"
    )
    head = (f"{'batch':>5} {'tok/s':>9} {'step ms':>9} {'bound ms':>9} {'bound tok/s':>11} {'of bound':>9} "
            f"{'of roof':>8} {'cpu/wall':>8}")
    print(head)
    print("-" * len(head))
    for b, r in report["batches"].items():
        print(
            f"{b:>5} {r['tok_s']:>9.1f} {r['step_ms_median']:>9.1f} {r['bound_step_ms']:>9.1f} "
            f"{r['bound_tok_s']:>11.1f} {r['fraction_of_bound']:>9.0%} {r['fraction_of_compute_roofline']:>8.0%} "
            f"{r['cpu_per_wall']:>8.2f}"
        )
    print(
        f"compute roofline {report['roofline_tok_s']:.0f} tok/s; at batch {report['max_batch']}: "
        f"{report['efficiency_at_max_batch']:.0%} of it (goal >= 60%)"
    )
    if report["batch1_step_ms"] is not None:
        print(
            f"batch 1: step {report['batch1_step_ms']:.1f} ms vs bound {report['batch1_bound_ms']:.1f} ms "
            f"= {report['batch1_step_over_bound']:.2f}x (goal <= 1.3x)"
        )
    if report.get("packed_weight_bytes"):
        print_packed(report)


def print_packed(report: dict) -> None:
    kinds = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in report["packed_bytes_by_type"].items())
    print(
        f"packed weights (GGUF blocks): {report['packed_weight_bytes'] / 1e6:.1f} MB/step ({kinds}); batch-1 bound "
        f"{report['batch1_packed_bound_ms']:.2f} ms = {report['packed_bound_batch1_tok_s']:.0f} tok/s, the "
        f"{report['packed_bound_term']} term (bandwidth alone {report['packed_bandwidth_bound_batch1_tok_s']:.0f} tok/s; "
        f"float32 weights: {report['bandwidth_bound_batch1_tok_s'] or float('nan'):.0f} tok/s)"
    )
    if report["packed_decode_tok_s_batch1"] is not None:
        print(
            f"batch 1, weight_format=packed: {report['packed_decode_tok_s_batch1']:.1f} tok/s, step "
            f"{report['batch1_packed_step_ms']:.1f} ms = {report['batch1_packed_step_over_bound']:.2f}x the packed "
            f"bound (goal <= 1.3x)"
        )


def write_png(report: dict, path: Path) -> None:
    from common import pyplot, save_figure

    plt = pyplot()

    rows = report["batches"]
    batches = [int(b) for b in rows]
    measured = [rows[b]["tok_s"] for b in rows]
    m = report["machine"]
    c = report["model"]
    xs = sorted({*batches, *[2**i for i in range(int(math.log2(max(batches))) + 2)]})
    # Roofline at the context of the largest measured batch (the curve barely moves with it).
    ctx = rows[str(max(batches))]["mean_context"]
    bw = [b * m["read_gb_s"] * 1e9 / (c["weight_bytes"] + b * ctx * c["kv_bytes_per_token"]) for b in xs]
    compute = [m["matmul_gflops"] * 1e9 / (c["flops_per_token"] + ctx * c["attn_flops_per_ctx_token"])] * len(xs)
    roof = [min(a, b) for a, b in zip(bw, compute, strict=True)]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(xs, roof, color="#555", lw=2, label="roofline min(bandwidth, compute)")
    ax.plot(xs, bw, color="#999", ls=":", lw=1, label=f"bandwidth bound ({m['read_gb_s']:.0f} GB/s)")
    ax.axhline(report["roofline_tok_s"], color="#999", ls="--", lw=1,
               label=f"compute bound ({m['matmul_gflops']:.0f} GFLOP/s)")
    ax.plot(batches, measured, "o-", color="#2b7bba", label="streamengine decode")
    if report.get("packed_weight_bytes"):
        _plot_packed(ax, report, xs, ctx)
    for b, y in zip(batches, measured, strict=True):
        ax.annotate(f"{rows[str(b)]['fraction_of_bound']:.0%}", (b, y), textcoords="offset points",
                    xytext=(4, -12), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch size (requests)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Steady decode vs roofline (CPU, float32 activations)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, path)


def _plot_packed(ax, report: dict, xs: list[int], ctx: float) -> None:
    """The bandwidth bound with GGUF-block weights, and the packed engine's batch-1 point."""
    m, c = report["machine"], report["model"]
    bw = [b * m["read_gb_s"] * 1e9 / (report["packed_weight_bytes"] + b * ctx * c["kv_bytes_per_token"]) for b in xs]
    ax.plot(xs, bw, color="#d08a1c", ls=":", lw=1, label="bandwidth bound, packed GGUF weights")
    if report["packed_decode_tok_s_batch1"] is not None:
        ax.plot([1], [report["packed_decode_tok_s_batch1"]], "s", color="#d08a1c", label="weight_format=packed")


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="batch 1, 32, 128 and fewer steps (< 3 min)")
    p.add_argument("--model", help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batches", help="comma-separated batch sizes (default: by mode)")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    p.add_argument("--steps", type=int, help="timed decode steps per batch size (default 8 quick, 32 full)")
    p.add_argument("--warmup", type=int, help="untimed decode steps first (default 2 quick, 4 full)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (engine and probes)")
    p.add_argument("--matmul-n", type=int, help="square matmul size of the FLOP probe (default 2048 quick, 3072)")
    p.add_argument("--bandwidth-mib", type=int, help="tensor size of the bandwidth probe (default 256 quick, 512)")
    p.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"])
    p.add_argument("--compare-transformers", action="store_true",
                   help="also time each batch with model_impl=transformers, attention_backend=torch")
    p.add_argument("--gguf", type=Path,
                   help="GGUF file of the packed-weight bound (default: the default model's, when --model is not given)")
    p.add_argument("--no-packed-decode", action="store_true", help="skip timing batch 1 with weight_format=packed")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "roofline.json")
    p.add_argument("--png", type=Path, default=None, help="the plot (default: beside --json, same name)")
    p.add_argument("--no-png", action="store_true")
    args = p.parse_args(argv)
    args.png = args.png or args.json.with_suffix(".png")  # never over a committed plot
    try:
        batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    except ValueError:
        p.error("--batches must be comma-separated integers")
    args.batches = sorted(set(batches or (QUICK_BATCHES if args.quick else FULL_BATCHES)))
    args.steps = args.steps if args.steps is not None else (8 if args.quick else 32)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 4)
    if args.matmul_n is None:
        args.matmul_n = 2048 if args.quick else 3072
    if args.bandwidth_mib is None:
        args.bandwidth_mib = 256 if args.quick else 512
    if min(args.batches) < 1:
        p.error("--batches must all be >= 1")
    for name in ("prompt_len", "steps", "threads", "matmul_n", "bandwidth_mib"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.gguf is None and args.model is None:
        args.gguf = default_gguf()
    if args.gguf is not None and not args.gguf.is_file():
        p.error(f"--gguf: no such file {args.gguf}")
    return args


def default_gguf() -> Path | None:
    from streamengine.models.loader import resolve_default_model

    try:
        path = resolve_default_model()
    except FileNotFoundError:
        return None
    return path if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_transformers()
    from streamengine.models import load_model

    folder = model_folder(args.model)
    print("measuring matmul rate and memory bandwidth ...", file=sys.stderr)
    rates = measure_machine(args.threads, args.quick, args.matmul_n, args.bandwidth_mib)
    loaded = load_model(str(folder), "float32", "cpu")
    cost = model_cost(loaded.model)
    token_ids = normal_token_ids(loaded.tokenizer, loaded.model.config.vocab_size)
    results, baseline = [], {}
    total = args.steps * len(args.batches) * (2 if args.compare_transformers else 1)
    with tqdm(total=total, desc="decode steps", unit="step", file=sys.stderr, dynamic_ncols=True) as bar:
        for batch in args.batches:
            bar.set_postfix(batch=batch)
            results.append(measure_decode(
                loaded, folder, batch, args.prompt_len, args.warmup, args.steps, args.threads, token_ids, bar,
                args.model_impl, args.attention_backend,
            ))
            if args.compare_transformers:  # the same batch right after, so both see the same machine
                bar.set_postfix(batch=batch, path="transformers")
                baseline[str(batch)] = measure_decode(
                    loaded, folder, batch, args.prompt_len, args.warmup, args.steps, args.threads, token_ids,
                    bar, "transformers", "torch",
                ).tok_s
    report = build_report(args, folder, rates, cost, results)
    if args.gguf is not None:
        packed = None
        if not args.no_packed_decode:
            with tqdm(total=args.steps, desc="decode steps, packed", unit="step", file=sys.stderr) as bar:
                packed = measure_decode(loaded, args.gguf, 1, args.prompt_len, args.warmup, args.steps, args.threads,
                                        token_ids, bar, args.model_impl, args.attention_backend, "packed")
        report.update(packed_report(args, rates, cost, packed_weights(args.gguf), packed))
    if baseline:
        report["transformers_modules_tok_s_by_batch"] = baseline
    print_table(report)
    for b, tok_s in baseline.items():
        ours = report["decode_tok_s_by_batch"][b]
        print(f"batch {b}: transformers' modules + PyTorch attention {tok_s:.1f} tok/s; this engine {ours / tok_s:.2f}x")
    write_report(report, args.json, None if args.no_png else args.png, write_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
