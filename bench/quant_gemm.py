"""The packed-weight GEMM against the float32 one, on the default model's own weights.

For each batch size M, one decode step's worth of projections (every layer's q/k/v, o,
gate/up and down, as the native decoder fuses them) plus the LM head, timed three ways in
one run, interleaved: the GGUF blocks as stored (`QuantLinear`, Q4_1 layers and a Q8_0 head),
the same weights dequantized into float32 panels (`PackedLinear`), and PyTorch's `F.linear`
over the float32 weights; where the AMX path runs (csrc/cpu_amx_gemm.cpp), also the packed
weights with it switched off. Reports ms per step and weights per ns, and the ratios float32 /
packed (> 1: packed is faster) and without / with AMX. The issue's claim "batch 128 no slower than the float32
path" is the last column at M=128.

    python bench/quant_gemm.py --quick          # M = 1, 8, 128
    python bench/quant_gemm.py --json bench/results/quant_gemm.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from common import amx_active, default_model_folder, software, write_report

FULL_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
QUICK_ROWS = (1, 8, 128)


def load_linears():
    """(packed, float32 panels, torch) linears of every projection of the default GGUF file."""
    import torch
    from streamengine.kernels import cpu_quant_linear
    from streamengine.kernels.cpu_linear import TorchLinear, make_linear
    from transformers import AutoConfig

    from streamengine.kv.spec import AttentionShape
    from streamengine.models.gguf_weights import read_gguf
    from streamengine.models.loader import resolve_default_model

    lib = cpu_quant_linear.load_library()
    if lib is None:
        raise SystemExit("the C++ kernels do not run here (they need AVX-512 or AVX2)")
    path = resolve_default_model()
    shape = AttentionShape.of(AutoConfig.from_pretrained(default_model_folder()))
    gguf = read_gguf(path, shape.num_heads, shape.num_kv_heads)
    groups = [[layer[n] for n in names] for layer in gguf.layers
              for names in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))]
    groups.append([gguf.output])
    packed, panels, plain = [], [], []
    for group in groups:
        rows = np.concatenate([t.blocks for t in group])
        shape = (sum(t.shape[0] for t in group), group[0].shape[1])
        packed.append(cpu_quant_linear.QuantLinear(rows, group[0].quant_type, shape, None, lib))
        weight = torch.cat([t.dequantize() for t in group])
        panels.append(make_linear(weight))
        plain.append(TorchLinear(weight, None))
    return packed, panels, plain


def step_ms(linears, m: int, repeats: int) -> Callable[[], float]:
    """A timer of one pass over `linears` at M rows: the best of `repeats` passes, in ms."""
    import torch

    inputs = {k: torch.randn(m, k) for k in {lin.in_features for lin in linears}}

    def run() -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for lin in linears:
                lin(inputs[lin.in_features])
            best = min(best, time.perf_counter() - start)
        return best * 1e3

    run()  # warm-up: first touch of every panel
    return run


def without_amx(timer: Callable[[], float]) -> Callable[[], float]:
    from streamengine.kernels.cpu_quant_linear import amx_enabled

    def run() -> float:
        with amx_enabled(False):
            return timer()

    return run


def measure(args: argparse.Namespace) -> list[dict]:
    import torch

    torch.set_num_threads(args.threads)
    packed, panels, plain = load_linears()
    weights = sum(lin.out_features * lin.in_features for lin in packed)
    rows = []
    for m in QUICK_ROWS if args.quick else FULL_ROWS:
        timers = {name: step_ms(lins, m, args.repeats) for name, lins in
                  (("packed", packed), ("float32", panels), ("torch", plain))}
        if amx_active():  # the same packed weights with the AMX path off: the dequantizing kernel
            timers["packed_no_amx"] = without_amx(timers["packed"])
        best = {name: float("inf") for name in timers}
        for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits all three
            for name, timer in timers.items():
                best[name] = min(best[name], timer())
        rows.append({
            "rows": m, **{f"{name}_ms": round(ms, 3) for name, ms in best.items()},
            "packed_weights_per_ns": round(weights * m / (best["packed"] * 1e6), 2),
            "float32_over_packed": round(best["float32"] / best["packed"], 3),
            "torch_over_packed": round(best["torch"] / best["packed"], 3),
            **({"no_amx_over_amx": round(best["packed_no_amx"] / best["packed"], 3)} if "packed_no_amx" in best else {}),
        })
        print(f"M={m:4d}  " + "  ".join(f"{name} {ms:8.2f} ms" for name, ms in best.items()) +
              f"  float32/packed {rows[-1]['float32_over_packed']:.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"M = {QUICK_ROWS}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per M (best is kept)")
    p.add_argument("--repeats", type=int, default=3, help="passes per round")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    rows = measure(args)
    if args.json:
        report = {"threads": args.threads, "rows": rows, "software": software()}
        write_report(report, Path(args.json), None, lambda *_: None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
