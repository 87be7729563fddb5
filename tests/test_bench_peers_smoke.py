"""bench/peers.py without building llama.cpp: its parsers on output captured from the real
tools, the report's headline keys and ratios on made-up figures, and one whole run on the tiny
model with stand-in tools that print what the real ones print (so the engine side, the CLI
and the JSON are exercised end to end in seconds)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
from test_bench_perf_smoke import load_bench, run_bench


@pytest.fixture(scope="module")
def peers():
    return load_bench("peers.py")


# Captured from llama-bench -o json (llama-cpp-python 0.3.36's vendored llama.cpp), fields trimmed.
LLAMA_BENCH_ROW = {
    "build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "backends": "CPU",
    "model_type": "llama 256M Q4_1", "model_size": 96576768, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2,
    "type_k": "f16", "flash_attn": -1, "repack": True, "n_prompt": 16, "n_gen": 0, "n_depth": 0,
    "avg_ns": 415843390, "stddev_ns": 0, "avg_ts": 38.476023, "stddev_ts": 0.0,
    "samples_ns": [415843390], "samples_ts": [38.476],
}
# llama-batched-bench logs on stderr; with --output-format jsonl its result lines are these.
BATCHED_LINE = (
    '{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, '
    '"n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 4, "pl": 2, "n_kv": 40, "t_pp": 0.701031, '
    '"speed_pp": 45.647053, "t_tg": 0.515062, "speed_tg": 15.532111, "t": 1.216093, "speed": 32.892220}'
)


def llama_bench_text(rows: list[dict]) -> str:
    """llama-bench's JSON layout (one field per line), after a log line as run_tool joins them."""
    body = ",\n".join("  " + json.dumps(r, indent=4).replace("\n", "\n  ") for r in rows)
    return "load_backend: loaded CPU backend\n[\n" + body + "\n]\n\nllama_perf: [ 1 ms ]\n"


def test_parse_llama_bench(peers):
    rows = peers.parse_llama_bench(llama_bench_text([LLAMA_BENCH_ROW, {**LLAMA_BENCH_ROW, "n_prompt": 0, "n_gen": 4}]))
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [(16, 0), (0, 4)]
    assert rows[0]["samples_ts"] == [38.476]
    with pytest.raises(ValueError):
        peers.parse_llama_bench("main: error: failed to load model\n")
    with pytest.raises(ValueError):  # an array, but not of test rows
        peers.parse_llama_bench('[\n  {"model": 1}\n]')


def test_parse_batched_bench(peers):
    text = "\nllama_context: n_ctx = 512\n" + BATCHED_LINE + "\n\nllama_perf_context_print: load time = 1 ms\n"
    (row,) = peers.parse_batched_bench(text)
    assert row["speed"] == pytest.approx(32.89222) and (row["pp"], row["tg"], row["pl"]) == (16, 4, 2)
    # S t/s is all tokens over prefill + decode time: the definition the engine side copies.
    assert row["speed"] == pytest.approx(row["pl"] * (row["pp"] + row["tg"]) / row["t"], rel=1e-5)
    with pytest.raises(ValueError):
        peers.parse_batched_bench("|    PP |     TG |    B |\n")


def test_ggml_version_and_find_tools(peers, tmp_path):
    assert peers.ggml_version("set(GGML_VERSION_MAJOR 0)\nset(GGML_VERSION_MINOR 25)\nset(GGML_VERSION_PATCH 3)") == "0.25.3"
    assert peers.ggml_version("nothing") is None
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in peers.TOOLS[:-1]:
        (bin_dir / tool).write_text("")
    assert peers.find_tools(tmp_path) is None  # one tool missing: build again
    (bin_dir / peers.TOOLS[-1]).write_text("")
    assert peers.find_tools(tmp_path) == bin_dir


def _variant(b1: float, prefill: dict[str, float], tput: float) -> dict:
    return {"b1": {"tok_s": b1}, "prefill": {n: {"tok_s": v} for n, v in prefill.items()}, "tput": {"tok_s": tput}}


