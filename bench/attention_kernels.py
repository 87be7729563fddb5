"""Paged attention kernel benchmark: the Triton kernels on CUDA; the C++ prefill kernel on CPU.

For a grid of batch x context x head configurations it times the Triton `paged_attention`
over a paged cache with shuffled physical blocks, next to torch SDPA over contiguous K/V of
the same sizes (the cost paging is measured against), and checks that both agree.

    python bench/attention_kernels.py [--quick] [--json bench/results/kernels_gpu.json] [--dtype bf16]

Decode: every request has one new token and `context` cached tokens. Prefill: every request
processes `context` new tokens causally. Bandwidth = bytes of K and V read (each request's
context once) / time; prefill also reports TFLOP/s of the causal QK^T and PV matmuls.
Without CUDA it prints "bench/attention_kernels.py needs CUDA" and exits with status 2 (nothing measured,
so a calling script can tell a skipped run from a successful one).

CPU prefill (`--cpu-prefill`, no CUDA needed): the C++ paged prefill kernel
(kernels/cpu_prefill_attention.py, all prefill rows of a step in one call) against the path it
replaced, SDPA per request (models/torch_backend.prefill_row: torch's flash CPU kernel over the
K/V gathered from the cache), on SmolLM2-135M's heads (9/3/64), a float32 cache in 16-token
blocks. A prompt is prefilled whole or in chunks, every chunk timed (median of --iters) and
summed; one more case prefills several prompts in one step.

    python bench/attention_kernels.py --cpu-prefill [--threads 2] [--json bench/results/kernels_cpu_prefill.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

EXIT_NO_CUDA = 2
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (num_heads, num_kv_heads, head_dim): SmolLM2-135M, a Llama-3-8B layer, a multi-head layer.
HEADS = [(9, 3, 64), (32, 8, 128), (32, 32, 128)]


@dataclass(slots=True)
class Case:
    kind: str  # "decode" | "prefill"
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(slots=True)
class Row:
    kind: str
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_bytes: int
    paged_ms: float  # one call as a caller sees it: launch overhead included
    sdpa_ms: float
    paged_gpu_ms: float | None  # device time alone: calls replayed from a CUDA graph
    sdpa_gpu_ms: float | None
    paged_host_us: float | None  # host time to issue one call (the launch overhead)
    sdpa_host_us: float | None
    paged_gbps: float
    sdpa_gbps: float
    paged_tflops: float | None
    sdpa_tflops: float | None
    paged_over_sdpa: float  # time ratio: > 1 means paged is slower
    max_abs_diff: float


def cases(quick: bool) -> list[Case]:
    heads = HEADS[:2] if quick else HEADS
    decode_batches = [1, 32] if quick else [1, 8, 32, 128]
    decode_contexts = [512, 4096] if quick else [512, 2048, 8192]
    prefill = (
        [(1, 2048), (4, 512)] if quick else [(1, 512), (1, 2048), (1, 8192), (4, 512), (4, 2048)]
    )
    out = [
        Case("decode", b, c, h, kv, d)
        for h, kv, d in heads
        for b in decode_batches
        for c in decode_contexts
    ]
    out += [Case("prefill", b, c, h, kv, d) for h, kv, d in heads for b, c in prefill]
    if quick:  # one case each large enough for the device time to dwarf the launch
        out += [Case("decode", 128, 4096, *HEADS[1]), Case("prefill", 1, 8192, *HEADS[1])]
    return out


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of fn in milliseconds (CUDA events on CUDA)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def graph_ms(fn: Callable[[], object], calls: int = 20, replays: int = 5) -> float | None:
    """Device time of one call alone: `calls` calls captured in a CUDA graph, whose replay
    issues them without the host, timed with events (median of `replays`) and divided."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up on the capture stream (allocator, autotuning)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as err:  # an op that cannot be captured: report no device time
        print(f"  (not capturable: {err})")
        return None
    graph.replay()
    return time_ms(graph.replay, torch.device("cuda"), 1, replays) / calls


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host time to issue one call, back to back (the queue hides the device time, as long as
    each call's device time is the shorter)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def build_inputs(case: Case, dtype: torch.dtype, device: torch.device, block_size: int) -> dict:
    """Contiguous K/V [batch, kv_heads, context, head_dim] and the same data in a paged pool."""
    gen = torch.Generator(device=device).manual_seed(0)
    b, ctx, h, kv, d = case.batch, case.context, case.num_heads, case.num_kv_heads, case.head_dim
    q_len = 1 if case.kind == "decode" else ctx
    k = torch.randn(b, kv, ctx, d, generator=gen, device=device, dtype=dtype)
    v = torch.randn(b, kv, ctx, d, generator=gen, device=device, dtype=dtype)
    q = torch.randn(b, h, q_len, d, generator=gen, device=device, dtype=dtype)
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = b * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen, device=device)  # scattered blocks
    block_tables = perm.view(b, blocks_per_seq).to(torch.int32)
    padded = blocks_per_seq * block_size
    key_cache = torch.empty(num_blocks, block_size, kv, d, device=device, dtype=dtype)
    value_cache = torch.empty_like(key_cache)
    # [b, ctx, kv, d] padded to whole blocks, then written block by block into the pool
    k_tok = F.pad(k.transpose(1, 2), (0, 0, 0, 0, 0, padded - ctx))
    v_tok = F.pad(v.transpose(1, 2), (0, 0, 0, 0, 0, padded - ctx))
    key_cache[perm] = k_tok.reshape(num_blocks, block_size, kv, d)
    value_cache[perm] = v_tok.reshape(num_blocks, block_size, kv, d)
    query = q.permute(0, 2, 1, 3).reshape(b * q_len, h, d)  # [b * q_len, h, d] packed
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(0, b + 1, dtype=torch.int32, device=device) * q_len
    return dict(
        q=q, k=k, v=v, query=query, key_cache=key_cache, value_cache=value_cache,
        block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
        q_len=q_len,
    )  # fmt: skip


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """SDPA with grouped KV heads; expands K/V on torch builds without enable_gqa."""
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def run_case(case: Case, dtype: torch.dtype, device: torch.device, args: argparse.Namespace) -> Row:
    from streamengine.kernels import paged_attention

    x = build_inputs(case, dtype, device, args.block_size)
    scale = case.head_dim**-0.5
    out = torch.empty_like(x["query"])
    causal = case.kind == "prefill"

    def paged() -> torch.Tensor:
        return paged_attention(
            x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"],
            x["query_start_loc"], scale, max_query_len=x["q_len"], out=out,
            max_seq_len=case.context,
        )  # fmt: skip

    def dense() -> torch.Tensor:
        return sdpa(x["q"], x["k"], x["v"], causal)

    paged_ms = time_ms(paged, device, args.warmup, args.iters)
    sdpa_ms = time_ms(dense, device, args.warmup, args.iters)
    paged_gpu, sdpa_gpu = graph_ms(paged), graph_ms(dense)
    paged_host, sdpa_host = host_us(paged), host_us(dense)
    want = dense().permute(0, 2, 1, 3).reshape_as(out).float()
    diff = (paged().float() - want).abs().max().item()
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * case.batch * case.context * case.num_kv_heads * case.head_dim * elem
    flops = None
    if causal:  # QK^T and PV over the causal half
        flops = 2 * 2 * case.batch * case.num_heads * case.head_dim * case.context**2 / 2
    return Row(
        kind=case.kind,
        batch=case.batch,
        context=case.context,
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        kv_bytes=kv_bytes,
        paged_ms=paged_ms,
        sdpa_ms=sdpa_ms,
        paged_gpu_ms=paged_gpu,
        sdpa_gpu_ms=sdpa_gpu,
        paged_host_us=paged_host,
        sdpa_host_us=sdpa_host,
        paged_gbps=kv_bytes / paged_ms / 1e6,
        sdpa_gbps=kv_bytes / sdpa_ms / 1e6,
        paged_tflops=None if flops is None else flops / paged_ms / 1e9,
        sdpa_tflops=None if flops is None else flops / sdpa_ms / 1e9,
        paged_over_sdpa=paged_ms / sdpa_ms,
        max_abs_diff=diff,
    )


