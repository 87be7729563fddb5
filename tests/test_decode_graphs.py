"""Decode graphs' device-independent part on CPU: buckets, persistent buffers, padding rows,
which steps take the graph path, and the engine's outputs with `cuda_graphs` on and off.

CPU has no graphs: with cuda_graphs="on" each bucket runs as an EagerStep over the same
buffers. With the Triton backend (interpreted here) a bucket is planned once from the static
bound, as a captured graph is; the CUDA capture itself runs only in bench/gpu_check.sh.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamengine import AsyncEngine, EngineConfig, SamplingParams
from streamengine import __main__ as cli
from streamengine.engine.core import EngineCore
from streamengine.models.decode_buffers import (
    BatchTooLarge,
    DecodeBuffers,
    bucket_sizes,
    pick_bucket,
)
from streamengine.models.decode_graphs import DecodeGraphRunner, EagerStep, graph_mode, pad_blocks
from streamengine.models.packed_batch import PackedBatch
from streamengine.models.torch_backend import TorchPagedAttention
from streamengine.models.triton_backend import TritonPagedAttention

BLOCK = 16


def test_buckets_are_vllms_and_end_at_the_limit():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(3) == (1, 2, 3)
    assert bucket_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    with pytest.raises(ValueError, match="at least one row"):
        bucket_sizes(0)


def test_pick_bucket_takes_the_smallest_that_holds_the_rows():
    sizes = bucket_sizes(20)
    assert [pick_bucket(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20)] == [1, 2, 4, 4, 8, 8, 16, 16, 20, 20]
    with pytest.raises(BatchTooLarge, match="21 rows exceeds the largest graph bucket"):
        pick_bucket(21, sizes)
    with pytest.raises(ValueError):
        pick_bucket(0, sizes)


def decode_batch(lens: list[int], tables: list[list[int]], first_token: int = 7) -> PackedBatch:
    """One decode row per sequence: its next token at position `len`, context `len + 1`."""
    batch = PackedBatch()
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        batch.token_ids.append(first_token + i)
        batch.positions.append(n)
        batch.slot_mapping.append(table[n // BLOCK] * BLOCK + n % BLOCK)
        batch.query_lens.append(1)
        batch.seq_lens.append(n + 1)
        batch.block_tables.append(table)
        batch.logits_indices.append(i)
    return batch


def prefill_batch(lens: list[int], tables: list[list[int]]) -> PackedBatch:
    batch = PackedBatch()
    gen = torch.Generator().manual_seed(0)
    for n, table in zip(lens, tables, strict=True):
        batch.token_ids.extend(torch.randint(3, 500, (n,), generator=gen).tolist())
        batch.positions.extend(range(n))
        batch.slot_mapping.extend(table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n))
        batch.query_lens.append(n)
        batch.seq_lens.append(n)
        batch.block_tables.append(table)
    return batch


def test_fill_pads_the_bucket_into_the_pad_block():
    buffers = DecodeBuffers(max_rows=8, max_blocks_per_seq=4, block_size=BLOCK, pad_block=9, device=torch.device("cpu"))
    buffers.fill(decode_batch([20, 3], [[1, 2], [5]]), bucket=4)
    assert buffers.input_ids[:4].tolist() == [7, 8, 0, 0]
    assert buffers.positions[:4].tolist() == [20, 3, 0, 0]
    assert buffers.slot_mapping[:4].tolist() == [2 * BLOCK + 4, 5 * BLOCK + 3, 9 * BLOCK, 9 * BLOCK]
    assert buffers.seq_lens[:4].tolist() == [21, 4, 1, 1]
    assert buffers.block_tables[:4, 0].tolist() == [1, 5, 9, 9]
    assert buffers.block_tables[0, :2].tolist() == [1, 2]
    assert buffers.seq_lens_host == [21, 4, 1, 1]
    meta = buffers.metadata(4, [], buffers.seq_lens_host)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.max_query_len == 1
    with pytest.raises(ValueError, match="block table of 5 blocks"):
        buffers.fill(decode_batch([70], [[1, 2, 3, 4, 5]]), bucket=1)
    with pytest.raises(ValueError, match="do not fit"):
        buffers.fill(decode_batch([1, 1], [[1], [2]]), bucket=1)


class Recorder:
    """A forward that records what each call received and returns one row per input row."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, object]] = []

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        self.calls.append((ids, positions, meta))
        return (ids * 10 + positions).float()[:, None].repeat(1, 3)  # [B, 3]


def recorder_runner(static_bound: int | None, max_rows: int = 8) -> tuple[DecodeGraphRunner, Recorder]:
    forward = Recorder()
    buffers = DecodeBuffers(max_rows, 4, BLOCK, pad_block=9, device=torch.device("cpu"))
    return DecodeGraphRunner(forward, buffers, bucket_sizes(max_rows), [], static_bound, cuda=False), forward