def test_report_takes_each_sides_best_variant(peers):
    engine = {
        "packed": {**_variant(150.0, {"1000": 600.0, "4096": 300.0}, 800.0),
                   "prefill": peers.best_prefill({"1000": {"tok_s": 600.0}, "4096": {"tok_s": 250.0}},
                                                 {"1000": {"tok_s": 550.0}, "4096": {"tok_s": 300.0}}),
                   "tput_kv_float16": {"tok_s": 900.0}},
        "dequantized": {**_variant(75.0, {"1000": 700.0, "4096": 280.0}, 850.0), "tput_kv_float16": {"tok_s": 880.0}},
    }
    llamacpp = {"Q4_1": _variant(120.0, {"1000": 300.0, "4096": 200.0}, 300.0),
                "F32": _variant(60.0, {"1000": 500.0, "4096": 250.0}, 400.0)}
    config = {"prefill_lens": [1000, 4096]}
    report = peers.build_report(engine, llamacpp, {"pypi_version": "x"}, config)
    assert report["engine_weight_format"] == "packed"  # the headline format: interleaved batch-1 runs it
    assert report["engine_b1_tok_s"] == 150.0 and report["llamacpp_b1_tok_s"] == 120.0
    assert report["engine_prefill4096_tok_s"] == 300.0 and report["llamacpp_prefill4096_tok_s"] == 250.0
    assert report["engine_prefill1000_tok_s"] == 700.0  # dequantized, the better here
    assert report["engine_tput_tok_s"] == 900.0 and report["llamacpp_tput_tok_s"] == 400.0
    assert report["engine_best_variant"] == {"b1": "packed", "prefill4096": "packed", "tput": "packed, KV float16",
                                             "prefill1000": "dequantized"}
    assert report["llamacpp_best_variant"] == {"b1": "Q4_1", "prefill4096": "F32", "tput": "F32", "prefill1000": "F32"}
    assert report["engine_prefill_best_config"] == {"1000": "default_chunk", "4096": "whole_prompt"}
    assert report["ratios"]["b1"] == pytest.approx(1.25)
    assert report["goals"]["b1"] == {"goal": 2.0, "done_at": 1.3, "ratio": pytest.approx(1.25),
                                     "goal_met": False, "done": False}
    assert report["goals"]["prefill4096"]["done"] and not report["goals"]["prefill4096"]["goal_met"]  # 1.2x
    assert report["goals"]["tput"]["done"] and not report["goals"]["tput"]["goal_met"]  # 2.25x


def test_int8_activation_keys_evaluate_the_goals_on_their_own_ratios(peers):
    llamacpp = {"Q4_1": _variant(120.0, {"4096": 200.0}, 300.0), "F32": _variant(60.0, {"4096": 250.0}, 400.0)}
    int8 = {"b1": {"tok_s": 180.0}, "prefill": {"4096": {"tok_s": 500.0}}, "tput": {"tok_s": 1000.0},
            "tput_kv_float16": {"tok_s": 1300.0}, "greedy_agreement": {"prompts": 16}}
    keys = peers.int8_activation_keys(int8, llamacpp, [4096])
    assert keys["engine_int8act_tput_tok_s"] == 1300.0  # the better KV cache dtype
    assert keys["int8act_ratios"] == {"b1": 1.5, "tput": 3.25, "prefill4096": 2.0}  # against each work's best
    assert keys["int8act_ratios_vs_llamacpp_q4_1"]["tput"] == pytest.approx(1300.0 / 300.0)
    goals = keys["int8act_goals"]
    assert goals["tput"]["goal_met"] and goals["prefill4096"]["goal_met"]
    assert goals["b1"]["done"] and not goals["b1"]["goal_met"]
    assert peers.int8_activation_keys({"error": "needs packed weights"}, llamacpp, [4096]) == {
        "int8_activations": {"error": "needs packed weights"}}


def test_report_falls_back_when_packed_cannot_run(peers):
    engine = {"packed": {"error": "packed weights need AVX-512"},
              "dequantized": _variant(70.0, {"4096": 200.0}, 600.0)}
    report = peers.build_report(engine, {"Q4_1": _variant(100.0, {}, 300.0)}, {}, {"prefill_lens": [4096]})
    assert report["engine_weight_format"] == "dequantized" and report["engine_b1_tok_s"] == 70.0
    assert report["llamacpp_prefill4096_tok_s"] is None and report["ratios"]["prefill4096"] is None
    assert report["engine"]["packed"] == {"error": "packed weights need AVX-512"}