def format_table(rows: list[Row]) -> str:
    head = (
        f"{'kind':8}{'B':>5}{'ctx':>7}{'H/KV/D':>12}{'paged ms':>10}{'sdpa ms':>10}"
        f"{'paged GB/s':>12}{'sdpa GB/s':>11}{'TFLOP/s p/s':>14}{'ratio':>7}{'maxdiff':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        tflops = "" if r.paged_tflops is None else f"{r.paged_tflops:.0f}/{r.sdpa_tflops:.0f}"
        shape = f"{r.num_heads}/{r.num_kv_heads}/{r.head_dim}"
        lines.append(
            f"{r.kind:8}{r.batch:>5}{r.context:>7}{shape:>12}{r.paged_ms:>10.3f}{r.sdpa_ms:>10.3f}"
            f"{r.paged_gbps:>12.0f}{r.sdpa_gbps:>11.0f}{tflops:>14}{r.paged_over_sdpa:>7.2f}"
            f"{r.max_abs_diff:>9.1e}"
        )
    lines += ["", "device time alone (CUDA graph replay) and host time to issue one call:"]
    head = f"{'kind':8}{'B':>5}{'ctx':>7}{'H/KV/D':>12}{'paged gpu ms':>14}{'sdpa gpu ms':>13}{'ratio':>7}{'paged host us':>15}{'sdpa host us':>14}"
    lines += [head, "-" * len(head)]
    for r in rows:
        shape = f"{r.num_heads}/{r.num_kv_heads}/{r.head_dim}"
        gpu = [f"{v:.4f}" if v is not None else "-" for v in (r.paged_gpu_ms, r.sdpa_gpu_ms)]
        ratio = f"{r.paged_gpu_ms / r.sdpa_gpu_ms:.2f}" if r.paged_gpu_ms and r.sdpa_gpu_ms else "-"
        lines.append(
            f"{r.kind:8}{r.batch:>5}{r.context:>7}{shape:>12}{gpu[0]:>14}{gpu[1]:>13}{ratio:>7}"
            f"{r.paged_host_us:>15.1f}{r.sdpa_host_us:>14.1f}"
        )
    return "\n".join(lines)


@dataclass(slots=True)
class PrefillRow:
    prompts: int  # prompts prefilled side by side, one row each per step
    prompt_len: int
    chunk: int  # query tokens per prompt and step
    kernel_ms: float  # every step of the prefill, summed
    sdpa_ms: float
    sdpa_over_kernel: float  # > 1: the kernel is faster
    kernel_gflops: float  # causal QK^T and PV
    max_abs_diff: float


PREFILL_HEADS = (9, 3, 64)  # SmolLM2-135M
PREFILL_CASES = [(1, 4096, 4096), (1, 4096, 512), (1, 4096, 64), (4, 1024, 1024)]  # (prompts, length, chunk)


def prefill_inputs(prompts: int, length: int, block_size: int) -> dict:
    """Every prompt's K/V ([length, kv_heads, D] each) in a shuffled paged pool, with queries."""
    h, kv, d = PREFILL_HEADS
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(prompts, length, kv, d, generator=gen)
    v = torch.randn(prompts, length, kv, d, generator=gen)
    blocks = -(-length // block_size)
    perm = torch.randperm(prompts * blocks, generator=gen)
    key_cache = torch.zeros(prompts * blocks, block_size, kv, d)
    value_cache = torch.zeros_like(key_cache)
    pad = (0, 0, 0, 0, 0, blocks * block_size - length)
    key_cache[perm] = F.pad(k, pad).reshape(-1, block_size, kv, d)
    value_cache[perm] = F.pad(v, pad).reshape(-1, block_size, kv, d)
    q = torch.randn(prompts, length, h, d, generator=gen)
    return dict(q=q, k=k, v=v, key_cache=key_cache, value_cache=value_cache,
                block_tables=perm.view(prompts, blocks).to(torch.int32))  # fmt: skip


def prefill_step(x: dict, start: int, end: int):
    """Every prompt's tokens [start, end) as one step: (metadata, q, k, v) in the engine's form."""
    from streamengine.models.attention import AttentionMetadata

    prompts, n = x["q"].shape[0], end - start
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),  # the cache already holds the step's K/V
        query_start_loc=torch.arange(prompts + 1, dtype=torch.int32) * n,
        seq_lens=torch.full((prompts,), end, dtype=torch.int32), block_tables=x["block_tables"],
        query_lens_host=[n] * prompts, seq_lens_host=[end] * prompts, max_query_len=n,
        kv_caches=[(x["key_cache"], x["value_cache"])],
    )
    flat = [x[name][:, start:end].flatten(0, 1) for name in ("q", "k", "v")]  # [prompts * n, heads, D]
    return meta, *flat


