"""vLLM's rows of bench/peers.py and bench/lora.py without vLLM: the runner tasks they build, the
figures and ratios they draw from made-up runner results, and the token-id jobs of the one
Poisson client."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_bench_perf_smoke import load_bench


@pytest.fixture(scope="module")
def rows():
    return load_bench("peers_vllm.py")


def peers_args(**over) -> SimpleNamespace:
    return SimpleNamespace(**{"tput_gen": 4, "decode_tokens": 8, "reps": 2, **over})


def test_offline_tasks_and_figures(rows):
    args = peers_args()
    ids = {"tput": [[[1] * 6, [2] * 6]], "prefill": {16: [[3] * 16, [4] * 16]}, "b1": [5, 6]}
    tasks = rows.offline_tasks(args, ids)
    assert [t["work"] for t in tasks] == ["tput", "prefill16", "prefill16", "b1", "b1"]
    assert tasks[0]["batch"] == 2 and tasks[0]["max_tokens"] == 5  # the engine's G + 1 tokens
    assert [t["max_tokens"] for t in tasks[3:]] == [9, 1] and tasks[3]["repeats"] == 2
    results = [{"seconds": [2.0]}, {"seconds": [0.5]}, {"seconds": [0.25]}, {"seconds": [1.5, 1.2]},
               {"seconds": [0.3, 0.2]}]
    figures = rows.offline_figures(args, tasks, results)
    assert figures["tput"]["tok_s"] == pytest.approx(2 * (6 + 4) / 2.0)  # positions through the model
    assert figures["prefill16"]["tok_s"] == pytest.approx(64.0) and len(figures["prefill16"]["samples_tok_s"]) == 2
    assert figures["b1"]["tok_s"] == pytest.approx(8 / (1.2 - 0.2))  # N decode steps without the prefill


def test_vllm_keys_ratios_and_goals(rows):
    report = {"engine_tput_tok_s": 300.0, "engine_b1_tok_s": 100.0, "engine_prefill4096_tok_s": None}
    offline = {"tput": {"tok_s": 150.0}, "b1": {"tok_s": 125.0}, "prefill4096": {"tok_s": 400.0}}
    serving = {"engine": {"ttft_s": {"p50": 0.2}}, "vllm": {"ttft_s": {"p50": 0.5}}}
    keys = rows.vllm_keys(report, offline, serving, [4096])
    assert keys["vllm_tput_tok_s"] == 150.0 and keys["vllm_prefill4096_tok_s"] == 400.0
    assert keys["vllm_ratios"]["tput"] == pytest.approx(2.0) and keys["vllm_ratios"]["b1"] == pytest.approx(0.8)
    assert keys["vllm_ratios"]["prefill4096"] is None  # the engine's figure missing: said, not invented
    assert keys["vllm_ratios"]["serve_ttft_p50"] == pytest.approx(2.5)  # vLLM's TTFT over the engine's
    goals = keys["vllm_goals"]
    assert goals["tput"]["met"] and not goals["b1"]["met"] and not goals["prefill4096"]["met"]
    assert goals["ahead_of_vllm_on_every_row"]["met"] is False
    unavailable = rows.vllm_keys(report, {"unavailable": "why"}, None, [4096])
    assert unavailable["vllm_tput_tok_s"] is None and "serve_ttft_p50" not in unavailable["vllm_ratios"]


def test_make_jobs_sends_token_ids_untagged():
    serving = load_bench("serving.py")
    jobs = serving.make_jobs(SimpleNamespace(seed=0), [[1, 2], [3]], [4, 5], 0, 0, 2.0)
    assert [j.prompt for j in jobs] == [[1, 2], [3]] and jobs[0].arrival_s == 0.0 < jobs[1].arrival_s
    text = serving.make_jobs(SimpleNamespace(seed=0), ["hi"], [4], 1, 2, 2.0)
    assert text[0].prompt.endswith(" hi") and text[0].prompt.startswith("#1")


def test_lora_compare_agreement_and_adapter_effect():
    lora = load_bench("lora.py")
    report = {"decode32": {"tok_s": {"base": 400.0, "lora16": 300.0}}}
    engine = {"base": [[1, 2, 3, 4]], "lora16": [[1, 2, 9, 9]]}
    vllm = {"decode32": {"base": {"tok_s": 200.0, "tokens": [[1, 2, 3, 4]]},
                         "lora16": {"tok_s": 100.0, "tokens": [[1, 2, 9, 8]]}}}
    lora.compare(report, "decode32", engine, vllm)
    row = report["decode32"]
    assert row["vs_vllm"] == {"base": pytest.approx(2.0), "lora16": pytest.approx(3.0)}
    assert row["agreement_vs_vllm"] == pytest.approx(0.75)  # compared under the most adapters
    assert row["adapter_changed"] == {"engine": pytest.approx(0.5), "vllm": pytest.approx(0.5)}
    assert [lora.adapter_of(i, 4) for i in (0, 5)] == ["a0", "a1"] and lora.adapter_of(3, 0) is None
