"""bench/cluster.py without a Ray cluster: its report and goals on synthetic numbers, its KV
event counting, its router-memory measurement, and the HTTP client end to end against the
single-process server on the tiny model (the `single` system only; clusters are too slow to
start here, tests/test_ray_cluster.py covers them)."""

from __future__ import annotations

import pytest
from test_bench_perf_smoke import load_bench, run_bench

HEADLINE = ("hit_rate_ours", "hit_rate_pow2", "hit_rate_ray_prefix", "hit_rate_single", "ttft_p50_ours",
            "ttft_p50_pow2", "ttft_p50_ray_prefix", "ttft_p99_ours", "throughput_ours")


@pytest.fixture(scope="module")
def cluster():
    return load_bench("cluster.py")


def _system(hit_rate: float, p50: float, p99: float = 1.0) -> dict:
    return {"hit_rate": hit_rate, "ttft_p50_s": p50, "ttft_p99_s": p99, "output_tok_s": 10.0}


def test_goals_compare_ours_with_single_pow2_and_ray_prefix(cluster):
    systems = {"single": _system(0.80, 0.1), "pow2": _system(0.5, 1.0), "ray_prefix": _system(0.6, 0.5),
               "cached": _system(0.75, 0.4)}
    report = cluster.headline(systems)
    assert report["hit_rate_ours"] == 0.75 and report["ttft_p50_pow2"] == 1.0
    goals = cluster.goals(report)
    assert goals["hit_rate_ours_vs_single"]["met"]  # 0.75 >= 0.9 * 0.80
    assert goals["hit_rate_ours_vs_single"]["limit"] == pytest.approx(0.72)
    assert goals["ttft_p50_ours_vs_pow2"]["met"]  # 0.4 <= 0.5 * 1.0
    assert goals["ttft_p50_ours_vs_ray_prefix"]["met"]  # 0.4 < 0.5

    systems["cached"] = _system(0.70, 0.55)  # each goal just missed
    goals = cluster.goals(cluster.headline(systems))
    assert not any(g["met"] for g in goals.values()), goals


def test_a_missing_system_leaves_its_keys_none_and_its_goals_unmet(cluster):
    report = cluster.headline({"cached": _system(0.7, 0.2)})
    assert report["hit_rate_single"] is None and report["ttft_p50_pow2"] is None
    assert not any(g["met"] for g in cluster.goals(report).values())


def test_event_traffic_counts_blocks_by_kind(cluster):
    from streamengine.kv.events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventBatch,
        encode,
    )

    h = [bytes([i]) * 16 for i in range(5)]
    traffic = cluster.ReplicaTraffic()
    first = encode(EventBatch(1.0, [BlockStored(h[:3], None, [1] * 48, 16), BlockRemoved(h[:2])]))
    second = encode(EventBatch(2.0, [BlockStored(h[3:], h[2], [2] * 32, 16), AllBlocksCleared()]))
    traffic.add(first)
    traffic.add(second)
    rates = traffic.rates(2.0)
    assert rates["totals"] == {"batches": 2, "events": 4, "bytes": len(first) + len(second),
                               "blocks_stored": 5, "blocks_removed": 2, "clears": 1}
    assert rates["blocks_stored_per_s"] == 2.5 and rates["events_per_s"] == 2.0


def test_index_memory_counts_what_the_index_keeps(cluster):
    memory = cluster.index_memory(num_hashes=4000, num_replicas=4)
    # More than the 16-byte digest itself (a bytes object, a set entry, a dict entry), far
    # less than the event that carried it (token ids included).
    assert 60 < memory["bytes_per_indexed_block"] < 1000, memory
    # A hash every replica holds costs one more set entry per holder, not a whole entry.
    assert memory["bytes_per_holder_shared"] < memory["bytes_per_indexed_block"]
    assert memory["apply_blocks_per_s"] > 0 and memory["rank_us_64_blocks_1000_replicas"] > 0


def test_pool_holds_its_fraction_and_at_least_the_longest_turn(cluster):
    args = cluster.parse_args(["--quick", "--bots", "4", "--duration", "5"])
    assert args.rate == cluster.QUICK["rate"] and args.json.name == "cluster_quick.json"
    workload = cluster.make_workload(cluster.workload_args(args), list(range(100, 5000)))
    assert workload.conversations and not any(c.burst for c in workload.conversations)
    pool = cluster.size_pool(workload, 0.5, 1000)
    assert pool.footprint_tokens == cluster.footprint_tokens(workload) <= workload.footprint_tokens  # bots in the trace
    assert pool.tokens >= pool.footprint_tokens * 0.5 and pool.tokens % cluster.BLOCK_SIZE == 0
    tiny = cluster.size_pool(workload, 1e-6, 1000)
    assert tiny.tokens >= workload.longest_turn_tokens + cluster.BLOCK_SIZE
    assert pool.describe()["blocks_single"] == 2 * pool.blocks


def test_single_system_over_http_on_tiny_model(tiny_llama_dir, tmp_path):
    """The client against the real single-process server: every turn streamed, with usage."""
    report = run_bench("cluster.py", [
        "--model", str(tiny_llama_dir), "--systems", "single", "--single-threads", "1", "--bots", "3",
        "--duration", "3", "--rate", "2", "--scale", "0.1", "--index-hashes", "400",
    ], tmp_path / "cluster.json")
    for key in HEADLINE:
        assert key in report, key
    single = report["systems"]["single"]
    assert single["num_turns"] == report["workload"]["num_turns"] > 0
    assert 0.0 < report["hit_rate_single"] < 1.0  # later turns re-send their cached history
    assert report["hit_rate_ours"] is None and not report["all_goals_met"]
    assert single["cached_tokens"] <= single["prompt_tokens"]
    assert report["kv_pool"]["tokens_single"] == 2 * report["kv_pool"]["tokens_per_replica"]
    assert report["router_memory"]["num_hashes"] == 400
