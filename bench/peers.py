"""streamengine vs llama.cpp on the same GGUF file, measured in one run.

llama.cpp is built from the source tree vendored in the `llama-cpp-python` source distribution
(CPU only, Release, `GGML_NATIVE=ON`, static, only the tools below) into
`default_cache_dir() / "llamacpp-<version>"` and reused by later runs; `--llamacpp-dir` points
at an existing build (a folder holding the tools, or their `build/bin`). The F32 copy of the
weights that llama.cpp also runs (`llama-quantize --allow-requantize FILE F32.gguf F32`: the
same values, dequantized) is kept next to the build.

Work, with the same thread count on both sides:

  b1        batch-1 decode of `--decode-tokens` tokens. llama.cpp: `llama-bench -p 0 -n N`
            (N decode steps from an empty context). Engine: one greedy request from a short
            prompt, `ignore_eos`, N + 1 tokens; timed from the first token (the prompt's
            prefill) to the last, so exactly N decode steps count.
  prefill   prompt processing of L tokens. llama.cpp: `llama-bench -p L -n 0`. Engine: TTFT of
            an L-token random prompt with `max_tokens=1` (submission to first token),
            L / TTFT tok/s, under two configs: the default chunking (`max_prefill_chunk`) and
            `whole_prompt` (no chunk cap, `max_num_batched_tokens >= L`: one step); the best
            counts and the JSON says which.
  tput      N parallel sequences of P prompt + G generated tokens. llama.cpp:
            `llama-batched-bench -npp P -ntg G -npl N` (all prompts in one batch, then G
            lockstep decode steps). Engine: N concurrent requests of random P-token prompts,
            G + 1 tokens each. Both sides count N * (P + G) tokens, the positions run through
            the model (the engine's first output token comes from the prefill step, so its
            G + 1 tokens take G decode steps like llama.cpp's G), over the wall time from
            the start to the last token: llama-batched-bench's `S t/s`.

  b1, interleaved: `--b1-rounds` rounds of one `llama-bench -r 1` run of llama.cpp's best b1
            file and setting, then one engine b1 request (the engine stays loaded). The
            rounds above are minutes apart, and the machine's speed drifts; here each round's
            ratio has both sides under the same conditions. Reported beside the goals, which
            keep the figures above.

  tput, interleaved: `--tput-rounds` rounds of one llama-batched-bench run of llama.cpp's best
            file and setting, then one engine run of its best variant, likewise; and as many
            rounds again with the engine in its int8-activation mode (below).

llama.cpp runs the file as stored (Q4_1) and its F32 copy, each with flash attention off and on
(`-fa 0,1`; `-fa off|on` for llama-batched-bench), its KV cache in float16 (its default). The
engine runs `weight_format="packed"` (when EngineConfig has the field) and "dequantized" (the
F32 copy's counterpart), and the parallel work once more per format with a float16 KV cache
(`--no-kv16` skips it). Each side's best variant per work is its figure, and the JSON names it
(`engine_best_variant`, `llamacpp_best_variant`); packed stays the headline format the
interleaved batch-1 rounds run. Every figure is the best of `--reps` repetitions (the machine is
shared: noise only slows a run down); means are kept in the JSON beside the samples.

The goal table counts exact arithmetic only (the engine's packed and dequantized weights compute
the float32 GEMM). Beside it, the engine's opt-in `int8_activations` mode (packed weights times
inputs quantized to int8 per 32 values, as llama.cpp's own Q4_1 run multiplies them; not exact)
runs the same three works (`--no-int8-activations` skips it): JSON `engine_int8act_<work>_tok_s`,
`int8act_ratios` (against llama.cpp's best), `int8act_ratios_vs_llamacpp_q4_1`, and
`int8act_greedy_agreement` (16 prompts x 64 greedy tokens against the exact packed weights),
`int8act_goals` (the goals evaluated on its ratios) and `tput_interleaved_int8`.

vLLM (`--peers` names it; bench/peers_vllm.py): its CPU build in its own venv on the float32
copy of the same weights, the same token ids, threads and KV bytes (`--kv-gib`, both sides):
offline tput, b1 and prefill rows in one model load, and serving under Poisson arrivals
(`--serve-rate`, `--serve-requests`) through each server's OpenAI route with one client. JSON
`vllm_<work>_tok_s` beside `engine_<work>_tok_s`, `engine_serve_ttft_p50_s`,
`vllm_serve_ttft_p50_s`, `vllm_ratios` and `vllm_goals` (ahead of vLLM on every row).

    python bench/peers.py --quick                  # builds llama.cpp first when missing
    python bench/peers.py                          # 3 repetitions of everything
    python bench/peers.py --llamacpp-dir ~/llama.cpp/build/bin --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

RESULTS_DIR = Path(__file__).resolve().parent / "results"
LLAMACPP_PYPI_VERSION = "0.3.36"  # llama-cpp-python sdist whose vendored llama.cpp is built
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",
)
# (goal, done at): engine / llama.cpp's best, from issue 16.
GOALS = {"b1": (2.0, 1.3), "prefill4096": (1.5, 1.0), "tput": (3.0, 2.0)}
HEADLINE_PREFILL = 4096
SHORT_PROMPT = "Write a very long story about a lighthouse keeper."


# -- llama.cpp: build -----------------------------------------------------------------------


def default_llamacpp_dir(version: str = LLAMACPP_PYPI_VERSION) -> Path:
    from streamengine.config import default_cache_dir

    return default_cache_dir() / f"llamacpp-{version}"


def find_tools(folder: Path) -> Path | None:
    """The folder holding every tool in TOOLS: `folder` itself or its build/bin."""
    for cand in (folder, folder / "bin", folder / "build" / "bin"):
        if all((cand / t).is_file() for t in TOOLS):
            return cand
    return None


def _download_source(folder: Path, version: str) -> Path:
    """The sdist's vendor/llama.cpp, extracted to folder/src."""
    src = folder / "src"
    if (src / "CMakeLists.txt").exists():
        return src
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", tmp,
             f"llama-cpp-python=={version}"], check=True,
        )
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            prefix = f"{tar.getnames()[0].split('/')[0]}/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            tar.extractall(tmp, members=members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        shutil.move(str(Path(tmp) / prefix), str(src))
    return src


