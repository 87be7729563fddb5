"""bench/structured.py, very short, on the tiny model: both modes generate the same tokens at
every batch size, and the JSON carries the keys and the goal the issue and the docs rely on."""

from __future__ import annotations

import pytest
from test_bench_perf_smoke import run_bench

KEYS = ("overhead_batch1", "overhead_batch64", "compile_ms_p50", "compile_ms_p99", "tokenizer_init_ms")


def test_structured_quick_on_tiny_model(tiny_llama_dir, tmp_path):
    report = run_bench("structured.py", [
        "--model", str(tiny_llama_dir), "--max-tokens", "24", "--repeats", "1", "--compile-rounds", "1",
    ], tmp_path / "structured.json")

    for key in KEYS:
        assert report[key] is not None and report[key] > 0, key
    assert set(report["by_batch"]) == {"1", "64"}
    for batch, b in report["by_batch"].items():
        for mode in ("unconstrained", "constrained"):
            (run,) = b["runs"][mode]
            # Every sample generated exactly max_tokens (the script raises otherwise): equal work.
            assert run["tokens"] == 24 * int(batch), (batch, mode)
        assert b["overhead"] == pytest.approx(b["unconstrained_tok_s"] / b["constrained_tok_s"])
    assert report["overhead_batch64"] == report["by_batch"]["64"]["overhead"]
    assert report["num_compiles"] == 20
    assert report["compile_ms_p50"] <= report["compile_ms_p99"] <= report["compile_ms_max"]
    goal = report["goals"]["overhead_batch64"]
    assert goal["met"] == (goal["value"] <= 1.10) and report["all_goals_met"] == goal["met"]
