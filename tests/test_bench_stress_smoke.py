"""bench/stress.py, very short, on the tiny model: the benchmark cannot rot, and a clean run of
it (every stream complete, nothing left in the server) is itself a check."""

from __future__ import annotations

import json

from test_bench_perf_smoke import run_script

KEYS = ("errors", "leaked_blocks", "health_p99_ms", "rss_growth_mb", "phases", "server")


def test_stress_quick_on_tiny_model(tiny_llama_dir, tmp_path):
    out_json = tmp_path / "stress.json"
    proc = run_script("stress.py", [
        "--quick", "--model", str(tiny_llama_dir), "--threads", "1",
        "--streams", "50,100", "--soak-seconds", "10", "--warmup-seconds", "3", "--slow-stall", "0.5,2",
        "--json", str(out_json),
    ], timeout=240)
    assert "phase" in proc.stdout and "leaked blocks" in proc.stdout  # the table

    data = json.loads(out_json.read_text())
    for key in KEYS:
        assert key in data, key
    assert data["errors"] == 0, data["error_examples"]
    assert data["leaked_blocks"] == 0
    assert data["health_p99_ms"] > 0 and isinstance(data["rss_growth_mb"], float)
    for n in (50, 100):
        phase = data["phases"][f"streams_{n}"]
        assert phase["completed"] == n and phase["failed"] == 0, phase["failure_examples"]
        assert phase["health_ms"]["count"] > 0 and phase["after"]["requests"] == 0
    soak = data["phases"]["soak"]
    assert sum(soak["episodes"].values()) > 0 and soak["errors"] == 0
    assert data["server"]["alive"] and data["server"]["final"]["requests"] == 0
    assert not data["server"]["open_connections"]  # every client socket closed on the server too
