"""bench/contention.py in its smallest run (the default engine only, quiet and beside one busy
process, a few tokens), so the script and its JSON cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_contention_runs_quiet_and_contended(smollm_dir, tmp_path):
    out_json, out_png = tmp_path / "contention.json", tmp_path / "contention.png"
    cmd = [sys.executable, str(ROOT / "bench" / "contention.py"), "--quick", "--systems", "engine",
           "--seconds", "0.2", "--max-tokens", "4", "--json", str(out_json), "--png", str(out_png)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out_json.read_text())
    for batch in ("b1", "b16"):
        row = report["systems"]["engine"][batch]
        assert row["tok_s_quiet"] > 0 and row["tok_s_contended"] > 0
        assert row["kept"] == row["tok_s_contended"] / row["tok_s_quiet"]
    assert report["engine_kept_b1"] == report["systems"]["engine"]["b1"]["kept"]
    assert "engine_vs_1t_contended_b1" not in report  # no one-thread run to compare with
    assert out_png.stat().st_size > 0
