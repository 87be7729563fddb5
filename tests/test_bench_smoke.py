"""Benchmarks in their quickest modes on a tiny model, and their helpers, so they cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("engine_tok_s", "hf_generate_tok_s", "hf_generate_batch_tok_s")


def test_throughput_quick_on_tiny_model(tiny_llama_dir, tmp_path):
    out_json, out_png = tmp_path / "throughput.json", tmp_path / "throughput.png"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "throughput.py"),
        "--quick",
        "--trace",
        "both",
        "--model",
        str(tiny_llama_dir),
        "--num-requests",
        "4",
        "--max-len",
        "12",
        "--threads",
        "1",
        "--systems",
        "engine,hf_generate,hf_generate_batch,engine_kv16,engine_kv8",
        "--kv-quality",
        "--json",
        str(out_json),
        "--png",
        str(out_png),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "streamengine" in proc.stdout and "HF generate_batch" in proc.stdout  # the table

    data = json.loads(out_json.read_text())
    for key in KEYS:
        assert data[key] > 0, key
    assert data["primary_trace"] == "sharegpt"
    assert set(data["traces"]) == {"sharegpt", "alpaca"}
    for name, trace in data["traces"].items():
        assert trace["trace"]["num_requests"] == 4
        assert trace["trace"]["prompt_max"] <= 12 and trace["trace"]["output_max"] <= 12
        useful = trace["trace"]["total_output_tokens"]
        for system, result in trace["systems"].items():
            assert result["useful_output_tokens"] == useful, (name, system)
            assert result["generated_tokens"] >= useful, (name, system)  # padding only adds
            assert result["output_tok_s"] > 0 and result["requests_per_s"] > 0
    # the headline figures are the ShareGPT-like trace's
    assert data["engine_tok_s"] == data["traces"]["sharegpt"]["systems"]["engine"]["output_tok_s"]
    assert data["engine_kv16_tok_s"] > 0 and data["speedups"]["engine_kv16_vs_engine"] > 0
    kv16 = data["traces"]["sharegpt"]["systems"]["engine_kv16"]["details"]
    engine = data["traces"]["sharegpt"]["systems"]["engine"]["details"]
    assert kv16["kv_capacity_tokens"] >= 2 * engine["kv_capacity_tokens"]  # same bytes, half per token
    kv8 = data["traces"]["sharegpt"]["systems"]["engine_kv8"]["details"]
    assert kv8["kv_capacity_tokens"] >= 2 * kv16["kv_capacity_tokens"]  # one byte a value
    assert data["speedups"]["engine_kv8_vs_engine_kv16"] > 0
    quality = data["kv_quality"]["cache_types"]
    assert set(quality) == {"float16", "fp8", "fp8_e5m2"}
    for row in quality.values():
        assert 0 <= row["greedy_agreement"] <= 1 and 0 <= row["forced_agreement"] <= 1
        assert row["perplexity"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_statistics_match_the_paper():
    """The generators' clipped means sit near the paper's dataset means, and a quick run's
    requests are a prefix of the full trace (same seed, same draws)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from traces import ALPACA, SHAREGPT, make_trace, summarize
    finally:
        sys.path.remove(str(ROOT / "bench"))
    ids = list(range(100, 1100))
    for spec in (SHAREGPT, ALPACA):
        stats = summarize(make_trace(spec, 3000, ids, seed=0))
        assert abs(stats["prompt_mean"] - spec.prompt_mean) / spec.prompt_mean < 0.06, spec.name
        assert abs(stats["output_mean"] - spec.output_mean) / spec.output_mean < 0.06, spec.name
        assert stats["prompt_max"] <= spec.max_len and stats["output_max"] <= spec.max_len
    full = make_trace(SHAREGPT, 40, ids, seed=3)
    assert make_trace(SHAREGPT, 10, ids, seed=3) == full[:10]
    assert make_trace(SHAREGPT, 10, ids, seed=4) != full[:10]
    assert all(100 <= t < 1100 for r in full for t in r.prompt_token_ids)


def _load_serving():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "bench" / "serving.py")
    module = importlib.util.module_from_spec(spec)
    before = list(sys.path)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)  # puts bench/ on sys.path, as a script needs
    finally:
        sys.path[:] = before
        del sys.modules[spec.name]
    return module


class _Engine:
    """What the probe reads of the engine: the scheduler's running list."""

    class core:
        class scheduler:
            running = [1, 2]


def test_lag_probe_never_reports_negative_lag():
    """uvloop's millisecond timers may wake a sleep before its perf_counter deadline (a busy CI
    run once reported p50 = -0.005 ms): such a wake-up is on time, lag 0, and is counted."""
    import asyncio
    import itertools

    serving = _load_serving()
    # a clock that runs backwards: every wake-up comes "before" its deadline
    probe = serving.LagProbe(_Engine(), clock=itertools.count(0.0, -1.0).__next__)

    async def run_briefly():
        task = asyncio.create_task(probe.run())
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(run_briefly())
    report = probe.report()
    assert report["lag_samples"] > 0 and report["lag_early_samples"] == report["lag_samples"]
    assert report["lag_p50_ms"] == report["lag_p99_ms"] == report["lag_max_ms"] == 0.0
    assert report["max_running"] == 2

    probe.reset()
    for overshoot in (-5e-6, 0.0, 0.002, 0.004, -1e-3):
        probe.record(overshoot)
    report = probe.report()
    assert report["lag_samples"] == 5 and report["lag_early_samples"] == 2
    assert 0.0 <= report["lag_p50_ms"] <= report["lag_p99_ms"] <= report["lag_max_ms"] == 4.0
    assert abs(report["lag_mean_ms"] - 1.2) < 1e-9