def test_steps_reuse_the_buffers_and_slice_the_real_rows():
    runner, forward = recorder_runner(static_bound=None)
    addresses = [t.data_ptr() for t in runner.buffers.tensors()]
    out = runner.run(decode_batch([20, 3, 5], [[1, 2], [5], [6]]))
    assert out.tolist() == [[7 * 10 + 20.0] * 3, [8 * 10 + 3.0] * 3, [9 * 10 + 5.0] * 3]  # real rows only
    runner.run(decode_batch([21, 4, 6], [[1, 2], [5], [6]], first_token=11))
    runner.run(decode_batch([9], [[3]]))
    assert [t.data_ptr() for t in runner.buffers.tensors()] == addresses
    (ids_a, _, meta_a), (ids_b, _, meta_b), (ids_c, _, _) = forward.calls
    assert ids_a.shape == (4,) and ids_a.data_ptr() == ids_b.data_ptr() == runner.buffers.input_ids.data_ptr()
    assert meta_a.slot_mapping.data_ptr() == meta_b.slot_mapping.data_ptr()
    assert meta_b.seq_lens_host == [22, 5, 7, 1]  # planned per step: the step's own lengths
    assert ids_c.shape == (1,)
    assert sorted(runner.steps) == [1, 4] and all(isinstance(s, EagerStep) for s in runner.steps.values())
    assert runner.num_replays == 3


def test_a_static_bound_plans_each_bucket_once():
    runner, forward = recorder_runner(static_bound=64)
    runner.run(decode_batch([20, 3, 5], [[1, 2], [5], [6]]))
    runner.run(decode_batch([3, 5], [[5], [6]]))
    runner.run(decode_batch([21, 4, 6], [[1, 2], [5], [6]]))
    first, _, last = (meta for _, _, meta in forward.calls)
    assert first is last and first.seq_lens_host == [64] * 4  # what a captured graph holds
    assert first.seq_lens.tolist() == [22, 5, 7, 1]  # the real lengths, read on the device


def test_prefill_mixed_and_oversized_steps_are_not_taken():
    runner, _ = recorder_runner(static_bound=None, max_rows=4)
    assert runner.takes(decode_batch([1, 2, 3, 4], [[1], [2], [3], [4]]))
    assert not runner.takes(prefill_batch([3], [[1]]))
    mixed = prefill_batch([3], [[1]])
    for field in ("token_ids", "positions", "slot_mapping", "query_lens", "seq_lens", "block_tables"):
        getattr(mixed, field).extend(getattr(decode_batch([5], [[2]]), field))
    assert not runner.takes(mixed)
    with_logprobs = decode_batch([5], [[2]])
    with_logprobs.prompt_rows = object()
    assert not runner.takes(with_logprobs)
    too_many = decode_batch([1] * 5, [[i] for i in range(1, 6)])
    assert not runner.takes(too_many)
    with pytest.raises(BatchTooLarge):
        runner.run(too_many)
    with pytest.raises(ValueError, match="decode steps only"):
        runner.run(prefill_batch([3], [[1]]))


def test_graph_mode_by_device_backend_and_setting():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    triton, torch_backend = TritonPagedAttention(), TorchPagedAttention()
    assert graph_mode("auto", cuda, triton) == "cuda" and graph_mode("on", cuda, triton) == "cuda"
    assert graph_mode("off", cuda, triton) is None
    assert graph_mode("auto", cuda, torch_backend) is None
    with pytest.raises(ValueError, match="needs the Triton attention backend"):
        graph_mode("on", cuda, torch_backend)
    assert graph_mode("auto", cpu, triton) is None and graph_mode("on", cpu, torch_backend) == "eager"
    assert pad_blocks(EngineConfig(), cpu) == 0 and pad_blocks(EngineConfig(), cuda) == 1
    assert pad_blocks(EngineConfig(cuda_graphs="on"), cpu) == 1 and pad_blocks(EngineConfig(cuda_graphs="off"), cuda) == 0


def test_cli_flag_and_vllms_enforce_eager():
    def config(*argv: str) -> EngineConfig:
        return cli.config_from_args(cli.build_parser().parse_args(["generate", "hi", *argv]))

    assert config().cuda_graphs == "auto"
    assert config("--cuda-graphs", "on").cuda_graphs == "on"
    assert config("--enforce-eager").cuda_graphs == "off"
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_padding_rows_leave_real_rows_and_the_pool_alone(tiny_llama_dir, backend):
    """A 5-row decode step padded to its bucket of 8 gives the eager step's hidden states,
    and writes the same K/V into the pool: the padding rows only touch the pad block."""
    core = EngineCore(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_gpu_blocks=32, cuda_graphs="on",
                                   attention_backend=backend))
    runner = core.runner
    assert runner.kv_caches[0][0].shape[0] == 33  # the pool and its pad block
    lens, tables = [20, 9, 17, 3, 12], [[1, 2], [3], [4, 5], [6], [7]]
    with torch.inference_mode():
        runner._forward(prefill_batch(lens, tables))
        batch = decode_batch(lens, tables)
        eager = runner._forward(batch)
        pool = [c[:32].clone() for pair in runner.kv_caches for c in pair]
        padded = runner.decode_graphs.run(batch)
    assert sorted(runner.decode_graphs.steps) == [8]
    assert torch.equal(padded, eager)
    assert all(torch.equal(c[:32], p) for c, p in zip((c for pair in runner.kv_caches for c in pair), pool, strict=True))
    assert runner.kv_caches[0][0][32].abs().sum() > 0  # the padding rows wrote their K here


