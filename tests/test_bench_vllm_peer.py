"""bench/vllm_peer.py without vLLM: the runner protocol end to end with a stand-in runner under
this python (result, vLLM's error with its root cause from the log), the figures drawn from a
runner's result, and vllm_spec_rows' two runs and its error for an unsupported speculation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_bench_perf_smoke import load_bench

STAND_IN = '''
import json, sys
job = json.loads(open(sys.argv[1]).read())
if job.get("speculative_config"):
    print("(EngineCore pid=1) NotImplementedError: speculation is not supported on CPU", flush=True)
    result = {"error": "RuntimeError: Engine core initialization failed. See root cause above."}
else:
    result = {"vllm_version": "0.0-test", "load_s": 1.0, "warmup_s": 0.5, "seconds": [2.0, 1.0, 4.0],
              "tokens": [[1, 2, 3, 4]] * len(job["prompts"]), "spec": {}}
json.dump(result, open(sys.argv[2], "w"))
'''


@pytest.fixture()
def peer(tmp_path, monkeypatch):
    module = load_bench("vllm_peer.py")
    runner = tmp_path / "runner.py"
    runner.write_text(STAND_IN)
    monkeypatch.setattr(module, "RUNNER", runner)
    monkeypatch.setattr(module, "VENVS", tmp_path)
    monkeypatch.setattr(module, "vllm_venv", lambda: Path(sys.executable))
    return module


def test_run_vllm_result_and_figures(peer):
    result = peer.run_vllm(peer.base_job(Path("m"), [[5, 6], [7]], 4, 1, 3))
    assert result["tokens"] == [[1, 2, 3, 4]] * 2
    assert peer.tok_s(result) == pytest.approx(4.0)  # 8 tokens, median of 2, 1, 4 s
    assert peer.acceptance(result) is None
    spec = {"vllm:spec_decode_num_draft_tokens": 8.0, "vllm:spec_decode_num_accepted_tokens": 6.0}
    assert peer.acceptance({"spec": spec}) == pytest.approx(0.75)


def test_run_vllm_error_names_root_cause(peer):
    job = {**peer.base_job(Path("m"), [[5]], 4, 1, 1), "speculative_config": peer.ngram_config(4)}
    with pytest.raises(peer.PeerUnavailable, match="NotImplementedError: speculation is not supported"):
        peer.run_vllm(job)


def test_spec_rows_reports_unsupported_speculation(peer, monkeypatch):
    loader = pytest.importorskip("streamengine.models.loader")
    monkeypatch.setattr(loader, "default_model_folder", lambda: Path("m"))
    monkeypatch.setattr(peer, "token_ids", lambda folder, texts: [[1, 2]] * len(texts))
    with pytest.raises(peer.PeerUnavailable, match=r"n-gram speculation \(k=3\) on vLLM's CPU backend"):
        peer.vllm_spec_rows(["a", "b"], 4, 1, 3, 1, None)


def test_runner_env_binds_cores_and_drops_pythonpath(peer, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = peer.runner_env(Path(sys.executable), threads=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "PYTHONPATH" not in env
    assert env["HF_HUB_OFFLINE"] == "1"


def test_agreement_counts_positions_over_the_longer_answer(peer):
    assert peer.agreement([[1, 2, 3], [4]], [[1, 9, 3], [4, 5]]) == pytest.approx(3 / 5)