FAKE_LLAMA_BENCH = '''
import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
ROW = json.loads({row!r})
rows = [dict(ROW, n_prompt=int(p), n_gen=0) for p in args["-p"].split(",") if int(p) > 0]
if int(args["-n"]) > 0:
    rows.append(dict(ROW, n_prompt=0, n_gen=int(args["-n"])))
reps = int(args["-r"])
for i, r in enumerate(rows):
    r["samples_ts"] = [10.0 * (i + 1) + k for k in range(reps)]
    r["avg_ts"] = sum(r["samples_ts"]) / reps
print("[\\n" + ",\\n".join(json.dumps(r, indent=4) for r in rows) + "\\n]")
'''
FAKE_BATCHED_BENCH = '''
import sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
assert int(args["-c"]) == int(args["-npl"]) * (int(args["-npp"]) + int(args["-ntg"])), args
print("llama_context: n_ctx = " + args["-c"], file=sys.stderr)
print({line!r})
'''
FAKE_QUANTIZE = '''
import shutil, sys
assert sys.argv[1] == "--allow-requantize" and sys.argv[4] == "F32", sys.argv
open(sys.argv[3], "w").write("stand-in F32 copy")
'''


def fake_tools(peers, folder: Path) -> Path:
    """Scripts named like llama.cpp's tools that answer in their output formats."""
    bodies = {"llama-bench": FAKE_LLAMA_BENCH.format(row=json.dumps(LLAMA_BENCH_ROW)),
              "llama-batched-bench": FAKE_BATCHED_BENCH.format(line=BATCHED_LINE), "llama-quantize": FAKE_QUANTIZE}
    assert set(bodies) == set(peers.TOOLS)
    for name, body in bodies.items():
        path = folder / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


def test_peers_quick_with_stand_in_tools(peers, tiny_llama_dir, tmp_path):
    tools = fake_tools(peers, tmp_path)
    report = run_bench("peers.py", [
        "--llamacpp-dir", str(tools), "--gguf", str(tiny_llama_dir), "--threads", "1", "--reps", "2",
        "--decode-tokens", "6", "--prefill-lens", "24,40", "--parallel", "3", "--tput-prompt", "8", "--tput-gen", "4",
        "--b1-rounds", "2", "--tput-rounds", "1", "--peers", "llamacpp",
    ], tmp_path / "peers.json")
    for key in ("engine_b1_tok_s", "llamacpp_b1_tok_s", "engine_tput_tok_s", "llamacpp_tput_tok_s",
                "engine_prefill40_tok_s", "llamacpp_prefill40_tok_s"):
        assert report[key] is not None and report[key] > 0, key
    assert report["engine_prefill4096_tok_s"] is None  # not measured at these sizes: said, not invented
    assert set(report["llamacpp"]) == {"as_stored", "F32"}  # a folder stand-in has no block types to name it by
    assert (tools / f"{tiny_llama_dir.stem}.F32.gguf").exists()  # cached beside the tools
    fmt = report["engine_weight_format"]
    if "packed" in report["engine"]:  # the tiny model is a folder, not a GGUF file: said, then dequantized
        assert "not a GGUF file" in report["engine"]["packed"]["error"] and fmt == "dequantized"
    ours = report["engine"][fmt]
    assert ours["weight_path"] is None or ours["weight_path"].startswith("weights: dequantized")  # the engine's log
    assert len(ours["b1"]["samples_tok_s"]) == 2 and ours["b1"]["tok_s"] == max(ours["b1"]["samples_tok_s"])
    assert set(ours["prefill"]) == {"24", "40"}
    assert ours["prefill"]["40"]["best_config"] in {"default_chunk", "whole_prompt"}
    assert ours["tput"]["num_preemptions"] == 0
    # The stand-in llama-bench's samples are 10 * (row + 1) + repetition: the best counts.
    assert report["llamacpp_b1_tok_s"] == 11.0 and report["llamacpp_prefill40_tok_s"] == 21.0
    assert report["ratios"]["b1"] == pytest.approx(report["engine_b1_tok_s"] / 11.0)
    assert report["llamacpp_version"]["tools"] == str(tools)
    # Interleaved batch-1: one stand-in llama-bench run (-r 1: 10 tok/s) beside one engine request a round.
    inter = report["b1_interleaved"]
    assert len(inter["rounds"]) == 2 and inter["engine_weight_format"] == fmt
    assert inter["llamacpp_variant"] in report["llamacpp"] and inter["llamacpp_flash_attn"] == "-1"
    for r in inter["rounds"]:
        assert r["llamacpp"] == 10.0 and r["engine"] > 0 and r["ratio"] == pytest.approx(r["engine"] / 10.0)
    assert inter["ratio_median"] == pytest.approx(sum(r["ratio"] for r in inter["rounds"]) / 2)
    # Each side's best variant is its peer figure; a float16 KV cache is one of the engine's.
    assert ours["tput_kv_float16"]["num_preemptions"] == 0
    tput_variants = {fmt: ours["tput"]["tok_s"], f"{fmt}, KV float16": ours["tput_kv_float16"]["tok_s"]}
    best = report["engine_best_variant"]["tput"]
    assert report["engine_tput_tok_s"] == tput_variants[best] == max(tput_variants.values())
    assert report["engine_best_variant"]["b1"] == fmt  # only the weight formats measure batch-1
    # Interleaved parallel runs: the stand-in llama-batched-bench prints one fixed line.
    inter = report["tput_interleaved"]
    assert inter["engine_variant"] == best and inter["llamacpp_variant"] == report["llamacpp_best_variant"]["tput"]
    (r,) = inter["rounds"]
    assert r["llamacpp"] == pytest.approx(32.89222) and r["ratio"] == pytest.approx(r["engine"] / r["llamacpp"])
    # The int8-activation mode needs packed weights, which a folder model has not: said, no rounds.
    assert "error" in report["int8_activations"] and report["tput_interleaved_int8"] is None