def time_prefill_step(x: dict, start: int, end: int, args: argparse.Namespace) -> tuple[float, float, float]:
    """(kernel ms, SDPA-per-prompt ms, max |difference|) of one step."""
    from streamengine.kernels.cpu_prefill_attention import PrefillPlan

    from streamengine.models.torch_backend import prefill_row

    meta, q, k, v = prefill_step(x, start, end)
    prompts, scale = len(meta.query_lens_host), PREFILL_HEADS[2] ** -0.5
    plan = PrefillPlan(meta.block_tables, meta.seq_lens, meta.query_start_loc, torch.arange(prompts))
    out_kernel, out_sdpa = torch.empty_like(q), torch.empty_like(q)

    def kernel() -> None:
        plan.run(q, x["key_cache"], x["value_cache"], scale, out_kernel)

    def sdpa_per_prompt() -> None:
        for i in range(prompts):
            prefill_row(meta, 0, i, q, k, v, scale, out_sdpa)

    cpu = torch.device("cpu")
    kernel_ms, sdpa_ms = time_ms(kernel, cpu, 1, args.iters), time_ms(sdpa_per_prompt, cpu, 1, args.iters)
    return kernel_ms, sdpa_ms, (out_kernel - out_sdpa).abs().max().item()


def run_prefill_case(prompts: int, length: int, chunk: int, args: argparse.Namespace) -> PrefillRow:
    x = prefill_inputs(prompts, length, args.block_size)
    steps = [time_prefill_step(x, start, min(length, start + chunk), args) for start in range(0, length, chunk)]
    kernel_ms, sdpa_ms = sum(s[0] for s in steps), sum(s[1] for s in steps)
    h, _, d = PREFILL_HEADS
    flops = 2 * 2 * prompts * h * d * length**2 / 2
    return PrefillRow(prompts, length, chunk, kernel_ms, sdpa_ms, sdpa_ms / kernel_ms,
                      flops / kernel_ms / 1e6, max(s[2] for s in steps))  # fmt: skip


