"""Engine configuration: one validated record that every layer reads and none mutates."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024
"""Default KV budget. 512 MiB holds ~11.6k tokens of SmolLM2-135M in float32 (45 KiB/token)."""
DEFAULT_MAX_PREFILL_CHUNK = 64
"""Default prefill tokens per sequence and step: the largest measured value that kept a decode
stream's inter-token gaps under ~1 s while an 8,000-token prompt prefilled (bench/long_prompt.py,
SmolLM2-135M, 2 torch threads, 2-core CPU): max gap 0.60 s at 64, 1.01 s at 128, 10.2 s
unchunked; the prompt's TTFT 42 s at 64, 34 s at 128, 29.5 s unchunked. A step's time grows
with chunk x context (one chunk at ~6.5k context, 1 thread: 0.33 s at 32, 1.0 s at 64, 1.3 s at
128). With 1 thread on a machine shared with other jobs 64 gave p99 1.26 s (32: 0.53 s). A lone
160-token prompt's TTFT grew 5% (1,000 tokens: 2%). A shared prefix is still computed once (the
scheduler waits for it), so bench/prefix.py's hit rate stays 99%."""

ATTENTION_BACKENDS = ("auto", "triton", "torch", "cpu")
PREEMPTION_MODES = ("auto", "recompute", "swap")
DTYPES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", *DTYPES)
MODEL_IMPLS = ("auto", "native", "transformers")


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start. Sizes are in tokens unless the name says bytes.

    The KV pool is sized from `num_gpu_blocks` when given, else from `kv_cache_bytes`
    (default `DEFAULT_KV_CACHE_BYTES`) divided by the bytes one block takes for this model.
    """

    model: str | None = None  # None: the default SmolLM2-135M-Instruct; else HF folder or .gguf
    dtype: str = "float32"
    device: str = "auto"  # "auto": cuda when available, else cpu
    block_size: int = 16
    kv_cache_bytes: int | None = None
    # The KV cache's element type; "auto" is the model's dtype. A float32 model with a float16
    # cache holds twice the tokens in the same bytes and reads half per token in attention, at
    # the cost of rounding K/V (greedy output can then differ from transformers').
    kv_cache_dtype: str = "auto"
    num_gpu_blocks: int | None = None  # overrides kv_cache_bytes (name as in vLLM)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # At most this many tokens of one sequence per step (vLLM: long_prefill_token_threshold).
    # Why: a step's time grows with its prefill tokens times their context, and every decode
    # stream batched with a long prompt waits for the whole step. None: up to the full budget.
    max_prefill_chunk: int | None = DEFAULT_MAX_PREFILL_CHUNK
    max_model_len: int | None = None  # default: the model's context, capped by the pool
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    # "native": streamengine's fused Llama/Qwen2 forward (models/native.py); "transformers":
    # transformers' own modules with the paged attention hook; "auto": native on CPU when the
    # architecture qualifies, transformers otherwise.
    model_impl: str = "auto"
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 0
    # Admission control: with this many sequences already waiting (new requests not yet
    # running, and preempted ones), generate() raises EngineOverloadedError instead of queuing
    # more. None: an unbounded queue.
    max_waiting: int | None = None
    # Largest max_tokens a request may ask for; max_tokens=None means min(this, the room left
    # in the context). Why: an uncapped request (times n up to 128) can hold the engine for
    # the whole context. None: no cap, max_tokens=None runs to the end of the context.
    max_tokens_cap: int | None = 4096
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's default
    cache_dir: str | None = None  # where converted GGUF copies are kept

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
               f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check(self.block_size in (8, 16, 32), "block_size", f"must be 8, 16 or 32, got {self.block_size}")
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _check(self.max_prefill_chunk is None or self.max_prefill_chunk >= 1, "max_prefill_chunk",
               f"must be >= 1 or None, got {self.max_prefill_chunk}")
        _check(self.max_waiting is None or self.max_waiting >= 1, "max_waiting",
               f"must be >= 1 or None, got {self.max_waiting}")
        _check(self.max_tokens_cap is None or self.max_tokens_cap >= 1, "max_tokens_cap",
               f"must be >= 1 or None, got {self.max_tokens_cap}")
        _check(self.kv_cache_bytes is None or self.kv_cache_bytes > 0, "kv_cache_bytes", "must be > 0")
        _check(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1, "num_gpu_blocks", "must be >= 1")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        _check(self.model_impl in MODEL_IMPLS, "model_impl", f"must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        _check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode", f"must be one of {PREEMPTION_MODES}")
        _check(self.swap_space_bytes >= 0, "swap_space_bytes", "must be >= 0")


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{field} {message}")


def default_cache_dir() -> Path:
    """Where converted models and compiled kernels are kept: $STREAMENGINE_CACHE, else
    $XDG_CACHE_HOME/streamengine, else ~/.cache/streamengine."""
    base = os.environ.get("STREAMENGINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "streamengine"
    )
    return Path(base)
