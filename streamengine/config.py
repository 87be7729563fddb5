"""Engine configuration: one validated record that every layer reads and none mutates."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, get_args, get_type_hints

from streamengine.tenancy.tenants import TenantConfig

DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024
"""Default KV budget: about 11.6k tokens of SmolLM2-135M in float32 (45 KiB per token)."""
DEFAULT_GRAMMAR_CACHE_BYTES = 256 * 1024 * 1024
"""Default memory for compiled grammars: one hostile regex can keep about 180 MB."""
DEFAULT_MAX_PREFILL_CHUNK = 64
"""Default prefill tokens per sequence and step: the largest value that kept decode streams'
inter-token gaps short while a long prompt prefilled, at little cost to that prompt's time to
first token (measurements: docs/design/step_length.md, "Choosing max_prefill_chunk")."""

ATTENTION_BACKENDS = ("auto", "triton", "torch", "cpu")
PREEMPTION_MODES = ("auto", "recompute", "swap")
DTYPES = ("float32", "float16", "bfloat16")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
"""8-bit float caches, as vLLM names them: "fp8" is e4m3 (torch.float8_e4m3fn)."""
KV_CACHE_DTYPES = ("auto", *DTYPES, *FP8_KV_CACHE_DTYPES)
MODEL_IMPLS = ("auto", "native", "transformers")
WEIGHT_FORMATS = ("auto", "dequantized", "packed", "int8")
SCHEDULING_POLICIES = ("fair", "fcfs")
SPECULATIVE_METHODS = ("ngram", "suffix", "draft")
CUDA_GRAPHS = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: each step, a decoding request's next `num_speculative_tokens`
    tokens are proposed and verified in the same forward pass as its next one; a verified
    token costs no step of its own. Outputs are those the engine gives without it.

    "ngram" (prompt lookup) proposes what followed the most recent earlier occurrence of the
    request's last n tokens (prompt and output), the longest n in [prompt_lookup_min,
    prompt_lookup_max] that occurs. "suffix" looks there first, then in the outputs of the
    same tenant's (and user's) earlier requests, the last `suffix_history_tokens` of them.
    "draft" runs `model`, a smaller model with the same tokenizer, ahead of the target: its
    greedy choices are the proposals, its KV lives in the target's blocks.

    Under a grammar, whatever the method, the tokens the grammar forces come first; then
    lookup ("ngram", "suffix"; and "draft", whose model does not see the grammar)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    suffix_history_tokens: int = 32768
    model: str | None = None  # "draft": its model, an HF folder or .gguf file

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"SpeculativeConfig.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        for name, low, high in (("num_speculative_tokens", 1, 16), ("prompt_lookup_min", 1, 64),
                                ("prompt_lookup_max", 1, 64), ("suffix_history_tokens", 1, 1 << 24)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"SpeculativeConfig.{name} must be an integer in [{low}, {high}], got {value!r}")
        if (self.method == "draft") != (self.model is not None):
            raise ValueError("SpeculativeConfig.model names the draft model of method='draft', and only of it "
                             f"(method={self.method!r}, model={self.model!r})")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"SpeculativeConfig.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """From a mapping (the CLI's JSON); an unknown key is refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"SpeculativeConfig has no field {unknown[0]!r} (fields: {sorted(known)})")
        return cls(**values)


def _option(
    default: Any, help: str, *, choices: tuple[Any, ...] = (), minimum: float | None = None,
    maximum: float | None = None,
) -> Any:
    """A field whose help, choices and bounds both the CLI and `__post_init__` read."""
    return field(
        default=default, metadata={"help": help, "choices": choices, "minimum": minimum, "maximum": maximum}
    )


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start. Sizes are in tokens unless the name says bytes.

    The KV pool is sized from `num_gpu_blocks` when given, else from `kv_cache_bytes`
    (default `DEFAULT_KV_CACHE_BYTES`) divided by the bytes one block takes for this model.
    Each field's metadata holds its help text, its allowed values and its lower bound: the
    CLI builds its options from them and `__post_init__` enforces them.
    """

    model: str | None = _option(None, "HF folder or .gguf file; None: the default SmolLM2-135M-Instruct")
    dtype: str = _option("float32", "the model's weight and activation type", choices=DTYPES)
    device: str = _option("auto", '"auto": cuda when available, else cpu')
    block_size: int = _option(16, "tokens per KV cache block", choices=(8, 16, 32))
    kv_cache_bytes: int | None = _option(
        None, f"KV pool budget in bytes; None: {DEFAULT_KV_CACHE_BYTES // 2**20} MiB", minimum=1)
    kv_cache_dtype: str = _option(
        "auto",
        "The KV cache's element type; \"auto\" is the model's dtype. A float32 model with a float16 "
        "cache holds twice the tokens in the same bytes and reads half per token in attention, at "
        "the cost of rounding K/V (greedy output can then differ from transformers'). \"fp8\" "
        "(= \"fp8_e4m3\") and \"fp8_e5m2\": one byte per value, a quarter of float32's, each K (V) "
        "tensor stored as K / k_scale with one scale per layer (k_scale, v_scale).",
        choices=KV_CACHE_DTYPES)
    k_scale: float | None = _option(
        None,
        "An fp8 cache's K scale, for every layer (stored code = K / k_scale, saturated). None: each "
        "layer's scale is set from the K of the first step that writes to its cache (max |K| x "
        "4 / the format's largest value) and kept for the engine's life, so it depends on that "
        "first batch (as vLLM's calculate_kv_scales).")
    v_scale: float | None = _option(None, "An fp8 cache's V scale, for every layer; None: as k_scale says.")
    num_gpu_blocks: int | None = _option(
        None, "KV pool size in blocks; overrides kv_cache_bytes (name as in vLLM)", minimum=1)
    max_num_seqs: int = _option(128, "most sequences running in one step", minimum=1)
    max_num_batched_tokens: int = _option(2048, "most tokens computed in one step", minimum=1)
    max_prefill_chunk: int | None = _option(
        DEFAULT_MAX_PREFILL_CHUNK,
        "At most this many tokens of one sequence per step (vLLM: long_prefill_token_threshold). "
        "Why: a step's time grows with its prefill tokens times their context, and every decode "
        "stream batched with a long prompt waits for the whole step. None: up to the full budget. "
        "Under scheduling_policy='fair' a tenant's prompts share 4 chunks a step (one each when it is alone), "
        "or its weighted slice of the budget when the step is full anyway: "
        "a lone prompt of a quiet tenant takes 4x this or more.",
        minimum=1)
    max_model_len: int | None = _option(
        None, "longest sequence; None: the model's context, capped by the pool", minimum=1)
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of prompts' shared prefixes")
    retain_waiting_prefixes: bool = _option(
        True, "evict last the cached blocks that a waiting request's prefix will hit (False: in LRU order)")
    tenant_fair_eviction: bool = _option(
        True,
        "evict free cached blocks from the tenant holding the most of them per unit of weight, LRU "
        "within it; False: one LRU order across tenants (vLLM's)")
    attention_backend: str = _option("auto", "paged attention implementation", choices=ATTENTION_BACKENDS)
    model_impl: str = _option(
        "auto",
        "\"native\": streamengine's fused Llama/Qwen2 forward (models/native.py); \"transformers\": "
        "transformers' own modules with the paged attention hook; \"auto\": native on CPU when the "
        "architecture qualifies, transformers otherwise.",
        choices=MODEL_IMPLS)
    weight_format: str = _option(
        "auto",
        "How a GGUF model's weights are kept. \"packed\": in the file's block formats (Q4_0, Q4_1, "
        "Q8_0, BF16), multiplied by the native decoder's fused dequantizing GEMM (needs AVX-512 or AVX2); "
        "\"dequantized\": float32 copies; \"auto\": packed where it can run, else dequantized, "
        "and float matrices holding only bfloat16 values kept as bfloat16 (exact). "
        "Both give the same tokens (the packed kernels compute the float32 GEMM over the "
        "dequantized weights). \"int8\" (opt-in, any float32 model on the native CPU path): "
        "every weight matrix quantized to Q8_0 blocks at load and run by the same kernels; "
        "not exact (greedy tokens may diverge from the float model's).",
        choices=WEIGHT_FORMATS)
    int8_activations: bool = _option(
        False,
        "Opt-in, not exact: the Q4_0, Q4_1 and Q8_0 weights of a packed GGUF model multiply inputs quantized to int8 "
        "per 32 values (as llama.cpp runs those formats), with integer dot products: about 2.5x the "
        "float32 GEMM's speed where it is compute-bound (prompts, large batches); greedy tokens may "
        "diverge from the float model's. Needs the weights packed (weight_format 'auto' or 'packed').")
    cuda_graphs: str = _option(
        "auto",
        "Decode steps (every row one token) replayed as CUDA graphs, one per batch-size bucket, from "
        "persistent input buffers; prompts and mixed steps run eagerly (models/decode_graphs.py). \"auto\": "
        "on CUDA with the Triton backend; \"off\": every step eager (vLLM's enforce_eager, CLI "
        "--enforce-eager); \"on\": as auto, an error where it cannot run; on CPU, which has no graphs, "
        "\"on\" runs the same padded buckets and buffers eagerly (to test that path).",
        choices=CUDA_GRAPHS)
    preemption_mode: str = _option(
        "recompute", "how a sequence gives up its blocks when the pool runs out", choices=PREEMPTION_MODES)
    swap_space_bytes: int = _option(0, "host memory for KV blocks swapped out by preemption", minimum=0)
    max_waiting: int | None = _option(
        1024,
        "Admission control: with this many sequences already waiting (new requests not yet "
        "running, and preempted ones), generate() raises EngineOverloadedError instead of queuing "
        "more; and a tenant holding max(1, max_waiting // max(2, k)) of them (k: the tenants with "
        "sequences waiting, itself included) is refused too, so one tenant never fills the queue. "
        "None: an unbounded queue, no share.",
        minimum=1)
    max_tokens_cap: int | None = _option(
        4096,
        "Largest max_tokens a request may ask for; max_tokens=None means min(this, the room left "
        "in the context). Why: an uncapped request (times n up to 128) can hold the engine for "
        "the whole context. None: no cap, max_tokens=None runs to the end of the context.",
        minimum=1)
    seed: int = _option(0, "seed of the sampler's generator for requests without their own seed")
    num_threads: int | None = _option(
        None, "threads of the forward pass on CPU; None: torch's default, fewer while other processes hold the cores")
    cache_dir: str | None = _option(None, "where converted GGUF copies are kept; None: default_cache_dir()")
    tenants: tuple[TenantConfig, ...] = _option(
        (), "tenants known at start (more can be added at run time); requests naming no tenant run as 'default'")
    scheduling_policy: str = _option(
        "fair",
        "\"fair\": admit from the backlogged tenant with the least weighted service (virtual token "
        "counter), FCFS within a tenant; \"fcfs\": arrival order across all tenants.",
        choices=SCHEDULING_POLICIES)
    fair_prompt_token_weight: float = _option(
        1.0, "service one computed prompt token counts for, in fair scheduling", minimum=0.0)
    fair_output_token_weight: float = _option(
        2.0, "service one generated token counts for, in fair scheduling", minimum=0.0)
    max_pinned_fraction: float = _option(
        0.5, "largest fraction of the KV pool pinned prefixes may hold", minimum=0.0, maximum=1.0)
    grammar_compile_timeout_s: float = _option(
        10.0,
        "Longest a structured-output spec may compile, counted from when a compile thread starts it "
        "(time waiting behind other specs is not counted); past it the request fails with GrammarError "
        "(400 invalid_grammar) and the compile, which cannot be interrupted, finishes in its thread "
        "unkept.",
        minimum=0.001)
    grammar_cache_bytes: int = _option(
        DEFAULT_GRAMMAR_CACHE_BYTES,
        "Memory for compiled structured-output specs, each counted at its measured size and kept per "
        "tenant (a tenant's spec never hits another's cache entry); least recently used dropped first, "
        "a grammar larger than the whole budget not kept. 0: no cache.",
        minimum=0)
    grammar_max_queued_per_tenant: int = _option(
        64,
        "Structured-output specs of one tenant that may wait to compile; one more fails with "
        "EngineOverloadedError (429 with Retry-After). The compile threads serve tenants round robin.",
        minimum=1)
    grammar_max_queued: int = _option(
        256, "structured-output specs of all tenants that may wait to compile; past it, as above", minimum=1)
    grammar_queue_timeout_s: float = _option(
        30.0,
        "Longest a structured-output spec waits for a compile thread; past it the request fails with "
        "EngineOverloadedError (429 with Retry-After).",
        minimum=0.001)
    speculative: SpeculativeConfig | None = _option(
        None, "speculative decoding (SpeculativeConfig); None: off")
    lora_modules: tuple[tuple[str, str], ...] = _option(
        (), "LoRA adapters loaded at start, as (name, folder) pairs (CLI: name=folder ...); more with "
            "add_lora at run time")
    max_loras: int = _option(4, "LoRA adapters that may run at once (each holds a slot of every adapted projection)",
                             minimum=1, maximum=256)
    max_lora_rank: int = _option(16, "highest LoRA rank an adapter may have (the slots' size)", minimum=1, maximum=256)
    lora_dtype: str = _option(
        "auto",
        "The resident adapters' weight type (vLLM: lora_dtype). \"auto\": bfloat16 when the base model's "
        "weights run packed on CPU (GGUF blocks, bfloat16 or int8: already rounded at least as coarsely), "
        "else float32. Why: a step reads every resident adapter its rows use, and bfloat16 halves those bytes.",
        choices=("auto", "float32", "bfloat16"))
    grammar_mask_budget_ms: float = _option(
        100.0,
        "Longest the grammar masks of one request's rows may take within one decode step (the whole "
        "batch waits for them); past it the request fails alone with GrammarError (400 invalid_grammar).",
        minimum=0.001)

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_field(f, getattr(self, f.name))
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError("EngineConfig.speculative must be a SpeculativeConfig or None")
        self.lora_modules = tuple((str(name), str(path)) for name, path in self.lora_modules)
        lora_names = [name for name, _ in self.lora_modules]
        if len(set(lora_names)) != len(lora_names):
            raise ValueError(f"EngineConfig.lora_modules names an adapter twice: {lora_names}")
        self.tenants = tuple(self.tenants)
        if not all(isinstance(t, TenantConfig) for t in self.tenants):
            raise ValueError("EngineConfig.tenants must be TenantConfig records")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"EngineConfig.tenants names a tenant twice: {names}")
        self._check_kv_scales()

    def _check_kv_scales(self) -> None:
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"EngineConfig.{name} must be a finite number > 0 or None, got {value!r}")
            if self.kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
                raise ValueError(f"EngineConfig.{name} scales an fp8 KV cache (kv_cache_dtype in "
                                 f"{FP8_KV_CACHE_DTYPES}), not kv_cache_dtype={self.kv_cache_dtype!r}")


def _check_field(f: Field, value: Any) -> None:
    choices, minimum = f.metadata["choices"], f.metadata["minimum"]
    if choices and value not in choices:
        raise ValueError(f"EngineConfig.{f.name} must be one of {choices}, got {value!r}")
    maximum = f.metadata["maximum"]
    if (minimum is None and maximum is None) or (value is None and f.name in NULLABLE_FIELDS):
        return
    if minimum is not None and (value is None or value < minimum):
        allowed = f">= {minimum} or None" if f.name in NULLABLE_FIELDS else f">= {minimum}"
        raise ValueError(f"EngineConfig.{f.name} must be {allowed}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"EngineConfig.{f.name} must be <= {maximum}, got {value}")


FIELD_TYPES: Mapping[str, Any] = MappingProxyType(get_type_hints(EngineConfig))
"""Each field's resolved annotation (`int | None`, ...), read by the CLI."""
NULLABLE_FIELDS = frozenset(name for name, hint in FIELD_TYPES.items() if type(None) in get_args(hint))
"""Fields that accept None."""


def default_cache_dir() -> Path:
    """Where converted models and compiled kernels are kept: $STREAMENGINE_CACHE, else
    $XDG_CACHE_HOME/streamengine, else ~/.cache/streamengine."""
    base = os.environ.get("STREAMENGINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "streamengine"
    )
    return Path(base)