def build_llamacpp(folder: Path, version: str, jobs: int, targets: tuple[str, ...] = TOOLS,
                   flags: tuple[str, ...] = CMAKE_FLAGS, niceness: int = 10) -> Path:
    """Downloads and builds llama.cpp's tools under `folder` (niced: the machine is shared).

    `targets` and `flags` let other benches (llamacpp_lookup.py: llama-server) build other tools
    into their own folder without changing this bench's cached build."""
    folder.mkdir(parents=True, exist_ok=True)
    src = _download_source(folder, version)
    build = folder / "build"
    start = time.perf_counter()
    nice = ["nice", "-n", str(niceness)]
    with open(folder / "build.log", "w") as log:
        for cmd in ([*nice, "cmake", "-S", str(src), "-B", str(build), *flags],
                    [*nice, "cmake", "--build", str(build), "-j", str(jobs), "--target", *targets]):
            print("+", " ".join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    info = {"pypi_version": version, "build_seconds": time.perf_counter() - start, "cmake_flags": list(flags),
            "targets": list(targets), "jobs": jobs}
    (folder / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return build / "bin"


def ensure_llamacpp(args) -> Path:
    """The tools' folder: --llamacpp-dir, else the cached build, else a fresh build."""
    if args.llamacpp_dir is not None:
        tools = find_tools(args.llamacpp_dir)
        if tools is None:
            raise SystemExit(f"--llamacpp-dir {args.llamacpp_dir} lacks one of {', '.join(TOOLS)}")
        return tools
    folder = default_llamacpp_dir(args.llamacpp_version)
    tools = find_tools(folder)
    if tools is None:
        print(f"building llama.cpp {args.llamacpp_version} in {folder} (about 10 min on 2 cores) ...", file=sys.stderr)
        tools = build_llamacpp(folder, args.llamacpp_version, args.build_jobs)
    return tools


def llamacpp_info(tools: Path, bench_rows: list[dict]) -> dict:
    """Version facts: the sdist's version, ggml's, the build commit llama-bench reports."""
    info: dict = {"tools": str(tools)}
    for folder in (tools, *tools.parents[:3]):
        if (folder / "build_info.json").exists():
            info.update(json.loads((folder / "build_info.json").read_text()))
        ggml = folder / "src" / "ggml" / "CMakeLists.txt"
        if ggml.exists():
            info["ggml_version"] = ggml_version(ggml.read_text())
    if bench_rows:
        info["build_commit"] = bench_rows[0].get("build_commit")
        info["build_number"] = bench_rows[0].get("build_number")
        info["cpu_info"] = bench_rows[0].get("cpu_info")
    return info


def ggml_version(cmake_text: str) -> str | None:
    parts = [re.search(rf"set\(GGML_VERSION_{p} (\d+)\)", cmake_text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def f32_copy(tools: Path, gguf: Path) -> Path:
    """The file's weights dequantized to F32 (llama-quantize), cached beside the tools."""
    out = tools / f"{gguf.stem}.F32.gguf"
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        run_tool([str(tools / "llama-quantize"), "--allow-requantize", str(gguf), str(tmp), "F32"], 600)
        os.replace(tmp, out)
    return out


# -- llama.cpp: runs ------------------------------------------------------------------------


def run_tool(cmd: list[str], timeout: float) -> str:
    """stdout of a llama.cpp tool; its stderr tail in the error when it fails."""
    print("+", " ".join(cmd), file=sys.stderr)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    print(f"  ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout + "\n" + proc.stderr


def parse_llama_bench(text: str) -> list[dict]:
    """The test rows of `llama-bench -o json` (a JSON array, possibly among log lines)."""
    start = text.find("[\n")
    if start < 0:
        raise ValueError("no JSON array in llama-bench output")
    rows, _ = json.JSONDecoder().raw_decode(text, start)  # log lines may follow it
    if not isinstance(rows, list) or not rows or not all("avg_ts" in r and "samples_ts" in r for r in rows):
        raise ValueError("llama-bench JSON has no test rows with avg_ts/samples_ts")
    return rows


def parse_batched_bench(text: str) -> list[dict]:
    """The result lines of `llama-batched-bench --output-format jsonl`."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed"' in line:
            rows.append(json.loads(line))
    if not rows:
        raise ValueError("no JSON result line in llama-batched-bench output")
    return rows


def llama_bench(tools: Path, model: Path, args, *, prompts: list[int], gen: int) -> list[dict]:
    cmd = [str(tools / "llama-bench"), "-m", str(model), "-t", str(args.threads), "-r", str(args.reps),
           "-p", ",".join(map(str, prompts)) or "0", "-n", str(gen), "-fa", "0,1", "-o", "json"]
    return parse_llama_bench(run_tool(cmd, timeout=3600))


def best_row(rows: list[dict]) -> dict:
    """llama.cpp's best setting (flash attention off or on) for one test: the row with the
    fastest repetition."""
    return max(rows, key=lambda r: max(r["samples_ts"]))


def batched_bench_cmd(tools: Path, model: Path, args, flash_attn: str) -> list[str]:
    """N parallel sequences of P + G tokens; the context holds all of them."""
    n, p, g = args.parallel, args.tput_prompt, args.tput_gen
    ctx = n * (p + g)  # exactly: llama.cpp rounds the context down to a multiple of -npl
    return [str(tools / "llama-batched-bench"), "-m", str(model), "-t", str(args.threads), "-tb", str(args.threads),
            "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(p), "-ntg", str(g), "-npl", str(n),
            "-fa", flash_attn, "--output-format", "jsonl"]


def batched_bench(tools: Path, model: Path, args) -> dict:
    """Best of `args.tput_reps` runs of `batched_bench_cmd`, flash attention off and on."""
    runs = {}
    for flash_attn in ("off", "on"):  # its best setting counts
        cmd = batched_bench_cmd(tools, model, args, flash_attn)
        runs[flash_attn] = (cmd, [parse_batched_bench(run_tool(cmd, timeout=3600))[-1] for _ in range(args.tput_reps)])
    best = max(runs, key=lambda fa: max(r["speed"] for r in runs[fa][1]))
    cmd, rows = runs[best]
    speeds = [r["speed"] for r in rows]
    return {"tok_s": max(speeds), "mean_tok_s": statistics.mean(speeds), "samples_tok_s": speeds,
            "prefill_tok_s": max(r["speed_pp"] for r in rows), "decode_tok_s": max(r["speed_tg"] for r in rows),
            "flash_attn": best, "command": " ".join(cmd[1:]), "runs": rows,
            "other_settings": {fa: [r["speed"] for r in rs] for fa, (_, rs) in runs.items() if fa != best}}


def _bench_figures(row: dict) -> dict:
    return {"tok_s": max(row["samples_ts"]), "mean_tok_s": row["avg_ts"], "samples_tok_s": row["samples_ts"],
            "flash_attn": row.get("flash_attn"), "n_batch": row.get("n_batch"), "n_ubatch": row.get("n_ubatch")}


def measure_llamacpp_file(tools: Path, model: Path, args) -> tuple[dict, list[dict]]:
    """b1, prefill and tput figures of llama.cpp on one file; also the raw llama-bench rows."""
    b1_rows = llama_bench(tools, model, args, prompts=[], gen=args.decode_tokens)
    pp_rows = llama_bench(tools, model, args, prompts=args.prefill_lens, gen=0)
    lengths = sorted({r["n_prompt"] for r in pp_rows if r["n_gen"] == 0})
    prefill = {str(n): _bench_figures(best_row([r for r in pp_rows if r["n_gen"] == 0 and r["n_prompt"] == n]))
               for n in lengths}
    result = {"file": str(model), "b1": _bench_figures(best_row(b1_rows)), "prefill": prefill,
              "tput": batched_bench(tools, model, args)}
    return result, b1_rows + pp_rows


def file_label(gguf: Path) -> str:
    """The file's main block type (the type most of its weights are stored in), e.g. "Q4_1"."""
    from gguf import GGUFReader

    if not gguf.is_file():  # a stand-in model (the smoke test's): no types to read
        return "as_stored"
    counts: dict[str, int] = {}
    for t in GGUFReader(str(gguf)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    return max(counts, key=counts.get)


def llamacpp_files(tools: Path, gguf: Path, args) -> dict[str, Path]:
    """The files llama.cpp runs, by label: the file as stored and (unless --no-f32) its F32 copy."""
    files = {file_label(gguf): gguf}
    if not args.no_f32:
        files["F32"] = f32_copy(tools, gguf)
    return files


def measure_llamacpp(tools: Path, files: dict[str, Path], args) -> tuple[dict, list[dict]]:
    results, rows = {}, []
    for name, path in files.items():
        print(f"llama.cpp {name} ...", file=sys.stderr)
        results[name], new = measure_llamacpp_file(tools, path, args)
        rows += new
    return results, rows


# -- the engine -----------------------------------------------------------------------------


def engine_formats() -> list[str]:
    """Weight formats to run: packed first (the headline), then dequantized for the record."""
    return ["packed", "dequantized"]


def engine_config(args, weight_format: str, whole_prompt: bool, kv_cache_dtype: str = "auto", int8: bool = False):
    from streamengine import EngineConfig

    extra: dict = {"weight_format": weight_format, "kv_cache_dtype": kv_cache_dtype}
    if int8:
        extra["int8_activations"] = True
    if whole_prompt:
        extra.update(max_prefill_chunk=None, max_num_batched_tokens=max(2048, *args.prefill_lens))
    return EngineConfig(model=str(args.gguf), dtype="float32", device="cpu", num_threads=args.threads, seed=0,
                        enable_prefix_caching=False, kv_cache_bytes=args.kv_gib << 30, **extra)


async def decode_b1(engine, n: int) -> float:
    """Decode tok/s of one greedy stream: n decode steps after the prompt's first token."""
    from streamengine import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n + 1)
    marks: list[tuple[float, int]] = []
    async for out in engine.generate(SHORT_PROMPT, params):
        marks.append((time.perf_counter(), len(out.outputs[0].token_ids)))
    (t0, n0), (t1, n1) = marks[0], marks[-1]
    if n1 != n + 1:
        raise RuntimeError(f"engine produced {n1} tokens, expected {n + 1}")
    return (n1 - n0) / (t1 - t0)


async def tput_once(engine, prompts: Prompts, args) -> float:
    """One parallel run: `--parallel` fresh random prompts of `--tput-prompt` tokens."""
    return await parallel_tput(engine, [prompts.draw(args.tput_prompt) for _ in range(args.parallel)], args.tput_gen)


async def ttft(engine, prompt: list[int]) -> float:
    from streamengine import SamplingParams

    start = time.perf_counter()
    async for _ in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1)):
        break
    return time.perf_counter() - start


async def parallel_tput(engine, prompts: list[list[int]], gen: int) -> float:
    """All prompts at once, gen + 1 tokens each; positions through the model / wall time."""
    from streamengine import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=gen + 1)

    async def one(prompt: list[int]) -> int:
        last = None
        async for out in engine.generate(prompt, params):
            last = out
        return len(last.outputs[0].token_ids)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - start
    if any(c != gen + 1 for c in counts):
        raise RuntimeError(f"engine produced {sorted(set(counts))} tokens, expected {gen + 1}")
    return sum(len(p) + gen for p in prompts) / elapsed


@dataclass(slots=True)
class Prompts:
    """Random prompts of ordinary tokens, seeded: no two share a prefix (no cache hits)."""

    ids: list[int]
    rng: random.Random

    @classmethod
    def of(cls, engine, seed: str) -> Prompts:
        from traces import normal_token_ids

        return cls(normal_token_ids(engine.tokenizer, engine.core.vocab_size), random.Random(seed))

    def draw(self, n: int) -> list[int]:
        return [self.rng.choice(self.ids) for _ in range(n)]


def figures(samples: list[float]) -> dict:
    return {"tok_s": max(samples), "mean_tok_s": statistics.mean(samples), "samples_tok_s": samples}


async def _warm_up(engine, prompts: Prompts) -> None:
    from streamengine import SamplingParams

    async for _ in engine.generate(prompts.draw(64), SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)):
        pass


async def _prefill(engine, prompts: Prompts, args) -> dict:
    return {str(n): figures([n / await ttft(engine, prompts.draw(n)) for _ in range(args.reps)])
            for n in args.prefill_lens}


class WeightLog(logging.Handler):
    """Keeps the engine's "weights: ..." log lines: which weight path a session really ran."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("weights:"):
            self.lines.append(message)


@contextmanager
def weight_log():
    logger = logging.getLogger("streamengine.models.model_runner")
    handler, level = WeightLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def _session_default(args, weight_format: str, int8: bool = False) -> dict:
    """b1, prefill (default chunking) and tput on one engine."""
    from streamengine import AsyncEngine

    with weight_log() as lines:
        engine = AsyncEngine(engine_config(args, weight_format, False, int8=int8))
    async with engine:
        prompts = Prompts.of(engine, f"peers:{weight_format}:default")
        await _warm_up(engine, prompts)
        b1 = [await decode_b1(engine, args.decode_tokens) for _ in range(args.reps)]
        prefill = await _prefill(engine, prompts, args)
        tput = [await tput_once(engine, prompts, args) for _ in range(args.tput_reps)]
        return {"b1": figures(b1), "prefill": prefill,
                "tput": {**figures(tput), "num_preemptions": engine.stats()["num_preemptions"]},
                "max_prefill_chunk": engine.config.max_prefill_chunk, "weight_path": " / ".join(lines) or None}


async def _session_tput(args, weight_format: str, kv_cache_dtype: str, int8: bool = False) -> dict:
    """tput alone, on an engine whose KV cache is `kv_cache_dtype`."""
    from streamengine import AsyncEngine

    async with AsyncEngine(engine_config(args, weight_format, False, kv_cache_dtype, int8)) as engine:
        prompts = Prompts.of(engine, f"peers:{weight_format}:{kv_cache_dtype}")
        await _warm_up(engine, prompts)
        tput = [await tput_once(engine, prompts, args) for _ in range(args.tput_reps)]
        return {**figures(tput), "num_preemptions": engine.stats()["num_preemptions"]}


async def _session_whole_prompt(args, weight_format: str, int8: bool = False) -> dict:
    from streamengine import AsyncEngine

    async with AsyncEngine(engine_config(args, weight_format, True, int8=int8)) as engine:
        prompts = Prompts.of(engine, f"peers:{weight_format}:whole")
        await _warm_up(engine, prompts)
        return await _prefill(engine, prompts, args)


def best_prefill(default: dict, whole: dict) -> dict:
    """Per prompt length: both configs' figures and the better one."""
    out = {}
    for n, d in default.items():
        w = whole[n]
        best = "whole_prompt" if w["tok_s"] > d["tok_s"] else "default_chunk"
        out[n] = {"tok_s": max(d["tok_s"], w["tok_s"]), "best_config": best, "default_chunk": d, "whole_prompt": w}
    return out


def measure_engine_format(args, weight_format: str) -> dict:
    print(f"engine {weight_format} ...", file=sys.stderr)
    try:
        default = asyncio.run(_session_default(args, weight_format))
        gc.collect()
        whole = asyncio.run(_session_whole_prompt(args, weight_format))
        gc.collect()
        kv16 = asyncio.run(_session_tput(args, weight_format, "float16")) if args.kv16 else None
        gc.collect()
    except ValueError as exc:  # e.g. packed weights cannot run on this CPU: say why, keep going
        return {"error": str(exc)}
    out = {"b1": default["b1"], "prefill": best_prefill(default["prefill"], whole), "tput": default["tput"],
           "default_max_prefill_chunk": default["max_prefill_chunk"], "weight_path": default["weight_path"]}
    if kv16 is not None:
        out["tput_kv_float16"] = kv16
    return out


AGREEMENT_PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of robotics are",
    "Water boils at", "List three colors:", "Translate to French: good morning", "The meaning of life is",
    "In 1492,", "Explain photosynthesis in one sentence.", "import numpy as np\n", "My favourite food is",
    "The quick brown fox", "Q: What is 2+2?\nA:", "Dear Sir,", "The best way to learn programming is",
]
AGREEMENT_TOKENS = 64


