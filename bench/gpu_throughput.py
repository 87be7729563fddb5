"""Throughput and latency on a GPU at realistic model sizes: the engine eagerly, with decode
graphs, and with an FP8 KV cache, against transformers' continuous batching (`generate_batch`),
on the same GPU and the same weights.

Models are built from a config with random weights (no download; the GPU machines have no
index or hub): "1b" has Llama-3.2-1B's shapes, "7b" Llama-2-7B's, in bfloat16. One model
object serves every system: the engine runs it through its paged attention hook, transformers
switches it to its own paged SDPA. A word-level tokenizer of the model's vocabulary stands in
for the real one (the prompts are token ids; only detokenization reads it).

Systems, each on the same prompts (random ids, `--prompt-len` tokens, `--output-len` new
tokens each, EOS ignored; the engine's start-up and a warm-up request, and transformers' manager
start-up (timing starts when its loop takes up the first request), never timed):

  engine_eager     EngineConfig(cuda_graphs="off"): every step launched eagerly
  engine_graphs    cuda_graphs="on": decode steps replay a CUDA graph of their bucket
  engine_fp8       as engine_graphs with kv_cache_dtype="fp8" (skipped, with the reason, where
                   the engine refuses it)
  hf_generate_batch  transformers' ContinuousBatchingManager through `generate_batch`, its own
                   CUDA graphs as it decides, its KV cache of the engine's bytes

Per system: output tokens per second with every request submitted at once, each request's time
to first token (p50) and time per output token after it (mean), and batch-1 milliseconds per
output token (one request alone). `graphs_vs_eager` and `engine_graphs_vs_hf` are ratios of the
same run. Greedy tokens of engine_eager and engine_graphs are compared (`graphs_token_agreement`:
the fraction of requests whose tokens are equal; bfloat16 GEMMs of a padded bucket may round
differently from the eager batch's, so near-ties can part).

    python bench/gpu_throughput.py                  # GPU: 1b then 7b (about 3-4 minutes on an H100)
    python bench/gpu_throughput.py --sizes 1b --num-requests 128
    python bench/gpu_throughput.py --tiny           # CPU, a tiny config, < 1 minute: keeps the script working

On CPU (--tiny) there are no graphs: engine_graphs runs the same buckets and buffers eagerly,
so its figures say nothing about graphs; the JSON marks it (`graphs_are_cuda_graphs`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's engine, installed or not
import torch  # noqa: E402
from common import quiet_transformers, software  # noqa: E402

import streamengine  # noqa: E402, F401  (before transformers: it takes the root off sys.path again)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    # Llama-3.2-1B
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    # Llama-2-7B
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False),
}
SYSTEMS = ("engine_eager", "engine_graphs", "engine_fp8", "hf_generate_batch")
BLOCK_SIZE = 16


def word_tokenizer(vocab_size: int):
    """A tokenizer whose every id is the word t<id>: enough to detokenize random ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t2")


