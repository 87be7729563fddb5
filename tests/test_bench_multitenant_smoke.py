"""bench/multitenant.py, very short, on the tiny model: both systems serve every turn of the
same workload, and the JSON carries the keys and goals the issue and the README rely on."""

from __future__ import annotations

from test_bench_perf_smoke import load_bench, run_bench

KEYS = ("quiet_ttft_p99_ratio", "hit_rate_fair", "hit_rate_baseline", "throughput_ratio", "jain_fair",
        "jain_baseline", "jain_fair_trace", "jain_baseline_trace")
GOALS = ("quiet_ttft_p99_ratio", "hit_rate_gain_points", "throughput_ratio", "jain_fair")


def test_multitenant_quick_on_tiny_model(tiny_llama_dir, tmp_path):
    report = run_bench("multitenant.py", [
        "--model", str(tiny_llama_dir), "--threads", "1", "--duration", "4", "--rate", "2",
        "--scale", "0.1", "--window", "1", "--sample-period", "0.1", "--backlogged-s", "3",
        "--backlogged-window", "1",
    ], tmp_path / "multitenant.json")

    for key in KEYS:
        assert key in report, key
    assert set(report["goals"]) == set(GOALS)
    for goal in report["goals"].values():
        assert goal["met"] == (goal["value"] is not None and goal["value"] >= float(goal["target"][3:]))
    assert report["all_goals_met"] == all(g["met"] for g in report["goals"].values())

    work = report["workload"]
    assert set(report["systems"]) == {"baseline", "streamengine"}
    for name, system in report["systems"].items():
        # Every turn of every conversation finished with its drawn answer length (the script
        # raises otherwise), in both systems.
        assert system["num_turns"] == work["num_turns"] > 0, name
        assert system["num_conversations"] == work["num_conversations"], name
        assert sum(c["num_turns"] for c in system["classes"].values()) == work["num_turns"]
        for klass, c in system["classes"].items():  # no cache hits what a never-evicting one misses
            assert c["hit_rate"] <= c["hit_rate_unbounded"] + 1e-9, (name, klass)
            assert min(c["lost_hit_tokens"].values()) >= 0 and (sum(c["lost_hit_tokens"].values()) > 0) == (
                c["hit_rate"] < c["hit_rate_unbounded"] - 1e-9), (name, klass)
        assert 0.0 < system["hit_rate"] < 1.0  # later turns re-send cached history
        # The best eviction a bounded pool allows hits no more than a cache that never evicts.
        assert 0.0 < system["hit_rate_optimal"] <= system["hit_rate_unbounded"] + 1e-9, name
        assert system["fairness"]["num_windows_total"] > 0  # the engine's tenant stats were sampled
        if system["quiet_turns_burst"]:  # each turn's admission wait is part of its time to first token
            assert 0.0 <= system["quiet_queue_p99_burst_s"] <= system["quiet_ttft_p99_burst_s"], name
        phase = system["backlogged"]
        assert [t["weight"] for t in phase["tenants"].values()] == [1.0, 1.0, 2.0]
        assert all(t["weighted_service"] > 0 for t in phase["tenants"].values()), name
        assert abs(sum(t["share"] for t in phase["tenants"].values()) - 1.0) < 1e-9
        assert phase["fairness"]["num_windows_total"] == 3
    assert report["jain_fair"] == report["systems"]["streamengine"]["backlogged"]["fairness"]["jain"]
    assert report["systems"]["baseline"]["pinned_bots"] == []
    assert report["systems"]["streamengine"]["pinned_bots"][0] == "bot00"  # most popular first
    assert report["hit_rate_fair"] == report["systems"]["streamengine"]["hit_rate"]
    assert report["hit_rate_optimal"] == report["systems"]["streamengine"]["hit_rate_optimal"]
    assert report["hit_rate_headroom_points_optimal"] <= report["hit_rate_headroom_points"] + 1e-9
    assert work["conversations_by_class"]["noisy"] > 0


def test_think_time_pauses_turns_and_leaves_the_rest_of_the_trace_alone():
    import dataclasses

    multitenant = load_bench("multitenant.py")

    def workload(think: float):
        args = multitenant.parse_args(["--quick", "--think-time", str(think), "--no-png"])
        return multitenant.make_workload(args, list(range(100, 400)))

    plain, paused = workload(0.0), workload(8.0)
    assert [c.think_s for c in plain.conversations] == [()] * len(plain.conversations)
    assert [dataclasses.replace(c, think_s=()) for c in paused.conversations] == list(plain.conversations)
    pauses = [t for c in paused.conversations for t in c.think_s]
    assert all(len(c.think_s) == len(c.users) - 1 for c in paused.conversations)
    assert 6.0 < sum(pauses) / len(pauses) < 10.0  # exponential, mean 8 s


def test_backlogged_only_runs_the_fairness_phase_alone(tiny_llama_dir, tmp_path):
    report = run_bench("multitenant.py", [
        "--model", str(tiny_llama_dir), "--threads", "1", "--duration", "6", "--rate", "2", "--scale", "0.1",
        "--sample-period", "0.1", "--backlogged-s", "2", "--backlogged-window", "1", "--backlogged-only",
        "--systems", "streamengine",
    ], tmp_path / "backlogged.json")

    assert set(report["systems"]) == {"streamengine"} and report["jain_baseline"] is None
    phase = report["systems"]["streamengine"]["backlogged"]
    assert set(phase["tenants"]) == {"heavy", "light", "double"}
    assert all(t["weighted_service"] > 0 for t in phase["tenants"].values())
    assert phase["fairness"]["num_windows_total"] == 2
    assert report["jain_fair"] == phase["fairness"]["jain"]