async def _greedy_tokens(args, int8: bool) -> list[list[int]]:
    from streamengine import AsyncEngine, SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=AGREEMENT_TOKENS)

    async def one(engine, prompt: str) -> list[int]:
        final = None
        async for out in engine.generate(prompt, params):
            final = out
        return list(final.outputs[0].token_ids)

    async with AsyncEngine(engine_config(args, "packed", False, int8=int8)) as engine:
        return list(await asyncio.gather(*(one(engine, p) for p in AGREEMENT_PROMPTS)))


def greedy_agreement(args) -> dict:
    """int8 activations against the exact packed weights, greedy on AGREEMENT_PROMPTS: the
    share of tokens before each output's first difference, and how many outputs are identical."""
    exact, int8 = asyncio.run(_greedy_tokens(args, False)), asyncio.run(_greedy_tokens(args, True))
    same = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
            for x, y in zip(exact, int8, strict=True)]
    return {"prompts": len(exact), "tokens": AGREEMENT_TOKENS, "tokens_before_first_difference": sum(same) / sum(map(len, exact)),
            "identical_outputs": sum(n == len(x) for n, x in zip(same, exact, strict=True)),
            "first_tokens_equal": sum(n > 0 for n in same)}


def measure_int8_activations(args) -> dict:
    """The opt-in int8-activation mode on the packed weights (not exact): b1, prefill, tput
    (also at a float16 KV cache), and its greedy agreement with the exact packed weights."""
    print("engine packed, int8 activations ...", file=sys.stderr)
    try:
        default = asyncio.run(_session_default(args, "packed", int8=True))
        gc.collect()
        whole = asyncio.run(_session_whole_prompt(args, "packed", int8=True))
        gc.collect()
        kv16 = asyncio.run(_session_tput(args, "packed", "float16", int8=True))
        gc.collect()
        agreement = greedy_agreement(args)
    except (ValueError, TypeError) as exc:  # cannot run here, or an engine without the option
        return {"error": str(exc)}
    return {"b1": default["b1"], "prefill": best_prefill(default["prefill"], whole), "tput": default["tput"],
            "tput_kv_float16": kv16, "weight_path": default["weight_path"], "greedy_agreement": agreement}


