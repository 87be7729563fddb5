"""bench/throughput.py in its quickest mode on a tiny model, so the benchmark cannot rot."""

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
        "engine,hf_generate,hf_generate_batch,engine_kv16",
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
