"""bench/gpu_throughput.py in its --tiny mode (CPU, a tiny random Llama): the engine systems run,
the bucket path is taken and agrees with eager, fp8 is measured or skipped with its reason,
and the JSON has the keys the docs name. Speed is not checked: on CPU there are no graphs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_gpu_throughput", BENCH / "gpu_throughput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tiny_mode_runs_the_engine_systems(tmp_path):
    bench = load_bench()
    out = tmp_path / "gpu_throughput_tiny.json"
    assert bench.main(["--tiny", "--systems", "engine_eager,engine_graphs,engine_fp8", "--num-requests", "4",
                       "--output-len", "6", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    entry = report["sizes"]["tiny"]
    eager, graphs, fp8 = (entry["systems"][s] for s in ("engine_eager", "engine_graphs", "engine_fp8"))
    assert eager["decode_graph_replays"] == 0 and graphs["decode_graph_replays"] > 0
    assert graphs["graphs_are_cuda_graphs"] is False  # CPU: the buckets run eagerly
    assert entry["graphs_token_agreement"] == 1.0
    assert entry["graphs_vs_eager_tput"] > 0 and "engine_graphs_vs_hf_tput" in entry
    assert "skipped" in fp8 or fp8["output_tok_s"] > 0
    assert all("_tokens" not in s for s in entry["systems"].values())


def test_unknown_sizes_and_a_gpu_run_without_cuda_are_usage_errors(capsys):
    bench = load_bench()
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "--sizes", "70b"])
    with pytest.raises(SystemExit):
        bench.parse_args([])  # 1b and 7b need CUDA
    assert "no CUDA device" in capsys.readouterr().err


def test_a_failing_system_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    bench = load_bench()

    def broken(*args, **kwargs):
        raise RuntimeError("capture exploded")

    monkeypatch.setattr(bench, "engine_system", broken)
    out = tmp_path / "r.json"
    assert bench.main(["--tiny", "--systems", "engine_eager,engine_graphs", "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    systems = report["sizes"]["tiny"]["systems"]
    assert systems["engine_eager"] == {"error": "RuntimeError: capture exploded"} and "error" in systems["engine_graphs"]
    assert report["failed"] == ["tiny/engine_eager", "tiny/engine_graphs"]
    assert report["sizes"]["tiny"]["graphs_vs_eager_tput"] is None