def int8_best_tput(int8: dict) -> tuple[str, float]:
    """The int8 mode's better parallel run: (its KV cache dtype, tok/s)."""
    return max(("float16", int8["tput_kv_float16"]["tok_s"]), ("auto", int8["tput"]["tok_s"]), key=lambda kv: kv[1])


def int8_activation_keys(int8: dict | None, llamacpp: dict, prefill_lens: list[int]) -> dict:
    """The int8-activation figures beside the goal table (which counts exact arithmetic only):
    per work its tok/s, the ratio to llama.cpp's best and to llama.cpp on the Q4_1 file as
    stored (whose matmuls quantize activations likewise)."""
    if not int8 or "error" in int8:
        return {"int8_activations": int8}
    figures = {"b1": int8["b1"]["tok_s"], "tput": int8_best_tput(int8)[1],
               **{f"prefill{n}": int8["prefill"][str(n)]["tok_s"] for n in prefill_lens}}
    keys: dict = {f"engine_int8act_{work}_tok_s": v for work, v in figures.items()}
    picks = {"b1": _pick("b1"), "tput": _pick("tput"), **{f"prefill{n}": _prefill_of(n) for n in prefill_lens}}
    keys["int8act_ratios"] = {work: _ratio(v, _best(llamacpp, picks[work])[0]) for work, v in figures.items()}
    q4 = llamacpp.get("Q4_1")
    keys["int8act_ratios_vs_llamacpp_q4_1"] = {
        work: _ratio(v, picks[work](q4)) if q4 and "error" not in q4 else None for work, v in figures.items()}
    keys["int8act_greedy_agreement"] = int8["greedy_agreement"]
    keys["int8act_goals"] = goal_status(keys["int8act_ratios"])
    return {**keys, "int8_activations": int8}


