"""bench/stress.py, very short, on the tiny model: the benchmark cannot rot, and a clean run of
it (every stream complete, nothing left in the server) is itself a check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("errors", "leaked_blocks", "health_p99_ms", "rss_growth_mb", "phases", "server")


def test_stress_quick_on_tiny_model(tiny_llama_dir, tmp_path):
    out_json = tmp_path / "stress.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "stress.py"), "--quick",
        "--model", str(tiny_llama_dir), "--threads", "1",
        "--streams", "50,100", "--soak-seconds", "10", "--warmup-seconds", "3", "--slow-stall", "0.5,2",
        "--json", str(out_json),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
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