def cpu_prefill_main(args: argparse.Namespace) -> int:
    from streamengine.kernels.cpu_prefill_attention import prefill_supported

    if not prefill_supported(*PREFILL_HEADS, args.block_size):
        print("bench/attention_kernels.py --cpu-prefill: the C++ prefill kernel does not run here; nothing measured")
        return EXIT_NO_CUDA
    torch.set_num_threads(args.threads)
    rows = [run_prefill_case(p, n, c, args) for p, n, c in PREFILL_CASES]
    head = f"{'prompts':>8}{'length':>8}{'chunk':>7}{'kernel ms':>11}{'sdpa ms':>10}{'sdpa/kernel':>13}{'GFLOP/s':>9}{'maxdiff':>9}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r.prompts:>8}{r.prompt_len:>8}{r.chunk:>7}{r.kernel_ms:>11.1f}{r.sdpa_ms:>10.1f}"
              f"{r.sdpa_over_kernel:>13.2f}{r.kernel_gflops:>9.1f}{r.max_abs_diff:>9.1e}")  # fmt: skip
    if args.json is not None:
        meta = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                "threads": args.threads, "heads": PREFILL_HEADS, "block_size": args.block_size, "iters": args.iters,
                "load_average_1min": os.getloadavg()[0]}  # shared machines: how busy this one was
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
        print(f"wrote {args.json}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small grid (about a minute)")
    p.add_argument("--cpu-prefill", action="store_true", help="the C++ prefill kernel vs SDPA on CPU")
    p.add_argument("--split-sweep", action="store_true", help="decode device time at every split-KV count")
    p.add_argument("--threads", type=int, default=2, help="--cpu-prefill: torch / OpenMP threads")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=None, help="timed runs (default 10 quick, 30 full)")
    args = p.parse_args(argv)
    if args.iters is None:
        args.iters = 5 if args.cpu_prefill else 10 if args.quick else 30
    if args.block_size < 1 or args.warmup < 0 or args.iters < 1:
        p.error("--block-size and --iters must be >= 1, --warmup >= 0")
    return args