def measure_engine(args) -> dict:
    import torch
    from common import quiet_transformers

    torch.set_num_threads(args.threads)
    quiet_transformers()
    results = {fmt: measure_engine_format(args, fmt) for fmt in args.weight_formats}
    for fmt in engine_formats():  # none of those could run (e.g. packed without the C++ kernels): the next that can
        if headline_format(results) is not None:
            break
        if fmt not in results:
            results[fmt] = measure_engine_format(args, fmt)
    return results


# -- batch-1, interleaved ------------------------------------------------------------------


def llamacpp_b1_setting(llamacpp: dict, files: dict[str, Path]) -> tuple[str, Path, str] | None:
    """llama.cpp's best batch-1 variant: (its file's label, path, flash-attention flag)."""
    _, best = _best(llamacpp, lambda r: r["b1"]["tok_s"])
    if best is None:
        return None
    return best, files[best], str(int(llamacpp[best]["b1"]["flash_attn"] or 0))


def llamacpp_b1_once(tools: Path, model: Path, flash_attn: str, args) -> float:
    cmd = [str(tools / "llama-bench"), "-m", str(model), "-t", str(args.threads), "-r", "1", "-p", "0",
           "-n", str(args.decode_tokens), "-fa", flash_attn, "-o", "json"]
    return max(parse_llama_bench(run_tool(cmd, timeout=600))[0]["samples_ts"])


async def _rounds(args, weight_format: str, kv_cache_dtype: str, num_rounds: int, engine_once, llama_once,
                  int8: bool = False) -> list[dict]:
    """`num_rounds` rounds of one llama.cpp run, then one `engine_once(engine, prompts)` on an
    engine kept loaded."""
    from streamengine import AsyncEngine

    async with AsyncEngine(engine_config(args, weight_format, False, kv_cache_dtype, int8)) as engine:
        prompts = Prompts.of(engine, f"peers:{weight_format}:{kv_cache_dtype}:rounds")
        await engine_once(engine, prompts)  # warm
        rounds = []
        for _ in range(num_rounds):
            theirs = llama_once()  # blocks the loop; the engine has nothing to do meanwhile
            ours = await engine_once(engine, prompts)
            rounds.append({"engine": ours, "llamacpp": theirs, "ratio": ours / theirs})
        return rounds


def _rounds_report(rounds: list[dict], **setting) -> dict:
    return {**setting, "rounds": rounds, "ratio_median": statistics.median(r["ratio"] for r in rounds),
            "engine_best_tok_s": max(r["engine"] for r in rounds),
            "llamacpp_best_tok_s": max(r["llamacpp"] for r in rounds)}