def generate_all(folder, n_prompts: int = 5, max_tokens: int = 10, **cfg) -> tuple[list[list[int]], list]:
    """Greedy outputs of prompts of different lengths submitted together, and the batches the
    decode graphs ran (None where they are off)."""
    async def run():
        config = EngineConfig(model=str(folder), device="cpu", num_gpu_blocks=64, max_prefill_chunk=8, **cfg)
        async with AsyncEngine(config) as engine:
            graphs, seen = engine.core.runner.decode_graphs, []
            if graphs is not None:
                run_batch = graphs.run

                def spy(batch):
                    seen.append(list(batch.query_lens))
                    return run_batch(batch)

                graphs.run = spy
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

            async def one(i: int) -> list[int]:
                async for out in engine.generate(list(range(5 + i, 9 + 4 * i)), params):  # noqa: B007
                    pass
                return out.outputs[0].token_ids

            return list(await asyncio.gather(*(one(i) for i in range(n_prompts)))), (seen if graphs else None)

    return asyncio.run(run())


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_engine_outputs_equal_with_and_without_graphs(untied_llama_dir, backend):
    """Greedy tokens with the buckets on equal those with every step eager, on the C++, the
    PyTorch and the (interpreted) Triton backend; only all-decode steps took the buckets, and
    chunked prompts (8 tokens a step) ran beside decode rows eagerly."""
    eager, off = generate_all(untied_llama_dir, attention_backend=backend, cuda_graphs="off")
    graphs, seen = generate_all(untied_llama_dir, attention_backend=backend, cuda_graphs="on")
    assert off is None
    assert graphs == eager
    assert seen and all(lens == [1] * len(lens) for lens in seen)
    assert any(len(lens) > 1 for lens in seen)


def test_steps_past_the_largest_bucket_run_eagerly(untied_llama_dir, monkeypatch):
    """With buckets of up to 2 rows, 4 decoding sequences run eagerly, with the same tokens."""
    from streamengine.models import decode_graphs

    monkeypatch.setattr(decode_graphs, "MAX_GRAPH_ROWS", 2)
    eager, _ = generate_all(untied_llama_dir, n_prompts=4, cuda_graphs="off")
    graphs, seen = generate_all(untied_llama_dir, n_prompts=4, cuda_graphs="on")
    assert graphs == eager
    assert seen and max(len(lens) for lens in seen) <= 2


class ReplayingStep:
    """A CudaGraphStep stand-in on CPU: 'captures' by running fn once, replays by running it."""

    captured: list[int] = []

    def __init__(self, fn, pool) -> None:
        self.fn, self.output = fn, fn()
        ReplayingStep.captured.append(self.output.shape[0])

    def replay(self) -> torch.Tensor:
        return self.fn()


def cuda_runner(monkeypatch, step_class) -> tuple[DecodeGraphRunner, Recorder]:
    from streamengine.models import decode_graphs

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(decode_graphs, "CudaGraphStep", step_class)
    forward = Recorder()
    buffers = DecodeBuffers(8, 4, BLOCK, pad_block=9, device=torch.device("cpu"))
    return DecodeGraphRunner(forward, buffers, bucket_sizes(8), [], static_bound=64, cuda=True), forward


def test_capture_takes_every_bucket_largest_first_over_padding_rows(monkeypatch):
    ReplayingStep.captured = []
    runner, forward = cuda_runner(monkeypatch, ReplayingStep)
    assert runner.capture_all(required=True) is runner
    assert ReplayingStep.captured == [8, 4, 2, 1]  # the smaller graphs reuse the largest one's pool
    assert all(meta.slot_mapping.tolist() == [9 * BLOCK] * len(ids) for ids, _, meta in forward.calls)
    out = runner.run(decode_batch([20, 3, 5], [[1, 2], [5], [6]]))
    assert out[:, 0].tolist() == [7 * 10 + 20.0, 8 * 10 + 3.0, 9 * 10 + 5.0]
    assert forward.calls[-1][2] is forward.calls[1][2]  # bucket 4's metadata, planned at capture


def test_a_failed_capture_turns_graphs_off_or_raises(monkeypatch, caplog):
    class Uncapturable:
        def __init__(self, fn, pool) -> None:
            raise RuntimeError("operation not permitted when stream is capturing")

    runner, _ = cuda_runner(monkeypatch, Uncapturable)
    with caplog.at_level("WARNING", logger="streamengine.models.decode_graphs"):
        assert runner.capture_all(required=False) is None
    assert "capture failed" in caplog.text and "not permitted" in caplog.text and not runner.steps
    runner, _ = cuda_runner(monkeypatch, Uncapturable)
    with pytest.raises(RuntimeError, match="capturing decode graphs failed"):
        runner.capture_all(required=True)
