"""LoRA adapters batched: throughput with 1, 4 and 16 distinct rank-16 adapters spread over the
batch, against the base model alone, in one run.

Adapters are random PEFT LoRA adapters of the default model (rank 16, alpha 32, all seven
projections of every layer), made with peft once and kept under the engine's cache folder.
Workloads (greedy, ignore_eos, the same prompts for every system):

  decode32  32 requests at once, 64-token prompts, 64 new tokens each: the decode steps
  mixed     96 requests with prompts of 16-480 tokens and 16-128 new tokens, at most 32
            running: prefill and decode mixed by continuous batching

Systems: `base` (no adapter), `lora1`, `lora4`, `lora16` (request i runs adapter i mod N;
max_loras = N). tok/s is generated tokens over wall time, median over repeats, the systems
taking turns. `lora_swap_ms` is the time to bring an adapter into a slot (copying its A and B
into the stacks of all 210 projections), `lora_load_ms` the time to read and check one from
disk (add_lora). vLLM's CPU build serving the same adapters is not run by this script yet.

    python bench/lora.py --quick     # ~3 min on a 2-core CPU
    python bench/lora.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

from common import pyplot, save_figure, software, write_report  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RANK = 16
COUNTS = (1, 4, 16)
GOALS = {"lora16_vs_base": 0.8}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter_folders(base: Path, count: int) -> list[Path]:
    """`count` random rank-16 adapters of `base`, made once (peft) under the cache folder."""
    from streamengine.config import default_cache_dir

    root = default_cache_dir() / "bench_loras" / f"{base.name}-r{RANK}"
    folders = [root / f"adapter{i}" for i in range(count)]
    missing = [f for f in folders if not (f / "adapter_model.safetensors").is_file()]
    if missing:
        make_adapters(base, missing)
    return folders


def make_adapters(base: Path, folders: list[Path]) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for folder in folders:
        torch.manual_seed(int(folder.name.removeprefix("adapter")))
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False)
        peft_model = get_peft_model(model, config)
        with torch.no_grad():  # B's default init would swamp the base model's weights
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.01)
        peft_model.save_pretrained(folder)


def workload(name: str, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request; ids drawn from the ordinary-token range."""
    rng = random.Random(seed)
    if name == "decode32":
        shapes = [(64, 64)] * 32
    else:
        shapes = [(rng.randint(16, 480), rng.randint(16, 128)) for _ in range(96)]
    return [([rng.randrange(100, vocab - 100) for _ in range(p)], g) for p, g in shapes]


def run(core, requests: list[tuple[list[int], int]], count: int) -> tuple[float, int]:
    """Seconds and generated tokens for `requests`, request i on adapter i mod `count` (0: base)."""
    from streamengine.sample.sampling_params import SamplingParams

    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora=f"a{i % count}" if count else None)
    tokens = 0
    while core.has_work():
        for out in core.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def swap_ms(core, repeats: int = 5) -> float:
    """Milliseconds to copy one adapter into a slot of every stack it adapts."""
    import torch

    stacks = core.runner.loras
    adapter = core.loras.get("a0")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.inference_mode():  # the stacks are inference tensors (made in a step)
            stacks._load(adapter, 0)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, help="timed repeats per row (quick 2, full 3)")
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    args = p.parse_args()
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.json = args.json or RESULTS_DIR / ("lora_quick.json" if args.quick else "lora.json")
    args.png = args.png or args.json.with_suffix(".png")

    from streamengine.config import EngineConfig
    from streamengine.engine.core import EngineCore
    from streamengine.models.loader import default_model_folder

    base = default_model_folder()
    folders = adapter_folders(base, max(COUNTS))
    modules = tuple((f"a{i}", str(f)) for i, f in enumerate(folders))
    cores = {"base": EngineCore(EngineConfig(max_num_seqs=32))}
    cores.update({f"lora{n}": EngineCore(EngineConfig(max_num_seqs=32, lora_modules=modules[:n], max_loras=n))
                  for n in COUNTS})
    start = time.perf_counter()
    cores["lora1"].add_lora("timed", str(folders[0]))
    load_ms = 1e3 * (time.perf_counter() - start)
    vocab = cores["base"].vocab_size
    report: dict = {"rank": RANK, "repeats": args.repeats, "vllm": "not run", "software": software(),
                    "weight_format": cores["base"].runner.weight_format}
    workloads = ("decode32",) if args.quick else ("decode32", "mixed")
    print(f"{'workload':<10}" + "".join(f"{name:>10}" for name in cores) + "   lora16/base")
    for name in workloads:
        requests = workload(name, vocab)
        for system, core in cores.items():  # prompts and slots warm, not timed
            run(core, requests[:4], int(system.removeprefix("lora") or 0) if system != "base" else 0)
        rates: dict[str, list[float]] = {system: [] for system in cores}
        for repeat in range(args.repeats):
            order = list(cores.items()) if repeat % 2 == 0 else list(cores.items())[::-1]
            for system, core in order:
                count = 0 if system == "base" else int(system.removeprefix("lora"))
                seconds, tokens = run(core, requests, count)
                rates[system].append(tokens / seconds)
        row = {system: statistics.median(r) for system, r in rates.items()}
        report[name] = {"tok_s": row, **{f"{s}_vs_base": row[s] / row["base"] for s in row if s != "base"}}
        print(f"{name:<10}" + "".join(f"{row[s]:>10.1f}" for s in cores) + f"{row['lora16'] / row['base']:>13.2f}")
    report["lora16_vs_base"] = report["decode32"]["lora16_vs_base"]
    report["lora16_vs_vllm"] = None
    report["lora_swap_ms"] = swap_ms(cores["lora16"])
    report["lora_load_ms"] = load_ms
    report["goals"] = {key: {"goal": goal, "met": report[key] >= goal} for key, goal in GOALS.items()}
    print(f"bringing an adapter into a slot: {report['lora_swap_ms']:.1f} ms; reading one from disk: {load_ms:.0f} ms")
    write_report(report, args.json, args.png, plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    workloads = [w for w in ("decode32", "mixed") if w in report]
    systems = list(report[workloads[0]]["tok_s"])
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    width = 0.8 / len(workloads)
    for j, name in enumerate(workloads):
        values = [report[name]["tok_s"][s] for s in systems]
        xs = [i + (j - (len(workloads) - 1) / 2) * width for i in range(len(systems))]
        bars = ax.bar(xs, values, width, label=name)
        for bar, value in zip(bars, values, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(systems)), systems)
    ax.set_ylabel("tok/s")
    ax.legend(fontsize=8)
    ax.set_title(f"LoRA rank {report['rank']}: adapters per batch (goal: 16 >= 0.8x base)", fontsize=10)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