def interleaved_b1(tools: Path, llamacpp: dict, files: dict[str, Path], engine: dict, args) -> dict | None:
    """Batch-1 decode side by side: `--b1-rounds` rounds of one llama-bench run (its best file
    and setting) then one engine request, so that a drift of the machine's speed during the
    run (the other measurements take minutes apart) lands on both sides alike."""
    setting, fmt = llamacpp_b1_setting(llamacpp, files), headline_format(engine)
    if setting is None or fmt is None or args.b1_rounds == 0:
        return None
    label, model, flash_attn = setting
    print(f"batch-1 interleaved: engine {fmt} vs llama.cpp {label} -fa {flash_attn} ...", file=sys.stderr)
    rounds = asyncio.run(_rounds(args, fmt, "auto", args.b1_rounds, lambda e, _: decode_b1(e, args.decode_tokens),
                                 lambda: llamacpp_b1_once(tools, model, flash_attn, args)))
    gc.collect()
    return _rounds_report(rounds, engine_weight_format=fmt, llamacpp_variant=label, llamacpp_flash_attn=flash_attn)


def interleaved_tput(tools: Path, report: dict, files: dict[str, Path], args) -> dict | None:
    """Parallel throughput side by side, as for batch-1: `--tput-rounds` rounds of one
    llama-batched-bench run (its best file and setting) then one engine run (its best variant)."""
    ours = report["engine_best_variant"].get("tput")
    if ours is None:
        return None
    fmt, kv = engine_variants(report["engine"])[ours]["setting"]
    return _interleaved_tput(tools, report, files, args, fmt, kv, ours)


def interleaved_tput_int8(tools: Path, report: dict, files: dict[str, Path], args) -> dict | None:
    """The same rounds with the engine in its int8-activation mode (packed weights, the KV cache
    dtype that gave its best parallel figure), so that its ratio too is one of figures taken
    side by side."""
    int8 = report.get("int8_activations")
    if not int8 or "error" in int8:
        return None
    kv, _ = int8_best_tput(int8)
    return _interleaved_tput(tools, report, files, args, "packed", kv, f"packed, int8 activations, KV {kv}", int8=True)


def _interleaved_tput(tools: Path, report: dict, files: dict[str, Path], args, fmt: str, kv: str, label: str,
                      int8: bool = False) -> dict | None:
    theirs = report["llamacpp_best_variant"].get("tput")
    if theirs is None or args.tput_rounds == 0:
        return None
    flash_attn = report["llamacpp"][theirs]["tput"]["flash_attn"]
    cmd = batched_bench_cmd(tools, files[theirs], args, flash_attn)
    print(f"parallel interleaved: engine {label} vs llama.cpp {theirs} -fa {flash_attn} ...", file=sys.stderr)
    rounds = asyncio.run(_rounds(args, fmt, kv, args.tput_rounds, lambda e, prompts: tput_once(e, prompts, args),
                                 lambda: parse_batched_bench(run_tool(cmd, timeout=3600))[-1]["speed"], int8))
    gc.collect()
    return _rounds_report(rounds, engine_variant=label, llamacpp_variant=theirs, llamacpp_flash_attn=flash_attn)


# -- report ---------------------------------------------------------------------------------


def _best(variants: dict, pick) -> tuple[float | None, str | None]:
    """The largest figure `pick(variant)` over the variants that have it, and its name."""
    found = [(v, name) for name, r in variants.items() if "error" not in r and (v := pick(r)) is not None]
    return max(found) if found else (None, None)


def _prefill_of(n: int):
    return lambda r: r["prefill"].get(str(n), {}).get("tok_s") if "prefill" in r else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def headline_format(engine: dict) -> str | None:
    """packed when it ran, else the first format that ran."""
    return next((f for f in engine if "error" not in engine[f]), None)


def engine_variants(engine: dict) -> dict[str, dict]:
    """Each weight format that ran, plus "<format>, KV float16" for its tput at a float16 KV
    cache (llama.cpp's default cache type); each with its `setting`, (weight format, KV cache
    dtype), for running it again."""
    variants = {}
    for fmt, r in engine.items():
        if "error" in r:
            continue
        variants[fmt] = {**r, "setting": (fmt, "auto")}
        if "tput_kv_float16" in r:
            variants[f"{fmt}, KV float16"] = {"tput": r["tput_kv_float16"], "setting": (fmt, "float16")}
    return variants


def _pick(work: str):
    """A variant's tok/s for `work` ("b1", "tput"), None where it did not run that work."""
    return lambda r: r[work]["tok_s"] if work in r else None


def goal_status(ratios: dict) -> dict:
    """Each goal of GOALS against `ratios` (work -> engine / llama.cpp's best)."""
    return {name: {"goal": g, "done_at": d, "ratio": ratios.get(name),
                   "goal_met": ratios.get(name) is not None and ratios[name] >= g,
                   "done": ratios.get(name) is not None and ratios[name] >= d} for name, (g, d) in GOALS.items()}


def build_report(engine: dict, llamacpp: dict, info: dict, config: dict) -> dict:
    """The issue's keys (the engine's best variant vs llama.cpp's best, per work) plus every
    variant's figures."""
    fmt = headline_format(engine)
    ours = engine_variants(engine)
    keys, best_of, ours_best = {}, {}, {}
    work = {"b1": _pick("b1"), f"prefill{HEADLINE_PREFILL}": _prefill_of(HEADLINE_PREFILL), "tput": _pick("tput")}
    for n in config["prefill_lens"]:
        work.setdefault(f"prefill{n}", _prefill_of(n))
    ratios = {}
    for name, pick in work.items():
        keys[f"engine_{name}_tok_s"], ours_best[name] = _best(ours, pick)
        keys[f"llamacpp_{name}_tok_s"], best_of[name] = _best(llamacpp, pick)
        ratios[name] = _ratio(keys[f"engine_{name}_tok_s"], keys[f"llamacpp_{name}_tok_s"])
    return {
        **keys,
        "ratios": ratios,
        "goals": goal_status(ratios),
        "engine_weight_format": fmt,
        "engine_best_variant": ours_best,
        "engine_prefill_best_config": {n: r.get("best_config") for n, r in engine[fmt]["prefill"].items()} if fmt else {},
        "llamacpp_best_variant": best_of,
        "engine": engine,
        "llamacpp": llamacpp,
        "llamacpp_version": info,
        "config": config,
    }


