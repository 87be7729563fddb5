"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket (vLLM's approach).

Why: a decode step of a small batch is bound by launches, not by the GPU. Every layer launches
its GEMMs, norms, RoPE and two Triton kernels, and a Triton launch alone costs 26-53 µs of host
time; at batch 1-32 the GPU waits for the host. A graph records a step's kernels once and
replays them in one launch.

What runs as a graph: a step whose every row is one token (plain decode; speculation's
proposal rows are decode rows too), with no prompt logprobs, no LoRA rows and no more rows than
the largest bucket. Its rows are copied into the persistent buffers (decode_buffers.py),
padded to their bucket, the bucket's graph replays, and the hidden states of the real rows go
on to the LM head and the sampler, which stay eager (their shapes and host reads vary per
step). Prompts, chunks of prompts and mixed steps run eagerly.

What must hold for capture: no host sync, no allocation that is not replayed the same way,
fixed shapes. So the backend plans once, at capture, from host-side bounds (every row's
context taken as the longest the buffers hold), and reads the real lengths from the device
tensors at run time: true of the Triton backend, the only one captured on CUDA. The CPU
backends plan from the step's own lengths, so they plan every step. CPU has no graphs: there
(`cuda_graphs="on"`, for tests) each bucket runs as an `EagerStep` over the same buffers and
padding, planned once like a graph with the (interpreted) Triton backend, per step otherwise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from streamengine.config import EngineConfig
from streamengine.kv.spec import KVCacheSpec
from streamengine.models.attention import AttentionBackend, AttentionMetadata, KVCaches
from streamengine.models.decode_buffers import (
    MAX_GRAPH_ROWS,
    DecodeBuffers,
    bucket_sizes,
    pick_bucket,
)
from streamengine.models.kv_scales import KVScales
from streamengine.models.triton_backend import TritonPagedAttention

if TYPE_CHECKING:
    from streamengine.models.packed_batch import PackedBatch

log = logging.getLogger(__name__)

# input_ids [B], positions [B], metadata of B decode rows -> hidden states [B, hidden]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

WARMUP_RUNS = 2
"""Eager runs of a bucket before its capture: Triton compiles its kernels and cuBLAS picks its
own outside the capture, where neither may happen."""


class Step(Protocol):
    def replay(self) -> torch.Tensor:
        """Runs the bucket over the buffers' current contents: hidden states [bucket, hidden]."""
        ...


class EagerStep:
    """A bucket's step called as it is, each time: what a graph would replay, without one."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn

    def replay(self) -> torch.Tensor:
        return self.fn()


class CudaGraphStep:
    """A bucket's step captured as a CUDA graph; its output tensor lives in the graph's pool
    and is overwritten by the next replay."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: an embedding application's other threads may use CUDA meanwhile.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.output = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


def graph_mode(setting: str, device: torch.device, backend: AttentionBackend) -> str | None:
    """"cuda" (captured graphs), "eager" (the buckets without graphs, CPU only) or None (off)."""
    if setting == "off":
        return None
    if device.type == "cuda":
        if isinstance(backend, TritonPagedAttention):
            return "cuda"
        if setting == "on":
            raise ValueError(f"EngineConfig.cuda_graphs='on' needs the Triton attention backend on CUDA, "
                             f"not {type(backend).__name__} (its plan reads the step's lengths on the host)")
        return None
    return "eager" if setting == "on" else None


def pad_blocks(config: EngineConfig, device: torch.device) -> int:
    """KV blocks to allocate past the pool for padding rows: one wherever graphs may run."""
    return 1 if config.cuda_graphs == "on" or (config.cuda_graphs == "auto" and device.type == "cuda") else 0


def context_limit(config: EngineConfig, model_config, kv: KVCacheSpec) -> int:
    """The longest context a sequence can reach: the engine's own max_model_len rule
    (engine/core_setup.py), from what the runner knows."""
    limit = kv.num_blocks * kv.block_size
    model = getattr(model_config, "max_position_embeddings", None)
    limit = min(limit, model) if model else limit
    return min(limit, config.max_model_len) if config.max_model_len else limit