SWEEP_SPLITS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
SWEEP_CASES = [  # decode: (batch, context, heads)
    (b, c, h) for h in HEADS[:2] for b in (1, 8, 32, 64, 128) for c in (1024, 4096, 16384)
]


def sweep_case(batch: int, context: int, heads: tuple[int, int, int], dtype: torch.dtype,
               args: argparse.Namespace, device: str = "cuda") -> dict:
    """One decode shape: device time at each split count, and the heuristic's pick."""
    from streamengine.kernels import paged_attention
    from streamengine.kernels._launch import next_power_of_2
    from streamengine.kernels.paged_attention import _choose_num_splits, _tile_config

    h, kv, d = heads
    x = build_inputs(Case("decode", batch, context, h, kv, d), dtype, torch.device(device), args.block_size)
    out = torch.empty_like(x["query"])
    inputs = [x[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")]
    times = {
        n: graph_ms(functools.partial(paged_attention, *inputs, d**-0.5, max_query_len=1, out=out,
                                      max_seq_len=context, num_kv_splits=n))
        for n in SWEEP_SPLITS if n * 32 <= context  # every split keeps at least one key tile (32 or 64)
    }  # fmt: skip
    tile_n = _tile_config(1, h // kv, max(16, next_power_of_2(d)))[3]  # head_dim_p as the kernel pads it
    picked = _choose_num_splits(x["query"], 1, context, batch, kv, tile_n)
    timed = [n for n, t in times.items() if t is not None]  # None: the call could not be captured
    best = min(timed, key=lambda n: times[n]) if timed else None
    return {"batch": batch, "context": context, "heads": list(heads), "gpu_ms": times,
            "picked": picked, "best": best}  # fmt: skip


def split_sweep_main(args: argparse.Namespace) -> int:
    """Device time of decode at every split-KV count, next to what the heuristic picks: the
    data behind `_choose_num_splits`."""
    results = []
    for batch, context, heads in SWEEP_CASES:
        r = sweep_case(batch, context, heads, DTYPES[args.dtype], args)
        results.append(r)
        us = {n: "-" if t is None else f"{t * 1e3:.1f}" for n, t in r["gpu_ms"].items()}
        print(f"  B={batch:<4} ctx={context:<6} {'/'.join(map(str, heads))}: picked {r['picked']} "
              f"({us.get(r['picked'], 'not timed')} us), best {r['best']} ({us.get(r['best'], '-')} us), "
              f"1 split {us[1]} us", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
        if args.json is not None:  # after every case, so a run cut short keeps what it measured
            meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype}
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"meta": meta, "rows": results}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_prefill:
        return cpu_prefill_main(args)
    if not torch.cuda.is_available():
        print("bench/attention_kernels.py needs CUDA (no CUDA device here); nothing measured")
        return EXIT_NO_CUDA
    if args.split_sweep:
        return split_sweep_main(args)
    import triton

    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    rows = []
    for case in cases(args.quick):
        rows.append(run_case(case, dtype, device, args))
        print(f"  {case.kind} B={case.batch} ctx={case.context} heads={case.num_heads}/{case.num_kv_heads}/{case.head_dim}: "
              f"paged {rows[-1].paged_ms:.3f} ms, sdpa {rows[-1].sdpa_ms:.3f} ms", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    print(format_table(rows))
    if args.json is not None:
        meta = {
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "dtype": args.dtype,
            "block_size": args.block_size,
            "iters": args.iters,
            "quick": args.quick,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2)
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
