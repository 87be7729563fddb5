"""Speculative decoding: decode tok/s with and without n-gram proposals, on three workloads built here.

Workloads (greedy, `max_tokens` each, chat template of the default model):

  quote   edits of code given in the prompt ("rename f to g and print the whole code"): the
          answer repeats its input, the case prompt lookup is for
  json    answers constrained by a JSON schema (structured outputs): the grammar's forced tokens
          (jump-forward) are proposed first, then lookup
  chat    free questions: lookup rarely matches; the draft-length rule must keep it from costing

Systems, one engine each, on the same prompts: `engine` (no speculation), `engine_ngram`
(EngineConfig.speculative = SpeculativeConfig("ngram", k)) and `engine_suffix` (the same with
"suffix": lookup in the request's tokens, then in the earlier answers of its tenant, here the
default tenant; its history is emptied before each timed run, so it never sees a prompt's own
earlier answer, only those of the other prompts before it in the run). Each row runs at batch 1 (one
request at a time) and batch 8 (eight at once), interleaved per repeat; tok/s is generated
tokens over wall time from the first submission to the last token, median over repeats (the
systems take turns going first). The
outputs of both systems must be token for token the same (`identical` in the JSON).

The bound: a decode step costs about `fixed + per_row * rows`, and a proposal is a row. With
every proposal accepted, k proposals per sequence give `(k+1)(fixed + per_row B) / (fixed +
(k+1) per_row B)` times the tokens per second at batch B. Each row's `bound` uses the
fixed/per-row ratio the speculating engine fitted on that row's steps (`bound_b1`, `bound_b8`:
the quote rows').

Peers, on the same prompts, each with and without its own speculation (`--peers`): llama.cpp's
n-gram speculation through llama-server on the same GGUF file (bench/llamacpp_lookup.py: `-np
8` slots for batch 8, its own JSON-schema grammar, timed by the server's own prompt and decode
times), and vLLM's CPU build with its n-gram proposer (bench/vllm_peer.py, its own virtual
environment). A peer that cannot run a row records why (`peers` in the row) instead of a rate.
`vs_<peer>` is the engine's "ngram" tok/s over the peer's own speculating tok/s.

    python bench/speculative.py --quick     # ~2 min on a 2-core CPU, no peers
    python bench/speculative.py --quick --peers llamacpp,vllm   # the results file: ~15 min more
    python bench/speculative.py             # more and longer answers, five repeats, both peers
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ is not a package

from common import pyplot, save_figure, software, write_report  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
WORKLOADS = ("quote", "json", "chat")
BATCHES = (1, 8)
GOALS = {"b1_quote": 2.5, "b1_json": 1.5, "b1_chat": 0.95, "b8_quote": 1.5}
NAMES = ("total", "count", "value", "items", "result", "scale", "offset", "limit", "index", "buffer")
VERBS = ("sum", "scale", "clip", "merge", "count", "shift", "filter", "pack")
QUESTIONS = (
    "Why is the sky blue? Answer in a short paragraph.",
    "Give three tips for a good night's sleep.",
    "What is the difference between a list and a tuple in Python?",
    "Describe a sunset over the sea.",
    "How do bees make honey?",
    "Suggest a name for a bakery and explain it.",
    "What should I pack for a weekend hike?",
    "Explain recursion to a child.",
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 3, "maxItems": 6},
        "minutes": {"type": "integer", "minimum": 1, "maximum": 240},
    },
    "required": ["name", "steps", "minutes"],
    "additionalProperties": False,
}
DISHES = ("pancakes", "tomato soup", "fried rice", "lemonade", "omelette", "guacamole", "porridge", "flatbread")


def code_snippet(i: int) -> tuple[str, str, str]:
    """A small generated module and one of its function names to rename (deterministic in i)."""
    verb = VERBS[i % len(VERBS)]
    lines = []
    for j in range(3):
        a, b = NAMES[(i + j) % len(NAMES)], NAMES[(i + 2 * j + 1) % len(NAMES)]
        name = f"{verb}_{a}" if j == 0 else f"{VERBS[(i + j) % len(VERBS)]}_{b}_{j}"
        lines += [
            f"def {name}({a}, {b}):",
            f'    """Return the {verb} of {a} and {b}."""',
            f"    if {a} is None:",
            f"        return {b}",
            f"    {a} = {a} + {b} * {j + 2}",
            f"    return {a}",
            "",
        ]
    return "\n".join(lines), f"{verb}_{NAMES[i % len(NAMES)]}", f"{verb}_new"


def prompts(tokenizer, workload: str, n: int) -> list[str]:
    out = []
    for i in range(n):
        if workload == "quote":
            code, old, new = code_snippet(i)
            text = f"Rename the function {old} to {new} in this code and print the whole code again:\n\n{code}"
        elif workload == "json":
            text = f"Give the recipe for {DISHES[i % len(DISHES)]} as JSON with its name, steps and minutes."
        else:
            text = QUESTIONS[i % len(QUESTIONS)]
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True))
    return out


def params(workload: str, max_tokens: int):
    from streamengine.sample.sampling_params import SamplingParams
    from streamengine.structured.params import JsonSchema

    structured = JsonSchema(SCHEMA) if workload == "json" else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured=structured)


def run_batch(core, texts: list[str], sampling) -> tuple[float, list[tuple[int, ...]], int, int]:
    """Seconds, each request's tokens, and the drafts' proposed and accepted tokens of one batch."""
    before = (core.spec_stats.num_draft_tokens, core.spec_stats.num_accepted_tokens)
    start = time.perf_counter()
    for i, text in enumerate(texts):
        core.add_request(f"r{time.monotonic_ns()}-{i}", text, sampling)
    done: dict[str, tuple[int, ...]] = {}
    while core.has_work():
        for out in core.step():
            if out.finished:
                done[out.request_id] = tuple(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    tokens = [done[k] for k in sorted(done, key=lambda r: int(r.rsplit("-", 1)[1]))]
    return (seconds, tokens, core.spec_stats.num_draft_tokens - before[0],
            core.spec_stats.num_accepted_tokens - before[1])


def measure(cores: dict, workload: str, batch: int, args) -> dict:
    """tok/s of each system over `args.requests` requests of `workload`, `batch` at a time."""
    from streamengine.spec.history import OutputHistory

    tokenizer = next(iter(cores.values())).tokenizer
    texts = prompts(tokenizer, workload, args.requests)
    sampling = params(workload, args.max_tokens)
    for core in cores.values():  # prompts computed once (prefix cache), grammar compiled: not timed
        run_batch(core, texts[:batch], params(workload, 1))
    rates: dict[str, list[float]] = {name: [] for name in cores}
    outputs: dict[str, list] = {}
    drafts = {name: [0, 0] for name in cores}
    for repeat in range(args.repeats):
        order = list(cores.items()) if repeat % 2 == 0 else list(cores.items())[::-1]  # no system always first
        for name, core in order:
            if core.output_history is not None:  # "suffix" learns only from this run's earlier answers
                core.output_history = OutputHistory(core.output_history.max_tokens)
            seconds, tokens = 0.0, []
            for lo in range(0, len(texts), batch):
                s, t, proposed, accepted = run_batch(core, texts[lo:lo + batch], sampling)
                seconds += s
                tokens += t
                drafts[name][0] += proposed
                drafts[name][1] += accepted
            rates[name].append(sum(map(len, tokens)) / seconds)
            outputs[name] = tokens
    row = {name: statistics.median(r) for name, r in rates.items()}
    out = {"tok_s": row, "identical": all(outputs[name] == outputs["engine"] for name in cores)}
    for name in cores:
        if name != "engine":
            method = name.removeprefix("engine_")
            proposed, accepted = drafts[name]
            out[f"speedup_{method}"] = row[name] / row["engine"]
            out[f"acceptance_{method}"] = accepted / proposed if proposed else None
    out["speedup"], out["acceptance"] = out["speedup_ngram"], out["acceptance_ngram"]
    return out


PEER_KEYS = ("tok_s", "tok_s_plain", "acceptance", "how")


def llamacpp_row(workload: str, batch: int, texts: list[str], args) -> dict:
    """llama.cpp's tok/s with and without its speculation on this row, or why it did not run."""
    from llamacpp_lookup import PeerUnavailable, llamacpp_lookup_rows

    try:
        result = llamacpp_lookup_rows(texts, args.max_tokens, batch, args.k, args.repeats,
                                      SCHEMA if workload == "json" else None)
    except PeerUnavailable as exc:
        return {"unavailable": str(exc)}
    return {key: result.get(key) for key in PEER_KEYS}


