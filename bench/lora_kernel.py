"""The batched multi-LoRA kernel (kernels/csrc/cpu_lora.cpp) against its PyTorch reference.

One LoRA target projection of a decode step: T rows, in -> out features, every adapter of
rank R in a stack of 16, the rows spread over 1, 4 or 16 distinct adapters (interleaved, as a
batch's sequences are). Both run on the same inputs, interleaved, and each reports its median
microseconds per call; the last column is reference / C++ (> 1: the kernel is faster).
Prints a table only; writes no results file.

    python bench/lora_kernel.py                  # T=32, in=576, out=1536, R=16
    python bench/lora_kernel.py --rows 1 32 256 --distinct 1 4 16
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

STACK = 16  # adapters in the stack (S); `distinct` of them are used by the step


def case(rows: int, in_features: int, out_features: int, rank: int, distinct: int) -> tuple:
    """(x, y, slot, A, B, rank, scale) with rows assigned round-robin to `distinct` adapters."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=gen)
    y = torch.zeros(rows, out_features)
    slot = (torch.arange(rows) % distinct).to(torch.int32)
    a = torch.randn(STACK, rank, in_features, generator=gen) * in_features**-0.5
    b = torch.randn(STACK, out_features, rank, generator=gen) * rank**-0.5
    ranks = torch.full((STACK,), rank, dtype=torch.int32)
    scale = torch.full((STACK,), 2.0)
    return x, y, slot, a, b, ranks, scale


def median_us(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[32])
    parser.add_argument("--distinct", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--in-features", type=int, default=576)
    parser.add_argument("--out-features", type=int, default=1536)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    from streamengine.kernels import cpu_lora

    if not cpu_lora.supported():
        raise SystemExit("the C++ kernels do not run here (they need AVX-512 or AVX2, and g++)")
    print(f"in={args.in_features} out={args.out_features} R={args.rank} stack={STACK} "
          f"threads={torch.get_num_threads()}, median of {args.repeats} calls each")
    print(f"{'T':>5} {'slots':>5} {'C++ us':>9} {'torch us':>9} {'speedup':>8}")
    for rows in args.rows:
        for distinct in args.distinct:
            inputs = case(rows, args.in_features, args.out_features, args.rank, min(distinct, STACK))
            kernel = functools.partial(cpu_lora.lora_shrink_expand, *inputs)
            reference = functools.partial(cpu_lora.ref_lora_shrink_expand, *inputs)
            for fn in (kernel, reference):  # warm up: first-call allocations, thread pool
                median_us(fn, 5)
            cxx, ref = [], []
            for _ in range(5):  # interleaved rounds, so load on the machine hits both alike
                cxx.append(median_us(kernel, args.repeats // 5))
                ref.append(median_us(reference, args.repeats // 5))
            c, r = statistics.median(cxx), statistics.median(ref)
            print(f"{rows:>5} {distinct:>5} {c:>9.1f} {r:>9.1f} {r / c:>7.1f}x")


if __name__ == "__main__":
    main()
