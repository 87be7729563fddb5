"""Runs inside vLLM's own venv (see vllm_peer.py): one model load, a warm-up, timed generates.

Kept free of streamengine imports: this file runs under another python with other packages.
Usage: python vllm_runner.py IN.json OUT.json. IN holds the model folder, prompts as token ids,
max_tokens (one for all, or one per prompt), batch, repeats and optional ignore_eos /
speculative_config / json_schema / LLM keyword arguments, and `loras` (per prompt an adapter
[name, id, folder] or null for the base model); OUT holds per-repeat seconds, the last repeat's
token ids, spec-decode counters and the vLLM version, or {"error": ...} when the model cannot
be built or run.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def sampling_params(job: dict, max_tokens: int):
    """Greedy SamplingParams, with a JSON schema through whichever API this vLLM has."""
    from vllm import SamplingParams

    extra = {}
    if job.get("json_schema") is not None:
        spec = {"json": job["json_schema"], "disable_any_whitespace": job.get("json_compact", False)}
        try:
            from vllm.sampling_params import StructuredOutputsParams
            extra["structured_outputs"] = StructuredOutputsParams(**spec)
        except ImportError:  # vLLM before structured_outputs replaced guided_decoding
            from vllm.sampling_params import GuidedDecodingParams
            extra["guided_decoding"] = GuidedDecodingParams(**spec)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=job.get("ignore_eos", False),
                          **extra)


# streamengine's JSON layout (json.dumps's), in llguidance's schema key: vLLM's guidance backend
# alone would write "," and ":" without the space.
COMPACT_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def counters(llm) -> dict[str, float]:
    """vLLM's cumulative spec-decode counters, summed over engines; {} when metrics are unreachable."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # older vLLM or stats disabled
        return {}
    out: dict[str, float] = {}
    for m in metrics:
        if m.name in SPEC_COUNTERS:
            out[m.name] = out.get(m.name, 0.0) + float(getattr(m, "value", 0.0))
    return out


def per_prompt(job: dict) -> tuple[list, list]:
    """Each prompt's SamplingParams and LoRARequest (None: the base model); one SamplingParams
    object is shared by prompts of the same length, as vLLM users pass one for all."""
    n = len(job["prompts"])
    lengths = job["max_tokens"] if isinstance(job["max_tokens"], list) else [job["max_tokens"]] * n
    made = {m: sampling_params(job, m) for m in set(lengths)}
    loras = job.get("loras") or [None] * n
    if any(loras):
        from vllm.lora.request import LoRARequest

        loras = [LoRARequest(*lora) if lora else None for lora in loras]
    return [made[m] for m in lengths], loras


def generate(llm, prompts: list[list[int]], params: list, loras: list, batch: int) -> tuple[float, list[list[int]]]:
    """Seconds spent in LLM.generate over `prompts`, `batch` at a time, and each prompt's token ids."""
    seconds, tokens = 0.0, []
    for lo in range(0, len(prompts), batch):
        chunk = [{"prompt_token_ids": ids} for ids in prompts[lo:lo + batch]]
        lora = loras[lo:lo + batch] if any(loras) else None
        start = time.perf_counter()
        outs = llm.generate(chunk, params[lo:lo + batch], use_tqdm=False, lora_request=lora)
        seconds += time.perf_counter() - start
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    return seconds, tokens


def run(job: dict) -> dict:
    """One model load, then the job itself, or each of its `tasks` (prompts, max_tokens,
    batch, repeats, json_schema each) in turn: {"tasks": [result, ...]} then."""
    import vllm
    from vllm import LLM

    tasks = job.get("tasks")
    if job.get("json_compact") and any(t.get("json_schema") is not None for t in (tasks or [job])):
        job.setdefault("llm_kwargs", {})["structured_outputs_config"] = {"backend": "guidance",
                                                                         "disable_any_whitespace": True}
    kwargs = dict(model=job["model"], dtype=job.get("dtype", "float32"), max_model_len=job["max_model_len"],
                  disable_log_stats=False, seed=0, **job.get("llm_kwargs", {}))
    if job.get("speculative_config"):
        kwargs["speculative_config"] = job["speculative_config"]
    start = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - start
    if tasks is None:
        return {"vllm_version": vllm.__version__, "load_s": load_s, **run_task(llm, job)}
    return {"vllm_version": vllm.__version__, "load_s": load_s,
            "tasks": [run_task(llm, {"json_compact": job.get("json_compact"), **task}) for task in tasks]}


def run_task(llm, job: dict) -> dict:
    """A warm-up generate over the first batch (answers of `warmup_tokens` when given), then
    `repeats` timed passes over all prompts."""
    if job.get("json_schema") is not None and job.get("json_compact"):
        job = {**job, "json_schema": {"x-guidance": COMPACT_LAYOUT, **job["json_schema"]}}
    params, loras = per_prompt(job)
    prompts, batch = job["prompts"], job["batch"]
    # `warmup_tokens` shortens the warm-up's answers where a full pass would cost minutes
    warm = per_prompt({**job, "max_tokens": job["warmup_tokens"]})[0] if job.get("warmup_tokens") else params
    start = time.perf_counter()
    generate(llm, prompts[:batch], warm, loras, batch)  # compiles shapes, loads adapters, caches prompts
    warmup_s = time.perf_counter() - start
    before = counters(llm)
    seconds, tokens = [], []
    for _ in range(job["repeats"]):
        s, tokens = generate(llm, prompts, params, loras, batch)
        seconds.append(s)
    after = counters(llm)
    return {"warmup_s": warmup_s, "seconds": seconds, "tokens": tokens,
            "spec": {k: after[k] - before.get(k, 0.0) for k in after}}


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    try:
        result = run(job)
    except Exception as exc:  # reported to the caller as the reason the peer cannot run
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
