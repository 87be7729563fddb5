"""Smoke tests of the performance benchmarks (bench/roofline.py, prefix.py, serving.py).

Each script runs as a subprocess in its quickest mode on the tiny random Llama, with knobs
small enough for a few seconds of work, and must exit 0 and write its JSON with the keys the
README and the issue rely on. The numbers themselves are not checked for speed (the machine is
shared and the model is random); only that they exist, are consistent and mean what they say.

The `transformers serve` baseline of serving.py takes about a minute here, so its test runs
only with STREAMENGINE_BENCH_BASELINE=1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: str) -> ModuleType:
    """bench/`script` imported as module bench_<name>, with bench/ on sys.path (the scripts
    import their siblings)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def run_script(script: str, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs bench/`script` with `args` offline; fails the test unless it exits 0."""
    cmd = [sys.executable, str(BENCH / script), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=BENCH.parent,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


def run_bench(script: str, args: list[str], out: Path, timeout: float = 120) -> dict:
    run_script(script, ["--quick", "--json", str(out), "--no-png", *args], timeout)
    return json.loads(out.read_text())


def test_roofline_quick(tiny_llama_dir, tmp_path):
    report = run_bench(
        "roofline.py",
        ["--model", str(tiny_llama_dir), "--batches", "1,4", "--steps", "2", "--warmup", "1",
         "--matmul-n", "256", "--bandwidth-mib", "16", "--threads", "1", "--compare-transformers"],
        tmp_path / "roofline.json",
    )
    assert set(report["transformers_modules_tok_s_by_batch"]) == {"1", "4"}
    for key in ("decode_tok_s_by_batch", "roofline_tok_s", "efficiency_at_max_batch",
                "batch1_step_ms", "batch1_bound_ms"):
        assert key in report, key
    by_batch = report["decode_tok_s_by_batch"]
    assert set(by_batch) == {"1", "4"}
    assert all(v > 0 for v in by_batch.values())
    assert report["roofline_tok_s"] > 0 and report["batch1_bound_ms"] > 0
    assert report["efficiency_at_max_batch"] == pytest.approx(by_batch["4"] / report["roofline_tok_s"])
    # The model cost must be the tiny Llama's: tied embeddings counted once, 2 FLOPs per weight.
    model = report["model"]
    assert model["flops_per_token"] == 2 * model["matmul_params"]
    assert model["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V x layers x kv heads x head dim x fp32
    # Every timed step of batch 4 decoded exactly 4 tokens (the script raises otherwise).
    assert report["batches"]["4"]["steps"] == 2


def test_prefix_quick(tiny_llama_dir, tmp_path):
    report = run_bench(
        "prefix.py",
        ["--model", str(tiny_llama_dir), "--tenants", "2", "--requests", "6", "--system-len", "128",
         "--question-len", "8", "--answer-len", "4", "--rate", "20", "--trials", "1",
         "--kv-tokens", "2048", "--threads", "1"],
        tmp_path / "prefix.json",
    )
    assert report["ttft_speedup_warm"] > 0
    assert 0.0 <= report["hit_rate"] <= 1.0
    # The warm request found its whole (block-aligned) system prompt in the cache.
    assert report["single"]["warm_cached_tokens"] == [128]
    on, off = report["modes"]["cache_on"], report["modes"]["cache_off"]
    assert on["num_requests"] == off["num_requests"] == 6
    assert on["shared_tokens"] == 4 * 128  # 6 requests, minus each tenant's first
    assert off["prefix_cache_hits"] == 0
    assert on["prefix_cache_hits"] == on["cached_tokens_reported"]
    for mode in (on, off):
        assert 0 < mode["ttft_p50_s"] <= mode["ttft_p99_s"]


SERVING_ARGS = ["--num-requests", "3", "--rates", "4", "--lag-requests", "4", "--lag-seconds", "10",
                "--run-timeout", "60", "--threads", "1"]


def _check_rate(result: dict, n: int) -> None:
    assert result["completed"] == n and result["errors"] == 0, result
    assert result["wrong_output_len"] == 0
    for metric in ("ttft_s", "itl_s", "normalized_latency_s_per_token"):
        stats = result[metric]
        assert stats["mean"] is not None and stats["p50"] is not None and stats["p99"] is not None, metric
        assert stats["p99"] >= stats["p50"] > 0, metric


def test_serving_quick(tiny_llama_dir, tmp_path):
    report = run_bench(
        "serving.py", ["--model", str(tiny_llama_dir), "--no-baseline", *SERVING_ARGS], tmp_path / "serving.json",
    )
    assert set(report["systems"]) == {"se_ws", "se_sse"}
    for system in ("se_ws", "se_sse"):
        _check_rate(report["systems"][system]["4"], 3)
    lag = report["event_loop_lag"]
    assert lag["burst_completed"] == 4 and lag["lag_samples"] > 0
    assert 0 <= report["event_loop_lag_p50_ms"] <= report["event_loop_lag_p99_ms"]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("STREAMENGINE_BENCH_BASELINE"), reason="set STREAMENGINE_BENCH_BASELINE=1")
def test_serving_baseline(tiny_llama_dir, tmp_path):
    pytest.importorskip("fastapi")
    report = run_bench(
        "serving.py",
        ["--model", str(tiny_llama_dir), "--systems", "se_ws", "--no-lag", *SERVING_ARGS],
        tmp_path / "serving.json", timeout=300,
    )
    assert report["baseline_note"] is None
    _check_rate(report["systems"]["hf_serve"]["4"], 3)
    assert "4" in report["normalized_latency_ratio_baseline_over_ours"]
