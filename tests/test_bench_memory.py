"""bench/memory.py on a few requests: the JSON it writes has the issue's keys and sane values."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def memory():
    sys.path.insert(0, str(BENCH))  # memory.py imports its sibling traces.py
    try:
        spec = importlib.util.spec_from_file_location("bench_memory", BENCH / "memory.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve their module by name
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def result(memory, tmp_path_factory):
    out = tmp_path_factory.mktemp("memory")
    path = out / "mem.json"
    returned = memory.main([
        "--num-requests", "12", "--num-blocks", "256", "--no-progress",
        "--json", str(path), "--png", str(out / "mem.png"),
    ])
    return returned, json.loads(path.read_text()), out


def test_headline_keys_and_ranges(result):
    _, data, _ = result
    for key in ("paged_waste_pct", "contiguous_waste_pct", "beam4_saving_pct", "parallel4_saving_pct"):
        assert 0.0 <= data[key] <= 100.0, (key, data[key])
    assert data["paged_waste_pct"] < data["contiguous_waste_pct"]
    # block granularity bounds the waste: under one block per running sequence
    assert data["paged_waste_pct"] < 25.0
    assert data["parallel4_saving_pct"] > 0.0
    assert data["beam4_saving_pct"] > data["parallel4_saving_pct"]  # beams also share history


def test_kv_cache_dtypes_at_equal_bytes(result):
    _, data, _ = result
    capacity = data["kv_dtypes"]["capacity"]
    assert data["fp8_tokens_vs_float16"] == capacity["fp8"]["tokens_vs_float16"] == 2.0
    assert capacity["float32"]["tokens"] * 4 == capacity["fp8_e5m2"]["tokens"]
    pools = data["kv_dtypes"]["simulated_sharegpt"]
    assert pools["fp8"]["num_blocks"] == 2 * pools["float16"]["num_blocks"]
    assert pools["fp8"]["batch_size"] >= pools["float16"]["batch_size"] > 0


def test_every_trace_and_width_reported(result):
    returned, data, out = result
    assert returned["paged_waste_pct"] == data["paged_waste_pct"]
    assert set(data["traces"]) == {"sharegpt", "alpaca"}
    for r in data["traces"].values():
        waste = r["waste"]
        assert set(waste["contiguous_waste_pct"]) == {"max", "pow2", "oracle"}
        c = waste["contiguous_waste_pct"]
        assert waste["paged_waste_pct"] < c["oracle"] <= c["pow2"] <= c["max"] <= 100.0
        assert waste["batch_size"]["paged"] >= waste["batch_size"]["contiguous_max"] > 0
        for kind in ("parallel", "beam"):
            savings = [r["sharing"][f"{kind}{w}"]["saving_pct"] for w in (2, 4, 6)]
            assert all(0.0 <= s < 100.0 for s in savings), (kind, savings)
    assert (out / "mem.png").stat().st_size > 0


def test_parallel_fork_shares_prompt_then_copies_on_write(memory):
    """One request, n = 3, prompt of 40 tokens (2 full blocks + 8): after the fork, the two
    full prompt blocks are shared and the partial block is copied for all but the last writer."""
    cfg = memory.SimConfig(num_blocks=64, max_num_seqs=8)
    sim = memory.Sim(cfg, seed=0)
    group = memory.ParallelGroup("r0", list(range(40)), output_len=5, arrival=0.0, n=3)
    group.start(sim)
    sim.step(lambda s: None)  # prefill; samples, forks
    assert len(group.seqs) == 3
    snapshots = []
    sim.step(lambda s: snapshots.append((s.bm.num_blocks - s.bm.num_free_blocks,
                                         sum(len(q.block_table) for q in s.scheduler.running))))
    physical, logical = snapshots[0]
    assert logical == 3 * 3
    assert physical == 2 + 3  # shared full blocks + one private last block each
    while sim.scheduler.has_work():
        sim.step(lambda s: None)
    assert sim.bm.num_free_blocks == cfg.num_blocks


def test_beam_group_frees_everything(memory):
    cfg = memory.SimConfig(num_blocks=64, max_num_seqs=16)
    sim = memory.Sim(cfg, seed=0)
    rng = memory.np.random.default_rng(0)
    group = memory.BeamGroup("r0", list(range(20)), output_len=40, arrival=0.0, width=4,
                             model=memory.BeamModel(), np_rng=rng)
    group.start(sim)
    meter = memory.ShareMeter()
    while sim.scheduler.has_work():
        sim.step(meter)
        assert len(group.seqs) in (0, 1, 4)
    assert sim.bm.num_free_blocks == cfg.num_blocks
    assert 0.0 < meter.saving_pct() <= 75.0 + 1e-9  # k tables of equal length: at most 1 - 1/k
    assert group.num_steps == 40


def test_rejects_bad_arguments(memory):
    with pytest.raises(SystemExit):
        memory.main(["--num-requests", "0"])


def test_engine_beam_search_measured_with_stats(memory, tiny_llama_dir, tmp_path):
    if not memory.engine_supports_beam_search():
        pytest.skip("the engine has no beam search")
    data = memory.main([
        "--trace", "sharegpt", "--num-requests", "3", "--num-blocks", "256", "--no-progress",
        "--png", str(tmp_path / "m.png"), "--engine-beam", "--engine-model", str(tiny_llama_dir),
        "--engine-requests", "2", "--engine-scale", "0.1",
    ])
    engine = data["engine_beam"]
    for w in (2, 4, 6):
        r = engine[f"beam{w}"]
        assert 0.0 < r["saving_pct"] <= 100.0 * (1 - 1 / w) + 1e-9, (w, r)
        assert 0.0 < r["sim_saving_pct"] <= 100.0 * (1 - 1 / w) + 1e-9, (w, r)
    assert data["beam4_engine_saving_pct"] == engine["beam4"]["saving_pct"]