def write_gguf(path: Path, tied: bool) -> Path:
    """A tiny GGUF with a Q8_0 embedding, a Q4_1 projection, an F32 norm (and an output head)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", quantize(rng.random((16, 64), dtype=np.float32), q.Q8_0), raw_dtype=q.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", quantize(rng.random((8, 64), dtype=np.float32), q.Q4_1), raw_dtype=q.Q4_1)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", quantize(rng.random((16, 64), dtype=np.float32), q.Q4_1), raw_dtype=q.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_roofline_packed_weight_bytes(tmp_path):
    roofline = load_bench("roofline.py")
    # Tied: the Q8_0 embedding is the output projection (34 bytes per 32 weights) and counts.
    tied = roofline.packed_weights(write_gguf(tmp_path / "tied.gguf", tied=True))
    assert tied.bytes_by_type == {"Q8_0": 16 * 64 // 32 * 34, "Q4_1": 8 * 64 // 32 * 20, "F32": 64 * 4}
    assert tied.weight_bytes == sum(tied.bytes_by_type.values())
    # Untied: the embedding only serves row lookups; the Q4_1 head is streamed instead.
    untied = roofline.packed_weights(write_gguf(tmp_path / "untied.gguf", tied=False))
    assert untied.bytes_by_type == {"Q4_1": (8 + 16) * 64 // 32 * 20, "F32": 64 * 4}
    # The bound: the same bandwidth term as float32's, with these bytes in place of 4 per weight.
    rates = roofline.MachineRates(threads=1, matmul_gflops=1e6, matmul_n=1, read_gb_s=10.0, copy_gb_s=10.0,
                                  bandwidth_bytes=1)
    cost = roofline.ModelCost(num_params=1, matmul_params=1, weight_bytes=4 * 10**6, flops_per_token=2.0,
                              attn_flops_per_ctx_token=0.0, kv_bytes_per_token=0)
    args = roofline.parse_args(["--model", str(tmp_path), "--gguf", str(tmp_path / "tied.gguf"), "--steps", "3"])
    report = roofline.packed_report(args, rates, cost, tied, None)
    assert report["packed_bound_term"] == "bandwidth"
    assert report["packed_bound_batch1_tok_s"] == pytest.approx(10e9 / tied.weight_bytes)
    assert report["packed_decode_tok_s_batch1"] is None