def build_model(size: str, dtype: torch.dtype, device: str, max_len: int):
    """The random-weight model of `size` on `device`, wired to the engine's attention hook."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from streamengine.models.attention import ATTN_IMPLEMENTATION, register_paged_attention
    from streamengine.models.loader import LoadedModel

    register_paged_attention()
    config = LlamaConfig(**SHAPES[size], max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: no 14 GB host copy for 7b
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    model.eval().requires_grad_(False)
    return LoadedModel(model, word_tokenizer(config.vocab_size), f"random-llama-{size}", Path(f"random-llama-{size}"))


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


async def _generate(engine, prompts: list[list[int]], output_len: int) -> dict:
    """Every prompt at once: (token lists, wall seconds, per-request TTFT and TPOT)."""
    from streamengine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    async def one(ids: list[int]) -> tuple[list[int], float, float]:
        start = time.perf_counter()
        first = None
        async for out in engine.generate(ids, params):  # noqa: B007 (the last output is kept)
            first = first or time.perf_counter()
        tokens = out.outputs[0].token_ids
        return tokens, first - start, (time.perf_counter() - first) / max(1, len(tokens) - 1)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return {"tokens": [r[0] for r in results], "seconds": time.perf_counter() - start,
            "ttft": [r[1] for r in results], "tpot": [r[2] for r in results]}


def latency_figures(run: dict, num_tokens: int) -> dict:
    """Throughput and per-request latency of one run (None where per-token times are missing)."""
    return {"output_tok_s": round(num_tokens / run["seconds"], 1), "seconds": round(run["seconds"], 3),
            "ttft_p50_s": round(statistics.median(run["ttft"]), 4) if run["ttft"] else None,
            "tpot_mean_ms": round(1000 * statistics.fmean(run["tpot"]), 3) if run["tpot"] else None}


def engine_system(loaded, args, prompts: list[list[int]], **overrides) -> dict:
    """One engine (startup timed apart): a warm-up request, every prompt at once, then batch 1."""
    from streamengine import AsyncEngine, EngineConfig

    config = EngineConfig(
        dtype=args.dtype, device=args.device, kv_cache_bytes=args.kv_mib << 20, block_size=BLOCK_SIZE,
        max_num_seqs=args.num_requests, max_num_batched_tokens=args.max_batched_tokens,
        max_prefill_chunk=args.max_batched_tokens, max_model_len=args.max_len, model_impl=args.model_impl,
        **overrides,
    )

    async def run() -> dict:
        start = time.perf_counter()
        async with AsyncEngine(config, loaded=loaded) as engine:
            startup = time.perf_counter() - start
            await _generate(engine, prompts[:2], 8)
            batch = await _generate(engine, prompts, args.output_len)
            single = await _generate(engine, prompts[:1], args.output_len)
            graphs = engine.core.runner.decode_graphs
            figures = latency_figures(batch, sum(len(t) for t in batch["tokens"]))
            return {**figures, "startup_s": round(startup, 2),
                    "b1_ms_per_token": round(1000 * single["seconds"] / len(single["tokens"][0]), 3),
                    "decode_graph_replays": graphs.num_replays if graphs is not None else 0,
                    "graph_buckets": list(graphs.sizes) if graphs is not None else [],
                    "graphs_are_cuda_graphs": bool(graphs is not None and graphs.cuda),
                    "_tokens": batch["tokens"]}

    try:
        return asyncio.run(run())
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def cb_config(model, args, num_requests: int):
    """transformers' ContinuousBatchingConfig holding the engine's KV bytes, with the engine's
    budgets; its own block size (256 tokens by default; the field is `block_size` in 5.17,
    `page_size` in later releases)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * model.dtype.itemsize
    default = ContinuousBatchingConfig()
    block = getattr(default, "block_size", None) or getattr(default, "page_size", None) or BLOCK_SIZE
    return ContinuousBatchingConfig(num_blocks=max(1, (args.kv_mib << 20) // (per_token * block)),
                                    max_batch_tokens=args.max_batched_tokens, max_requests_per_batch=num_requests)


def _hf_batch(model, args, prompts: list[list[int]]) -> dict:
    """generate_batch over `prompts`, timed from when its loop took up the first request: each
    call starts a manager (warm-up, a thread) after its requests are created, and the engine's
    start-up is not timed either."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=args.output_len, eos_token_id=-1, pad_token_id=2)
    outs = model.generate_batch(inputs=prompts, generation_config=gen, record_timestamps=True,
                                continuous_batching_config=cb_config(model, args, len(prompts)))
    returned = time.perf_counter()
    outs = list(outs.values())
    if len(outs) != len(prompts) or any(o.error for o in outs):
        raise RuntimeError(f"generate_batch failed: {[o.error for o in outs if o.error][:3]}")
    start = min([o.lifespan[0] for o in outs if o.lifespan[0] > 0] or [o.created_time for o in outs])
    end = max([o.lifespan[1] for o in outs if o.lifespan[1] > 0] or [returned])  # finish times when recorded
    ttft = [o.timestamps[0] - start for o in outs if o.timestamps]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / max(1, len(o.timestamps) - 1) for o in outs if o.timestamps]
    return {"tokens": [o.generated_tokens for o in outs], "seconds": end - start, "ttft": ttft, "tpot": tpot}


def hf_system(loaded, args, prompts: list[list[int]]) -> dict:
    model = loaded.model
    engine_impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")  # transformers' CB switches it to its paged SDPA itself
    try:
        with torch.inference_mode():
            # No warm-up call: each call warms its own manager up before its requests are created.
            batch = _hf_batch(model, args, prompts)
            single = _hf_batch(model, args, prompts[:1])
    finally:
        try:
            model.set_attn_implementation(engine_impl)
        except Exception:  # noqa: BLE001 (a release that validates names differently: set it as loaded)
            model.config._attn_implementation = engine_impl
        gc.collect()
    num_tokens = sum(len(t) for t in batch["tokens"])
    return {**latency_figures(batch, num_tokens),
            "b1_ms_per_token": round(1000 * single["seconds"] / max(1, len(single["tokens"][0])), 3),
            "output_tokens": num_tokens}


def run_size(size: str, args, report: dict, write) -> None:
    """Every system on one model size, the report written after each (a timeout keeps the rest)."""
    t0 = time.perf_counter()
    loaded = build_model(size, getattr(torch, args.dtype), args.device, args.max_len)
    prompts = make_prompts(args.num_requests, args.prompt_len, loaded.model.config.vocab_size, seed=0)
    entry = report["sizes"].setdefault(size, {"build_s": round(time.perf_counter() - t0, 1), "systems": {}})
    entry["params_b"] = round(sum(p.numel() for p in loaded.model.parameters()) / 1e9, 3)
    for system in args.systems:
        print(f"=== {size}: {system}", file=sys.stderr, flush=True)
        entry["systems"][system] = one_system(system, loaded, args, prompts)
        write()
    systems = entry["systems"]
    eager, graphs = systems.get("engine_eager", {}), systems.get("engine_graphs", {})
    if "_tokens" in eager and "_tokens" in graphs:
        same = sum(a == b for a, b in zip(eager["_tokens"], graphs["_tokens"], strict=True))
        entry["graphs_token_agreement"] = round(same / len(prompts), 3)
    entry.update(ratios(systems))
    for s in systems.values():
        s.pop("_tokens", None)
    del loaded
    gc.collect()
    write()


def one_system(system: str, loaded, args, prompts) -> dict:
    """The system's figures; {"skipped": why} where the engine refuses fp8, {"error": ...} where
    a system failed (the run goes on: a GPU session is short, the other systems still count)."""
    try:
        if system == "hf_generate_batch":
            return hf_system(loaded, args, prompts)
        overrides = {"engine_eager": {"cuda_graphs": "off"}, "engine_graphs": {"cuda_graphs": "on"},
                     "engine_fp8": {"cuda_graphs": "on", "kv_cache_dtype": "fp8"}}[system]
        return engine_system(loaded, args, prompts, **overrides)
    except Exception as exc:  # noqa: BLE001
        if system == "engine_fp8" and isinstance(exc, ValueError):  # a configuration refused: say why
            return {"skipped": f"{type(exc).__name__}: {exc}"}
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def ratios(systems: dict) -> dict:
    def ratio(a: str, b: str, key: str, inverse: bool = False) -> float | None:
        x, y = systems.get(a, {}).get(key), systems.get(b, {}).get(key)
        if not x or not y:
            return None
        return round(y / x if inverse else x / y, 3)

    return {"graphs_vs_eager_tput": ratio("engine_graphs", "engine_eager", "output_tok_s"),
            "graphs_vs_eager_b1": ratio("engine_graphs", "engine_eager", "b1_ms_per_token", inverse=True),
            "engine_graphs_vs_hf_tput": ratio("engine_graphs", "hf_generate_batch", "output_tok_s"),
            "engine_graphs_vs_hf_b1": ratio("engine_graphs", "hf_generate_batch", "b1_ms_per_token", inverse=True),
            "fp8_vs_graphs_tput": ratio("engine_fp8", "engine_graphs", "output_tok_s")}


def print_table(report: dict) -> None:
    print(f"{'size':<5} {'system':<18} {'tok/s':>9} {'TTFT p50 s':>11} {'TPOT ms':>8} {'b1 ms/tok':>10} {'graph steps':>11}")
    for size, entry in report["sizes"].items():
        for name, s in entry["systems"].items():
            if "skipped" in s or "error" in s:
                print(f"{size:<5} {name:<18} {'skipped' if 'skipped' in s else 'ERROR'}: {s.get('skipped') or s['error']}"[:120])
                continue
            print(f"{size:<5} {name:<18} {s['output_tok_s']:>9} {s['ttft_p50_s']:>11} {s['tpot_mean_ms']:>8} "
                  f"{s['b1_ms_per_token']:>10} {s.get('decode_graph_replays', '-'):>11}")
        print(f"{size:<5} ratios: " + ", ".join(f"{k}={v}" for k, v in entry.items() if k.endswith(("tput", "b1"))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU, a tiny config, a small workload (< 1 minute)")
    p.add_argument("--sizes", default=None, help=f"comma-separated, of {sorted(SHAPES)} (default: 1b,7b; tiny with --tiny)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {SYSTEMS}")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--max-batched-tokens", type=int, default=4096)
    p.add_argument("--max-len", type=int, default=1024,
                   help="max_model_len: a captured graph plans split-KV for this context (see docs/engine.md)")
    p.add_argument("--kv-mib", type=int, default=None, help="KV cache MiB of each system (default 16384; 64 with --tiny)")
    p.add_argument("--model-impl", default="auto", choices=("auto", "native", "transformers"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    tiny = args.tiny
    defaults = dict(sizes="tiny" if tiny else "1b,7b", num_requests=8 if tiny else 64, prompt_len=16 if tiny else 256,
                    output_len=12 if tiny else 128, kv_mib=64 if tiny else 16384,
                    json=RESULTS_DIR / ("gpu_throughput_tiny.json" if tiny else "gpu_throughput.json"))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device = "cpu" if tiny else "cuda"
    args.dtype = "float32" if tiny else "bfloat16"
    args.sizes = args.sizes.split(",")
    args.systems = args.systems.split(",")
    for name, known in (("sizes", SHAPES), ("systems", SYSTEMS)):
        unknown = [v for v in getattr(args, name) if v not in known]
        if unknown:
            p.error(f"--{name}: unknown {unknown} (known: {list(known)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run with --tiny on CPU")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_transformers()
    report = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "dtype": args.dtype,
              "workload": {k: getattr(args, k) for k in ("num_requests", "prompt_len", "output_len", "max_len",
                                                          "max_batched_tokens", "kv_mib", "model_impl")},
              "software": software(), "sizes": {}}

    def write() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        clean = json.loads(json.dumps(report, default=str, allow_nan=True))
        for entry in clean["sizes"].values():
            for s in entry["systems"].values():
                s.pop("_tokens", None)
        args.json.write_text(json.dumps(clean, indent=2) + "\n")

    start = time.perf_counter()
    for size in args.sizes:
        run_size(size, args, report, write)
    report["seconds"] = round(time.perf_counter() - start, 1)
    failed = [f"{size}/{name}" for size, e in report["sizes"].items() for name, s in e["systems"].items() if "error" in s]
    report["failed"] = failed
    write()
    print_table(report)
    print(f"wrote {args.json}" + (f"; FAILED: {failed}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