def vllm_rows(tokenizer, args) -> dict[str, dict]:
    """vLLM's rows, all in two model loads (its load and compile take minutes)."""
    from vllm_peer import PeerUnavailable, vllm_spec_table

    keys = [(b, w) for b in BATCHES for w in WORKLOADS]
    rows = [(prompts(tokenizer, w, args.requests), b, SCHEMA if w == "json" else None) for b, w in keys]
    try:
        results = vllm_spec_table(rows, args.max_tokens, args.k, args.repeats)
    except PeerUnavailable as exc:
        return {f"b{b}_{w}": {"unavailable": str(exc)} for b, w in keys}
    return {f"b{b}_{w}": {key: r.get(key) for key in PEER_KEYS} for (b, w), r in zip(keys, results, strict=True)}


def bound(ratio: float, k: int, batch: int) -> float:
    """tok/s gain with every proposal accepted, for a step of fixed/per-row cost `ratio`."""
    return (k + 1) * (ratio + batch) / (ratio + (k + 1) * batch)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels, values, goals = [], [], []
    for batch in BATCHES:
        for workload in WORKLOADS:
            key = f"b{batch}_{workload}"
            labels.append(f"{workload}\nbatch {batch}")
            values.append(report[f"speedup_{key}"])
            goals.append(GOALS.get(key))
    suffix = [report[f"speedup_suffix_b{b}_{w}"] for b in BATCHES for w in WORKLOADS]
    width = 0.4
    bars = ax.bar([i - width / 2 for i in range(len(values))], values, width, color="#4c72b0", label="ngram")
    ax.bar([i + width / 2 for i in range(len(values))], suffix, width, color="#55a868", label="suffix")
    ax.legend(fontsize=8, loc="upper right")
    for i, goal in enumerate(goals):
        if goal is not None:
            ax.plot([i - 0.4, i + 0.4], [goal, goal], color="#c44e52", linewidth=1.5)
    for bar, value in zip(bars, values, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(values)), labels, fontsize=8)
    ax.set_ylabel("tok/s vs no speculation")
    ax.set_title(f"speculative decoding, k={report['num_speculative_tokens']} (red: goal)", fontsize=10)
    save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--requests", type=int, help="requests per workload (quick 8, full 16)")
    p.add_argument("--max-tokens", type=int, help="tokens per answer (quick 96, full 192)")
    p.add_argument("--repeats", type=int, help="timed repeats per row, alternating which system goes first (quick 3, full 5)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--peers", help="comma-separated peers to run (llamacpp, vllm), or none "
                                   "(default: both, none with --quick)")
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    args = p.parse_args()
    mode = dict(requests=8, max_tokens=96, repeats=3) if args.quick else dict(requests=16, max_tokens=192, repeats=5)
    for key, value in mode.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.json = args.json or RESULTS_DIR / ("speculative_quick.json" if args.quick else "speculative.json")
    args.png = args.png or args.json.with_suffix(".png")

    from streamengine.config import EngineConfig, SpeculativeConfig
    from streamengine.engine.core import EngineCore

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=args.k)
    cores = {"engine": EngineCore(EngineConfig()), "engine_ngram": EngineCore(EngineConfig(speculative=spec)),
             "engine_suffix": EngineCore(EngineConfig(speculative=dataclasses.replace(spec, method="suffix")))}
    args.peers = args.peers or ("none" if args.quick else "llamacpp,vllm")
    peers = [] if args.peers == "none" else args.peers.split(",")
    report: dict = {"num_speculative_tokens": args.k, "requests": args.requests, "max_tokens": args.max_tokens,
                    "repeats": args.repeats, "peers": peers, "software": software()}
    vllm_by_row = vllm_rows(cores["engine"].tokenizer, args) if "vllm" in peers else {}
    print(f"{'row':<12}{'engine':>10}{'ngram':>10}{'x':>7}{'accept':>8}{'suffix':>10}{'x':>7}{'accept':>8}  identical")
    for batch in BATCHES:
        for workload in WORKLOADS:
            row = measure(cores, workload, batch, args)
            # The fixed/per-row cost the speculating engine fitted on this row's own steps.
            row["step_fixed_per_row"] = ratio = cores["engine_ngram"].step_cost.ratio
            row["bound"] = bound(ratio, args.k, batch)
            key = f"b{batch}_{workload}"
            report[key] = row
            report[f"speedup_{key}"] = row["speedup"]
            report[f"speedup_suffix_{key}"] = row["speedup_suffix"]
            report[f"acceptance_{key}"] = row["acceptance"]
            row["peers"] = {}
            if "llamacpp" in peers:
                row["peers"]["llamacpp"] = llamacpp_row(workload, batch, prompts(cores["engine"].tokenizer, workload,
                                                                                  args.requests), args)
            if "vllm" in peers:
                row["peers"]["vllm"] = vllm_by_row[key]
            for name, peer in row["peers"].items():
                if peer.get("tok_s"):
                    report[f"{name}_tok_s_{key}"] = peer["tok_s"]
                    report[f"{name}_plain_tok_s_{key}"] = peer["tok_s_plain"]
                    report[f"vs_{name}_{key}"] = row["tok_s"]["engine_ngram"] / peer["tok_s"]
                    print(f"{'':<12}{name}: {peer['tok_s']:.1f} tok/s with its speculation, {peer['tok_s_plain']:.1f} "
                          f"without; engine ngram {report[f'vs_{name}_{key}']:.2f}x")
                else:
                    print(f"{'':<12}{name}: not run ({peer.get('unavailable')})")
            acc = {m: "-" if row[f"acceptance_{m}"] is None else f"{row[f'acceptance_{m}']:.2f}" for m in ("ngram", "suffix")}
            print(f"{key:<12}{row['tok_s']['engine']:>10.1f}{row['tok_s']['engine_ngram']:>10.1f}"
                  f"{row['speedup']:>7.2f}{acc['ngram']:>8}{row['tok_s']['engine_suffix']:>10.1f}"
                  f"{row['speedup_suffix']:>7.2f}{acc['suffix']:>8}  {row['identical']}")
    report["bound_b1"], report["bound_b8"] = report["b1_quote"]["bound"], report["b8_quote"]["bound"]
    report["goals"] = {key: {"goal": goal, "met": report[f"speedup_{key}"] >= goal} for key, goal in GOALS.items()}
    report["identical"] = all(report[f"b{b}_{w}"]["identical"] for b in BATCHES for w in WORKLOADS)
    ahead = [report[f"vs_{name}_b{b}_{w}"] >= 1.0 for name in peers for b in BATCHES for w in WORKLOADS
             if f"vs_{name}_b{b}_{w}" in report]
    report["goals"]["ahead_of_peers"] = {"goal": "every row", "met": bool(ahead) and all(ahead)}
    print(f"with every proposal accepted, quote could gain at most {report['bound_b1']:.2f}x at batch 1 and "
          f"{report['bound_b8']:.2f}x at batch 8 (step fixed/per-row cost "
          f"{report['b1_quote']['step_fixed_per_row']:.2f} and {report['b8_quote']['step_fixed_per_row']:.2f})")
    write_report(report, args.json, args.png, plot)


if __name__ == "__main__":
    main()