def print_table(report: dict) -> None:
    cfg = report["config"]
    if cfg.get("load_avg", [0])[0] > cfg["threads"] + 0.5:
        print(f"\nwarning: load average {cfg['load_avg'][0]:.1f} on {os.cpu_count()} CPUs: other work skews these numbers")
    print(f"\nsame file {Path(cfg['gguf']).name}, {cfg['threads']} threads; tok/s, best of {cfg['reps']}")
    rows = [("b1", f"batch-1 decode, {cfg['decode_tokens']} tokens")]
    rows += [(f"prefill{n}", f"prompt processing, {n} tokens") for n in cfg["prefill_lens"]]
    rows.append(("tput", f"{cfg['parallel']} parallel, {cfg['tput_prompt']}+{cfg['tput_gen']} (total tok/s)"))
    engine, llama = report["engine"], report["llamacpp"]
    variants = {**engine_variants(engine), **{f: r for f, r in engine.items() if "error" in r}}
    cols = [(f"engine {f}", r) for f, r in variants.items()] + [(f"llama.cpp {v}", llama[v]) for v in llama]
    head = f"{'work':<40}" + "".join(f"{c:>22}" for c, _ in cols) + f"{'ratio':>10}"
    print(head)
    print("-" * len(head))
    picks = {"b1": _pick("b1"), "tput": _pick("tput")}
    for key, label in rows:
        pick = picks.get(key) or _prefill_of(int(key.removeprefix("prefill")))
        cells = "".join(f"{_cell(r, pick):>22}" for _, r in cols)
        ratio = report["ratios"].get(key)
        print(f"{label:<40}{cells}{(f'{ratio:.2f}x' if ratio else '-'):>10}")
    for fmt, r in engine.items():
        print(f"engine {fmt}: {r.get('error') or r.get('weight_path') or 'no weight log line'}")
    for key, label, ours in (("b1_interleaved", "batch-1", "engine_weight_format"),
                             ("tput_interleaved", "parallel", "engine_variant"),
                             ("tput_interleaved_int8", "parallel", "engine_variant")):
        if inter := report.get(key):
            rounds = ", ".join(f"{r['engine']:.0f}/{r['llamacpp']:.0f}" for r in inter["rounds"])
            print(f"{label} interleaved ({inter[ours]} vs llama.cpp {inter['llamacpp_variant']} "
                  f"-fa {inter['llamacpp_flash_attn']}), engine/llama.cpp tok/s per round: {rounds}; "
                  f"median ratio {inter['ratio_median']:.2f}x")
    if ratios := report.get("int8act_ratios"):
        agree = report["int8act_greedy_agreement"]
        figures = ", ".join(f"{w} {report[f'engine_int8act_{w}_tok_s']:.1f} tok/s ({r:.2f}x)" for w, r in ratios.items() if r)
        print(f"engine packed with int8 activations (opt-in, not exact; beside the goals): {figures} against "
              f"llama.cpp's best; greedy: {agree['tokens_before_first_difference']:.0%} of tokens before the first "
              f"difference, {agree['identical_outputs']} of {agree['prompts']} outputs identical")
    elif report.get("int8_activations"):
        print(f"engine packed with int8 activations: {report['int8_activations'].get('error')}")
    for label, goals in (("engine", report["goals"]), ("engine, int8 activations", report.get("int8act_goals") or {})):
        for name, g in goals.items():
            r = g["ratio"]
            print(f"{name}: {label} / llama.cpp best = {'-' if r is None else f'{r:.2f}'} (goal >= {g['goal']}, "
                  f"done at {g['done_at']}: {'met' if g['goal_met'] else 'done' if g['done'] else 'not yet'})")


def _cell(result: dict, pick) -> str:
    if "error" in result:
        return "error"
    value = pick(result)
    return "-" if value is None else f"{value:.1f}"