class DecodeGraphRunner:
    """Runs decode steps through per-bucket steps over persistent buffers. `static_bound`:
    plan each bucket once with every row's context taken as this many tokens (what a graph
    needs); None plans every replay with the step's own lengths."""

    def __init__(self, forward: DecodeForward, buffers: DecodeBuffers, sizes: tuple[int, ...], kv_caches: KVCaches,
                 static_bound: int | None, cuda: bool, kv_scales: KVScales | None = None) -> None:
        if sizes[-1] > buffers.max_rows:
            raise ValueError(f"the largest bucket ({sizes[-1]}) exceeds the buffers' {buffers.max_rows} rows")
        self.forward, self.buffers, self.sizes, self.kv_caches = forward, buffers, sizes, kv_caches
        self.static_bound, self.cuda, self.kv_scales = static_bound, cuda, kv_scales
        self.steps: dict[int, Step] = {}
        self.pool = torch.cuda.graph_pool_handle() if cuda else None  # shared: one step runs at a time
        self.num_replays = 0  # decode steps that ran through a bucket

    @classmethod
    def build(cls, config: EngineConfig, device: torch.device, backend: AttentionBackend, forward: DecodeForward,
              kv_caches: KVCaches, kv: KVCacheSpec, model_config,
              kv_scales: KVScales | None = None) -> DecodeGraphRunner | None:
        """The runner `config.cuda_graphs` asks for here, its graphs captured (CUDA); None: off.
        The pad block is block `kv.num_blocks`: `kv_caches` must hold one block past the pool.
        An fp8 cache's scales (`kv_scales`) are baked into captured graphs: they must be given
        (k_scale, v_scale), not set later by the first prefill."""
        mode = graph_mode(config.cuda_graphs, device, backend)
        if mode is None:
            return None
        if mode == "cuda" and kv_scales is not None and not kv_scales.ready:
            why = "an fp8 KV cache needs k_scale and v_scale given: a captured graph keeps the scales it saw"
            if config.cuda_graphs == "on":
                raise ValueError(f"EngineConfig.cuda_graphs='on': {why}")
            log.info("decode graphs off: %s", why)
            return None
        if kv_caches[0][0].shape[0] <= kv.num_blocks:
            raise ValueError("decode graphs need the KV tensors to hold a pad block past the pool")
        rows = min(config.max_num_seqs, config.max_num_batched_tokens, MAX_GRAPH_ROWS)
        width = -(-context_limit(config, model_config, kv) // kv.block_size)
        buffers = DecodeBuffers(rows, width, kv.block_size, kv.num_blocks, device)
        static = width * kv.block_size if isinstance(backend, TritonPagedAttention) else None
        runner = cls(forward, buffers, bucket_sizes(rows), kv_caches, static, cuda=mode == "cuda", kv_scales=kv_scales)
        if mode == "cuda":
            return runner.capture_all(required=config.cuda_graphs == "on")
        log.info("decode graphs: buckets %s run eagerly on %s (no graphs there)", runner.sizes, device.type)
        return runner

    def takes(self, batch: PackedBatch) -> bool:
        """Whether the step runs through a bucket: decode rows only, nothing a graph leaves out."""
        n = len(batch.token_ids)
        return (0 < n <= self.sizes[-1] and len(batch.query_lens) == n and batch.prompt_rows is None
                and batch.lora_rows is None)

    def run(self, batch: PackedBatch) -> torch.Tensor:
        """Hidden states [rows, hidden] of a decode step (`takes`), through its bucket.
        BatchTooLarge past the largest bucket; ValueError for rows of more than one token."""
        n = len(batch.token_ids)
        if len(batch.query_lens) != n:
            raise ValueError("decode graphs run decode steps only (every row one token)")
        bucket = pick_bucket(n, self.sizes)
        self.buffers.fill(batch, bucket)
        out = self._step(bucket).replay()  # [bucket, hidden]
        self.num_replays += 1
        return out[:n]

    def capture_all(self, required: bool) -> DecodeGraphRunner | None:
        """Captures every bucket, largest first (the smaller graphs reuse its pool's memory).
        A failure turns graphs off with a warning, or raises when they were `required`."""
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                for bucket in reversed(self.sizes):
                    self._step(bucket)
            torch.cuda.synchronize()
        except Exception as exc:  # a model or kernel that cannot be captured: say which, run eagerly
            if required:
                raise RuntimeError(f"capturing decode graphs failed: {exc}") from exc
            log.warning("decode graphs off, every step eager: capture failed (%s: %s)", type(exc).__name__, exc)
            self.steps.clear()
            return None
        log.info("decode graphs: captured %d buckets %s in %.1f s", len(self.steps), self.sizes,
                 time.perf_counter() - start)
        return self

    def _step(self, bucket: int) -> Step:
        step = self.steps.get(bucket)
        if step is None:
            fn = self._bucket_fn(bucket)
            step = self.steps[bucket] = CudaGraphStep(fn, self.pool) if self.cuda else EagerStep(fn)
        return step

    def _bucket_fn(self, bucket: int) -> Callable[[], torch.Tensor]:
        """The bucket's forward over views of the buffers: planned once from the static bound,
        or from the lengths of whichever step filled the buffers last."""
        ids, positions = self.buffers.input_ids[:bucket], self.buffers.positions[:bucket]
        if self.static_bound is not None:
            meta = self.buffers.metadata(bucket, self.kv_caches, [self.static_bound] * bucket, self.kv_scales)
            return lambda: self.forward(ids, positions, meta)
        return lambda: self.forward(ids, positions, self.buffers.metadata(
            bucket, self.kv_caches, self.buffers.seq_lens_host, self.kv_scales))