def write_png(report: dict, path: Path) -> None:
    from common import pyplot, save_figure

    plt = pyplot()
    names = list(report["goals"])
    labels = {"b1": "batch-1 decode", "prefill4096": f"prefill {HEADLINE_PREFILL}", "tput": "parallel throughput"}
    values = [report["goals"][n]["ratio"] or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bars = ax.bar(range(len(names)), values, color="#2b7bba", width=0.55)
    for i, n in enumerate(names):
        g = report["goals"][n]
        ax.hlines(g["goal"], i - 0.35, i + 0.35, colors="#2a8a3a", lw=2, label="goal" if i == 0 else None)
        ax.hlines(g["done_at"], i - 0.35, i + 0.35, colors="#d08a1c", ls="--", lw=2, label="done at" if i == 0 else None)
        text = "not run" if g["ratio"] is None else f"{values[i]:.2f}x"
        ax.annotate(text, (bars[i].get_x() + bars[i].get_width() / 2, values[i]),
                    textcoords="offset points", xytext=(0, 3), ha="center", fontsize=9)
    ax.axhline(1.0, color="#777", lw=1)
    ax.set_xticks(range(len(names)), [labels.get(n, n) for n in names])
    ax.set_ylabel("streamengine / llama.cpp's best (x)")
    ax.set_title(f"Same GGUF, {report['config']['threads']} threads (engine: {report['engine_weight_format']})")
    ax.set_ylim(0, 1.15 * max([*values, *(g["goal"] for g in report["goals"].values())]))
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path)


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="one repetition of each, 16 parallel sequences, the headline weight format only")
    p.add_argument("--gguf", type=Path, help="GGUF file both sides run (default: the SmolLM2 Q4_1 file)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, help="repetitions of b1 and prefill (default 3, quick 1)")
    p.add_argument("--tput-reps", type=int, help="repetitions of the parallel run (default 2, quick 1)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--b1-rounds", type=int, help="interleaved batch-1 rounds, engine beside llama.cpp "
                   "(default 5, quick 2; 0: none)")
    p.add_argument("--tput-rounds", type=int, help="interleaved parallel rounds, engine beside llama.cpp "
                   "(default 3, quick 1; 0: none)")
    p.add_argument("--prefill-lens", default="1000,2048,4096", help="comma-separated prompt lengths")
    p.add_argument("--peers", default="llamacpp,vllm", help="comma-separated peers to run: llamacpp, vllm")
    p.add_argument("--vllm-model", type=Path, help="HF folder vLLM loads (default: the float32 folder of the "
                   "default GGUF; needed with another --gguf)")
    p.add_argument("--kv-gib", type=int, default=1, help="KV cache GiB on the engine and vLLM (vLLM: whole GiB)")
    p.add_argument("--serve-rate", type=float, default=1.0, help="Poisson arrivals per second (vLLM serving row)")
    p.add_argument("--serve-requests", type=int, help="requests of the serving row (default 32, quick 16)")
    p.add_argument("--no-serve", dest="serve", action="store_false", help="skip the serving row")
    p.add_argument("--parallel", type=int, help="parallel sequences (default 32, quick 16)")
    p.add_argument("--tput-prompt", type=int, default=128)
    p.add_argument("--tput-gen", type=int, default=128)
    p.add_argument("--no-f32", action="store_true", help="skip llama.cpp on the F32 copy")
    p.add_argument("--no-kv16", dest="kv16", action="store_false",
                   help="skip the engine's tput at a float16 KV cache")
    p.add_argument("--weight-formats", help="engine weight formats, comma-separated, headline first "
                   "(default: packed,dequantized when EngineConfig has weight_format, else dequantized; quick: the first)")
    p.add_argument("--llamacpp-dir", type=Path, help="an existing llama.cpp build (folder with the tools or build/bin)")
    p.add_argument("--llamacpp-version", default=LLAMACPP_PYPI_VERSION, help="llama-cpp-python sdist to build from")
    p.add_argument("--build-jobs", type=int, default=2)
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "peers.json")
    p.add_argument("--png", type=Path, default=None, help="the plot (default: beside --json, same name)")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--no-int8-activations", dest="int8_activations", action="store_false",
                   help="skip the engine's opt-in int8-activation mode (not exact; reported beside the goals)")
    args = p.parse_args(argv)
    args.png = args.png or args.json.with_suffix(".png")  # never over a committed plot
    args.reps = args.reps or (1 if args.quick else 3)
    args.tput_reps = args.tput_reps or (1 if args.quick else 2)
    args.parallel = args.parallel or (16 if args.quick else 32)
    args.b1_rounds = (2 if args.quick else 5) if args.b1_rounds is None else args.b1_rounds
    args.tput_rounds = (1 if args.quick else 3) if args.tput_rounds is None else args.tput_rounds
    args.serve_requests = args.serve_requests or (16 if args.quick else 32)
    args.peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    if not set(args.peers) <= {"llamacpp", "vllm"} or args.kv_gib < 1 or args.serve_rate <= 0:
        p.error("--peers names llamacpp and/or vllm; --kv-gib >= 1; --serve-rate > 0")
    if args.b1_rounds < 0 or args.tput_rounds < 0:
        p.error("--b1-rounds and --tput-rounds must be >= 0")
    try:
        args.prefill_lens = sorted({int(n) for n in args.prefill_lens.split(",")})
    except ValueError:
        p.error("--prefill-lens must be comma-separated integers")
    for name in ("threads", "reps", "tput_reps", "decode_tokens", "parallel", "tput_prompt", "tput_gen", "build_jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.prefill_lens) < 1:
        p.error("--prefill-lens must all be >= 1")
    known = engine_formats()
    args.weight_formats = args.weight_formats.split(",") if args.weight_formats else known[:1] if args.quick else known
    if not set(args.weight_formats) <= set(known):
        p.error(f"--weight-formats: this engine knows {', '.join(known)}")
    return args


def run_config(args) -> dict:
    from common import software

    keys = ("quick", "threads", "reps", "tput_reps", "decode_tokens", "b1_rounds", "tput_rounds", "prefill_lens", "parallel",
            "tput_prompt", "tput_gen", "weight_formats", "kv16", "int8_activations", "peers", "kv_gib", "serve", "vllm_model",
            "serve_rate", "serve_requests")
    values = {k: str(v) if isinstance(v := getattr(args, k), Path) else v for k in keys}
    return {"gguf": str(args.gguf), **values, **software()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gguf is None:
        from streamengine.models.loader import resolve_default_model

        args.gguf = resolve_default_model()
    llama = "llamacpp" in args.peers
    tools = ensure_llamacpp(args) if llama else None
    files = llamacpp_files(tools, args.gguf, args) if llama else {}
    llamacpp, rows = measure_llamacpp(tools, files, args) if llama else ({}, [])
    engine = measure_engine(args)
    int8 = measure_int8_activations(args) if args.int8_activations else None
    report = build_report(engine, llamacpp, llamacpp_info(tools, rows) if llama else {}, run_config(args))
    report.update(int8_activation_keys(int8, llamacpp, args.prefill_lens))
    report["b1_interleaved"] = interleaved_b1(tools, llamacpp, files, engine, args) if llama else None
    report["tput_interleaved"] = interleaved_tput(tools, report, files, args) if llama else None
    report["tput_interleaved_int8"] = interleaved_tput_int8(tools, report, files, args) if llama else None
    if "vllm" in args.peers:
        from peers_vllm import measure_serving, measure_vllm_offline, vllm_keys

        serving = measure_serving(args) if args.serve else None
        report.update(vllm_keys(report, measure_vllm_offline(args), serving, args.prefill_lens))
    print_table(report)
    if "vllm" in args.peers:
        from peers_vllm import print_vllm

        print_vllm(report)
    from common import write_report

    write_report(report, args.json, None if args.no_png else args.png, write_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
